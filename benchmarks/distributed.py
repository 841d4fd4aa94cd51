"""torch.distributed on `neuron` vs the same job on CPU tensors through gloo, side by side in one run
(JSON on stdout, from rank 0).

Launches `--ranks` processes of itself (fresh interpreters, 127.0.0.1). Each rank holds two groups over
the same processes: the default `neuron` group and a gloo group for CPU tensors. Measured, in interleaved
rounds (A then B, `--rounds` times), medians reported with their ratio:
  * all_reduce, all_gather_into_tensor, reduce_scatter_tensor of 1 MiB and 64 MiB float32: algorithm
    bandwidth (bytes of the full tensor / seconds) — target neuron >= 0.9x CPU; `ratio` is the median of
    the per-round quotients (as for DDP below), `ratio_of_medians` the quotient of the median bandwidths;
  * the latency of a 4-byte all_reduce (the backend's fixed cost per call);
  * 4 cold ranks on one host (empty local tier and fleet store), sync and background compile modes:
    the compiles of all ranks summed vs the job's unique keys — target equal;
  * DDP on the MLP of benchmarks/fusion.py, step time — target neuron <= 1.2x CPU — in three loops:
    `fixed` (one batch, the loss read at the end), `fresh+item` (a new batch every step, `loss.item()`
    every step) and `wide` (a 4x wider MLP). Its rounds alternate the order (A B, B A, ...) and `ratio`
    is the median of the per-round quotients; `cpu_time_ratio` is the same for the ranks' CPU time, which
    the scheduler's placement of two ranks on a shared host does not move.
Rank r is pinned to core r when the host has a core per rank (`--no-pin` to not).
OMP_NUM_THREADS=1 and one torch thread per rank; compiler tier TORCH_NEURONX_COMPILER (default
reference, i.e. the runtime's own cost; executables are compiled/loaded before timing).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time

import _models

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TORCH_NEURONX_COMPILER", "reference")


def _spawn(ranks: int, phase: str, extra_env: dict[str, str]) -> tuple[int, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for r in range(ranks):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(ranks), LOCAL_RANK=str(r),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), **extra_env)
        procs.append(subprocess.Popen([sys.executable, __file__, "--rank-main", phase, *sys.argv[1:]], env=env,
                                      stdout=subprocess.PIPE if r == 0 else subprocess.DEVNULL, text=True))
    out, _ = procs[0].communicate()
    return max(p.wait() for p in procs), out


def _launch(args: argparse.Namespace) -> int:
    import tempfile

    rc, out = _spawn(args.ranks, "speed", {})
    if rc != 0:
        return rc
    result = json.loads(out)
    # 4 cold ranks on one host, in each compile mode: an empty local tier and an empty fleet store.
    result["cold"] = {}
    for mode in ("sync", "background"):
        with tempfile.TemporaryDirectory() as tmp:
            rc, out = _spawn(4, "cold", {"TORCH_NEURONX_COMPILE_MODE": mode,
                                         "TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR": os.path.join(tmp, "local"),
                                         "TORCH_NEURONX_NEFF_CACHE_DIR": os.path.join(tmp, "fleet"),
                                         "TORCH_NEURONX_PREFETCH": "0"})
            if rc != 0:
                return rc
            result["cold"][mode] = json.loads(out)
    print(json.dumps(result, indent=2))
    return 0


def _cold() -> int:
    """Each of 4 fresh ranks trains the MLP under DDP; the job's compiles (summed) vs its unique keys."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import neuron_runtime
    from neuron_runtime.aten import _runtime

    dist.init_process_group("neuron")
    torch.manual_seed(0)
    m = DDP(torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 128),
                                torch.nn.GELU(), torch.nn.Linear(128, 10)).to("neuron"))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    t0 = time.perf_counter()
    for _ in range(3):
        x, y = torch.randn(16, 64, device="neuron"), torch.randn(16, 10, device="neuron")
        torch.nn.functional.mse_loss(m(x), y).backward()
        opt.step()
        opt.zero_grad()
    neuron_runtime.wait_for_compiles(600)
    mine = {"compiles": neuron_runtime.stats()["compiles"], "keys": sorted(_runtime.runtime().by_digest),
            "s": time.perf_counter() - t0}
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    if dist.get_rank() == 0:
        keys = set().union(*(set(e["keys"]) for e in every))
        print(json.dumps({"ranks": len(every), "compiles_per_rank": [e["compiles"] for e in every],
                          "fleet_compiles": sum(e["compiles"] for e in every), "unique_keys": len(keys),
                          "seconds": round(max(e["s"] for e in every), 2)}))
    dist.destroy_process_group()
    return 0


def _rank(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import neuron_runtime

    torch.set_num_threads(1)
    dist.init_process_group("neuron")
    gloo = dist.new_group(backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    if args.pin and (os.cpu_count() or 1) >= world:  # each rank owns a core, as each owns a NeuronCore
        os.sched_setaffinity(0, {rank})

    def timed(fn, n: int) -> tuple[float, float]:
        """Seconds per call of `fn`: wall clock, and this process's CPU time (its gloo threads included)."""
        dist.barrier(group=gloo)
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(n):
            fn()
        return (time.perf_counter() - t0) / n, (time.process_time() - c0) / n

    def side_by_side(a, b, n: int) -> tuple[float, float, float, float]:
        """Median seconds of `a` and of `b` over the rounds, which alternate the order (A B, B A, ...), then
        the median of the per-round quotients a/b in wall clock and in CPU time (the work each side does,
        whatever the scheduler does with two ranks on a busy host)."""
        a(), b()  # warm
        ta, tb, wall, cpu = [], [], [], []
        for r in range(args.rounds):
            if r % 2 == 0:
                (wa, ca), (wb, cb) = timed(a, n), timed(b, n)
            else:
                (wb, cb), (wa, ca) = timed(b, n), timed(a, n)
            ta.append(wa)
            tb.append(wb)
            wall.append(wa / wb)
            cpu.append(ca / cb)
        return statistics.median(ta), statistics.median(tb), statistics.median(wall), statistics.median(cpu)

    result: dict[str, object] = {"ranks": world, "rounds": args.rounds, "compiler": os.environ["TORCH_NEURONX_COMPILER"],
                                 "transport": "gloo over zero-copy host views", "collectives": {}, "ddp": {}}
    # The backend's own cost per call (views, Work, counters) shows on a 4-byte all_reduce's latency.
    one_dev, one_cpu = torch.ones(1, device="neuron"), torch.ones(1)
    ta, tb, _, _ = side_by_side(lambda: dist.all_reduce(one_dev), lambda: dist.all_reduce(one_cpu, group=gloo),
                                200)
    result["all_reduce_4B_latency_us"] = {"neuron": round(ta * 1e6, 1), "cpu": round(tb * 1e6, 1),
                                          "ratio": round(ta / tb, 3)}
    for mib in (1, 64):
        numel = mib * 2**20 // 4
        n = 50 if mib == 1 else 3
        cpu_x = torch.randn(numel)
        dev_x = cpu_x.to("neuron")
        for op in ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor"):
            if op == "all_reduce":
                fa = lambda: dist.all_reduce(dev_x)  # noqa: E731
                fb = lambda: dist.all_reduce(cpu_x, group=gloo)  # noqa: E731
            elif op == "all_gather_into_tensor":
                part = numel // world
                dev_o, cpu_o = torch.empty(numel, device="neuron"), torch.empty(numel)
                fa = lambda: dist.all_gather_into_tensor(dev_o, dev_x[:part])  # noqa: E731
                fb = lambda: dist.all_gather_into_tensor(cpu_o, cpu_x[:part], group=gloo)  # noqa: E731
            else:
                part = numel // world
                dev_o, cpu_o = torch.empty(part, device="neuron"), torch.empty(part)
                fa = lambda: dist.reduce_scatter_tensor(dev_o, dev_x)  # noqa: E731
                fb = lambda: dist.reduce_scatter_tensor(cpu_o, cpu_x, group=gloo)  # noqa: E731
            ta, tb, quotient, _ = side_by_side(fa, fb, n)
            nbytes = numel * 4
            result["collectives"][f"{op}_{mib}MiB"] = {  # type: ignore[index]
                "neuron_GBps": round(nbytes / ta / 1e9, 3), "cpu_GBps": round(nbytes / tb / 1e9, 3),
                "ratio": round(1 / quotient, 3), "ratio_of_medians": round(tb / ta, 3)}

    for loop, width in (("fixed", 128), ("fresh+item", 128), ("wide", 512)):
        steps = {}
        for dev, group, wrap in (("neuron", None, True), ("cpu", gloo, True), ("neuron", None, False),
                                 ("cpu", None, False)):
            torch.manual_seed(0)
            m = _models.mlp(width)[0].to(dev)
            m = DDP(m, process_group=group) if wrap else m
            opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
            g = torch.Generator().manual_seed(rank)
            fixed = (torch.randn(16, 64, generator=g).to(dev), torch.randn(16, 10, generator=g).to(dev))

            def step(m=m, opt=opt, dev=dev, fixed=fixed, g=g) -> None:
                x, y = fixed if loop != "fresh+item" else (torch.randn(16, 64, generator=g).to(dev),
                                                           torch.randn(16, 10, generator=g).to(dev))
                loss = torch.nn.functional.mse_loss(m(x), y)
                loss.backward()
                opt.step()
                opt.zero_grad()
                if loop == "fresh+item":
                    loss.item()

            steps[(dev, wrap)] = step
        for _ in range(3):
            steps[("neuron", True)]()
            steps[("neuron", False)]()
        neuron_runtime.wait_for_compiles()
        ta, tb, ratio, cpu_ratio = side_by_side(steps[("neuron", True)], steps[("cpu", True)], args.steps)
        # The same loop without DDP (each rank alone): how much of the gap is the runtime's per-op cost
        # rather than communication.
        la, lb, alone, alone_cpu = side_by_side(steps[("neuron", False)], steps[("cpu", False)], args.steps)
        result["ddp"][loop] = {  # type: ignore[index]
            "neuron_ms": round(ta * 1e3, 3), "cpu_ms": round(tb * 1e3, 3), "ratio": round(ratio, 3),
            "ratio_of_medians": round(ta / tb, 3), "cpu_time_ratio": round(cpu_ratio, 3),
            "no_ddp_neuron_ms": round(la * 1e3, 3), "no_ddp_cpu_ms": round(lb * 1e3, 3),
            "no_ddp_ratio": round(alone, 3), "no_ddp_cpu_time_ratio": round(alone_cpu, 3)}
    result["stats_collectives"] = neuron_runtime.stats()["collectives"]
    if rank == 0:
        print(json.dumps(result))
    dist.barrier(group=gloo)
    dist.destroy_process_group()
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--rounds", type=int, default=9, help="interleaved A/B rounds (medians of these)")
    p.add_argument("--steps", type=int, default=40, help="DDP training steps per round and side")
    p.add_argument("--no-pin", dest="pin", action="store_false",
                   help="do not pin rank r to core r (pinned when the host has a core per rank)")
    p.add_argument("--rank-main", choices=["speed", "cold"], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.rank_main == "cold":
        return _cold()
    return _rank(args) if args.rank_main else _launch(args)


if __name__ == "__main__":
    sys.exit(main())

"""A distributed job on `neuron` the tests launch as real processes (torchrun, or plain `Popen` per rank
with RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT set). One launch shares its process group across many
checks (process start-up with torch is the expensive part).

DIST_OUT=dir: each rank writes dir/rank<N>.json. DIST_SCENARIO picks what runs:
  api    every collective, async Work, errors, DDP (buckets, no_sync, find_unused_parameters), FSDP2,
         DTensor, DCP save/load — each check compared with a single-process reference computed here
  kill   DDP training; rank 1 SIGKILLs itself mid-step; the others record the error they get
  hang   rank 1 stops calling collectives (sleeps); the others record the error and how long it took
  cold   a few DDP steps (+ wait for background compiles, + one more); stats and the keys used
         (DIST_HOSTS=N: the ranks spread over N simulated hosts, each with its own local tier)
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import neuron_runtime
from neuron_runtime.aten import _runtime

DEV = "neuron"
SCENARIO = os.environ.get("DIST_SCENARIO", "api")
TIMEOUT = float(os.environ.get("DIST_TIMEOUT", "60"))


def mlp() -> torch.nn.Module:
    """The MLP of benchmarks/fusion.py."""
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 128),
                               torch.nn.GELU(), torch.nn.Linear(128, 10))


def batches(steps: int, n: int = 32) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1234)
    return [(torch.randn(n, 64, generator=g), torch.randn(n, 10, generator=g)) for _ in range(steps)]


def reference_losses(steps: int, opt_name: str = "sgd") -> list[float]:
    """One process, the global batch, same init: what the distributed run must reproduce."""
    torch.manual_seed(0)
    m = mlp().to(DEV)
    return train(m, make_opt(m, opt_name), steps)


def train(model: Any, opt: torch.optim.Optimizer, steps: int, part: Callable[[torch.Tensor], torch.Tensor] = lambda t: t,
          record: Callable[[torch.Tensor], float] = lambda loss: loss.item()) -> list[float]:
    """`steps` SGD/AdamW steps of `model` on `part` of each batch (the whole batch, or this rank's shard);
    `record` turns each step's loss into the number kept (its value, or the mean over ranks)."""
    out = []
    for x, y in batches(steps):
        loss = torch.nn.functional.mse_loss(model(part(x).to(DEV)), part(y).to(DEV))
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(record(loss))
    return out


def make_opt(m: torch.nn.Module, name: str) -> torch.optim.Optimizer:
    if name == "adamw":
        return torch.optim.AdamW(m.parameters(), lr=1e-2)
    return torch.optim.SGD(m.parameters(), lr=0.1)


def shard(t: torch.Tensor) -> torch.Tensor:
    r, w = dist.get_rank(), dist.get_world_size()
    n = t.shape[0] // w
    return t[r * n:(r + 1) * n]


def global_loss(loss: torch.Tensor) -> float:
    g = loss.detach().clone()
    dist.all_reduce(g, op=dist.ReduceOp.AVG)
    return g.item()


# -- api -----------------------------------------------------------------------------------------------
def check_collectives(res: dict[str, Any]) -> None:
    r, w = dist.get_rank(), dist.get_world_size()
    ok: dict[str, bool] = {}
    base = torch.tensor([1.0, 2.0, 3.0, 4.0])
    mine = base * (r + 1)
    every = [base * (k + 1) for k in range(w)]
    expect = {
        dist.ReduceOp.SUM: sum(every), dist.ReduceOp.AVG: sum(every) / w,
        dist.ReduceOp.PRODUCT: torch.stack(every).prod(0), dist.ReduceOp.MIN: torch.stack(every).min(0).values,
        dist.ReduceOp.MAX: torch.stack(every).max(0).values,
    }
    for op, want in expect.items():
        t = mine.to(DEV)
        dist.all_reduce(t, op=op)
        ok[f"all_reduce_{op}"] = t.device.type == DEV and torch.allclose(t.cpu(), want)
    ints = torch.tensor([0b0110 | r, 0b0011 + r], dtype=torch.int64)
    for op, fn in ((dist.ReduceOp.BAND, lambda a, b: a & b), (dist.ReduceOp.BOR, lambda a, b: a | b),
                   (dist.ReduceOp.BXOR, lambda a, b: a ^ b)):
        t = ints.to(DEV)
        dist.all_reduce(t, op=op)
        want = torch.tensor([0b0110 | 0, 0b0011 + 0], dtype=torch.int64)
        for k in range(1, w):
            want = fn(want, torch.tensor([0b0110 | k, 0b0011 + k], dtype=torch.int64))
        ok[f"all_reduce_{op}"] = torch.equal(t.cpu(), want)

    t = (base * (r + 1)).to(DEV)
    dist.broadcast(t, src=1)
    ok["broadcast"] = torch.equal(t.cpu(), base * 2)
    t = mine.to(DEV)
    dist.reduce(t, dst=0)
    ok["reduce"] = r != 0 or torch.allclose(t.cpu(), expect[dist.ReduceOp.SUM])
    outs = [torch.empty(4, device=DEV) for _ in range(w)]
    dist.all_gather(outs, mine.to(DEV))
    ok["all_gather"] = all(torch.equal(o.cpu(), e) for o, e in zip(outs, every))
    out = torch.empty(4 * w, device=DEV)
    dist.all_gather_into_tensor(out, mine.to(DEV))
    ok["all_gather_into_tensor"] = torch.equal(out.cpu(), torch.cat(every))
    full = torch.arange(4.0 * w) * (r + 1)
    o = torch.empty(4, device=DEV)
    dist.reduce_scatter_tensor(o, full.to(DEV))
    tot = sum(torch.arange(4.0 * w) * (k + 1) for k in range(w))
    ok["reduce_scatter_tensor"] = torch.allclose(o.cpu(), tot[4 * r:4 * (r + 1)])
    o = torch.empty(4, device=DEV)
    dist.reduce_scatter(o, [c.to(DEV) for c in full.chunk(w)])
    ok["reduce_scatter"] = torch.allclose(o.cpu(), tot[4 * r:4 * (r + 1)])
    src = torch.arange(2.0 * w) + 100 * r
    o = torch.empty(2 * w, device=DEV)
    dist.all_to_all_single(o, src.to(DEV))
    ok["all_to_all_single"] = torch.equal(
        o.cpu(), torch.cat([(torch.arange(2.0 * w) + 100 * k)[2 * r:2 * r + 2] for k in range(w)]))
    outs = [torch.empty(2, device=DEV) for _ in range(w)]
    dist.all_to_all(outs, [c.to(DEV) for c in src.chunk(w)])
    ok["all_to_all"] = all(torch.equal(outs[k].cpu(), (torch.arange(2.0 * w) + 100 * k)[2 * r:2 * r + 2])
                           for k in range(w))
    gl = [torch.empty(4, device=DEV) for _ in range(w)] if r == 0 else None
    dist.gather(mine.to(DEV), gl, dst=0)
    ok["gather"] = r != 0 or all(torch.equal(o.cpu(), e) for o, e in zip(gl, every))
    o = torch.empty(4, device=DEV)
    dist.scatter(o, [e.to(DEV) for e in every] if r == 1 else None, src=1)
    ok["scatter"] = torch.equal(o.cpu(), every[r])
    if r == 0:
        dist.send(torch.tensor([7.0, 8.0], device=DEV), dst=1)
        ok["send_recv"] = True
    elif r == 1:
        t = torch.empty(2, device=DEV)
        dist.recv(t, src=0)
        ok["send_recv"] = torch.equal(t.cpu(), torch.tensor([7.0, 8.0]))
    # async Work: wait(), is_completed(), the future's value is the caller's neuron tensor
    t = mine.to(DEV)
    work = dist.all_reduce(t, async_op=True)
    ok["async_wait"] = work.wait() and work.is_completed() and torch.allclose(t.cpu(), expect[dist.ReduceOp.SUM])
    t = mine.to(DEV)
    fut = dist.all_reduce(t, async_op=True).get_future()
    v = fut.wait()
    ok["async_future"] = v[0] is t and torch.allclose(t.cpu(), expect[dist.ReduceOp.SUM])
    # coalesced variants (what DDP and FSDP2 call) and object collectives
    a, b = mine.to(DEV), (mine * 10).to(DEV)
    dist.all_reduce_coalesced([a, b])
    ok["all_reduce_coalesced"] = torch.allclose(a.cpu(), expect[dist.ReduceOp.SUM]) and \
        torch.allclose(b.cpu(), expect[dist.ReduceOp.SUM] * 10)
    with dist._coalescing_manager(device=torch.device(DEV), async_ops=True) as cm:
        o1, o2 = torch.empty(4 * w, device=DEV), torch.empty(4 * w, device=DEV)
        dist.all_gather_into_tensor(o1, mine.to(DEV))
        dist.all_gather_into_tensor(o2, (mine * 2).to(DEV))
    cm.wait()
    ok["coalescing_manager"] = torch.equal(o1.cpu(), torch.cat(every)) and torch.equal(o2.cpu(), torch.cat(every) * 2)
    objs: list[Any] = [None] * w
    dist.all_gather_object(objs, {"rank": r})
    ok["all_gather_object"] = objs == [{"rank": k} for k in range(w)]
    dist.barrier()
    ok["barrier"] = True
    res["collectives"] = ok


def check_errors(res: dict[str, Any]) -> None:
    errs: dict[str, str] = {}
    try:
        dist.all_reduce(torch.ones(2))
        errs["cpu_through_neuron"] = "no error"
    except Exception as e:  # noqa: BLE001
        errs["cpu_through_neuron"] = f"{type(e).__name__}: {e}"
    try:
        dist.all_gather([torch.empty(2, device=DEV), torch.empty(2)], torch.ones(2, device=DEV))
        errs["mixed_devices"] = "no error"
    except Exception as e:  # noqa: BLE001
        errs["mixed_devices"] = f"{type(e).__name__}: {e}"
    gloo = dist.new_group(backend="gloo")
    try:
        dist.all_reduce(torch.ones(2, device=DEV), group=gloo)
        errs["neuron_through_gloo"] = "no error"
    except Exception as e:  # noqa: BLE001
        errs["neuron_through_gloo"] = f"{type(e).__name__}: {e}"
    res["errors"] = errs


def check_ddp(res: dict[str, Any]) -> None:
    steps = 4
    ref = reference_losses(steps)
    torch.manual_seed(0)
    m = mlp().to(DEV)
    # a small bucket cap: the gradients travel in several buckets; device_ids as torchrun users pass them
    ddp = DDP(m, device_ids=[int(os.environ["LOCAL_RANK"])], bucket_cap_mb=0.01)
    got = train(ddp, make_opt(ddp, "sgd"), steps, shard, global_loss)
    res["ddp"] = {"ref": ref, "got": got, "buckets": len(ddp.reducer._get_zeros_like_grad_buckets()),
                  "device_ids": ddp.device_ids}
    try:
        DDP(mlp().to(DEV), device_ids=[5])
        res["ddp"]["bad_device_ids"] = "no error"
    except ValueError as e:
        res["ddp"]["bad_device_ids"] = str(e)

    # no_sync: two micro-batches, gradients all-reduced once, equal to one process accumulating both
    torch.manual_seed(0)
    refm = mlp().to(DEV)
    torch.manual_seed(0)
    m = mlp().to(DEV)
    ddp = DDP(m)
    (x1, y1), (x2, y2) = batches(2)
    for x, y in ((x1, y1), (x2, y2)):
        torch.nn.functional.mse_loss(refm(x.to(DEV)), y.to(DEV)).backward()
    before = neuron_runtime.stats()["collectives"].get("all_reduce", {}).get("calls", 0)
    with ddp.no_sync():
        torch.nn.functional.mse_loss(ddp(shard(x1).to(DEV)), shard(y1).to(DEV)).backward()
    between = neuron_runtime.stats()["collectives"].get("all_reduce", {}).get("calls", 0)
    torch.nn.functional.mse_loss(ddp(shard(x2).to(DEV)), shard(y2).to(DEV)).backward()
    diff = max((a.grad - b.grad).abs().max().item() for a, b in zip(m.parameters(), refm.parameters()))
    res["no_sync"] = {"max_grad_diff": diff, "all_reduces_inside": between - before}

    # comm hooks: PyTorch's own (Python futures over our Work): plain all-reduce and fp16 compression
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    hooks = {}
    for name, hook in (("allreduce", default_hooks.allreduce_hook), ("fp16", default_hooks.fp16_compress_hook)):
        torch.manual_seed(0)
        m = mlp().to(DEV)
        ddp = DDP(m)
        ddp.register_comm_hook(None, hook)
        torch.nn.functional.mse_loss(ddp(shard(x1).to(DEV)), shard(y1).to(DEV)).backward()
        torch.manual_seed(0)
        refm = mlp().to(DEV)
        torch.nn.functional.mse_loss(refm(x1.to(DEV)), y1.to(DEV)).backward()
        hooks[name] = max((a.grad - b.grad).abs().max().item() for a, b in zip(m.parameters(), refm.parameters()))
    res["comm_hooks"] = hooks

    # find_unused_parameters: a branch that this forward does not use
    class Branchy(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.used, self.unused = torch.nn.Linear(8, 4), torch.nn.Linear(8, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.used(x)

    torch.manual_seed(0)
    bm = Branchy().to(DEV)
    torch.manual_seed(0)
    bref = Branchy().to(DEV)
    ddp = DDP(bm, find_unused_parameters=True)
    x = torch.randn(4 * dist.get_world_size(), 8)
    ddp(shard(x).to(DEV)).sum().backward()
    (bref(x.to(DEV)).sum() / dist.get_world_size()).backward()
    res["find_unused"] = {
        "max_grad_diff": (bm.used.weight.grad - bref.used.weight.grad).abs().max().item(),
        "unused_grad_is_none": bm.unused.weight.grad is None,
    }


def check_fsdp_dtensor_dcp(res: dict[str, Any], tmp: Path) -> None:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
    import torch.distributed.checkpoint as dcp
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor, init_device_mesh

    w = dist.get_world_size()
    mesh = init_device_mesh(DEV, (w,))
    # DTensor ops on neuron shards
    a = torch.arange(8.0 * 6).reshape(8, 6)
    b = torch.arange(6.0 * 4).reshape(6, 4) / 10
    da = distribute_tensor(a.to(DEV), mesh, [Shard(0)])
    db = distribute_tensor(b.to(DEV), mesh, [Replicate()])
    dc = (da @ db).relu().sum(dim=1)
    res["dtensor"] = {
        "local_device": da.to_local().device.type,
        "local_shape": list(da.to_local().shape),
        "matmul_ok": torch.allclose(dc.full_tensor().cpu(), (a @ b).relu().sum(dim=1)),
        "redistribute_ok": torch.equal(da.redistribute(mesh, [Replicate()]).to_local().cpu(), a),
    }

    # tensor parallelism: column- then row-wise sharded Linears, forward and backward vs one process
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    def tp_mlp() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16)).to(DEV)

    tp, tref = tp_mlp(), tp_mlp()
    parallelize_module(tp, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(7)).to(DEV)
    out, want = tp(x), tref(x)
    out.sum().backward()
    want.sum().backward()
    res["tp"] = {
        "out_diff": (out.cpu() - want.cpu()).abs().max().item(),
        "grad_diff": max((tp[i].weight.grad.full_tensor().cpu() - tref[i].weight.grad.cpu()).abs().max().item()
                         for i in (0, 2)),
        "weight_shard": list(tp[0].weight.to_local().shape),
    }

    steps = 4
    ref = reference_losses(steps, "adamw")
    torch.manual_seed(0)
    m = mlp().to(DEV)
    for layer in m:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(m, mesh=mesh)
    got = train(m, make_opt(m, "adamw"), steps, shard, global_loss)
    p0 = next(iter(m.parameters()))
    res["fsdp2"] = {"ref": ref, "got": got, "param_type": type(p0).__name__,
                    "shard_device": p0.to_local().device.type, "shard_rows": p0.to_local().shape[0]}

    # DCP: save the sharded model, scramble it, load it back
    ckpt = tmp / "ckpt"
    saved = {k: v.full_tensor().cpu() for k, v in get_model_state_dict(m).items()}
    dcp.save({"model": get_model_state_dict(m)}, checkpoint_id=str(ckpt))
    with torch.no_grad():
        for p in m.parameters():
            p.to_local().zero_()
    sd = {"model": get_model_state_dict(m)}
    dcp.load(sd, checkpoint_id=str(ckpt))
    set_model_state_dict(m, sd["model"])
    back = {k: v.full_tensor().cpu() for k, v in get_model_state_dict(m).items()}
    res["dcp"] = {"equal": all(torch.equal(saved[k], back[k]) for k in saved), "keys": len(saved),
                  "files": sorted(p.name for p in ckpt.iterdir())}


def check_mismatch(res: dict[str, Any]) -> None:
    """Ranks pass different shapes: with PyTorch's desync checks on (TORCH_DISTRIBUTED_DEBUG=DETAIL, which
    wraps a group's backend when the group is made), an error on every rank within the group's timeout,
    not a hang or an abort."""
    os.environ["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
    dist.set_debug_level_from_env()
    g = dist.new_group(backend="neuron", timeout=datetime.timedelta(seconds=5))
    del os.environ["TORCH_DISTRIBUTED_DEBUG"]
    dist.set_debug_level_from_env()
    t = torch.ones(4, device=DEV)
    dist.all_reduce(t, group=g)  # same shapes: passes the check
    res["same_shapes_ok"] = t.cpu().tolist() == [2.0] * 4
    t0 = time.monotonic()
    try:
        dist.all_reduce(torch.ones(4 + 4 * dist.get_rank(), device=DEV), group=g)
        res["mismatch"] = {"error": "no error", "s": time.monotonic() - t0}
    except Exception as e:  # noqa: BLE001
        res["mismatch"] = {"error": f"{type(e).__name__}: {e}", "s": time.monotonic() - t0}


# -- faults and compiles ---------------------------------------------------------------------------
def train_until_fault(res: dict[str, Any]) -> None:
    torch.manual_seed(0)
    ddp = DDP(mlp().to(DEV))
    opt = make_opt(ddp, "sgd")
    t0 = None
    try:
        for step, (x, y) in enumerate(batches(50)):
            if step == 3:
                if dist.get_rank() == 1:
                    if SCENARIO == "kill":
                        os.kill(os.getpid(), signal.SIGKILL)
                    time.sleep(600)
                t0 = time.monotonic()
            loss = torch.nn.functional.mse_loss(ddp(shard(x).to(DEV)), shard(y).to(DEV))
            loss.backward()
            opt.step()
            opt.zero_grad()
        res["error"] = "no error"
    except Exception as e:  # noqa: BLE001
        res["error"] = f"{type(e).__name__}: {e}"
        res["s"] = None if t0 is None else time.monotonic() - t0


def train_cold(res: dict[str, Any]) -> None:
    torch.manual_seed(0)
    ddp = DDP(mlp().to(DEV))
    opt = make_opt(ddp, "adamw")
    data = batches(2)  # two requests of every signature: background mode compiles them all
    for x, y in data:
        loss = torch.nn.functional.mse_loss(ddp(shard(x).to(DEV)), shard(y).to(DEV))
        loss.backward()
        opt.step()
        opt.zero_grad()
    res["waited"] = neuron_runtime.wait_for_compiles(240)
    dist.barrier()
    x, y = data[0]
    loss = torch.nn.functional.mse_loss(ddp(shard(x).to(DEV)), shard(y).to(DEV))
    loss.backward()
    res["loss"] = global_loss(loss)
    res["keys"] = sorted(_runtime.runtime().by_digest)


def main() -> int:
    out = Path(os.environ["DIST_OUT"])
    hosts = int(os.environ.get("DIST_HOSTS", "1"))
    if hosts > 1:
        # Ranks spread over `hosts` simulated hosts: a local tier of their own per host (read when the
        # runtime starts, at the first neuron op), one fleet store for all.
        host = int(os.environ["RANK"]) % hosts
        os.environ["TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR"] += f"-host{host}"
    dist.init_process_group(timeout=datetime.timedelta(seconds=TIMEOUT))
    rank = dist.get_rank()
    res: dict[str, Any] = {"rank": rank, "backend": dist.get_backend(),
                           "group": dist.group.WORLD._get_backend(torch.device(DEV)).name()}
    try:
        if SCENARIO == "api":
            check_collectives(res)
            check_errors(res)
            check_ddp(res)
            check_fsdp_dtensor_dcp(res, out)
            check_mismatch(res)
        elif SCENARIO in ("kill", "hang"):
            train_until_fault(res)
        elif SCENARIO == "cold":
            train_cold(res)
    except Exception:  # noqa: BLE001 - the test reads the traceback
        res["crash"] = traceback.format_exc()
    res["stats"] = neuron_runtime.stats()
    (out / f"rank{rank}.json").write_text(json.dumps(res, default=str))
    sys.stdout.flush()
    # A group whose peer died cannot be torn down cleanly: leave without waiting for it.
    if SCENARIO in ("kill", "hang") or "mismatch" in res:
        os._exit(0)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

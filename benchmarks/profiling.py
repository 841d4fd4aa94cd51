"""How much of a step's trace the runtime names (JSON on stdout; README "Profiling").

Each workload runs in fresh processes on an empty local tier (and fresh Inductor scratch):
  cold process   step 1 profiled (every signature new: compiles in `sync` mode, host runs while the
                 service compiles in `background` mode), then, once everything is compiled, one hit step;
  warm process   the same job again on the filled local tier: step 1 (loads) and one hit step profiled.
For each profiled step: its wall time, the share of it inside `neuron::*` ranges on the threads that ran
its ops (the union of the ranges, the background thread left out: its work overlaps the step), that
time by range kind, the device track's runs (count, summed duration), and the share inside a named range
or an executable's run on the device track (`named_or_device_share`), and the time in neither
(`unnamed_ms`). The same steps run on CPU too (`<workload>/cpu`, median of three processes): PyTorch's
own cost of a first step (modules, autograd's first run, the optimizer's state), to hold the unnamed time
against; a first step's `added_over_cpu_ms` is its time beyond CPU's, `named_share_of_added` the named
ranges' share of that. A session's first range costs the profiler ~1 ms of its own: a throwaway range
before the step's keeps it out.
Workloads: `demo` (`make demo`'s model and step) and `mlp` (LayerNorm, dropout, a new batch size every
step, `loss.item()`).

    python benchmarks/profiling.py [--tier aoti|reference] [--workloads demo,mlp] [--modes sync,background]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

JOB = r"""
import json, sys, time, torch, neuron_runtime
from neuron_runtime.aten import _runtime
from torch.profiler import profile, record_function
workload, trace, dev = sys.argv[1], sys.argv[2], sys.argv[3]
torch.manual_seed(0)
if workload == "demo":
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 10))
    sizes, width, classes = [64] * 8, 32, 10
else:
    model = torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.LayerNorm(256), torch.nn.GELU(),
                                torch.nn.Dropout(0.1), torch.nn.Linear(256, 256), torch.nn.GELU(),
                                torch.nn.Linear(256, 16))
    sizes, width, classes = [48, 64, 40, 64, 56, 32, 64, 48], 128, 16
model = model.to(dev)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
def step(i):
    x = torch.randn(sizes[i], width).to(dev)
    y = torch.randint(0, classes, (sizes[i],)).to(dev)
    opt.zero_grad(set_to_none=True)
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    return loss.item()
def profiled(i, name):
    with profile() as p:
        with record_function("profiler warm-up"):  # the first range of a session costs ~1 ms of its own
            pass
        with record_function("step"):
            t0 = time.perf_counter()
            step(i)
            wall = time.perf_counter() - t0
    p.export_chrome_trace(trace + name + ".json")
    return wall
out = {"first": profiled(0, "first")}
for i in range(1, 8):  # until a step runs no op on the host (background mode compiles from a key's 2nd call)
    neuron_runtime.wait_for_compiles(3600)
    before = neuron_runtime.stats()["host_runs"]
    step(i)
    if neuron_runtime.stats()["host_runs"] == before and i >= 3:
        break
out["hit"] = profiled(0, "hit")
bg = _runtime.runtime().resolver._background
out["bg_tid"] = bg.thread.native_id if bg is not None and bg.thread is not None else None
s = neuron_runtime.stats()
out.update(compiles=s["compiles"], compiles_by_kind=s["compiles_by_kind"], host_runs=s["host_runs"],
           loads=s["loads"], fallback_ops=s["fallback_ops"])
print(json.dumps(out))
"""

KINDS = ("compile", "load", "cache", "wait", "host_run", "fallback", "miss", "kernel_setup", "prefetch")


def _union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def analyse(path: Path, wall_s: float, exclude_tid: int | None) -> dict[str, Any]:
    events = [e for e in json.loads(path.read_text(), strict=False)["traceEvents"] if e.get("ph") == "X"]
    step = next(e for e in events if e["name"] == "step")
    t0, t1 = step["ts"], step["ts"] + step["dur"]
    op_tids = {e["tid"] for e in events if e.get("cat") == "cpu_op" and t0 <= e["ts"] < t1} - {exclude_tid}

    def clipped(pred: Any) -> list[tuple[float, float]]:
        return [(max(e["ts"], t0), min(e["ts"] + e["dur"], t1)) for e in events
                if e["tid"] in op_tids and e["name"].startswith("neuron::") and pred(e["name"])
                and e["ts"] < t1 and e["ts"] + e["dur"] > t0]

    ranges = clipped(lambda n: True)
    named = _union(ranges)
    by_kind = {}
    for kind in KINDS:
        ms = _union(clipped(lambda n, k=kind: n.removeprefix("neuron::").split(" ")[0].split("[")[0].split(".")[0] == k))
        if ms:
            by_kind[kind] = round(ms / 1000, 2)
    device = [e for e in events if e.get("cat") == "kernel"]
    # Executable runs on the device track (the op's own work, the ops' thread waits on it): with the named
    # ranges, what the trace accounts for; the rest is PyTorch's own (autograd, modules, the optimizer).
    runs = [(max(e["ts"], t0), min(e["ts"] + e["dur"], t1)) for e in device if e["ts"] < t1 and e["ts"] + e["dur"] > t0]
    covered = _union(ranges + runs)
    return {"wall_ms": round(wall_s * 1000, 2), "trace_step_ms": round((t1 - t0) / 1000, 2),
            "named_ms": round(named / 1000, 2), "named_share": round(named / (t1 - t0), 4), "named_ms_by_kind": by_kind,
            "named_or_device_share": round(covered / (t1 - t0), 4), "unnamed_ms": round((t1 - t0 - covered) / 1000, 2),
            "device_runs": len(device), "device_ms": round(sum(e["dur"] for e in device) / 1000, 2)}


def run(work: Path, env: dict[str, str], workload: str, name: str, dev: str = "neuron") -> dict[str, Any]:
    trace = work / f"{name}-"
    r = subprocess.run([sys.executable, "-c", JOB, workload, str(trace), dev], env=env, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(r.stderr[-3000:])
    out = json.loads(r.stdout.strip().splitlines()[-1])
    return {"first_step": analyse(Path(f"{trace}first.json"), out.pop("first"), out["bg_tid"]),
            "hit_step": analyse(Path(f"{trace}hit.json"), out.pop("hit"), out.pop("bg_tid")), **out}


def _env(work: Path, tier: str, mode: str) -> dict[str, str]:
    """A run's environment: everything it writes (tiers, Inductor's scratch, temporary files) under `work`."""
    (work / "tmp").mkdir(exist_ok=True)
    return dict(os.environ, OMP_NUM_THREADS="1", TORCH_NEURONX_COMPILER=tier, TORCH_NEURONX_COMPILE_MODE=mode,
                TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR=str(work / "local"), TORCH_NEURONX_NEFF_CACHE_DIR="",
                TORCH_NEURONX_PREFETCH="0", TMPDIR=str(work / "tmp"), TORCHINDUCTOR_CACHE_DIR=str(work / "inductor"))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tier", default="aoti", choices=["aoti", "reference"])
    p.add_argument("--workloads", default="demo,mlp")
    p.add_argument("--modes", default="sync,background")
    args = p.parse_args()
    results: dict[str, Any] = {"tier": args.tier, "loadavg_before": [round(x, 2) for x in os.getloadavg()]}
    for workload in args.workloads.split(","):
        # The same steps on CPU: PyTorch's own cost of a first step (modules, autograd's first run, the
        # optimizer's state), which no range of ours can name; a neuron step's unnamed time compares to it.
        # Three processes, the median: a CPU first step is a few ms, and one-off costs swing it.
        work = Path(tempfile.mkdtemp(prefix="neuron-profiling-"))
        try:
            cpus = [run(work, _env(work, args.tier, "sync"), workload, f"cpu{i}", "cpu") for i in range(3)]
            results[f"{workload}/cpu"] = {k: {m: statistics.median(c[k][m] for c in cpus) for m in ("wall_ms", "trace_step_ms")}
                                          for k in ("first_step", "hit_step")}
            cpu = results[f"{workload}/cpu"]
        finally:
            shutil.rmtree(work, ignore_errors=True)
        for mode in args.modes.split(","):
            work = Path(tempfile.mkdtemp(prefix="neuron-profiling-"))
            env = _env(work, args.tier, mode)
            try:
                res = {"cold_process": run(work, env, workload, "cold"), "warm_process": run(work, env, workload, "warm"),
                       "loadavg": [round(x, 2) for x in os.getloadavg()]}
                for proc in ("cold_process", "warm_process"):
                    # What the runtime adds to the first step over CPU's, and the share of that in named ranges.
                    first = res[proc]["first_step"]
                    first["added_over_cpu_ms"] = round(first["trace_step_ms"] - cpu["first_step"]["trace_step_ms"], 2)
                    first["named_share_of_added"] = round(min(1.0, first["named_ms"] / max(first["added_over_cpu_ms"], 1e-9)), 4)
                results[f"{workload}/{mode}"] = res
            finally:
                shutil.rmtree(work, ignore_errors=True)
            print(json.dumps({f"{workload}/{mode}": results[f"{workload}/{mode}"]}), file=sys.stderr, flush=True)
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

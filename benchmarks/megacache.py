"""Mega-Cache round trip (JSON on stdout): what a second process compiles after
`torch.compiler.load_cache_artifacts()` of the first one's `save_cache_artifacts()` bundle.

Process A trains `make demo`'s model for a few steps and runs a `torch.compile(backend="neuron")` graph on
an empty local tier, then saves the bundle. Process B, on another empty local tier (and fresh Inductor
scratch: another host), loads the bundle and runs the same job. Reports both processes' compiles by kind,
first-step times, the bundle's size and artifacts, B's load time, and the machine's load.

    python benchmarks/megacache.py [--tier aoti|reference] [--mode sync|background]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

JOB = r"""
import json, sys, time, torch, neuron_runtime
mode, bundle = sys.argv[1], sys.argv[2]
out = {}
if mode == "load":
    t0 = time.perf_counter()
    info = torch.compiler.load_cache_artifacts(open(bundle, "rb").read())
    out["load_s"] = time.perf_counter() - t0
    out["loaded_artifacts"] = {k: len(v) for k, v in info.artifacts.items()}
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 10)).to("neuron")
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
x, y = torch.randn(64, 32, device="neuron"), torch.randint(0, 10, (64,), device="neuron")
times = []
for _ in range(4):
    t0 = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    loss = torch.nn.functional.cross_entropy(model(x), y); loss.backward(); opt.step(); loss.item()
    times.append(time.perf_counter() - t0)
neuron_runtime.wait_for_compiles(3600)
graph = torch.compile(lambda a, b: torch.nn.functional.gelu(a @ b.t() + 1).sum(dim=1), backend="neuron")
t0 = time.perf_counter()
graph(x, x).sum().item()
out["graph_first_call_s"] = time.perf_counter() - t0
neuron_runtime.wait_for_compiles(3600)
s = neuron_runtime.stats()
out.update(first_step_s=times[0], compiles=s["compiles"], compiles_by_kind=s["compiles_by_kind"],
           loads=s["loads"], megacache=s["megacache"], fallback_ops=s["fallback_ops"])
if mode == "save":
    data, info = torch.compiler.save_cache_artifacts()
    open(bundle, "wb").write(data)
    out.update(bundle_bytes=len(data), artifacts={k: len(v) for k, v in info.artifacts.items()})
print(json.dumps(out))
"""


def run(env: dict[str, str], mode: str, bundle: Path) -> dict[str, object]:
    r = subprocess.run([sys.executable, "-c", JOB, mode, str(bundle)], env=env, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(r.stderr[-3000:])
    out: dict[str, object] = json.loads(r.stdout.strip().splitlines()[-1])
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in out.items()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tier", default="aoti", choices=["aoti", "reference"])
    p.add_argument("--mode", default="sync", choices=["sync", "background"])
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="neuron-megacache-"))
    try:
        result: dict[str, object] = {"tier": args.tier, "mode": args.mode,
                                     "loadavg_before": [round(x, 2) for x in os.getloadavg()]}
        for name, mode in (("process_a", "save"), ("process_b", "load")):
            (work / name / "tmp").mkdir(parents=True)
            env = dict(os.environ, OMP_NUM_THREADS="1", TORCH_NEURONX_COMPILER=args.tier,
                       TORCH_NEURONX_COMPILE_MODE=args.mode, TORCH_NEURONX_PREFETCH="0",
                       TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR=str(work / name / "local"), TORCH_NEURONX_NEFF_CACHE_DIR="",
                       TMPDIR=str(work / name / "tmp"), TORCHINDUCTOR_CACHE_DIR=str(work / name / "inductor"))
            result[name] = run(env, mode, work / "bundle.bin")
        result["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
        print(json.dumps(result, indent=2))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

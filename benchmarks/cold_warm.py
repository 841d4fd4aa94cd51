"""Cold vs warm (JSON on stdout): the small training job of `make demo` run twice in fresh processes on
an empty local tier (and fresh Inductor scratch), then load and hit-path costs.

Reports: compiles and seconds per compile of the cold run; first-step time cold vs warm; load time per
executable from the local tier (p50/p95, envelope verification included); and the hit path of a
64-float `add` for `aoti`, `reference` and native CPU eager, each measured side by side with native in
one process (interleaved rounds, medians, OMP_NUM_THREADS=1).

    python benchmarks/cold_warm.py [--tier aoti|reference] [--steps N]
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
import time
from pathlib import Path

JOB = r"""
import json, sys, time, torch, neuron_runtime
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 10)).to("neuron")
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
x, y = torch.randn(64, 32, device="neuron"), torch.randint(0, 10, (64,), device="neuron")
times = []
for _ in range(int(sys.argv[1])):
    t0 = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    loss = torch.nn.functional.cross_entropy(model(x), y); loss.backward(); opt.step(); loss.item()
    times.append(time.perf_counter() - t0)
s = neuron_runtime.stats()
print(json.dumps({"compiles": s["compiles"], "hits": s["hits"], "fallback_ops": s["fallback_ops"],
                  "first_step_s": times[0], "later_step_ms": 1000 * statistics.median(times[1:]) if len(times) > 1 else None}))
""".replace("import json, sys", "import json, statistics, sys")

LOADS = r"""
import json, statistics, sys, time
import neuron_runtime
from neuron_runtime import _config
from neuron_runtime.cache import envelope
from neuron_runtime.aten import _runtime
from neuron_runtime.cache import LocalCache
cfg = _config.get()
local = LocalCache(cfg.local_cache_dir, cfg.cache_max_size)
compiler = _runtime.runtime().compiler
ms = []
for e in local.entries():
    t0 = time.perf_counter()
    entry = envelope.unpack(local.get(e.key), expected_key=e.key, signing_key=cfg.signing_key)
    compiler.load(entry.payload)
    ms.append(1000 * (time.perf_counter() - t0))
ms.sort()
print(json.dumps({"executables": len(ms), "load_ms_p50": statistics.median(ms),
                  "load_ms_p95": ms[min(len(ms) - 1, int(0.95 * len(ms)))]}))
"""

HIT = r"""
import json, statistics, time, torch
torch.set_num_threads(1)
a, b = torch.randn(64), torch.randn(64)
na, nb = a.to("neuron"), b.to("neuron")
torch.add(na, nb); torch.add(na, nb)
def t(f, n=5000):
    t0 = time.perf_counter()
    for _ in range(n): f()
    return (time.perf_counter() - t0) / n * 1e6
nat, neu = [], []
for _ in range(9):
    nat.append(t(lambda: torch.add(a, b))); neu.append(t(lambda: torch.add(na, nb)))
print(json.dumps({"native_us": statistics.median(nat), "neuron_us": statistics.median(neu)}))
"""


def _run(code: str, env: dict[str, str], *args: str) -> dict[str, object]:
    r = subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(r.stderr[-3000:])
    return json.loads(r.stdout.strip().splitlines()[-1])


def _rounded(v: object) -> object:
    if isinstance(v, float):
        return round(v, 3)
    if isinstance(v, dict):
        return {k: _rounded(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_rounded(x) for x in v]
    return v


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tier", default="aoti", choices=["aoti", "reference"])
    p.add_argument("--steps", type=int, default=10)
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="neuron-coldwarm-"))
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCH_NEURONX_COMPILER=args.tier,
               TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR=str(work / "local"),
               TORCH_NEURONX_NEFF_CACHE_DIR="", TMPDIR=str(work / "tmp"))
    (work / "tmp").mkdir()
    try:
        t0 = time.perf_counter()
        cold = _run(JOB, env, str(args.steps))
        cold_wall = time.perf_counter() - t0
        t0 = time.perf_counter()
        warm = _run(JOB, env, str(args.steps))
        warm_wall = time.perf_counter() - t0
        loads = _run(LOADS, env)
        hit = {tier: _run(HIT, dict(env, TORCH_NEURONX_COMPILER=tier)) for tier in ("aoti", "reference")
               if tier == args.tier or tier == "reference"}
        out = {
            "tier": args.tier,
            "cold": {**cold, "process_wall_s": round(cold_wall, 2),
                     "s_per_compile": round(float(cold["first_step_s"]) / max(1, int(cold["compiles"])), 2)},
            "warm": {**warm, "process_wall_s": round(warm_wall, 2)},
            "first_step_cold_over_warm": round(float(cold["first_step_s"]) / float(warm["first_step_s"]), 1),
            "local_tier_loads": loads,
            "hit_path_add64": {t: {k: round(float(v), 2) for k, v in h.items()} |
                               {"ratio": round(float(h["neuron_us"]) / float(h["native_us"]), 2)}
                               for t, h in hit.items()},
        }
        print(json.dumps(_rounded(out), indent=2))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

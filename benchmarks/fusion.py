"""Fusion benchmark (JSON on stdout): training steps of a small MLP and a small transformer block with
fusion off, fusion on (TORCH_NEURONX_ENABLE_CONCATENATION=1), native CPU eager and `torch.compile` on CPU.

Fusion is decided when a process builds its kernels, so each mode runs in its own process; every process
also times native CPU eager on the same model, so each ratio is measured side by side (interleaved
rounds of steps alternating one by one, OMP_NUM_THREADS=1; `vs_native` is the median of the rounds'
ratios, which a machine whose speed drifts disturbs least). Also checks that fusion on and off give the
same losses.

    python benchmarks/fusion.py [--tier reference|aoti] [--steps N] [--rounds R] [--cache-dir DIR]

With --cache-dir the executables persist: on `aoti` a first run compiles (minutes), a second one then
measures warm processes only.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import _models

CHILD = r"""
import json, os, statistics, sys, time, torch
torch.set_num_threads(1)
mode, steps, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])

from _models import block, mlp

def step_fn(make, device, compiled=False):
    torch.manual_seed(0)
    model, shape = make()
    model = model.to(device)
    x = torch.randn(*shape).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    fwd = torch.compile(model) if compiled else model
    losses = []
    def step():
        opt.zero_grad(set_to_none=True)
        loss = fwd(x).float().pow(2).mean()
        loss.backward()
        opt.step()
        losses.append(loss)
    return step, losses

def timed(fn):
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0

out = {}
for name, make in (("mlp", mlp), ("transformer_block", block)):
    native, _ = step_fn(make, "cpu")
    if mode == "compile":
        other, losses = step_fn(make, "cpu", compiled=True)
    else:
        other, losses = step_fn(make, "neuron")
    for _ in range(8):  # warm: compiles, fusion groups become hot
        native(); other()
    if mode != "compile":
        torch.neuron.synchronize()
    a, b = [], []
    for _ in range(rounds):  # steps alternate one by one: both sides see the same machine
        ta = tb = 0.0
        for _ in range(steps):
            ta += timed(native)
            tb += timed(lambda: (other(), losses[-1].item()))
        a.append(ta / steps * 1e3); b.append(tb / steps * 1e3)
    out[name] = {"native_ms": statistics.median(a), "mode_ms": statistics.median(b),
                 "ratio": statistics.median(y / x for x, y in zip(a, b)),
                 "losses": [float(l) for l in losses[:6]]}
if mode != "compile":
    import neuron_runtime
    s = neuron_runtime.stats()
    out["fallback_ops"] = s["fallback_ops"]
    out["fusion"] = s.get("fusion")
print(json.dumps(out))
"""


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tier", default="reference", choices=["reference", "aoti"])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--rounds", type=int, default=30, help="rounds of --steps steps per mode (medians of these)")
    p.add_argument("--cache-dir", help="local executable cache to use (default: a fresh temporary directory)")
    args = p.parse_args()
    cache = args.cache_dir or tempfile.mkdtemp(prefix="neuron-fusion-bench-")
    base = dict(os.environ, OMP_NUM_THREADS="1", TORCH_NEURONX_COMPILER=args.tier,
                TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR=cache)
    modes = {"fusion_off": {"TORCH_NEURONX_ENABLE_CONCATENATION": "0"},
             "fusion_on": {"TORCH_NEURONX_ENABLE_CONCATENATION": "1"},
             "torch_compile": {}}
    results = {}
    for mode, extra in modes.items():
        arg = "compile" if mode == "torch_compile" else "neuron"
        r = subprocess.run([sys.executable, "-c", CHILD, arg, str(args.steps), str(args.rounds)],
                           env=_models.child_env(dict(base, **extra)), capture_output=True, text=True)
        if r.returncode != 0:
            results[mode] = {"error": r.stderr[-1500:]}
            continue
        results[mode] = json.loads(r.stdout.strip().splitlines()[-1])
    report: dict[str, object] = {"tier": args.tier, "steps_per_round": args.steps, "rounds": args.rounds}
    for model in ("mlp", "transformer_block"):
        row: dict[str, object] = {}
        for mode, res in results.items():
            if "error" in res:
                row[mode] = res
                continue
            m = res[model]
            row[mode] = {"ms": round(m["mode_ms"], 3), "native_eager_ms_same_process": round(m["native_ms"], 3),
                         "vs_native": round(m["ratio"], 2)}
        on, off = results.get("fusion_on", {}), results.get("fusion_off", {})
        if model in on and model in off:
            row["losses_equal_on_off"] = all(abs(a - b) <= 1e-5 * max(1.0, abs(b))
                                             for a, b in zip(on[model]["losses"], off[model]["losses"]))
        report[model] = row
    report["fusion_stats"] = results.get("fusion_on", {}).get("fusion")
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

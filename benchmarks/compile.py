"""torch.compile benchmark (JSON on stdout): `backend="neuron"` against Inductor on CPU tensors.

1. Steady state: training steps of `benchmarks/fusion.py`'s MLP and transformer block, the model's
   forward + loss compiled, AdamW eager, in one process: native CPU eager, `torch.compile` (Inductor) on
   CPU tensors and `torch.compile(backend="neuron")` on neuron tensors, steps interleaved one by one
   (OMP_NUM_THREADS=1), medians of per-round ratios. Three loop shapes: the same batch with
   `loss.item()` every step, a new batch (made on CPU, moved to the device) every step, and the same
   batch with `opt.step` compiled too (on both compiled sides).
2. Warm start: a second process on a warm local tier (the first one compiles): compiles it ran, and the
   first compiled step's time after `import torch` returned (Dynamo + AOTAutograd tracing, keying,
   loading). Beside it, Inductor's own FX graph cache warm start for the same model, measured the same way,
   and two floors no backend can go below on this host: `backend="eager"` (importing Dynamo and tracing,
   then the captured graph run as it is) and `"aot_eager"` (the same plus AOTAutograd's forward/backward
   tracing), both on CPU tensors; `import_dynamo_s` is what the first `torch.compile` call's import of
   `torch._dynamo` cost in that process.

    python benchmarks/compile.py [--tier reference|aoti] [--steps N] [--rounds R] [--cache-dir DIR]

With --cache-dir the executables persist: on `aoti` a first run compiles (minutes), later runs measure
warm processes only.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import _models

MODELS = r"""
import torch
from _models import MAKERS, mlp
MAKERS = dict(MAKERS, mlp_wide=lambda: mlp(512))  # another model size (--models)

def step_fn(make, device, backend, new_batch=False, compile_opt=False):
    torch.manual_seed(0)
    model, shape = make()
    model = model.to(device)
    x = torch.randn(*shape).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    def loss_fn(x):
        return model(x).float().pow(2).mean()
    fwd = loss_fn if backend is None else torch.compile(loss_fn, backend=backend)
    opt_step = torch.compile(opt.step, backend=backend) if compile_opt and backend else opt.step
    losses = []
    gen = torch.Generator().manual_seed(1)  # each side's own batches: the same ones on every side
    def step():
        opt.zero_grad(set_to_none=True)
        loss = fwd(torch.randn(*shape, generator=gen).to(device) if new_batch else x)
        loss.backward()
        opt_step()
        losses.append(loss.item())
    return step, losses
"""

STEADY = MODELS + r"""
import json, statistics, sys, time
torch.set_num_threads(1)
steps, rounds, LOOPS, NAMES = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3].split(","), sys.argv[4].split(",")
import neuron_runtime
out = {}
for name in NAMES:
    make = MAKERS[name]
    for loop in LOOPS:
        kw = {"new_batch": loop == "new_batch", "compile_opt": loop == "optimizer_compiled"}
        sides = {"native": step_fn(make, "cpu", None, **kw),
                 "inductor": step_fn(make, "cpu", "inductor", **kw),
                 "neuron": step_fn(make, "neuron", "neuron", **kw)}
        for _ in range(4):  # warm: compiles (sync mode), Inductor's autotuning-free first calls
            for fn, _l in sides.values():
                fn()
        neuron_runtime.wait_for_compiles()
        for fn, _l in sides.values():
            fn()
        times = {k: [] for k in sides}
        for _ in range(rounds):
            acc = dict.fromkeys(sides, 0.0)
            for _ in range(steps):
                for k, (fn, _l) in sides.items():
                    t0 = time.perf_counter(); fn(); acc[k] += time.perf_counter() - t0
            for k in sides:
                times[k].append(acc[k] / steps * 1e3)
        med = {k: statistics.median(v) for k, v in times.items()}
        ratio = lambda a, b: statistics.median(x / y for x, y in zip(times[a], times[b]))
        out[f"{name}/{loop}"] = {
            "ms": {k: round(v, 3) for k, v in med.items()},
            "neuron_vs_inductor": round(ratio("neuron", "inductor"), 3),
            "neuron_vs_native": round(ratio("neuron", "native"), 3),
            "inductor_vs_native": round(ratio("inductor", "native"), 3),
            "losses_neuron_vs_native_max_diff": max(abs(a - b) for a, b in zip(sides["neuron"][1], sides["native"][1])),
        }
s = neuron_runtime.stats()
out["neuron_stats"] = {"compiles": s["compiles"], "graphs": s.get("graphs"), "fallback_ops": s["fallback_ops"]}
print(json.dumps(out))
"""

WARM = MODELS + r"""
import json, sys, time
t_imported = time.perf_counter()
torch.set_num_threads(1)
backend, name = sys.argv[1], sys.argv[2]
device = "neuron" if backend == "neuron" else "cpu"
t0 = time.perf_counter()
import torch._dynamo  # what torch.compile imports on its first call anyway: timed on its own
import_dynamo = time.perf_counter() - t0
step, losses = step_fn(MAKERS[name], device, backend)
step()
first = time.perf_counter() - t_imported
t0 = time.perf_counter(); step(); second = time.perf_counter() - t0
res = {"first_step_s": round(first, 3), "import_dynamo_s": round(import_dynamo, 3),
       "second_step_s": round(second, 4), "loss": losses[0]}
if backend == "neuron":
    import neuron_runtime
    s = neuron_runtime.stats()
    res["compiles"] = s["compiles"]
    res["graph_compiles"] = s["graphs"]["compiles"]
print(json.dumps(res))
"""


def _child(src: str, argv: list[str], env: dict[str, str]) -> dict[str, object]:
    r = subprocess.run([sys.executable, "-c", src, *argv], env=_models.child_env(env), capture_output=True,
                       text=True)
    if r.returncode != 0:
        return {"error": r.stderr[-2000:]}
    return json.loads(r.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tier", default="reference", choices=["reference", "aoti"])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--rounds", type=int, default=15, help="rounds of --steps steps (medians of these)")
    p.add_argument("--cache-dir", help="local executable cache to use (default: a fresh temporary directory)")
    p.add_argument("--skip", choices=["steady", "warm"], help="leave one part out")
    p.add_argument("--models", default="mlp,transformer_block",
                   help="comma-separated: mlp, transformer_block, mlp_wide (the MLP 4x wider)")
    p.add_argument("--loops", default="same_batch,new_batch,optimizer_compiled",
                   help="steady-state loop shapes: same_batch (loss.item() every step), new_batch (a new batch "
                        "moved to the device every step), optimizer_compiled (same batch, opt.step compiled too)")
    args = p.parse_args()
    cache = args.cache_dir or tempfile.mkdtemp(prefix="neuron-compile-bench-")
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCH_NEURONX_COMPILER=args.tier,
               TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR=cache, TORCH_NEURONX_COMPILE_MODE="sync",
               TORCHINDUCTOR_CACHE_DIR=os.path.join(cache, "inductor"))
    report: dict[str, object] = {"tier": args.tier, "steps_per_round": args.steps, "rounds": args.rounds,
                                 "load": os.getloadavg()[0]}
    if args.skip != "steady":
        report["steady"] = _child(STEADY, [str(args.steps), str(args.rounds), args.loops, args.models], env)
    if args.skip != "warm":
        warm: dict[str, object] = {}
        for name in args.models.split(","):
            for backend in ("neuron", "inductor", "eager", "aot_eager"):
                _child(WARM, [backend, name], env)  # fills the caches (a no-op once they are warm)
                warm[f"{name}/{backend}"] = _child(WARM, [backend, name], env)
        report["warm_start"] = warm
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

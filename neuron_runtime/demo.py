"""`make demo`: train a small model on `neuron` twice, in two processes, on the local disk cache.

The first run compiles every op signature once (progress on stderr); the second loads them all from the
local tier and compiles nothing. Prints compiles, hits and step times of both runs.

    python -m neuron_runtime.demo [--tier aoti|reference] [--steps N] [--cache-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _train(steps: int) -> dict[str, object]:
    import logging

    import torch

    import neuron_runtime

    class Progress(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.getMessage().startswith("compiling"):
                Progress.n += 1
                print(f"  [{time.strftime('%H:%M:%S')}] compile #{Progress.n}: {record.args[0]}",  # type: ignore[index]
                      file=sys.stderr, flush=True)

        n = 0

    log = logging.getLogger("neuron_runtime")
    log.addHandler(Progress())
    log.setLevel(logging.INFO)

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 10)).to("neuron")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(64, 32, device="neuron")
    y = torch.randint(0, 10, (64,), device="neuron")
    times, losses = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        times.append(time.perf_counter() - t0)
    s = neuron_runtime.stats()
    return {"compiles": s["compiles"], "hits": s["hits"], "fallback_ops": s["fallback_ops"],
            "first_step_s": round(times[0], 3), "later_step_ms": round(1000 * sorted(times[1:])[len(times[1:]) // 2], 3)
            if len(times) > 1 else None, "loss_first": round(losses[0], 5), "loss_last": round(losses[-1], 5)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m neuron_runtime.demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--tier", default=os.environ.get("TORCH_NEURONX_COMPILER", "aoti"), choices=["aoti", "reference"])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--cache-dir", help="local cache directory (default: a fresh temporary one)")
    p.add_argument("--run", action="store_true", help=argparse.SUPPRESS)  # one training run (internal)
    args = p.parse_args(argv)
    if args.run:
        print(json.dumps(_train(args.steps)))
        return 0
    cache = Path(args.cache_dir) if args.cache_dir else Path(tempfile.mkdtemp(prefix="neuron-demo-"))
    env = dict(os.environ, TORCH_NEURONX_COMPILER=args.tier, TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR=str(cache))
    env.pop("TORCH_NEURONX_NEFF_CACHE_DIR", None)  # the embedded default: local disk, no fleet store
    print(f"neuron demo: tier={args.tier}, local cache {cache}", file=sys.stderr)
    results = {}
    for name in ("cold", "warm"):
        print(f"== {name} run (new process)", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        r = subprocess.run([sys.executable, "-m", "neuron_runtime.demo", "--run", "--steps", str(args.steps)],
                           env=env, stdout=subprocess.PIPE, text=True)
        if r.returncode != 0:
            print(f"{name} run failed (exit {r.returncode})", file=sys.stderr)
            return 1
        results[name] = json.loads(r.stdout.strip().splitlines()[-1])
        results[name]["wall_s"] = round(time.perf_counter() - t0, 1)
        print(f"   {name}: {results[name]}", file=sys.stderr)
    print(json.dumps(results, indent=2))
    ok = results["warm"]["compiles"] == 0 and results["cold"]["loss_last"] == results["warm"]["loss_last"]
    print("warm run compiled nothing and matched the cold run" if ok else "UNEXPECTED: warm run compiled",
          file=sys.stderr)
    if not args.cache_dir:
        shutil.rmtree(cache, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())

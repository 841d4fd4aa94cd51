"""`make demo`: train a small model on `neuron` twice, in two processes, on the local disk cache.

The first run meets every op signature for the first time: in background mode (the default) those ops
run on the host while the host's compile service compiles them, and it trains on until every op runs
compiled (progress on stderr). The second run loads them all from the local tier and compiles nothing.
Prints compiles, hits, first-step and step times of both runs.

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


def _train(steps: int, max_seconds: float, exact: bool = False) -> dict[str, object]:
    """Train until every op runs compiled (background mode; progress on stderr), then `steps` more; with
    `exact`, `steps` steps in all."""
    import logging

    import torch

    import neuron_runtime

    class SyncProgress(logging.Handler):  # TORCH_NEURONX_COMPILE_MODE=sync: each compile blocks the step
        n = 0

        def emit(self, record: logging.LogRecord) -> None:
            if record.getMessage().startswith("compiling"):
                SyncProgress.n += 1
                print(f"  [{time.strftime('%H:%M:%S')}] compile #{SyncProgress.n}: {record.args[0]}",  # type: ignore[index]
                      file=sys.stderr, flush=True)

    log = logging.getLogger("neuron_runtime.executables._resolver")
    log.addHandler(SyncProgress())
    log.setLevel(logging.INFO)

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 10)).to("neuron")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(64, 32, device="neuron")
    y = torch.randint(0, 10, (64,), device="neuron")
    times, losses = [], []
    progress = _Progress()
    t_start = time.perf_counter()
    compiled_at: float | None = None
    steps_on_host = 0
    step = 0
    after: list[float] = []  # step times once every op ran compiled
    while True:
        before = neuron_runtime.stats()["host_runs"]
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        times.append(time.perf_counter() - t0)
        step += 1
        s = neuron_runtime.stats()
        bg = s.get("background", {})
        host_now = s["host_runs"] - before
        steps_on_host += host_now > 0
        if compiled_at is None and host_now == 0 and not bg.get("pending"):
            compiled_at = time.perf_counter() - t_start
        progress.show(step, bg, host_now)
        if (step >= steps if exact else compiled_at is not None and len(after) >= steps):
            break
        if compiled_at is not None:
            after.append(times[-1])
        if time.perf_counter() - t_start > max_seconds:
            print(f"neuron demo: stopping after {max_seconds:g} s with compiles still pending", file=sys.stderr)
            break
    progress.end()
    s = neuron_runtime.stats()
    done = after or times
    return {"compiles": s["compiles"], "hits": s["hits"], "fallback_ops": s["fallback_ops"],
            "compile_mode": s["compile_mode"], "steps": step, "steps_with_host_runs": steps_on_host,
            "host_runs": s["host_runs"], "first_step_s": round(times[0], 3),
            "all_compiled_after_s": None if compiled_at is None else round(compiled_at, 1),
            "step_ms_compiled": round(1000 * sorted(done)[len(done) // 2], 3),
            "loss_first": round(losses[0], 5), "loss_last": round(losses[-1], 5), "losses": losses}


class _Progress:
    """Compile progress while the cold run trains: a bar redrawn on a terminal, a line every 5 s otherwise."""

    def __init__(self) -> None:
        self.tty = sys.stderr.isatty()
        self.last = 0.0
        self.shown = False

    def show(self, step: int, bg: dict[str, object], host_now: int) -> None:
        queued = int(bg.get("queued", 0) or 0)
        if not queued:
            return
        done = int(bg.get("done", 0) or 0)
        now = time.monotonic()
        line = (f"compiles {done}/{queued} (running {bg.get('running', 0)}), step {step}, "
                f"{host_now} op(s) on the host this step")
        if self.tty:
            fill = int(24 * done / queued)
            sys.stderr.write(f"\r  [{'#' * fill}{'.' * (24 - fill)}] {line}   ")
            sys.stderr.flush()
            self.shown = True
        elif now - self.last >= 5.0 or done == queued and not self.shown:
            print(f"  [{time.strftime('%H:%M:%S')}] {line}", file=sys.stderr, flush=True)
            self.last = now
            self.shown = done == queued

    def end(self) -> None:
        if self.tty and self.shown:
            sys.stderr.write("\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m neuron_runtime.demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--tier", default=os.environ.get("TORCH_NEURONX_COMPILER", "aoti"), choices=["aoti", "reference"])
    p.add_argument("--steps", type=int, default=20, help="steps to train once every op runs compiled (a cold "
                   "background run trains on the host meanwhile)")
    p.add_argument("--max-seconds", type=float, default=1800.0, help=argparse.SUPPRESS)
    p.add_argument("--exact", action="store_true", help=argparse.SUPPRESS)  # --steps in all (the warm run)
    p.add_argument("--cache-dir", help="local cache directory (default: a fresh temporary one)")
    p.add_argument("--run", action="store_true", help=argparse.SUPPRESS)  # one training run (internal)
    args = p.parse_args(argv)
    if args.run:
        print(json.dumps(_train(args.steps, args.max_seconds, args.exact)))
        return 0
    cache = Path(args.cache_dir) if args.cache_dir else Path(tempfile.mkdtemp(prefix="neuron-demo-"))
    env = dict(os.environ, TORCH_NEURONX_COMPILER=args.tier, TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR=str(cache))
    env.pop("TORCH_NEURONX_NEFF_CACHE_DIR", None)  # the embedded default: local disk, no fleet store
    print(f"neuron demo: tier={args.tier}, local cache {cache}", file=sys.stderr)
    results = {}
    steps = args.steps
    for name in ("cold", "warm"):
        print(f"== {name} run (new process)", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        exact = ["--exact"] if name == "warm" else []
        r = subprocess.run([sys.executable, "-m", "neuron_runtime.demo", "--run", "--steps", str(steps), *exact],
                           env=env, stdout=subprocess.PIPE, text=True)
        if r.returncode != 0:
            print(f"{name} run failed (exit {r.returncode})", file=sys.stderr)
            return 1
        results[name] = json.loads(r.stdout.strip().splitlines()[-1])
        results[name]["wall_s"] = round(time.perf_counter() - t0, 1)
        steps = int(results[name]["steps"])  # the warm run trains as many steps as the cold one did
        shown = {k: v for k, v in results[name].items() if k != "losses"}
        print(f"   {name}: {shown}", file=sys.stderr)
    cold, warm = results["cold"], results["warm"]
    # The cold run's first steps ran some ops on the host while their executables compiled (background
    # mode): the same aten kernels, not the compiled code, so the last bits may differ (docs/dispatch.md).
    worst = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(cold.pop("losses"), warm.pop("losses")))
    results["max_loss_rel_diff"] = worst
    print(json.dumps(results, indent=2))
    ok = warm["compiles"] == 0 and worst <= 1e-4
    print(f"warm run compiled nothing; losses matched the cold run (max relative difference {worst:.1e})" if ok
          else "UNEXPECTED: the warm run compiled, or its losses differ from the cold run's", file=sys.stderr)
    if not args.cache_dir:
        shutil.rmtree(cache, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())

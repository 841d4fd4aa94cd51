"""`neuron-cache warm`/`compile`: parallel compile speed-up, and a job's first step on a warmed vs a cold cache.

Method (JSON on stdout, progress on stderr; every measured thing is a separate process, as in CI):
  1. Record a manifest: the MLP training job below runs one step on the reference tier with
     TORCH_NEURONX_RECORD_FILE; the first --ops signatures of it are the workload.
  2. Speed-up: `neuron-cache compile MANIFEST --jobs 1` and `--jobs 2`, each into a fresh local cache,
     interleaved for --rounds rounds; wall time of the whole command (workers' start-up included),
     medians, ratio. The Inductor scratch directory (precompiled headers, built once per host) is either
     fresh per run (--cold-scratch: both pay the headers, and parallel workers wait on each other's
     header build) or shared and pre-warmed by compiling one signature outside the workload (default:
     a CI host that has compiled before).
  3. First step: a small job (--first-step-job) on a cold cache (it compiles every op of its first step)
     vs the same job after `neuron-cache warm` (strict mode, so a miss would fail it): first-step seconds,
     compiles, and what the warm-up itself cost.
The tier is `aoti` unless --tier says otherwise (`reference` runs in seconds but compiles nothing real);
the JSON states it, the CPU count and the load average, because this host is shared.

    python benchmarks/warm.py [--tier aoti|reference] [--workload mlp|decoder|llama|llamas[,...]] [--ops N] [--rounds 1] [--first-step-job tiny|mlp]
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
from typing import Any

MLP = """
import torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 10)).to('neuron')
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
x, y = torch.randn(64, 32, device='neuron'), torch.randint(0, 10, (64,), device='neuron')
opt.zero_grad(); torch.nn.functional.cross_entropy(model(x), y).backward(); opt.step()
"""

# Another workload (--workload decoder): a written-out decoder block with AdamW, two steps at each of two
# lengths (bmm, softmax, layer norm, embedding, foreach; shape classes): 34 signatures.
DECODER = """
import sys, torch
sys.path.insert(0, __BENCH__)
from _models import Decoder, train_decoder
torch.manual_seed(0)
train_decoder(Decoder(vocab=256, d=64, heads=4).to('neuron'), (12, 20), vocab=256)
"""

# Hugging Face LlamaForCausalLMs from a config (cold_start.py's `LLAMA`): one training step each, what a
# real model asks a CI warm-up to compile. --workload llama: the 4-layer model (~50 signatures); llamas:
# both sizes (~100), as a warm-up of a fleet's several models would.
LLAMA = """
import sys, torch
sys.path.insert(0, __BENCH__)
from cold_start import LLAMA
from transformers import LlamaConfig, LlamaForCausalLM
for name in __MODELS__:
    torch.manual_seed(0)
    cfg, (batch, seq) = LLAMA[name]
    model = LlamaForCausalLM(LlamaConfig(**cfg)).to('neuron')
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, cfg["vocab_size"], (batch, seq), device='neuron')
    model(input_ids=x, labels=x).loss.backward()
    opt.step()
"""
LLAMA_MODELS = {"llama": ["llama"], "llamas": ["llama", "llama_small"]}

FIRST_STEP = {
    # a tiny inference step: 4 compiled ops (mm, add, relu, sum); fits a cold aoti run in a minute
    "tiny": """
import json, sys, time, torch, neuron_runtime
torch.manual_seed(0)
w, b, x = (torch.randn(32, 32, device='neuron'), torch.randn(32, device='neuron'), torch.randn(16, 32, device='neuron'))
t0 = time.perf_counter()
out = torch.relu(x @ w + b).sum().item()
t1 = time.perf_counter()
s = neuron_runtime.stats()
print(json.dumps({"first_step_s": t1 - t0, "compiles": s["compiles"], "hits": s["hits"], "fallbacks": s["fallbacks"]}))
""",
    "mlp": """
import json, sys, time, torch, neuron_runtime
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 10)).to('neuron')
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
x, y = torch.randn(64, 32, device='neuron'), torch.randint(0, 10, (64,), device='neuron')
t0 = time.perf_counter()
opt.zero_grad(); torch.nn.functional.cross_entropy(model(x), y).backward(); opt.step()
t1 = time.perf_counter()
s = neuron_runtime.stats()
print(json.dumps({"first_step_s": t1 - t0, "compiles": s["compiles"], "hits": s["hits"], "fallbacks": s["fallbacks"]}))
""",
}


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    for var in ("TORCH_NEURONX_NEFF_CACHE_DIR", "TORCH_NEURONX_CACHE_MODE", "TORCH_NEURONX_STATS_FILE",
                "TORCH_NEURONX_RECORD_FILE"):
        env.pop(var, None)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(extra)
    return env


def _run(cmd: list[str], env: dict[str, str], what: str) -> tuple[float, str]:
    print(f"[warm-bench] {what}", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    r = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wall = time.perf_counter() - t0
    if r.returncode not in (0, 1):
        raise SystemExit(f"{what} failed ({r.returncode}):\n{r.stderr[-3000:]}")
    return wall, r.stdout


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "neuron_runtime.cli", *args]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tier", default="aoti", choices=["aoti", "reference"])
    p.add_argument("--ops", type=int, help="signatures in the speed-up workload (default: 8 of mlp, all of decoder)")
    p.add_argument("--workload", default="mlp",
                   help="the job whose recorded signatures are compiled (mlp; decoder: 34 signatures; llama: a "
                        "Hugging Face LlamaForCausalLM step, ~50; llamas: two sizes' steps, ~63), or several, "
                        "comma-separated, recorded into one manifest (a CI warm-up of a fleet's models)")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--first-step-job", default="tiny", choices=sorted(FIRST_STEP))
    p.add_argument("--skip-first-step", action="store_true")
    p.add_argument("--cold-scratch", action="store_true",
                   help="a fresh Inductor scratch directory per compile run (default: shared, pre-warmed)")
    args = p.parse_args()
    workloads = args.workload.split(",")
    for w in workloads:
        if w not in ("mlp", "decoder", *LLAMA_MODELS):
            p.error(f"--workload {w}: one of mlp, decoder, {', '.join(LLAMA_MODELS)}")
    root = Path(tempfile.mkdtemp(prefix="neuron-warm-bench-"))
    out: dict[str, Any] = {"tier": args.tier, "cpus": os.cpu_count(), "load_avg_start": os.getloadavg(),
                           "omp_num_threads": _env()["OMP_NUM_THREADS"]}
    try:
        # 1. the workload
        full = root / "full.jsonl"
        for w in workloads:
            job = root / f"{w}.py"
            text = MLP if w == "mlp" else DECODER if w == "decoder" else LLAMA
            job.write_text(text.replace("__BENCH__", repr(str(Path(__file__).resolve().parent)))
                           .replace("__MODELS__", repr(LLAMA_MODELS.get(w))))
            # sync mode, as `neuron-cache warm` records: a signature is recorded when its executable is
            # loaded, which in background mode may come after a short job has ended
            _run([sys.executable, str(job)], _env(TORCH_NEURONX_COMPILER="reference", TORCH_NEURONX_RECORD_FILE=str(full),
                                                  TORCH_NEURONX_COMPILE_MODE="sync",
                                                  TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR=str(root / "rec")), f"recording {w}")
        lines = list(dict.fromkeys(full.read_text().splitlines()))  # a signature two jobs share, once
        if args.ops is None:
            args.ops = 8 if workloads == ["mlp"] else len(lines) - 1  # the last one pre-warms the scratch
        manifest = root / "manifest.jsonl"
        manifest.write_text("\n".join(lines[: args.ops]) + "\n")
        out["scratch"] = "fresh per run" if args.cold_scratch else "shared, pre-warmed"
        if not args.cold_scratch:
            pre = root / "pre.jsonl"
            pre.write_text(lines[-1] + "\n")  # not part of the workload
            _run(_cli("compile", str(pre), "--tier", args.tier, "--jobs", "1", "--local-dir",
                      str(root / "shared" / "pre"), "--json", "--no-progress"), _env(), "pre-warming the scratch")
        out["manifest_signatures"] = len(lines)
        out["workload"] = args.workload
        out["workload_signatures"] = min(args.ops, len(lines))
        out["workload_ops"] = [json.loads(x)["op"] for x in lines[: args.ops]]

        # 2. --jobs 1 vs --jobs 2, interleaved
        walls: dict[int, list[float]] = {1: [], 2: []}
        summaries: dict[int, dict[str, Any]] = {}
        for r in range(args.rounds):
            for jobs in (1, 2):
                # The Inductor scratch lives beside the local dir (<parent>/inductor-<fingerprint>).
                d = root / f"r{r}-j{jobs}"
                local = d / "local" if args.cold_scratch else root / "shared" / f"r{r}-j{jobs}"
                wall, stdout = _run(_cli("compile", str(manifest), "--tier", args.tier, "--jobs", str(jobs),
                                         "--local-dir", str(local), "--json", "--no-progress"),
                                    _env(), f"round {r}: compile --jobs {jobs}")
                s = json.loads(stdout)
                walls[jobs].append(wall)
                summaries[jobs] = {k: s[k] for k in ("compiled", "refused", "failed", "compile_seconds")}
                summaries[jobs]["refused_ops"] = sorted({f["op"] for f in s["failures"]})
                shutil.rmtree(d if args.cold_scratch else local, ignore_errors=True)
        med = {j: statistics.median(w) for j, w in walls.items()}
        out["compile"] = {"wall_s": {f"jobs_{j}": [round(x, 1) for x in w] for j, w in walls.items()},
                          "median_s": {f"jobs_{j}": round(m, 1) for j, m in med.items()},
                          "speedup_jobs2_vs_jobs1": round(med[1] / med[2], 2), "summary": summaries}

        # 3. first step, cold vs warmed
        if not args.skip_first_step:
            fjob = root / "first_step.py"
            fjob.write_text(FIRST_STEP[args.first_step_job])
            cold_dir, warm_dir = root / "cold" / "local", root / "warm" / "local"
            wall_cold, stdout = _run([sys.executable, str(fjob)],
                                     _env(TORCH_NEURONX_COMPILER=args.tier,
                                          TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR=str(cold_dir)), "cold first step")
            cold = json.loads(stdout.strip().splitlines()[-1])
            wall_w, stdout = _run(_cli("warm", "--tier", args.tier, "--jobs", "2", "--local-dir", str(warm_dir),
                                       "--json", "--no-progress", "--", sys.executable, str(fjob)), _env(), "warm-up")
            warm_summary = json.loads(stdout)
            wall_warm, stdout = _run([sys.executable, str(fjob)],
                                     _env(TORCH_NEURONX_COMPILER=args.tier, TORCH_NEURONX_CACHE_MODE="strict",
                                          TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR=str(warm_dir)), "warmed first step")
            warm = json.loads(stdout.strip().splitlines()[-1])
            out["first_step"] = {
                "job": args.first_step_job,
                "cold": {"first_step_s": round(cold["first_step_s"], 3), "compiles": cold["compiles"],
                         "fallbacks": cold["fallbacks"], "process_wall_s": round(wall_cold, 1)},
                "warmed_strict": {"first_step_s": round(warm["first_step_s"], 3), "compiles": warm["compiles"],
                                  "hits": warm["hits"], "process_wall_s": round(wall_warm, 1)},
                "speedup": round(cold["first_step_s"] / max(warm["first_step_s"], 1e-9), 1),
                "warm_up": {"wall_s": round(wall_w, 1), "compiled": warm_summary["compiled"],
                            "refused": warm_summary["refused"], "failed": warm_summary["failed"]},
            }
        out["load_avg_end"] = os.getloadavg()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

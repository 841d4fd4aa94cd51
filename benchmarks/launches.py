"""Launches per training step and step time of a Hugging Face Llama: CPU eager, neuron unfused and neuron
with adaptive fusion (TORCH_NEURONX_ENABLE_CONCATENATION=1), side by side (JSON on stdout).

Each mode runs in its own process (fusion is decided when a process builds its kernels); the parent
drives them one step at a time in turn (interleaved rounds: every mode sees the same machine), after
`--warm` steps each. A launch is one executable run: a per-op hit, an op of a region run op by op, or a
fused region's one call. Step times are medians of wall and of process CPU time (the latter is what a
loaded machine disturbs least); the load average is printed with them.

    python benchmarks/launches.py [--size small|large] [--loop fixed|new_batch|varlen] [--steps N]
                                  [--warm N] [--tier aoti|reference] [--cache-dir DIR]

`--loop new_batch` draws new token ids every step; `varlen` also cycles the sequence length (3 lengths).
With --cache-dir the executables persist (a first run on `aoti` compiles; run it twice to measure warm).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

import _models

SIZES = {"small": dict(layers=2, hidden=64, inter=176, heads=4, kv=2, vocab=512, batch=2, seq=32),
         "large": dict(layers=4, hidden=256, inter=688, heads=4, kv=2, vocab=4096, batch=4, seq=128)}

CHILD = r"""
import json, sys, time, torch
torch.set_num_threads(1)
device, size, loop = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
from transformers import LlamaConfig, LlamaForCausalLM
if device == "neuron":
    import neuron_runtime
torch.manual_seed(0)
cfg = LlamaConfig(vocab_size=size["vocab"], hidden_size=size["hidden"], intermediate_size=size["inter"],
                  num_hidden_layers=size["layers"], num_attention_heads=size["heads"],
                  num_key_value_heads=size["kv"], max_position_embeddings=512)
model = LlamaForCausalLM(cfg).to(device)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
g = torch.Generator().manual_seed(1)
fixed = torch.randint(0, size["vocab"], (size["batch"], size["seq"]), generator=g).to(device)
lengths = [size["seq"], size["seq"] * 3 // 4, size["seq"] // 2]
n = [0]

def batch():
    if loop == "fixed":
        return fixed
    t = lengths[n[0] % 3] if loop == "varlen" else size["seq"]
    return torch.randint(0, size["vocab"], (size["batch"], t), generator=g).to(device)

def launches():
    if device != "neuron":
        return 0
    s = neuron_runtime.stats()
    f = s.get("fusion") or {}
    return s["executions"] + f.get("fused_executions", 0) + f.get("ops_run_each", 0)

for line in sys.stdin:
    if line.strip() == "stats":
        out = {}
        if device == "neuron":
            s = neuron_runtime.stats()
            out = {"fusion": s.get("fusion"), "fallback_ops": s["fallback_ops"], "compiles": s["compiles"]}
        print(json.dumps(out), flush=True)
        break
    ids = batch()
    n[0] += 1
    l0, w0, c0 = launches(), time.perf_counter(), time.process_time()
    opt.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    value = loss.item()
    print(json.dumps({"wall": time.perf_counter() - w0, "cpu": time.process_time() - c0,
                      "launches": launches() - l0, "loss": value}), flush=True)
"""


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="small", choices=sorted(SIZES))
    p.add_argument("--loop", default="fixed", choices=["fixed", "new_batch", "varlen"])
    p.add_argument("--steps", type=int, default=30, help="measured steps per mode (medians of these)")
    p.add_argument("--warm", type=int, default=10, help="steps per mode before measuring")
    p.add_argument("--tier", default="aoti", choices=["aoti", "reference"])
    p.add_argument("--cache-dir", help="local executable cache (default: a fresh temporary directory)")
    args = p.parse_args()
    cache = args.cache_dir or tempfile.mkdtemp(prefix="neuron-launches-bench-")
    base = dict(os.environ, OMP_NUM_THREADS="1", TORCH_NEURONX_COMPILER=args.tier,
                TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR=cache)
    modes = {"cpu_eager": ("cpu", {}),
             "neuron_unfused": ("neuron", {"TORCH_NEURONX_ENABLE_CONCATENATION": "0"}),
             "neuron_fused": ("neuron", {"TORCH_NEURONX_ENABLE_CONCATENATION": "1"})}
    procs = {m: subprocess.Popen([sys.executable, "-c", CHILD, dev, json.dumps(SIZES[args.size]), args.loop],
                                 env=_models.child_env(dict(base, **extra)), stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True)
             for m, (dev, extra) in modes.items()}
    rows: dict[str, list[dict[str, float]]] = {m: [] for m in modes}

    def step(m: str) -> dict[str, float]:
        proc = procs[m]
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write("step\n")
        proc.stdin.flush()
        return json.loads(proc.stdout.readline())  # type: ignore[no-any-return]

    load_start = os.getloadavg()
    firsts = {}
    for i in range(args.warm + args.steps):
        for m in modes:  # one step of each mode in turn: interleaved
            r = step(m)
            if i == 0:
                firsts[m] = r["wall"]
            if i >= args.warm:
                rows[m].append(r)
    report: dict[str, object] = {"size": args.size, "loop": args.loop, "tier": args.tier,
                                 "steps": args.steps, "warm": args.warm,
                                 "load_start": load_start, "load_end": os.getloadavg()}
    unfused = statistics.median(r["wall"] for r in rows["neuron_unfused"])
    unfused_cpu = statistics.median(r["cpu"] for r in rows["neuron_unfused"])
    unfused_launches = statistics.median(r["launches"] for r in rows["neuron_unfused"])
    for m, proc in procs.items():
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write("stats\n")
        proc.stdin.flush()
        extra = json.loads(proc.stdout.readline())
        proc.wait(timeout=60)
        wall = statistics.median(r["wall"] for r in rows[m])
        cpu = statistics.median(r["cpu"] for r in rows[m])
        launches = statistics.median(r["launches"] for r in rows[m])
        report[m] = {"step_ms": round(wall * 1e3, 3), "step_cpu_ms": round(cpu * 1e3, 3),
                     "first_step_ms": round(firsts[m] * 1e3, 1), "launches_per_step": launches,
                     "vs_unfused": round(wall / unfused, 3), "cpu_vs_unfused": round(cpu / unfused_cpu, 3),
                     "launches_vs_unfused": round(launches / unfused_launches, 3) if unfused_launches else None,
                     "losses_last": [r["loss"] for r in rows[m][-3:]], **extra}
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

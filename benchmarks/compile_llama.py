"""`torch.compile(backend="neuron")` vs Inductor on CPU on issue 39's small Llama (JSON on stdout).

Hugging Face `LlamaForCausalLM` (2 layers, hidden 64, intermediate 176, 4 heads, 2 KV heads, vocab 512),
batch 2 x seq 32, AdamW (eager), `loss.item()` every step, OMP_NUM_THREADS=1, one process: CPU eager,
Inductor on CPU and `backend="neuron"` (sync compiles into --cache-dir, so a second run is warm) stepped
interleaved, step by step; medians per mode over the rounds, the load printed with them. Also the graphs
`backend="neuron"` keyed, refused and ran op by op (target: 0 refused, <= 1.1x Inductor).

    python benchmarks/compile_llama.py [--tier aoti] [--cache-dir DIR] [--rounds R] [--steps N]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

from _ab import child_result  # type: ignore[import-not-found]

CHILD = r"""
import copy, json, os, statistics, sys, time, warnings
import torch, neuron_runtime
from transformers import LlamaConfig, LlamaForCausalLM
torch.set_num_threads(1)
rounds, steps = int(sys.argv[1]), int(sys.argv[2])
torch.manual_seed(0)
cfg = LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=176, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=512, max_position_embeddings=64)
base = LlamaForCausalLM(cfg)
ids = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(1))

def trainer(model, compile_kw, device):
    model = copy.deepcopy(base).to(device)
    fn = torch.compile(model, **compile_kw) if compile_kw is not None else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = ids.to(device)
    def step():
        loss = fn(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.item()
    return step

modes = {"cpu_eager": trainer(base, None, "cpu"), "inductor_cpu": trainer(base, {}, "cpu"),
         "neuron_compiled": trainer(base, {"backend": "neuron"}, "neuron")}
refusals = []
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    first = {}
    for name, step in modes.items():
        t = time.perf_counter(); step(); first[name] = round(time.perf_counter() - t, 2)
        for _ in range(3):
            step()
refusals = [str(w.message) for w in caught if "cannot be compiled" in str(w.message)]
losses = {name: [step() for _ in range(2)] for name, step in modes.items()}
times = {name: [] for name in modes}
for _ in range(rounds):
    for name, step in modes.items():
        for _ in range(steps):
            t = time.perf_counter(); step(); times[name].append(time.perf_counter() - t)
med = {name: statistics.median(v) * 1e3 for name, v in times.items()}
g = neuron_runtime.stats()["graphs"]
print("RESULT " + json.dumps({
    "step_ms": {k: round(v, 3) for k, v in med.items()},
    "neuron_vs_inductor": round(med["neuron_compiled"] / med["inductor_cpu"], 3),
    "inductor_vs_eager": round(med["inductor_cpu"] / med["cpu_eager"], 3),
    "graphs": g, "refusals": refusals, "first_step_s": first, "losses_after_warmup": losses,
    "load": os.getloadavg()}))
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tier", default="aoti")
    ap.add_argument("--cache-dir", default=None, help="local cache (default: a fresh one: every graph compiles)")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--steps", type=int, default=5)
    a = ap.parse_args()
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCH_NEURONX_")}
    env.update(TORCH_NEURONX_COMPILER=a.tier, TORCH_NEURONX_COMPILE_MODE="sync", TORCH_NEURONX_PREFETCH="0",
               TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR=a.cache_dir or tempfile.mkdtemp(prefix="compile-llama-"),
               OMP_NUM_THREADS="1")
    return child_result(CHILD, [str(a.rounds), str(a.steps)], env)


if __name__ == "__main__":
    sys.exit(main())

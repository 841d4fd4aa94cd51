"""Issue 40's decoder block at eight sequence lengths (JSON on stdout): compiles per length on a tier.

A decoder block (LayerNorm, fused QKV `Linear`, `scaled_dot_product_attention(is_causal=True)`, GELU MLP;
d=32, 4 heads, batch 2), forward + backward at lengths 8, 12, 16, 20, 24, 28, 32, 40, sync mode, an empty
cache: the signatures compiled at each length (by op), and the loss and gradients against the same block on
CPU at every length. Target: the lengths after the first together compile <= 10 % of the first's count.

    python benchmarks/attention_lengths.py [--tier aoti|reference] [--cache-dir DIR]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

from _ab import child_result  # type: ignore[import-not-found]

CHILD = r"""
import collections, json, logging, os, sys, torch
import neuron_runtime
torch.manual_seed(0)
compiled = []
class Grab(logging.Handler):
    def emit(self, record):
        if record.getMessage().startswith("aoti: compiled ") or record.getMessage().startswith("reference: compiled "):
            compiled.append(record.args[0] if record.args else record.getMessage())
logging.getLogger("neuron_runtime").addHandler(Grab()); logging.getLogger("neuron_runtime").setLevel(logging.INFO)

class Block(torch.nn.Module):
    def __init__(self, d=32, heads=4):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.qkv, self.o = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)
        self.fc1, self.fc2 = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)
    def forward(self, x):
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in self.qkv(self.ln1(x)).split(d, -1))
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(y.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln2(x))))

cpu = Block()
dev = Block(); dev.load_state_dict(cpu.state_dict()); dev = dev.to("neuron")
per, by_op, worst = [], [], 0.0
for t in (8, 12, 16, 20, 24, 28, 32, 40):
    before, n0 = neuron_runtime.stats()["compiles"], len(compiled)
    x = torch.randn(2, t, 32)
    for m, xx in ((cpu, x), (dev, x.to("neuron"))):
        m.zero_grad()
        (m(xx) ** 2).mean().backward()
    for pc, pd in zip(cpu.parameters(), dev.parameters()):
        worst = max(worst, (pc.grad - pd.grad.cpu()).abs().max().item())
    per.append(neuron_runtime.stats()["compiles"] - before)
    by_op.append(dict(collections.Counter(compiled[n0:])))
    print(f"length {t}: {per[-1]} compiles {by_op[-1]}", file=sys.stderr, flush=True)
s = neuron_runtime.stats()
print("RESULT " + json.dumps({"compiles": per, "by_op": by_op, "later_vs_first": round(sum(per[1:]) / per[0], 3),
                              "max_grad_diff_vs_cpu": worst, "host_ops": s.get("host_ops"),
                              "fallback_ops": s.get("fallback_ops"), "load": os.getloadavg()}))
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tier", default="aoti")
    ap.add_argument("--cache-dir", default=None, help="local cache (default: a fresh, empty one)")
    a = ap.parse_args()
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCH_NEURONX_")}
    env.update(TORCH_NEURONX_COMPILER=a.tier, TORCH_NEURONX_COMPILE_MODE="sync", TORCH_NEURONX_PREFETCH="0",
               TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR=a.cache_dir or tempfile.mkdtemp(prefix="attn-lengths-"),
               OMP_NUM_THREADS="1")
    return child_result(CHILD, [], env)


if __name__ == "__main__":
    sys.exit(main())

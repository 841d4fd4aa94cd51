"""Shape-class benchmark (JSON on stdout): compiles per new shape and step times, TORCH_NEURONX_SHAPES=static
vs generic, side by side in one run.

Each policy runs in its own process with its own empty cache (the policy is read when the runtime
starts), doing the same work:
  1. a tiny decoder-only transformer (embedding, attention with SDPA, MLP, LM head; cross-entropy,
     backward, AdamW) trained two steps at each of 8 sequence lengths, then two steps at each of 8
     batch sizes (a new batch size every step pair): compiles per length / batch size;
  2. `generate`: a prompt, then 32 tokens with a growing KV cache (torch.cat, as HF's DynamicCache):
     compiles per generated token;
  3. step times at one shape (the decoder step and a small MLP step), warm, interleaved one by one with
     native CPU eager in the same process (OMP_NUM_THREADS=1): `vs_native` is the median of the rounds'
     ratios, and `generic_vs_static` their quotient.

    python benchmarks/shapes.py [--tier reference|aoti] [--rounds R] [--steps N] [--cache-dir DIR]
    python benchmarks/shapes.py --kernels [--tier aoti]   # a static vs a generic executable, per op
    python benchmarks/shapes.py --times-only [--tier aoti]  # step 3 alone: one shape, so few compiles
    python benchmarks/shapes.py --collide [--tier aoti] [--old DIR]  # lengths that collide with the dims

`--collide` (issue 32): a written-out decoder block (hidden 32, 4 heads: head dim 8, MLP 128, vocab 64)
trained two steps at each of the lengths 8, 12, ..., 36 (batch 2; 8 = the head dim, 2 x 16 = hidden, 32
= hidden), sync mode, the default shape policy: compiles per length, this checkout and `--old DIR` (a
git worktree of the code before a change) side by side; `later_vs_first` is the target (<= 0.10).

On `aoti` every compile is real (minutes per policy); --cache-dir keeps the executables between runs.
Sizes are chosen so that no sequence length, batch size or KV length equals a model dimension: equal sizes
share a symbol in a class, so a coincidence (a KV length equal to the head dim) is another class.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

CHILD = r"""
import json, statistics, sys, time, torch
import neuron_runtime
torch.set_num_threads(1)
steps, rounds, times_only = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "times"
V, D, H = 128, 64, 1
LENGTHS = [5, 6, 7, 9, 10, 11, 12, 13]
BATCHES = [2, 3, 5, 6, 7, 9, 10, 11]

class Decoder(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(V, D)
        self.ln1, self.ln2, self.lnf = torch.nn.LayerNorm(D), torch.nn.LayerNorm(D), torch.nn.LayerNorm(D)
        self.qkv, self.o = torch.nn.Linear(D, 3 * D), torch.nn.Linear(D, D)
        self.fc1, self.fc2 = torch.nn.Linear(D, 4 * D), torch.nn.Linear(4 * D, D)
        self.head = torch.nn.Linear(D, V)
    def forward(self, ids, kv=None):
        B, T = ids.shape
        x = self.emb(ids)
        q, k, v = self.qkv(self.ln1(x)).split(D, dim=-1)
        q, k, v = (t.view(B, T, H, D // H).transpose(1, 2) for t in (q, k, v))
        if kv is not None:
            k, v = torch.cat([kv[0], k], 2), torch.cat([kv[1], v], 2)
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=kv is None)
        x = x + self.o(a.transpose(1, 2).reshape(B, T, D))
        x = x + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln2(x))))
        return self.head(self.lnf(x)), (k, v)

def compiles():
    neuron_runtime.wait_for_compiles()
    return neuron_runtime.stats()["compiles"]

def trainer(device):
    torch.manual_seed(0)
    model = Decoder().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    def step(ids):
        opt.zero_grad(set_to_none=True)
        logits, _ = model(ids)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, V), ids.reshape(-1))
        loss.backward()
        opt.step()
        return loss
    return model, step

out = {}
model, step = trainer("neuron")
gen = torch.Generator().manual_seed(1)
def ids(b, t, device="neuron"):
    return torch.randint(0, V, (b, t), generator=gen).to(device)
for name, shapes in (() if times_only else (("lengths", [(2, t) for t in LENGTHS]),
                                            ("batches", [(b, 4) for b in BATCHES]))):
    per, last = [], compiles()
    for b, t in shapes:
        for _ in range(2):
            step(ids(b, t)).item()
        now = compiles()
        per.append(now - last)
        last = now
        print(f"{name} {b}x{t}: {per[-1]} compiles", file=sys.stderr, flush=True)
    out[name] = {"shapes": shapes, "compiles": per}

if not times_only:
    with torch.no_grad():
        prompt = ids(2, 5)
        last = compiles()
        logits, kv = model(prompt)
        out_prompt = compiles() - last
        per, last = [], compiles()
        tok = logits[:, -1:].argmax(-1)
        for _ in range(32):
            logits, kv = model(tok, kv)
            tok = logits[:, -1:].argmax(-1)
            now = compiles()
            per.append(now - last)
            last = now
            print(f"token {len(per)}: {per[-1]} compiles", file=sys.stderr, flush=True)
        out["generate"] = {"prompt_compiles": out_prompt, "per_token": per}

def mlp_trainer(device):
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 10)).to(device)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(2)).to(device)
    def step():
        opt.zero_grad(set_to_none=True)
        loss = m(x).pow(2).mean()
        loss.backward()
        opt.step()
        return loss
    return step

def timed(fn):
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t

times = {}
cpu_model, cpu_step = trainer("cpu")
fixed_dev, fixed_cpu = ids(2, 6), ids(2, 6, "cpu")
cases = {"decoder": (lambda: step(fixed_dev).item(), lambda: cpu_step(fixed_cpu).item())}
mlp_dev, mlp_cpu = mlp_trainer("neuron"), mlp_trainer("cpu")
cases["mlp"] = (lambda: mlp_dev().item(), lambda: mlp_cpu().item())
for name, (dev, cpu) in cases.items():
    for _ in range(3):  # warm: every executable compiled and loaded
        dev(); cpu()
    neuron_runtime.wait_for_compiles()
    dev(); cpu()
    ratios, dev_t, cpu_t = [], [], []
    for _ in range(rounds):
        d = statistics.median(timed(dev) for _ in range(steps))
        c = statistics.median(timed(cpu) for _ in range(steps))
        ratios.append(d / c); dev_t.append(d); cpu_t.append(c)
    times[name] = {"step_ms": round(statistics.median(dev_t) * 1e3, 3),
                   "native_ms": round(statistics.median(cpu_t) * 1e3, 3),
                   "vs_native": round(statistics.median(ratios), 3)}
out["times"] = times
s = neuron_runtime.stats()
out["stats"] = {k: s.get(k) for k in ("compiles", "class_hits", "fallbacks", "host_runs")}
print("RESULT " + json.dumps(out))
"""


KERNELS = r"""
import json, statistics, sys, time, torch
from neuron_runtime.compiler import get_compiler
from neuron_runtime.signatures import _ops, _shapes, _signature
torch.set_num_threads(1)
rounds, n = int(sys.argv[1]), int(sys.argv[2])
comp = get_compiler(sys.argv[3])
cases = {"add_64": ("aten::add.Tensor", lambda: (torch.randn(64), torch.randn(64), 1)),
         "mm_128": ("aten::mm", lambda: (torch.randn(128, 128), torch.randn(128, 128))),
         "sum_rows_256x64": ("aten::sum.dim_IntList", lambda: (torch.randn(256, 64), [1], False, None))}
out = {}
for name, (op, make) in cases.items():
    info = _ops.classify(op)
    values = make()
    sig = _signature.build(info, values)
    exes = {"static": comp.load(comp.compile(sig)), "generic": comp.load(comp.compile(_shapes.shape_class(sig)))}
    from neuron_runtime.aten._host import flatten
    tensors, scalars = flatten(info, values)
    times = {k: [] for k in exes}
    for _ in range(rounds):
        for k, exe in exes.items():
            t = time.perf_counter()
            for _ in range(n):
                exe(tensors, scalars)
            times[k].append((time.perf_counter() - t) / n * 1e6)
    out[name] = {"static_us": round(statistics.median(times["static"]), 2),
                 "generic_us": round(statistics.median(times["generic"]), 2),
                 "generic_vs_static": round(statistics.median(g / s for g, s in zip(times["generic"], times["static"])), 3)}
print("RESULT " + json.dumps(out))
"""


COLLIDE = r"""
import json, os, sys, time, torch
import neuron_runtime
from _models import Decoder, train_decoder
torch.set_num_threads(1)
torch.manual_seed(0)
per, secs = [], []
last = [neuron_runtime.stats()["compiles"], time.perf_counter()]
def done(t):
    per.append(neuron_runtime.stats()["compiles"] - last[0])
    secs.append(round(time.perf_counter() - last[1], 2))
    last[:] = [neuron_runtime.stats()["compiles"], time.perf_counter()]
    print(f"length {t}: {per[-1]} compiles in {secs[-1]} s", file=sys.stderr, flush=True)
train_decoder(Decoder(vocab=64, d=32, heads=4).to("neuron"), (8, 12, 16, 20, 24, 28, 32, 36), vocab=64, on_length=done)
print("RESULT " + json.dumps({"compiles": per, "seconds": secs, "fallback_ops": neuron_runtime.stats()["fallback_ops"],
                              "later_vs_first": round(sum(per[1:]) / per[0], 3) if per[0] else None,
                              "load": os.getloadavg()}))
"""


def collide(tier: str, code: str | None, cache: str) -> dict:  # type: ignore[type-arg]
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCH_NEURONX_")}
    env.update(TORCH_NEURONX_COMPILER=tier, TORCH_NEURONX_COMPILE_MODE="sync", TORCH_NEURONX_PREFETCH="0",
               TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR=cache, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (code, os.path.dirname(os.path.abspath(__file__)))))
    p = subprocess.run([sys.executable, "-c", COLLIDE], env=env, stdout=subprocess.PIPE, text=True, timeout=4 * 3600,
                       cwd=code)
    line = next((ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if p.returncode != 0 or line is None:
        raise SystemExit(f"collide run failed ({p.returncode}); its stderr is above")
    return json.loads(line[len("RESULT "):])  # type: ignore[no-any-return]


def kernels(tier: str, rounds: int) -> dict:  # type: ignore[type-arg]
    """Per op, a static and a generic executable of the same shape called directly, interleaved."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, "-c", KERNELS, str(rounds), "2000", tier], env=env,
                       stdout=subprocess.PIPE, text=True, timeout=3600)
    line = next((ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if p.returncode != 0 or line is None:
        raise SystemExit(f"kernel comparison failed ({p.returncode}); its stderr is above")
    return json.loads(line[len("RESULT "):])  # type: ignore[no-any-return]


def run(policy: str, tier: str, cache: str, steps: int, rounds: int,
        times_only: bool = False) -> dict:  # type: ignore[type-arg]
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCH_NEURONX_")}
    env.update(TORCH_NEURONX_SHAPES=policy, TORCH_NEURONX_COMPILER=tier, TORCH_NEURONX_COMPILE_MODE="sync",
               TORCH_NEURONX_PREFETCH="0", TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR=os.path.join(cache, policy),
               OMP_NUM_THREADS="1")
    # The child's progress (compiles per shape) goes to our stderr as it happens.
    p = subprocess.run([sys.executable, "-c", CHILD, str(steps), str(rounds), "times" if times_only else "all"],
                       env=env, stdout=subprocess.PIPE,
                       text=True, timeout=4 * 3600)
    line = next((ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if p.returncode != 0 or line is None:
        raise SystemExit(f"{policy} run failed ({p.returncode}); its stderr is above")
    return json.loads(line[len("RESULT "):])  # type: ignore[no-any-return]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tier", default="reference", choices=("reference", "aoti"))
    ap.add_argument("--steps", type=int, default=5, help="timed steps per round")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--cache-dir", help="keep the executables here (default: a fresh temporary directory)")
    ap.add_argument("--policies", default="static,generic",
                    help="comma-separated TORCH_NEURONX_SHAPES values to run (aoti static: ~1,000 compiles)")
    ap.add_argument("--kernels", action="store_true",
                    help="only compare a static and a generic executable per op (add, mm, a row sum), called directly")
    ap.add_argument("--repeat", type=int, default=1,
                    help="run the policies' processes this many times, alternating; medians of their quotients")
    ap.add_argument("--times-only", action="store_true",
                    help="only the step times at one shape (no sweep of lengths, batch sizes and tokens: "
                         "the static aoti run compiles one shape's signatures, not ~1,000)")
    ap.add_argument("--collide", action="store_true", help="only the decoder block at lengths that collide with "
                    "its dims (issue 32): compiles per length")
    ap.add_argument("--old", help="with --collide: another checkout to run side by side (e.g. a git worktree)")
    args = ap.parse_args()
    if args.collide:
        with tempfile.TemporaryDirectory(prefix="neuron-collide-") as tmp:
            out = {"tier": args.tier, "new": collide(args.tier, None, os.path.join(tmp, "new"))}
            if args.old:
                out["old"] = collide(args.tier, args.old, os.path.join(tmp, "old"))
        print(json.dumps(out, indent=1))
        return 0
    if args.kernels:
        print(json.dumps({"tier": args.tier, "kernels": kernels(args.tier, args.rounds)}, indent=1))
        return 0
    with tempfile.TemporaryDirectory(prefix="neuron-shapes-bench-") as tmp:
        cache = args.cache_dir or tmp
        res = {p: run(p, args.tier, cache, args.steps, args.rounds, args.times_only)
               for p in args.policies.split(",")}
        # Each policy's times come from its own process: on a shared machine a process's speed drifts,
        # so --repeat alternates the processes and reports the median of the per-repeat quotients.
        repeats = [res] + [{p: run(p, args.tier, cache, args.steps, args.rounds, args.times_only)
                            for p in args.policies.split(",")} for _ in range(args.repeat - 1)]
    summary: dict[str, object] = {"tier": args.tier}
    for p, r in res.items():
        if args.times_only:
            continue
        first, later = r["lengths"]["compiles"][0], sum(r["lengths"]["compiles"][1:])
        summary[p] = {
            "first_length_compiles": first, "later_lengths_compiles": later,
            "later_vs_first": round(later / first, 3) if first else None,
            "later_batches_compiles": sum(r["batches"]["compiles"][1:]),
            "generate_compiles_after_two_tokens": sum(r["generate"]["per_token"][2:]),
        }
    if "generic" in res and "static" in res:
        quotients = {name: [r["generic"]["times"][name]["vs_native"] / r["static"]["times"][name]["vs_native"]
                            for r in repeats] for name in res["generic"]["times"]}
        summary["generic_vs_static"] = {name: round(statistics.median(q), 3) for name, q in quotients.items()}
        if len(repeats) > 1:
            summary["generic_vs_static_per_repeat"] = {name: [round(x, 3) for x in q] for name, q in quotients.items()}
    print(json.dumps({"summary": summary, "runs": res}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Decode benchmark (JSON on stdout, issue 43): compiles per token, launches per token and ms per token
against CPU, for Hugging Face `generate` on `neuron`.

For each model (a tiny `LlamaForCausalLM`: 2 layers, hidden 64, intermediate 176, 4 heads, 2 KV heads,
vocab 256; a tiny GPT-2: 2 layers, hidden 64, 4 heads, vocab 256; random weights, nothing downloaded) and
each case (batch 1; batch 4 with left padding; greedy; `do_sample=True` under a seed; the default dynamic
KV cache, and `--static` adds `cache_implementation="static"`), one process, sync mode, its own empty cache:
  1. the issue's run: an 8-token prompt, 8 new tokens, then 16, then 48: compiles of each call, and
     whether its tokens equal CPU's (sampling: the same seed on both sides before each call);
  2. launches per token: executables run during a warm 48-token call, per token;
  3. warm ms per token: neuron's and CPU's 48-token `generate`, interleaved call by call (`--rounds`),
     medians, and their ratio (`vs_cpu`);
and `--train`: the Llama trained one step at each of 6 new batch sizes (sequence 16, AdamW): compiles per
step (after the first sizes the target is 0).

Other loops than the issue's: `--size small` (4 layers, hidden 256, 8 heads, 4 KV heads, intermediate 688,
vocab 1024; GPT-2 alike), and `--prompts 5,8,13`: step 3 cycles through these prompt lengths call by call
(each length warmed first: `new_length_compiles`), so no two consecutive calls decode from the same length.

    python benchmarks/decode.py [--tier reference|aoti] [--rounds R] [--models llama,gpt2] [--static]
                                [--train] [--batches 1,4] [--sampling greedy,seeded] [--cache-dir DIR]
                                [--size tiny|small] [--prompts 8]

OMP_NUM_THREADS=1 and one CPU thread on both sides; the load average is printed (stderr) and recorded.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

CHILD = r"""
import json, statistics, sys, time, warnings
warnings.filterwarnings("ignore")
import torch, neuron_runtime
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
torch.set_num_threads(1)
model_name, rounds, static, train = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1", sys.argv[4] == "1"
batches, samplings = [int(b) for b in sys.argv[5].split(",")], [s == "seeded" for s in sys.argv[6].split(",")]
small, PROMPTS = sys.argv[7] == "small", [int(p) for p in sys.argv[8].split(",")]
V, PAD = (1024 if small else 256), 0
H, L, NH, KV, FF = (256, 4, 8, 4, 688) if small else (64, 2, 4, 2, 176)

def make():
    torch.manual_seed(0)
    if model_name == "llama":
        cfg = LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=FF, num_hidden_layers=L,
                          num_attention_heads=NH, num_key_value_heads=KV, max_position_embeddings=256,
                          pad_token_id=PAD, bos_token_id=1, eos_token_id=2)
        return LlamaForCausalLM(cfg).eval()
    cfg = GPT2Config(vocab_size=V, n_positions=256, n_embd=H, n_layer=L, n_head=NH, pad_token_id=PAD,
                     bos_token_id=1, eos_token_id=2)
    return GPT2LMHeadModel(cfg).eval()

cpu = make()
dev = make().to("neuron")
dev.load_state_dict(cpu.state_dict())

def stat(k):
    return neuron_runtime.stats().get(k, 0)

def inputs(batch, prompt):
    g = torch.Generator().manual_seed(batch)
    ids = torch.randint(3, V, (batch, prompt), generator=g)
    mask = torch.ones(batch, prompt, dtype=torch.long)
    for row in range(1, batch):  # left padding: row r has r pad tokens in front
        ids[row, :row] = PAD
        mask[row, :row] = 0
    return ids, mask

def gen(model, device, ids, mask, n, sample):
    kw = dict(max_new_tokens=n, min_new_tokens=n, do_sample=sample, pad_token_id=PAD)
    if sample:
        kw.update(top_k=0, top_p=1.0, temperature=1.0)
        torch.manual_seed(1234)
    if static:
        kw["cache_implementation"] = "static"
    with torch.no_grad():
        return model.generate(ids.to(device), attention_mask=mask.to(device), **kw).cpu()

results = []
for batch in batches:
    for sample in samplings:
        ids, mask = inputs(batch, PROMPTS[0])
        calls = []
        for n in (8, 16, 48):
            c0 = stat("compiles")
            out = gen(dev, "neuron", ids, mask, n, sample)
            calls.append({"new_tokens": n, "compiles": stat("compiles") - c0,
                          "equal_cpu": bool(torch.equal(out, gen(cpu, "cpu", ids, mask, n, sample)))})
        e0, c0, f0 = stat("executions"), stat("compiles"), stat("fallbacks")
        gen(dev, "neuron", ids, mask, 48, sample)
        launches = (stat("executions") - e0) / 48
        warm_compiles = stat("compiles") - c0
        prompts = [inputs(batch, p) for p in PROMPTS]
        c0 = stat("compiles")
        for ids, mask in prompts[1:]:
            gen(dev, "neuron", ids, mask, 48, sample)
        new_length_compiles = stat("compiles") - c0
        tn, tc = [], []
        c0 = stat("compiles")
        for r in range(rounds):  # interleaved, call by call
            ids, mask = prompts[r % len(prompts)]
            t = time.perf_counter(); gen(dev, "neuron", ids, mask, 48, sample); tn.append(time.perf_counter() - t)
            t = time.perf_counter(); gen(cpu, "cpu", ids, mask, 48, sample); tc.append(time.perf_counter() - t)
        mn, mc = statistics.median(tn) * 1e3 / 48, statistics.median(tc) * 1e3 / 48
        results.append({
            "batch": batch, "sampling": "seeded" if sample else "greedy", "calls": calls,
            "later_compiles": calls[1]["compiles"] + calls[2]["compiles"],
            "compiles_per_token_after_first": (calls[1]["compiles"] + calls[2]["compiles"]) / 64,
            "warm_call_compiles": warm_compiles, "new_length_compiles": new_length_compiles,
            "timed_compiles": stat("compiles") - c0, "launches_per_token": round(launches, 1),
            "ms_per_token": round(mn, 3), "cpu_ms_per_token": round(mc, 3), "vs_cpu": round(mn / mc, 2)})
        print(json.dumps(results[-1]), file=sys.stderr, flush=True)

training = None
if train and model_name == "llama":
    m = make().to("neuron").train()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    per_step = []
    for b in (2, 3, 5, 6, 7, 9):
        x = torch.randint(3, V, (b, 16), generator=torch.Generator().manual_seed(b)).to("neuron")
        c0 = stat("compiles")
        m(input_ids=x, labels=x).loss.backward(); opt.step(); opt.zero_grad()
        per_step.append({"batch": b, "compiles": stat("compiles") - c0})
    training = per_step
print(json.dumps({"model": model_name, "static_cache": static, "cases": results, "train": training,
                  "fallback_ops": neuron_runtime.fallback_ops()}))
"""


def _build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tier", default="reference", choices=("reference", "aoti"))
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--models", default="llama,gpt2")
    p.add_argument("--static", action="store_true", help='also run cache_implementation="static"')
    p.add_argument("--train", action="store_true", help="also train the Llama at 6 new batch sizes")
    p.add_argument("--batches", default="1,4", help="batch sizes (rows after the first are left-padded)")
    p.add_argument("--sampling", default="greedy,seeded")
    p.add_argument("--size", default="tiny", choices=("tiny", "small"),
                   help="the issue's models, or 4x wider and 2x deeper")
    p.add_argument("--prompts", default="8", help="prompt lengths the timed calls cycle through")
    p.add_argument("--cache-dir", help="keep executables here (default: a fresh temporary directory per run)")
    return p


def _run(model: str, static: bool, args: argparse.Namespace, cache: str) -> dict[str, object]:
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCH_NEURONX_COMPILER=args.tier, TORCH_NEURONX_COMPILE_MODE="sync",
               TORCH_NEURONX_PREFETCH="0", TORCH_NEURONX_NEFF_CACHE_DIR=os.path.join(cache, "fleet"),
               TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR=os.path.join(cache, "local"), HF_HUB_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false")
    argv = [sys.executable, "-c", CHILD, model, str(args.rounds), "1" if static else "0", "1" if args.train else "0",
            args.batches, args.sampling, args.size, args.prompts]
    out = subprocess.run(argv, env=env, stdout=subprocess.PIPE, text=True, check=True)
    result: dict[str, object] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def main(argv: list[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    load_before = os.getloadavg()
    print(f"load average before: {load_before}", file=sys.stderr)
    runs = []
    for model in args.models.split(","):
        for static in ((False, True) if args.static else (False,)):
            with tempfile.TemporaryDirectory(prefix="neuron-decode-") as tmp:
                cache = args.cache_dir or tmp
                if args.cache_dir:  # each model and cache kind in its own place: every run starts cold
                    kind = ("static" if static else "dynamic") + ("-small" if args.size == "small" else "")
                    cache = os.path.join(cache, f"{args.tier}-{model}-{kind}")
                runs.append(_run(model, static, args, cache))
    load_after = os.getloadavg()
    print(f"load average after: {load_after}", file=sys.stderr)
    print(json.dumps({"tier": args.tier, "rounds": args.rounds, "size": args.size, "prompts": args.prompts,
                      "load_before": load_before, "load_after": load_after,
                      "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

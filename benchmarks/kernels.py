"""Kernel library benchmark (JSON on stdout): `neuron_runtime.kernels` against the eager compositions they
replace, on the Llama shapes of the launches measurement (hidden 64, sequence 32, batch 2, 4 heads).

  * per kernel (rms_norm, rotary, swiglu): one forward + backward call on neuron, the kernel against the
    same math written as torch ops (the composition); launches per call and time per call;
  * a Hugging Face `LlamaForCausalLM` (2 layers) training step (forward, backward, AdamW) on neuron,
    plain against `kernels.use_in_llama(model)`: launches per step, step time, and whether the losses agree.

Both sides run in one process, interleaved round by round (medians; `OMP_NUM_THREADS=1`); the load
average is printed with the numbers. Executables are compiled during the warm-up (sync mode), so the
rounds time launches only.

    python benchmarks/kernels.py [--tier aoti|reference] [--rounds R] [--calls N] [--cache-dir DIR]
                                 [--only rms_norm rotary swiglu llama]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tier", default="aoti", choices=["aoti", "reference"])
    p.add_argument("--rounds", type=int, default=15, help="interleaved rounds (medians of these)")
    p.add_argument("--calls", type=int, default=20, help="kernel calls (or training steps / 4) per round")
    p.add_argument("--cache-dir", help="local executable cache (default: a fresh temporary directory)")
    p.add_argument("--only", nargs="+", choices=["rms_norm", "rotary", "swiglu", "llama"],
                   help="measure only these (default: all)")
    return p.parse_args()


def main() -> int:
    args = _args()
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ["TORCH_NEURONX_COMPILER"] = args.tier
    os.environ["TORCH_NEURONX_COMPILE_MODE"] = "sync"
    os.environ.setdefault("TORCH_NEURONX_PREFETCH", "0")
    os.environ["TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR"] = args.cache_dir or tempfile.mkdtemp(prefix="neuron-kernels-")
    import torch

    import neuron_runtime
    from neuron_runtime import kernels

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _ab import interleaved_medians

    torch.set_num_threads(1)
    dev = "neuron"
    torch.manual_seed(0)
    b, t, h, heads = 2, 32, 64, 4
    d = h // heads
    x, w = torch.randn(b, t, h), torch.randn(h)
    q, k = torch.randn(b, heads, t, d), torch.randn(b, heads, t, d)
    cos, sin = torch.randn(b, t, d), torch.randn(b, t, d)
    g, u = torch.randn(b, t, 172), torch.randn(b, t, 172)

    def rms(x: Any, w: Any, eps: float) -> Any:
        hh = x.float()
        return w * (hh * torch.rsqrt(hh.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)

    def half(v: Any) -> Any:
        return torch.cat((-v[..., v.shape[-1] // 2:], v[..., : v.shape[-1] // 2]), dim=-1)

    def rot(q: Any, k: Any, cos: Any, sin: Any) -> Any:
        c, s = cos.unsqueeze(1), sin.unsqueeze(1)
        return q * c + half(q) * s, k * c + half(k) * s

    def glu(g: Any, u: Any) -> Any:
        return torch.nn.functional.silu(g) * u

    cases = {"rms_norm": (kernels.rms_norm, rms, [x, w, 1e-6]), "rotary": (kernels.rotary, rot, [q, k, cos, sin]),
             "swiglu": (kernels.swiglu, glu, [g, u])}
    report: dict[str, Any] = {"tier": args.tier, "rounds": args.rounds, "calls_per_round": args.calls,
                              "shapes": {"batch": b, "seq": t, "hidden": h, "heads": heads}}
    only = set(args.only or [*cases, "llama"])
    for name, (kern, eager, inputs) in cases.items():
        if name not in only:
            continue
        ins = [a.to(dev).requires_grad_() if isinstance(a, torch.Tensor) else a for a in inputs]
        report[name] = _compare(torch, neuron_runtime, interleaved_medians, args,
                                kernel=_call(torch, kern, ins), composition=_call(torch, eager, ins))
    if "llama" in only:
        report["llama_train_step"] = _llama(torch, neuron_runtime, kernels, interleaved_medians, args, b, t, h, heads)
    report["load_average"] = os.getloadavg()
    print(json.dumps(report, indent=2))
    return 0


def _call(torch: Any, fn: Callable[..., Any], ins: list[Any]) -> Callable[[], None]:
    """One forward + backward call of `fn` on `ins` (gradients taken, not accumulated)."""
    tensors = [a for a in ins if isinstance(a, torch.Tensor)]

    def once() -> None:
        out = fn(*ins)
        outs = list(out) if isinstance(out, tuple) else [out]
        torch.autograd.grad(outs, tensors, [torch.ones_like(o) for o in outs])
    return once


def _launches(nr: Any, fn: Callable[[], None]) -> int:
    before = nr.stats()["executions"]
    fn()
    return int(nr.stats()["executions"] - before)


def _timer(fn: Callable[[], None], n: int) -> Callable[[], float]:
    def round_() -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - t0) / n
    return round_


def _compare(torch: Any, nr: Any, medians: Any, args: Any, *, kernel: Callable[[], None],
             composition: Callable[[], None]) -> dict[str, Any]:
    for _ in range(3):  # compile (sync) and load everything both sides use
        kernel()
        composition()
    launches = {"kernel": _launches(nr, kernel), "composition": _launches(nr, composition)}
    tk, tc = medians(_timer(kernel, args.calls), _timer(composition, args.calls), args.rounds)
    return {"launches_per_call_fwd_bwd": launches, "kernel_us": round(tk * 1e6, 1),
            "composition_us": round(tc * 1e6, 1), "kernel_vs_composition": round(tk / tc, 3),
            "load_average": os.getloadavg()}


def _llama(torch: Any, nr: Any, kernels: Any, medians: Any, args: Any, b: int, t: int, h: int,
           heads: int) -> dict[str, Any]:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=h, intermediate_size=172, num_hidden_layers=2,
                      num_attention_heads=heads, num_key_value_heads=heads)
    base = LlamaForCausalLM(cfg)
    plain, fused = copy.deepcopy(base).to("neuron"), copy.deepcopy(base).to("neuron")
    swapped = kernels.use_in_llama(fused)
    ids = torch.randint(0, 256, (b, t)).to("neuron")
    losses: dict[str, list[float]] = {"plain": [], "kernels": []}

    def stepper(model: Any, name: str) -> Callable[[], None]:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

        def step() -> None:
            opt.zero_grad(set_to_none=True)
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            losses[name].append(loss.item())
        return step

    sp, sk = stepper(plain, "plain"), stepper(fused, "kernels")
    for _ in range(3):
        sp()
        sk()
    agree = all(abs(a - c) <= 1e-4 * max(1.0, abs(a)) for a, c in zip(losses["plain"], losses["kernels"]))
    launches = {"plain": _launches(nr, sp), "kernels": _launches(nr, sk)}
    n = max(1, args.calls // 4)
    tp, tk = medians(_timer(sp, n), _timer(sk, n), args.rounds)
    return {"swapped": swapped, "launches_per_step": launches, "plain_ms": round(tp * 1e3, 3),
            "kernels_ms": round(tk * 1e3, 3), "kernels_vs_plain": round(tk / tp, 3),
            "first_losses_agree": agree, "load_average": os.getloadavg()}


if __name__ == "__main__":
    raise SystemExit(main())

"""AdamW's step alone on `neuron` vs the same step on CPU tensors, interleaved in one run (JSON).

Method: OMP_NUM_THREADS=1; the parameters of the Hugging Face Trainer benchmark's models (`hf_trainer.py`:
a GPT-2 with tied embeddings, 28 parameters for `tiny`) with fixed gradients; `torch.optim.AdamW` with
`fused=True` (the Trainer's default `adamw_torch_fused`) and `foreach=True` (`adamw_torch`). Each round
times `--steps` steps per device; medians over rounds of ms per step, ratio neuron/CPU. Warm: a few
steps on each device first compile and load every signature.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TORCH_NEURONX_COMPILER", "reference")

import torch  # noqa: E402

import neuron_runtime  # noqa: E402
from _ab import interleaved_medians  # noqa: E402

torch.set_num_threads(1)

# (n_embd, n_layer, vocab, seq) as in hf_trainer.py's SIZES.
SIZES = {"tiny": (32, 2, 256, 32), "small": (128, 4, 256, 64)}


def shapes(size: str) -> list[tuple[int, ...]]:
    """GPT-2's parameter shapes (Conv1D weights are (in, out)); the LM head is tied to `wte`."""
    d, layers, vocab, seq = SIZES[size]
    per_layer = [(d,), (d,), (d, 3 * d), (3 * d,), (d, d), (d,), (d,), (d,), (d, 4 * d), (4 * d,), (4 * d, d), (d,)]
    return [(vocab, d), (seq, d)] + per_layer * layers + [(d,), (d,)]


def _setup(size: str, device: str, kind: str) -> tuple[torch.optim.Optimizer, list[torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=g).to(device)) for s in shapes(size)]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g).to(device)
    opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, **{kind: True})
    return opt, params


def ms_per_step(opt: torch.optim.Optimizer, steps: int) -> float:
    t0 = time.perf_counter()
    for _ in range(steps):
        opt.step()
    return (time.perf_counter() - t0) * 1e3 / steps


def compare(size: str, kind: str, steps: int, rounds: int) -> dict[str, float]:
    cpu, _ = _setup(size, "cpu", kind)
    neu, _ = _setup(size, "neuron", kind)
    for opt in (cpu, neu, neu):
        ms_per_step(opt, 3)
    neuron_runtime.wait_for_compiles()
    ms_per_step(neu, 3)
    mc, mn = interleaved_medians(lambda: ms_per_step(cpu, steps), lambda: ms_per_step(neu, steps), rounds)
    return {"cpu_ms": round(mc, 3), "neuron_ms": round(mn, 3), "neuron_over_cpu": round(mn / mc, 2)}


def _build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="tiny,small", help="comma-separated: tiny, small")
    p.add_argument("--kinds", default="fused,foreach", help="comma-separated: fused, foreach")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--rounds", type=int, default=7)
    return p


def main(argv: list[str] | None = None) -> int:
    a = _build_parser().parse_args(argv)
    load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    out: dict[str, object] = {"tier": neuron_runtime.stats()["compiler"], "load": load,
                              "steps": a.steps, "rounds": a.rounds}
    for size in a.sizes.split(","):
        for kind in a.kinds.split(","):
            out[f"{size}_{kind}"] = compare(size, kind, a.steps, a.rounds)
    out["load_after"] = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Transformers' Trainer on `neuron` vs the same Trainer on CPU tensors, side by side in one run (JSON).

Method: OMP_NUM_THREADS=1 (set below before torch loads); a tiny GPT-2 (random weights, in-memory data,
nothing downloaded) trained by `Trainer` with `logging_steps=1` (so `loss.item()` every step) and a new
batch every step. Warm: one Trainer run on each device first (on `neuron` every signature is then
compiled and loaded: background compiles are waited for), then interleaved rounds of one Trainer run
per device; steps/s of a round is measured from the end of its first step to the end of its last (the
Trainer's set-up is not a step). Medians over rounds, ratio neuron/CPU. Two model sizes.

Flags: `--quick` (3 rounds of 8 steps), `--cases tiny,small,tiny_foreach_adamw`, `--no-cold`.

Cold: the first step of a fresh process (`--cold`, run in a subprocess with an empty local cache and
fresh compiler scratch dirs, in the default background compile mode), from `trainer.train()` to the
end of step 1, beside the same process's later step time.

The compiler tier is TORCH_NEURONX_COMPILER (default here: `reference`; `aoti` compiles real
executables, minutes of cold compiles on 2 cores).
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TORCH_NEURONX_COMPILER", "reference")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402

import neuron_runtime  # noqa: E402

torch.set_num_threads(1)

SIZES = {
    "tiny": dict(n_embd=32, n_layer=2, n_head=4, seq=32, batch=8),
    "small": dict(n_embd=128, n_layer=4, n_head=4, seq=64, batch=8),
}
# Trainer's default optimizer is `adamw_torch_fused`; `adamw_torch` (foreach) shows what the fused
# op's copy-back into parameters and moments costs.
CASES = {"tiny": ("tiny", "adamw_torch_fused"), "small": ("small", "adamw_torch_fused"),
         "tiny_foreach_adamw": ("tiny", "adamw_torch")}
VOCAB = 256


def _trainer(size: str, device: str, steps: int, out: str, optim: str = "adamw_torch_fused"):  # type: ignore[no-untyped-def]
    from datasets import Dataset
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

    s = SIZES[size]
    cfg = GPT2Config(vocab_size=VOCAB, n_positions=s["seq"], n_embd=s["n_embd"], n_layer=s["n_layer"],
                     n_head=s["n_head"], bos_token_id=1, eos_token_id=1, pad_token_id=0)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(cfg)
    ids = torch.randint(0, VOCAB, (steps * s["batch"], s["seq"]), generator=torch.Generator().manual_seed(0))
    data = Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()})
    args = TrainingArguments(output_dir=out, use_cpu=device == "cpu", max_steps=steps,
                             per_device_train_batch_size=s["batch"], logging_steps=1, save_strategy="no",
                             report_to=[], disable_tqdm=True, seed=0, dataloader_num_workers=0, optim=optim)

    class Clock(TrainerCallback):
        def __init__(self) -> None:
            self.ends: list[float] = []

        def on_step_end(self, *a, **k):  # type: ignore[no-untyped-def]
            self.ends.append(time.perf_counter())

    clock = Clock()
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[clock])
    assert trainer.args.device.type == device, trainer.args.device
    return trainer, clock


def steps_per_s(size: str, device: str, steps: int, out: str, optim: str) -> float:
    trainer, clock = _trainer(size, device, steps, out, optim)
    with contextlib.redirect_stdout(sys.stderr):  # the Trainer prints its logs: stdout is the JSON's
        trainer.train()
    return (len(clock.ends) - 1) / (clock.ends[-1] - clock.ends[0])


def compare(size: str, optim: str, steps: int, rounds: int, out: str) -> dict[str, float]:
    steps_per_s(size, "cpu", steps, out, optim)
    steps_per_s(size, "neuron", steps, out, optim)  # compiles (or queues) every signature
    neuron_runtime.wait_for_compiles()
    steps_per_s(size, "neuron", steps, out, optim)  # ... once-per-run ones asked for a second time
    neuron_runtime.wait_for_compiles()
    before = neuron_runtime.stats()
    cpu, neu = [], []
    for _ in range(rounds):
        cpu.append(steps_per_s(size, "cpu", steps, out, optim))
        neu.append(steps_per_s(size, "neuron", steps, out, optim))
    after = neuron_runtime.stats()
    c, n = statistics.median(cpu), statistics.median(neu)
    return {"cpu_steps_per_s": round(c, 2), "neuron_steps_per_s": round(n, 2), "ratio": round(n / c, 3),
            "compiles_while_measured": after["compiles"] - before["compiles"],
            "host_runs_while_measured": after.get("host_runs", 0) - before.get("host_runs", 0)}


def cold() -> dict[str, float]:
    """In this (fresh) process: the first step's time and the later steps' median."""
    with tempfile.TemporaryDirectory() as out:
        trainer, clock = _trainer("tiny", "neuron", 8, out)
        t0 = time.perf_counter()
        with contextlib.redirect_stdout(sys.stderr):
            trainer.train()
    later = [b - a for a, b in zip(clock.ends[1:], clock.ends[2:])]
    return {"first_step_s": round(clock.ends[0] - t0, 2), "later_step_s": round(statistics.median(later), 4)}


def cold_subprocess() -> dict[str, float]:
    with tempfile.TemporaryDirectory() as d:
        env = dict(os.environ, TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR=os.path.join(d, "neff"),
                   TORCHINDUCTOR_CACHE_DIR=os.path.join(d, "inductor"), TMPDIR=d, TORCH_NEURONX_PREFETCH="0")
        env.pop("TORCH_NEURONX_COMPILE_MODE", None)  # the default: background
        env.pop("TORCH_NEURONX_NEFF_CACHE_DIR", None)
        r = subprocess.run([sys.executable, __file__, "--cold"], capture_output=True, text=True, env=env)
        if r.returncode != 0:
            return {"error": r.stderr[-2000:]}  # type: ignore[dict-item]
        return json.loads(r.stdout)


def main() -> int:
    if "--cold" in sys.argv:
        print(json.dumps(cold()))
        return 0
    quick = "--quick" in sys.argv
    rounds, steps = (3, 8) if quick else (5, 12)
    # `--cases tiny,small`: only these (default: all of CASES); `--no-cold`: skip the cold subprocess.
    cases = sys.argv[sys.argv.index("--cases") + 1].split(",") if "--cases" in sys.argv else list(CASES)
    with tempfile.TemporaryDirectory() as out:
        result = {"tier": neuron_runtime.stats()["compiler"], "threads": torch.get_num_threads(),
                  "rounds": rounds, "steps_per_round": steps}
        result["load"] = os.getloadavg()
        for case in cases:
            size, optim = CASES[case]
            result[case] = compare(size, optim, steps, rounds, out)
        result["load_after"] = os.getloadavg()
    if "--no-cold" not in sys.argv:
        result["cold_tiny"] = cold_subprocess()
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

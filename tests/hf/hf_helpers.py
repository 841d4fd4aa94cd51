"""The tiny causal LM, its data and the Trainer runs that tests/hf share."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import torch
from datasets import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

VOCAB = 64
STEPS = 4  # per run; a checkpoint after step SAVE_AT, so resumed runs train steps SAVE_AT+1 .. STEPS
SAVE_AT = 2


def tiny_config(dropout: float = 0.1) -> GPT2Config:
    # Dropout stays on by default (GPT-2's 0.1): equal losses then also mean equal dropout masks.
    # n_positions 128: TRL pads sequences to a multiple of 128 on `neuron` (its one Neuron setting).
    return GPT2Config(vocab_size=VOCAB, n_positions=128, n_embd=32, n_layer=2, n_head=4,
                      bos_token_id=1, eos_token_id=1, pad_token_id=0,
                      resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout)


def tiny_model(seed: int = 0, dropout: float = 0.1) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    return GPT2LMHeadModel(tiny_config(dropout))


def lm_dataset(rows: int = 16, length: int = 16) -> Dataset:
    ids = torch.randint(0, VOCAB, (rows, length), generator=torch.Generator().manual_seed(0)).tolist()
    return Dataset.from_dict({"input_ids": ids, "labels": ids})


class Losses(TrainerCallback):
    """The training loss of every step, as the Trainer logs it (logging_steps=1)."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, float] | None = None, **kw: Any) -> None:
        if logs and "loss" in logs:
            self.losses.append(float(logs["loss"]))


def train_args(out: Path, *, use_cpu: bool, **kw: Any) -> TrainingArguments:
    base: dict[str, Any] = dict(
        output_dir=str(out), use_cpu=use_cpu, max_steps=STEPS, per_device_train_batch_size=4,
        logging_steps=1, save_steps=SAVE_AT, save_strategy="steps", report_to=[], disable_tqdm=True,
        seed=0, learning_rate=1e-3, dataloader_num_workers=0)
    base.update(kw)
    return TrainingArguments(**base)


def run_trainer(out: Path, *, use_cpu: bool, resume: Path | None = None, dropout: float = 0.1,
                **kw: Any) -> tuple[list[float], Trainer]:
    args = train_args(out, use_cpu=use_cpu, **kw)
    losses = Losses()
    trainer = Trainer(model=tiny_model(dropout=dropout), args=args, train_dataset=lm_dataset(), callbacks=[losses])
    trainer.train(resume_from_checkpoint=str(resume) if resume else None)
    return losses.losses, trainer


class TrainerRuns:
    """Each run happens once, on first use, and is shared by every test that reads it."""

    def __init__(self, root: Path) -> None:
        self.root = root

    @functools.cached_property
    def cpu(self) -> tuple[list[float], Trainer]:
        return run_trainer(self.root / "cpu", use_cpu=True)

    @functools.cached_property
    def neuron(self) -> tuple[list[float], Trainer]:
        return run_trainer(self.root / "neuron", use_cpu=False)

    def checkpoint(self, which: str) -> Path:
        getattr(self, which)
        return self.root / which / f"checkpoint-{SAVE_AT}"

    def resumed(self, on: str, checkpoint_of: str) -> list[float]:
        """Losses of a run on `on` ("cpu" | "neuron") resumed from the other run's checkpoint."""
        losses, _ = run_trainer(self.root / f"{on}-from-{checkpoint_of}", use_cpu=on == "cpu",
                                resume=self.checkpoint(checkpoint_of))
        return losses

"""Transformers' Trainer and Accelerate pick the `neuron` device with no user code change, train with
the losses of the same run on CPU, and resume from checkpoints written on either device."""

from __future__ import annotations

import pytest
import torch

import neuron_runtime
from hf_helpers import SAVE_AT, STEPS, TrainerRuns, train_args

# The stated tolerance: the `reference` tier runs each op's aten kernel on host memory, so the losses
# agree to float32 rounding of the logged values; `aoti` executables may differ in the last bits.
TOL = dict(rel=1e-5, abs=1e-5)


def test_detection_picks_neuron_with_no_user_code_change(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from accelerate import PartialState
    from accelerate.utils import is_neuron_available
    from transformers.utils import is_torch_bf16_gpu_available, is_torch_neuron_available

    assert is_torch_neuron_available() and is_neuron_available()
    args = train_args(tmp_path, use_cpu=False)
    assert args.device == torch.device("neuron:0")
    assert PartialState().device.type == "neuron"
    assert is_torch_bf16_gpu_available()  # asks torch.neuron.is_bf16_supported()
    assert train_args(tmp_path, use_cpu=False, torch_compile=True).torch_compile_backend == "neuron"


def test_trainer_on_neuron_has_the_losses_of_the_cpu_run(runs: TrainerRuns) -> None:
    before = neuron_runtime.stats()["executions"]
    losses, trainer = runs.neuron
    cpu_losses, cpu_trainer = runs.cpu
    assert len(losses) == STEPS == len(cpu_losses)
    assert losses == pytest.approx(cpu_losses, **TOL)
    assert {p.device.type for p in trainer.model.parameters()} == {"neuron"}
    assert {p.device.type for p in cpu_trainer.model.parameters()} == {"cpu"}
    if before == 0:  # the run happened in this test: it ran compiled executables
        assert neuron_runtime.stats()["executions"] > 0
    assert losses[0] != losses[-1]  # it trained


def test_resume_reproduces_the_uninterrupted_run(runs: TrainerRuns) -> None:
    # Dropout is on: equal losses after the resume also mean the RNG state came back.
    assert runs.resumed("neuron", "neuron") == pytest.approx(runs.neuron[0][SAVE_AT:], **TOL)


def test_a_cpu_checkpoint_resumes_on_neuron_and_the_reverse(runs: TrainerRuns) -> None:
    assert runs.resumed("neuron", "cpu") == pytest.approx(runs.cpu[0][SAVE_AT:], **TOL)
    assert runs.resumed("cpu", "neuron") == pytest.approx(runs.neuron[0][SAVE_AT:], **TOL)


def test_memory_counters_see_the_model(runs: TrainerRuns) -> None:
    _, trainer = runs.neuron
    params = sum(p.numel() * p.element_size() for p in trainer.model.parameters())
    assert torch.neuron.memory_allocated() >= params
    assert torch.neuron.max_memory_allocated() >= torch.neuron.memory_allocated()
    assert torch.accelerator.memory_allocated() == torch.neuron.memory_allocated()


"""Hugging Face's libraries on the `neuron` device: one tiny GPT-2 config built here, random weights,
in-memory datasets, nothing downloaded (HF_HUB_OFFLINE=1 makes any download attempt an error)."""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from hf_helpers import TrainerRuns  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def runs(tmp_path_factory: pytest.TempPathFactory) -> TrainerRuns:
    """The Trainer runs the checks share (each run once per session)."""
    return TrainerRuns(tmp_path_factory.mktemp("hf"))

"""Fixtures for the compiler tiers: one scratch root per checkout, one set of `aoti` compiles per session.

Each AOTInductor compile costs 5-30 s on 2 cores and the first one in a fresh scratch directory another
30-60 s of precompiled headers, so the slow tests share what they compile. The scratch root lives in
pytest's cache directory: Inductor's precompiled headers (keyed by the fingerprint, never by the test)
survive between sessions, the executables under test never do (they are compiled fresh each session).
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest


@pytest.fixture(scope="session")
def aoti_root(pytestconfig: pytest.Config, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Parent of the local cache directories the `aoti` tests use; Inductor's scratch goes beside them."""
    cache = getattr(pytestconfig, "cache", None)
    if cache is not None:
        return Path(cache.mkdir("neuron-aoti"))
    return tmp_path_factory.mktemp("neuron-aoti")


@pytest.fixture(scope="session")
def aoti_compiler(aoti_root: Path) -> Any:
    from neuron_runtime.compiler._aoti import AotiCompiler

    return AotiCompiler(local_cache_dir=str(aoti_root / "neff"))


@pytest.fixture
def fresh_local_dir(aoti_root: Path) -> Iterator[Path]:
    """An empty local executable cache beside the shared scratch (so a run compiles, headers are reused)."""
    path = aoti_root / "neff-e2e"
    shutil.rmtree(path, ignore_errors=True)
    yield path
    shutil.rmtree(path, ignore_errors=True)

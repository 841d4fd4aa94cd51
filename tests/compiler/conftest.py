"""Fixtures for the compiler tiers: one scratch root per checkout, one set of `aoti` compiles per session.

Each AOTInductor compile costs 5-30 s on 2 cores and the first one in a fresh scratch directory another
30-60 s of precompiled headers, so the slow tests share what they compile. The scratch root lives in
pytest's cache directory: Inductor's precompiled headers (keyed by the fingerprint, never by the test)
survive between sessions, the executables under test never do (they are compiled fresh each session).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]


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


@pytest.fixture(scope="session")
def device_run(aoti_root: Path) -> Iterator[subprocess.Popen[str]]:
    """A process that runs an op on `neuron` with TORCH_NEURONX_COMPILER=aoti and prints its stats.

    Started once, early (the `compiled` fixture asks for it first): g++ is single-threaded, so on two
    cores its compile overlaps the in-process compiles instead of adding to them. Its local cache starts
    empty, so it compiles; the scratch (precompiled headers) is the session's."""
    local = aoti_root / "neff-e2e"
    shutil.rmtree(local, ignore_errors=True)
    script = textwrap.dedent("""
        import json
        import torch, neuron_runtime
        torch.manual_seed(0)
        torch.set_default_device("neuron")  # the compile must not make its example inputs on neuron
        x = torch.randn(64)
        assert x.device.type == "neuron"
        with torch.inference_mode():  # nor trace under the caller's inference mode
            y = (x + x).cpu()
        torch.testing.assert_close(y, x.cpu() * 2)
        # The rank-collapse rule: `+` of every rank and dense layout runs add's one flat (1-D) kernel,
        # on 1-D views of the inputs and the output viewed back; natively from the second call on.
        compiled = neuron_runtime.stats()["compiles"]
        for t in (x.view(8, 8), x.view(4, 4, 4), x.view(8, 8).t()):
            for _ in range(3):
                z = t + t
                assert z.shape == t.shape and z.stride() == t.stride(), (z.shape, z.stride())
                torch.testing.assert_close(z.cpu(), t.cpu() * 2)
        assert neuron_runtime.stats()["compiles"] == compiled
        print(json.dumps(neuron_runtime.stats()))
    """)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCH_NEURONX_")}
    env.update(TORCH_NEURONX_COMPILER="aoti", TORCH_NEURONX_COMPILE_MODE="sync",
               TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR=str(local))
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=REPO, env=env)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()
        shutil.rmtree(local, ignore_errors=True)

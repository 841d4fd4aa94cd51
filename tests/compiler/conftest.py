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
        # An in-place foreach op (an optimizer's update): its kernel stores into the tensors themselves,
        # natively from the second call on; calls whose written tensors overlap another argument run the
        # in-place op on the host instead, and every call equals CPU's.
        from neuron_runtime._native import _hostmem
        base = [torch.randn(5, 3, device="cpu"), torch.randn(7, device="cpu")]
        other = [torch.randn(5, 3, device="cpu"), torch.randn(7, device="cpu")]
        def check(fn, xs, ys):
            want = [t.clone() for t in xs]
            fn(want, [t.clone() for t in ys])
            got = [t.to("neuron") for t in xs]
            fn(got, [t.to("neuron") for t in ys])
            for g, w in zip(got, want):
                torch.testing.assert_close(g.cpu(), w, rtol=0, atol=0)
        native = _hostmem.NATIVE.executions() if _hostmem.NATIVE is not None else 0
        for _ in range(4):
            check(torch._foreach_mul_, base, other)
        inplace_native = (_hostmem.NATIVE.executions() if _hostmem.NATIVE is not None else 0) - native
        in_place_compiles = neuron_runtime.stats()["compiles"] - compiled
        check(lambda xs, ys: torch._foreach_mul_(xs, xs), base, other)       # each written tensor read too
        check(lambda xs, ys: torch._foreach_mul_([xs[0], xs[0]], [ys[0], ys[0]]), base, other)  # written twice
        buf = torch.arange(24.0, device="cpu")
        check(lambda xs, ys: torch._foreach_mul_([xs[0][:15].view(5, 3), xs[0][9:16]], ys), [buf], other)
        stats = neuron_runtime.stats()
        stats["in_place"] = {"native": inplace_native, "compiles": in_place_compiles}
        print(json.dumps(stats))
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


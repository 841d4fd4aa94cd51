"""Helpers for the runtime tests: run a computation on CPU and on `neuron`, compare."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import neuron_runtime
from neuron_runtime import _config
from neuron_runtime.aten import _runtime
from neuron_runtime.compiler import CompileRefused
from neuron_runtime.compiler._reference import ReferenceCompiler

DEV = "neuron"


def to_dev(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.to(DEV)
    if isinstance(x, (list, tuple)):
        return type(x)(to_dev(v) for v in x)
    return x


def assert_same(cpu: Any, dev: Any, **kw: Any) -> None:
    """`dev` (from neuron) equals `cpu`, tensors compared on the host, structure and dtypes included."""
    if isinstance(cpu, torch.Tensor):
        assert isinstance(dev, torch.Tensor), type(dev)
        assert dev.device.type == DEV, dev.device
        assert dev.dtype == cpu.dtype
        torch.testing.assert_close(dev.cpu(), cpu, **kw)
    elif isinstance(cpu, (list, tuple)):
        assert len(cpu) == len(dev)
        for c, d in zip(cpu, dev):
            assert_same(c, d, **kw)
    else:
        assert cpu == dev


@pytest.fixture
def fresh_runtime(monkeypatch: pytest.MonkeyPatch) -> Iterator[_runtime.Runtime]:
    """A runtime with empty in-process caches and counters (config re-read from the environment)."""
    rt = _runtime.reset_runtime()
    yield rt
    monkeypatch.undo()
    _runtime.reset_runtime()


def run_python(code: str, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """Run `code` in a fresh interpreter (another process is what 'import torch alone' means)."""
    return _run([sys.executable, "-c", code], env, timeout)


def run_script(path: str, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """Run the script at `path` in a fresh interpreter."""
    return _run([sys.executable, path], env, timeout)


def _run(cmd: list[str], env: dict[str, str] | None, timeout: float) -> subprocess.CompletedProcess[str]:
    full_env = dict(os.environ)
    full_env.update(env or {})
    return subprocess.run(cmd, capture_output=True, text=True, env=full_env, timeout=timeout)


_ = (neuron_runtime, _config)


class RefusingCompiler(ReferenceCompiler):
    """The reference tier, refusing the ops named (what a real compiler does for ops it cannot lower)."""

    def __init__(self, refuse: set[str]) -> None:
        self.refuse = refuse

    def fingerprint(self) -> dict[str, Any]:  # its own keys: refusals cached by it stay its own
        return {**super().fingerprint(), "test": "refusing " + ",".join(sorted(self.refuse))}

    def compile(self, signature: dict[str, Any]) -> bytes:
        if signature["op"] in self.refuse:
            raise CompileRefused(f"{signature['op']} is not supported by this compiler")
        return super().compile(signature)

"""torch.compile graphs through a real gRPC fleet store: a fresh host compiles nothing; a dead server
never fails a compiled step."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.server.conftest import ServerProc

JOB = r"""
import json, torch, neuron_runtime
torch.manual_seed(0)
m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 3)).to("neuron")
cm = torch.compile(m, backend="neuron")
x = torch.randn(5, 8).to("neuron")
for _ in range(2):
    loss = cm(x).pow(2).sum()
    loss.backward()
s = neuron_runtime.stats()
print(json.dumps({"loss": loss.item(), "graphs": s["graphs"], "hits": s["hits"]}))
"""


def _host(tmp: Path, name: str, store: str, hash_seed: str) -> dict[str, object]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCH_NEURONX_")}
    env["PYTHONHASHSEED"] = hash_seed
    env.update(TORCH_NEURONX_COMPILER="reference", TORCH_NEURONX_COMPILE_MODE="sync", TORCH_NEURONX_PREFETCH="0",
               TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR=str(tmp / name), TORCH_NEURONX_NEFF_CACHE_DIR=store)
    r = subprocess.run([sys.executable, "-c", JOB], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def test_fresh_host_on_a_warm_grpc_store_compiles_no_graph(server: ServerProc, tmp_path: Path) -> None:
    """Also: the same graphs get the same keys in two processes with other hash seeds (else B compiles)."""
    first = _host(tmp_path, "host-a", f"grpc://{server.address}", "1")
    assert first["graphs"]["compiles"] == 2  # type: ignore[index]
    second = _host(tmp_path, "host-b", f"grpc://{server.address}", "2")
    assert second["graphs"]["compiles"] == 0 and second["graphs"]["graph_executions"] == 4  # type: ignore[index]
    assert second["hits"]["fleet"] >= 2  # type: ignore[index]
    assert second["loss"] == pytest.approx(first["loss"])


def test_server_killed_mid_run_never_fails_a_compiled_step(
        server: ServerProc, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import neuron_runtime
    from neuron_runtime.aten import _runtime

    monkeypatch.setenv("TORCH_NEURONX_NEFF_CACHE_DIR", f"grpc://{server.address}")
    monkeypatch.setenv("TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR", str(tmp_path / "local"))
    monkeypatch.setenv("TORCH_NEURONX_FLEET_TIMEOUT", "2")
    _runtime.reset_runtime()
    torch._dynamo.reset()
    try:
        f = torch.compile(lambda t: (t.sin() * 3).sum(0), backend="neuron")
        x = torch.randn(4, 5)
        torch.testing.assert_close(f(x.to("neuron")).cpu(), (x.sin() * 3).sum(0))
        server.kill()
        # Another rank: a new graph of a new shape class, whose fleet lookup meets a dead server.
        y = torch.randn(4, 5, 3)
        torch.testing.assert_close(f(y.to("neuron")).cpu(), (y.sin() * 3).sum(0))
        s = neuron_runtime.stats()
        assert s["graphs"]["compiles"] == 2 and s["graphs"]["graph_executions"] == 2
        assert s["fleet_errors"] >= 1
    finally:
        monkeypatch.undo()
        torch._dynamo.reset()
        _runtime.reset_runtime()

"""torch.compile(backend="neuron") on the `aoti` tier: a graph becomes one real AOTInductor package.

One compile (an inference graph), shared by the checks of this module."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import neuron_runtime
from neuron_runtime import _dispatch

DEV = "neuron"


def _f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.gelu(x @ w).sum(1) * 0.5


@pytest.fixture(scope="module")
def graph_run(aoti_root: Path) -> Iterator[dict[str, Any]]:
    try:
        # A module-scoped fixture has no `monkeypatch`; MonkeyPatch.context() restores the environment the same way.
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("TORCH_NEURONX_COMPILER", "aoti")
            mp.setenv("TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR", str(aoti_root / "neff-graph"))
            _dispatch.reset_runtime()
            torch._dynamo.reset()
            x, w = torch.randn(6, 8), torch.randn(8, 5).t().contiguous().t()  # w non-contiguous
            with torch.no_grad():
                got = torch.compile(_f, backend="neuron")(x.to(DEV), w.to(DEV)).cpu()
            first = neuron_runtime.stats()
            # Another start on the warm local tier: load, no compile.
            _dispatch.reset_runtime()
            torch._dynamo.reset()
            with torch.no_grad():
                again = torch.compile(_f, backend="neuron")(x.to(DEV), w.to(DEV)).cpu()
            yield {"x": x, "w": w, "got": got, "again": again, "first": first, "second": neuron_runtime.stats(),
                   "local": aoti_root / "neff-graph"}
    finally:  # after the environment is restored: reset_runtime reads it
        torch._dynamo.reset()
        _dispatch.reset_runtime()


def test_graph_is_one_aoti_executable_equal_to_eager(graph_run: dict[str, Any]) -> None:
    want = _f(graph_run["x"], graph_run["w"])
    torch.testing.assert_close(graph_run["got"], want, rtol=1e-4, atol=1e-4)
    first = graph_run["first"]
    assert first["compiler"] == "aoti"
    assert first["compiles_by_kind"]["graph"] == 1 and first["graphs"]["graph_executions"] == 1
    assert first["graphs"]["graphs_refused"] == 0


def test_warm_local_tier_loads_the_graph_without_compiling(graph_run: dict[str, Any]) -> None:
    second = graph_run["second"]
    assert second["compiles"] == 0 and second["graphs"]["graph_executions"] == 1
    assert second["hits"]["local"] >= 1
    torch.testing.assert_close(graph_run["again"], graph_run["got"])


def test_graph_entry_is_an_aoti_package(graph_run: dict[str, Any]) -> None:
    import io
    import zipfile

    from neuron_runtime.cache import LocalCache
    from neuron_runtime.envelope import unpack

    local = LocalCache(str(graph_run["local"]), 1 << 30)
    graphs = []
    for e in local.entries():
        entry = unpack(local.get(e.key) or b"", expected_key=e.key, signing_key=None)
        if entry.header["signature"]["op"].startswith("graph:"):
            graphs.append(entry)
    assert len(graphs) == 1
    with zipfile.ZipFile(io.BytesIO(graphs[0].payload)) as z:  # one .pt2 holding the whole graph's .so
        assert sum(n.endswith(".so") for n in z.namelist()) == 1

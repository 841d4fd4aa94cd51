"""torch.compile(backend="neuron") on the `aoti` tier: a graph becomes one real AOTInductor package.

One compile (an inference graph that also updates one of its inputs in place), shared by the checks of
this module."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import neuron_runtime
from neuron_runtime.aten import _runtime

DEV = "neuron"


def _f(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    y = torch.nn.functional.gelu(x @ w)
    s.mul_(0.9).add_(y.sum(0))  # an input mutation (optimizer-state style): the kernel stores it in place
    return y.sum(1) * 0.5


@pytest.fixture(scope="module")
def graph_run(aoti_root: Path) -> Iterator[dict[str, Any]]:
    try:
        # A module-scoped fixture has no `monkeypatch`; MonkeyPatch.context() restores the environment the same way.
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("TORCH_NEURONX_COMPILER", "aoti")
            # An empty local tier (aoti_root persists across sessions): this run compiles the graph.
            shutil.rmtree(aoti_root / "neff-graph", ignore_errors=True)
            mp.setenv("TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR", str(aoti_root / "neff-graph"))
            _runtime.reset_runtime()
            torch._dynamo.reset()
            x, w = torch.randn(6, 8), torch.randn(8, 5).t().contiguous().t()  # w non-contiguous
            s = torch.randn(5)
            s_dev = s.to(DEV)
            version = s_dev._version
            with torch.no_grad():
                got = torch.compile(_f, backend="neuron")(x.to(DEV), w.to(DEV), s_dev).cpu()
            first = neuron_runtime.stats()
            # Another start on the warm local tier: load, no compile.
            _runtime.reset_runtime()
            torch._dynamo.reset()
            s_again = s.to(DEV)
            with torch.no_grad():
                again = torch.compile(_f, backend="neuron")(x.to(DEV), w.to(DEV), s_again).cpu()
            yield {"x": x, "w": w, "s": s, "got": got, "again": again, "first": first,
                   "second": neuron_runtime.stats(), "local": aoti_root / "neff-graph",
                   "s_dev": s_dev.cpu(), "s_again": s_again.cpu(), "bumped": s_dev._version > version}
    finally:  # after the environment is restored: reset_runtime reads it
        torch._dynamo.reset()
        _runtime.reset_runtime()


def test_graph_is_one_aoti_executable_equal_to_eager(graph_run: dict[str, Any]) -> None:
    s = graph_run["s"].clone()
    want = _f(graph_run["x"], graph_run["w"], s)
    torch.testing.assert_close(graph_run["got"], want, rtol=1e-4, atol=1e-4)
    # the input the graph updates: written by the executable into the neuron tensor's memory
    torch.testing.assert_close(graph_run["s_dev"], s, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(graph_run["s_again"], s, rtol=1e-4, atol=1e-4)
    assert graph_run["bumped"]  # as the in-place op would have
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
    from neuron_runtime.cache.envelope import unpack

    local = LocalCache(str(graph_run["local"]), 1 << 30)
    graphs = []
    for e in local.entries():
        entry = unpack(local.get(e.key) or b"", expected_key=e.key, signing_key=None)
        if entry.header["signature"]["op"].startswith("graph:"):
            graphs.append(entry)
    assert len(graphs) == 1
    # the input mutation is part of the kernel (`into`), not a result copied back
    assert graphs[0].header["signature"]["into"], graphs[0].header["signature"]
    with zipfile.ZipFile(io.BytesIO(graphs[0].payload)) as z:  # one .pt2 holding the whole graph's .so
        assert sum(n.endswith(".so") for n in z.namelist()) == 1

"""Issue 41 item 4: a job's manifest loses no writer at any count, and junk cannot freeze it.

Each writer is a `Chain` of its own (its own random writer id, as each rank or CI shard of a job has),
over the runtime's real local tier on disk; the multi-process race of writers is
tests/executables/test_trust.py's `test_concurrent_manifest_writers_lose_nothing`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from neuron_runtime.aten import _runtime
from neuron_runtime.executables import _manifest
from neuron_runtime.signatures import _ops, _signature

JOB = "manifest-generations-test"


@pytest.fixture
def rt(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, fresh_runtime: _runtime.Runtime) -> _runtime.Runtime:
    monkeypatch.setenv("TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR", str(tmp_path / "local"))
    return _runtime.reset_runtime()


def sig(n: int) -> dict[str, Any]:
    x = torch.zeros(n)
    return _signature.build(_ops.classify("aten::add.Tensor"), (x, x, 1))


def chain(rt: _runtime.Runtime) -> _manifest.Chain:
    return _manifest.Chain(rt.cache, JOB, rt.fingerprint, rt.resolver.key)


def write(rt: _runtime.Runtime, n: int) -> None:
    """One writer of the job: reads the manifest, then appends the one signature it used."""
    w = chain(rt)
    w.read()
    s = sig(n)
    w.append({rt.resolver.key(s): s})


def test_eighty_writers_lose_nothing(rt: _runtime.Runtime) -> None:
    for n in range(1, 81):
        write(rt, n)
    reader = chain(rt)
    got = reader.read()
    want = {rt.resolver.key(sig(n)) for n in range(1, 81)}
    assert want <= set(got), f"{len(want - set(got))} of 80 writers' signatures lost"
    assert reader.gen["local"] == 1 and not reader.problems
    # A start reads the compaction, not the 64 segments before it.
    reads: list[str] = []
    cache = rt.cache
    assert cache is not None
    orig = cache.read_tier

    def counted(tier: str, key: str, limit: int | None = None) -> Any:
        reads.append(key)
        return orig(tier, key, limit)

    cache.read_tier = counted  # type: ignore[method-assign]
    assert set(chain(rt).read()) == set(got)
    assert len(reads) < 30, len(reads)


def test_junk_segments_do_not_freeze_the_manifest(rt: _runtime.Runtime) -> None:
    cache = rt.cache
    assert cache is not None
    for i in range(_manifest.MAX_SEGMENTS):  # every index of generation 0 taken by junk that verifies
        key = _manifest.segment_key(JOB, rt.fingerprint, i)
        assert cache.put_tier("local", key, cache.pack(key, {"kind": "junk", "signature": {"op": "junk"},
                                                             "fingerprint": rt.fingerprint}, b"\x00" * 100))
    for n in range(1, 11):
        write(rt, n)
    got = chain(rt).read()
    assert {rt.resolver.key(sig(n)) for n in range(1, 11)} <= set(got)


def test_an_oversized_segment_is_never_read_and_takes_only_its_index(rt: _runtime.Runtime) -> None:
    """Issue 41 item 3: a value over a segment's bound under a segment's key (here 12 MiB in the local
    tier; a 1,000 MiB one cost +2 GiB RSS at every start) is measured, not read, and writers go on past it."""
    import tracemalloc

    cache = rt.cache
    assert cache is not None
    big = _manifest.segment_key(JOB, rt.fingerprint, 0)
    assert cache.local.put(big, b"\0" * (12 << 20))
    write(rt, 3)
    tracemalloc.start()
    try:
        reader = chain(rt)
        got = reader.read()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert rt.resolver.key(sig(3)) in got and reader.next["local"] == 2
    assert any("over" in p for p in reader.problems), reader.problems
    assert peak < _manifest.MAX_READ, peak

"""Job manifests and prefetch, with real processes: a job on one "host" warms a shared fleet store, a
job on a fresh "host" fetches its executables before calling them; bad manifests never stop a job."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_background import job_env, run_job, sync_losses

from neuron_runtime.cache import envelope
from neuron_runtime.cache import SharedPathStore
from neuron_runtime.compiler import get_compiler
from neuron_runtime.executables import _manifest
from neuron_runtime.signatures import _signature

JOB = "prefetch-test-job"


def fleet_env(tmp: Path, host: str, **extra: str) -> dict[str, str]:
    return job_env(tmp, TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR=str(tmp / host), TORCH_NEURONX_NEFF_CACHE_DIR=str(tmp / "fleet"),
                   TORCH_NEURONX_JOB=JOB, TORCH_NEURONX_PREFETCH="1", **extra)


def manifest_key(segment: int = 0) -> str:
    return _manifest.segment_key(JOB, get_compiler("reference").fingerprint(), segment)


@pytest.fixture
def warm_fleet(tmp_path: Path) -> dict[str, object]:
    """One job that compiled everything into the fleet store and wrote its manifest there."""
    r, _ = run_job(tmp_path, "warm", fleet_env(tmp_path, "host-a", JOB_STEPS="2", JOB_WAIT="120"))
    assert r["stats"]["compiles"] > 10 and r["stats"]["background"]["manifest_writes"] >= 1
    assert SharedPathStore(str(tmp_path / "fleet")).get(manifest_key()) is not None
    return r


def test_fresh_host_prefetches_from_the_fleet_and_compiles_nothing(tmp_path: Path, warm_fleet: dict[str, object]) -> None:
    r, err = run_job(tmp_path, "fresh", fleet_env(tmp_path, "host-b", JOB_STEPS="2", JOB_WAIT="60"))
    s = r["stats"]
    bg = s["background"]
    # An op that comes before the prefetch loaded its key asks the service, which finds the entry in the
    # fleet store: how many do is a race a loaded host can lose (CI saw 8 of them), so it is not counted
    # here; that nothing is compiled either way, and nothing refused, is.
    assert s["compiles"] == 0 and bg["refused"] == 0 and bg["loaded"] == bg["queued"], bg
    # Executables loaded ahead: one per key, or fewer where a shape class serves several keys.
    assert 0 < bg["prefetched"] <= len(warm_fleet["keys"]) and bg["prefetch_hits"] > 0, bg
    assert s["hits"]["fleet"] >= bg["prefetched"]
    assert r["host_runs"][-2:] == [0, 0]
    assert r["losses"] == warm_fleet["losses"]


def _rewrite_manifest(tmp: Path, data: bytes) -> None:
    for store in (SharedPathStore(str(tmp / "fleet")),):
        store.delete(manifest_key())
        assert store.put(manifest_key(), data)


@pytest.mark.parametrize("damage", ["corrupt", "forged", "foreign-signatures"])
def test_bad_manifest_is_never_used_and_the_job_trains_on(tmp_path: Path, warm_fleet: dict[str, object],
                                                          damage: str) -> None:
    key = manifest_key()
    extra: dict[str, str] = {}
    if damage == "corrupt":
        good = SharedPathStore(str(tmp_path / "fleet")).get(key)
        assert good is not None
        _rewrite_manifest(tmp_path, good[:-40] + b"\0" * 40)
    elif damage == "forged":
        # Signed with a key the fleet does not trust (every reader has TORCH_NEURONX_CACHE_SIGNING_KEY).
        fp = get_compiler("reference").fingerprint()
        _rewrite_manifest(tmp_path, envelope.pack(key, _manifest.header(JOB, fp, 0, "forger"),
                                                  _manifest.payload(JOB, 0, []), b"not-the-fleet-key"))
        extra["TORCH_NEURONX_CACHE_SIGNING_KEY"] = "the-fleet-key"
    else:
        # Verifies, but names signatures this runtime keys differently or does not know.
        fp = get_compiler("reference").fingerprint()
        unknown = {"op": "aten::no_such_op", "schema": "?", "args": []}
        sigs = [unknown, {"op": "aten::add.Tensor", "schema": "not its schema", "args": []}, "not a signature", [1]]
        _rewrite_manifest(tmp_path, envelope.pack(key, _manifest.header(JOB, fp, 0, "other"),
                                                  _signature.canonical({"format": _manifest.FORMAT, "job": JOB,
                                                                        "segment": 0, "signatures": sigs}), None))
    r, err = run_job(tmp_path, "fresh", fleet_env(tmp_path, "host-b", JOB_STEPS="2", JOB_WAIT="120", **extra))
    assert r["losses"] == pytest.approx(warm_fleet["losses"], rel=1e-6)
    assert r["host_runs"][-1] == 0 and r["stats"]["fallback_ops"] == []
    assert r["stats"]["background"]["prefetched"] == 0
    if damage == "corrupt":
        assert r["stats"]["corrupt"] >= 1 and "quarantined" in err
    elif damage == "forged":
        assert r["stats"]["corrupt"] >= 1 and "signature" in err
    else:
        assert "manifest of job" in err and "skipped" in err


def test_fleet_store_down_at_start(tmp_path: Path) -> None:
    from tests.conftest import free_port

    env = job_env(tmp_path, TORCH_NEURONX_NEFF_CACHE_DIR=f"grpc://127.0.0.1:{free_port()}", TORCH_NEURONX_JOB=JOB,
                  TORCH_NEURONX_PREFETCH="1", TORCH_NEURONX_FLEET_TIMEOUT="1", JOB_STEPS="2", JOB_WAIT="120")
    r, err = run_job(tmp_path, "down", env)
    assert r["losses"] == pytest.approx(sync_losses(tmp_path, "4"), rel=1e-6)
    assert r["stats"]["fleet_errors"] >= 1 and r["host_runs"][-1] == 0
    assert json.dumps(r["stats"]["fallback_ops"]) == "[]"

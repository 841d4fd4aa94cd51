"""Sharded warming: `warm --shard I/N` (and NEURON_CACHE_SHARD + JOB_COMPLETION_INDEX) split a manifest's
signatures by key, the shards' union is the unsharded set, and `verify --manifest` says whether every
entry landed (also on an HTTP store, which cannot list)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from neuron_runtime.cli import main
from neuron_runtime.cli._errors import UsageError
from neuron_runtime.cli._warm import parse_shard, shard_of

JOB = Path(__file__).resolve().parents[1] / "jobs" / "train_small.py"


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("TORCH_NEURONX_NEFF_CACHE_DIR", "TORCH_NEURONX_CACHE_MODE", "TORCH_NEURONX_STATS_FILE",
                        "NEURON_CACHE_SHARD", "JOB_COMPLETION_INDEX")}
    env.update(extra)
    return env


def test_parse_shard() -> None:
    assert parse_shard(None) is None and parse_shard("") is None
    assert parse_shard("0/4") == (0, 4) and parse_shard(" 3/4 ") == (3, 4)
    assert parse_shard("4", index_env="2") == (2, 4)
    for bad in ("4/4", "-1/4", "1/0", "a/b", "1/2/3"):
        with pytest.raises(UsageError, match="--shard"):
            parse_shard(bad)
    with pytest.raises(UsageError, match="JOB_COMPLETION_INDEX"):
        parse_shard("4", index_env=None)


def test_shards_partition_any_key_set() -> None:
    keys = [hashlib.sha256(str(i).encode()).hexdigest() for i in range(2000)]
    for n in (1, 2, 3, 8):
        parts = [{k for k in keys if shard_of(k, n) == i} for i in range(n)]
        assert set().union(*parts) == set(keys) and sum(map(len, parts)) == len(keys)
        # a key's shard depends on the key alone: the same in any subset of the manifest
        assert all(shard_of(k, n) == shard_of(k, n) for k in keys[:50])
        assert min(map(len, parts)) > 0.8 * len(keys) / n  # even in expectation (sha256 keys)


def test_two_shards_split_a_warm_up_and_verify_says_everything_landed(
        tmp_path: Path, redis_server: Any, capsys: pytest.CaptureFixture[str]) -> None:
    fleet = redis_server.url(prefix=f"{tmp_path.name}:")
    manifest = tmp_path / "manifest.jsonl"
    procs = []
    for i in range(2):
        # Shard 0 by flag; shard 1 the way a Kubernetes Indexed Job passes it (count + completion index).
        shard = ["--shard", "0/2"] if i == 0 else []
        env = _env(NEURON_CACHE_SHARD="2", JOB_COMPLETION_INDEX="1") if i == 1 else _env()
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "neuron_runtime.cli", "warm", "--tier", "reference", "--jobs", "1", *shard,
             "--local-dir", str(tmp_path / f"host{i}"), "--to", fleet, "--manifest", str(tmp_path / f"m{i}.jsonl"),
             "--json", "--no-progress", "--", sys.executable, str(JOB)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    summaries = []
    for p in procs:
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-3000:]
        summaries.append(json.loads(out))
    s0, s1 = summaries
    assert (s0["shard"], s1["shard"]) == ("0/2", "1/2")
    total = s0["manifest_signatures"]
    assert total == s1["manifest_signatures"] > 10
    assert s0["signatures"] + s1["signatures"] == total and min(s0["signatures"], s1["signatures"]) > 0
    # Each shard compiled exactly its own part: no key twice, none left out.
    assert s0["compiled"] == s0["signatures"] and s1["compiled"] == s1["signatures"]
    assert s0["failed"] == s1["failed"] == 0
    manifest.write_bytes((tmp_path / "m0.jsonl").read_bytes())

    # The union is the unsharded set: an unsharded compile of the same manifest finds everything present.
    rc = main(["compile", str(manifest), "--tier", "reference", "--jobs", "1", "--local-dir", str(tmp_path / "h3"),
               "--to", fleet, "--json", "--no-progress"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["compiled"] == 0 and out["present"] == total

    rc = main(["verify", "--manifest", str(manifest), "--tier", "reference", "--local-dir", str(tmp_path / "h4"),
               "--fleet", fleet, "--json"])
    v = json.loads(capsys.readouterr().out)
    assert rc == 0 and v["signatures"] == total and v["missing"] == [] and v["bad"] == [] and v["tiers"] == ["fleet"]
    assert v["checked"] == total


def test_verify_manifest_names_what_is_missing_on_a_store_that_cannot_list(
        tmp_path: Path, http_cache: Any, capsys: pytest.CaptureFixture[str]) -> None:
    from tests.cli.test_warm import SIGNATURES

    manifest = tmp_path / "m.jsonl"
    manifest.write_text("\n".join(json.dumps(s) for s in SIGNATURES) + "\n")
    fleet = f"http://ci:ci-pw@127.0.0.1:{http_cache.port}/{tmp_path.name}"
    local = str(tmp_path / "local")
    # Only shard 0 of 2 ran.
    rc = main(["compile", str(manifest), "--shard", "0/2", "--tier", "reference", "--jobs", "1", "--local-dir", local,
               "--to", fleet, "--json", "--no-progress"])
    part = json.loads(capsys.readouterr().out)
    assert rc == 0 and 0 < part["signatures"] < len(SIGNATURES)
    rc = main(["verify", "--manifest", str(manifest), "--tier", "reference", "--local-dir", str(tmp_path / "other"),
               "--fleet", fleet, "--json"])
    v = json.loads(capsys.readouterr().out)
    assert rc == 1 and len(v["missing"]) == len(SIGNATURES) - part["signatures"]
    assert {m["op"] for m in v["missing"]} <= {s["op"] for s in SIGNATURES}
    assert all(m["tier"] == "fleet" and m["line"] for m in v["missing"])
    # The other shard runs; now everything has landed.
    assert main(["compile", str(manifest), "--shard", "1/2", "--tier", "reference", "--jobs", "1", "--local-dir",
                 local, "--to", fleet, "--no-progress"]) == 0
    capsys.readouterr()
    assert main(["verify", "--manifest", str(manifest), "--tier", "reference", "--local-dir", str(tmp_path / "o2"),
                 "--fleet", fleet]) == 0
    assert "missing 0" in capsys.readouterr().out


def test_a_bad_shard_is_a_usage_error_before_the_job_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    marker = tmp_path / "ran"
    rc = main(["warm", "--shard", "2/2", "--local-dir", str(tmp_path), "--", "touch", str(marker)])
    assert rc == 2 and "0 <= I < N" in capsys.readouterr().err and not marker.exists()
    monkeypatch.setenv("NEURON_CACHE_SHARD", "3")
    monkeypatch.delenv("JOB_COMPLETION_INDEX", raising=False)
    assert main(["warm", "--local-dir", str(tmp_path), "--", "touch", str(marker)]) == 2
    assert "JOB_COMPLETION_INDEX" in capsys.readouterr().err and not marker.exists()

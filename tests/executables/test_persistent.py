"""The runtime over its persistent tiers, with real processes: warm runs, one compile per key per host,
strict and read-only modes, damaged entries."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rt_helpers import run_python, run_script

JOB = str(Path(__file__).resolve().parents[1] / "jobs" / "train_small.py")


def _env(tmp: Path, name: str, **extra: str) -> dict[str, str]:
    env = {"TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR": str(tmp / "local"),
           "TORCH_NEURONX_STATS_FILE": str(tmp / f"{name}.stats.json"),
           "JOB_OUT": str(tmp / f"{name}.out.json"), "TORCH_NEURONX_COMPILER": "reference"}
    env.update(extra)
    return env


def _read(tmp: Path, name: str) -> tuple[dict, dict]:  # type: ignore[type-arg]
    return (json.loads((tmp / f"{name}.stats.json").read_text()),
            json.loads((tmp / f"{name}.out.json").read_text()))


def test_second_run_compiles_nothing(tmp_path: Path) -> None:
    for name in ("cold", "warm"):
        r = run_script(JOB, env=_env(tmp_path, name))
        assert r.returncode == 0, r.stderr
    cold, cold_out = _read(tmp_path, "cold")
    warm, warm_out = _read(tmp_path, "warm")
    assert cold["compiles"] == len(cold_out["keys"]) > 10
    assert warm["compiles"] == 0 and warm["hits"]["local"] == len(warm_out["keys"])
    assert warm_out == cold_out


def test_processes_started_together_compile_each_key_once(tmp_path: Path) -> None:
    procs = []
    for i in range(4):
        env = dict(os.environ)
        env.update(_env(tmp_path, f"p{i}"))
        procs.append(subprocess.Popen([sys.executable, JOB], env=env, stderr=subprocess.PIPE, text=True))
    for p in procs:
        _, err = p.communicate(timeout=600)
        assert p.returncode == 0, err
    results = [_read(tmp_path, f"p{i}") for i in range(4)]
    keys = set().union(*(set(out["keys"]) for _, out in results))
    assert sum(s["compiles"] for s, _ in results) == len(keys)
    assert len({out["loss"] for _, out in results}) == 1


def test_strict_mode_names_the_op_and_readonly_writes_nothing(tmp_path: Path) -> None:
    r = run_script(JOB, env=_env(tmp_path, "strict", TORCH_NEURONX_CACHE_MODE="strict"))
    assert r.returncode != 0
    assert "strict" in r.stderr and "aten::" in r.stderr and "Signature" in r.stderr
    r = run_script(JOB, env=_env(tmp_path, "ro", TORCH_NEURONX_CACHE_MODE="readonly"))
    assert r.returncode == 0, r.stderr
    r = run_script(JOB, env=_env(tmp_path, "after", TORCH_NEURONX_CACHE_MODE="readwrite"))
    after, _ = _read(tmp_path, "after")
    assert after["hits"]["local"] == 0 and after["compiles"] > 0  # readonly left nothing behind
    r = run_script(JOB, env=_env(tmp_path, "strict2", TORCH_NEURONX_CACHE_MODE="strict"))
    assert r.returncode == 0, r.stderr  # warm now: strict runs


def test_unwritable_cache_dir_never_fails_an_op(tmp_path: Path) -> None:
    if os.geteuid() == 0:
        target = "/proc/neuron-cache-cannot-exist"  # even root cannot create directories here
    else:
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o500)
        target = str(ro / "cache")
    env = _env(tmp_path, "unwritable")
    env["TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR"] = target
    r = run_script(JOB, env=env)
    assert r.returncode == 0, r.stderr
    stats, out = _read(tmp_path, "unwritable")
    assert stats["compiles"] == len(out["keys"])
    assert r.stderr.count("Warning") <= 3, r.stderr


def test_damaged_local_entries_are_refused_and_recompiled(tmp_path: Path) -> None:
    r = run_script(JOB, env=_env(tmp_path, "cold"))
    assert r.returncode == 0, r.stderr
    _, cold_out = _read(tmp_path, "cold")
    damage = f"""
from neuron_runtime.cache import LocalCache
import diskcache
local = LocalCache({str(tmp_path / 'local')!r}, 1 << 30)
keys = sorted(e.key for e in local.entries())
for i, k in enumerate(keys[:6]):
    data = bytearray(local.get(k))
    if i % 3 == 0:
        data[len(data) // 2] ^= 0xFF          # flipped byte
    elif i % 3 == 1:
        data = data[: len(data) // 2]         # truncated
    else:
        data = bytearray(local.get(keys[-1])) # another key's entry under this name
    local.delete(k)
    local.put(k, bytes(data))
print(len(keys))
"""
    r = run_python(damage)
    assert r.returncode == 0, r.stderr
    r = run_script(JOB, env=_env(tmp_path, "after"))
    assert r.returncode == 0, r.stderr
    stats, out = _read(tmp_path, "after")
    assert stats["corrupt"] == 6 and stats["compiles"] == 6
    assert out["loss"] == pytest.approx(cold_out["loss"])

"""Helpers for the cache tests: keys, entries, configs, and "other hosts" as real OS processes."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from neuron_runtime import envelope
from neuron_runtime._config import Config

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("_worker.py")


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def key_of(name: str | int) -> str:
    import hashlib

    return hashlib.sha256(str(name).encode()).hexdigest()


def make_entry(key: str, payload: bytes = b"executable bytes", signing_key: bytes | None = None) -> bytes:
    return envelope.pack(key, {"signature": {"op": "aten::add"}, "fingerprint": {"tier": "test"}}, payload, signing_key)


def make_cfg(tmp: Path, **over: Any) -> Config:
    base = dict(local_cache_dir=str(tmp / "local"), lock_timeout_s=60.0, lease_ttl_s=60.0, fleet_timeout_s=5.0)
    base.update(over)
    return dataclasses.replace(Config(), **base)  # type: ignore[arg-type]


def worker_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra or {})
    return env


def start_workers(n: int, spec: dict[str, Any], tmp: Path, env: dict[str, str] | None = None) -> list[subprocess.Popen[str]]:
    """Start `n` worker processes ("hosts", each with its own local tier) held at a start barrier;
    `release(tmp)` lets them all go at once."""
    procs = []
    for i in range(n):
        s = dict(spec, local_dir=str(tmp / f"host{i}"), name=f"host{i}", go=str(tmp / "go"))
        procs.append(subprocess.Popen([sys.executable, str(WORKER), json.dumps(s)], env=worker_env(env),
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=str(REPO)))
    return procs


def release(tmp: Path) -> None:
    (tmp / "go").write_text("go")


def collect(procs: list[subprocess.Popen[str]], timeout: float = 120) -> list[dict[str, Any]]:
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=timeout)
        assert p.returncode == 0, f"worker failed ({p.returncode}):\n{stderr[-3000:]}"
        out.append(json.loads(stdout.strip().splitlines()[-1]))
    return out


def compiles_in(count_dir: Path) -> dict[str, int]:
    """How many times each key was compiled, across all processes (one file per compile)."""
    counts: dict[str, int] = {}
    if count_dir.exists():
        for f in count_dir.iterdir():
            k = f.name.split("-")[0]
            counts[k] = counts.get(k, 0) + 1
    return counts


def wait_until(cond: Callable[[], bool], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached")
        time.sleep(0.02)

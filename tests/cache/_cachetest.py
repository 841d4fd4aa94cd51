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

from neuron_runtime.cache import envelope
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
    tmp.mkdir(parents=True, exist_ok=True)
    procs = []
    for i in range(n):
        # `same_host`: the processes share one local tier (and its lock files), as on one machine.
        local = tmp / "host" if spec.get("same_host") else tmp / f"host{i}"
        s = dict(spec, local_dir=str(local), name=f"host{i}", go=str(tmp / "go"))
        procs.append(subprocess.Popen([sys.executable, str(WORKER), json.dumps(s)], env=worker_env(env),
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=str(REPO)))
    STARTED.extend(procs)
    return procs


#: every worker started by this test process, so a failing test's workers can be killed at teardown.
STARTED: list[subprocess.Popen[str]] = []


def kill_started() -> None:
    while STARTED:
        p = STARTED.pop()
        if p.poll() is None:
            p.kill()
            p.communicate()


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


NOBODY = 65534


def fork_call(fn: Callable[[], Any], *, unprivileged: bool = False, fsize: int | None = None) -> Any:
    """Run `fn` in a forked child and return its JSON-able result (the child's exceptions re-raised as
    AssertionError). `unprivileged`: the child drops to uid/gid 65534 when running as root, so
    permission bits apply (root ignores them). `fsize`: RLIMIT_FSIZE in the child, a "full disk"."""
    import resource
    import signal
    import traceback

    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        code = 0
        try:
            os.close(r)
            if unprivileged and os.geteuid() == 0:
                os.setgroups([])
                os.setgid(NOBODY)
                os.setuid(NOBODY)
            if fsize is not None:
                signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # get EFBIG instead of being killed
                resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
            out = json.dumps({"ok": fn()})
        except BaseException:  # noqa: BLE001 - report everything to the parent
            out = json.dumps({"error": traceback.format_exc()})
            code = 1
        with os.fdopen(w, "w") as f:
            f.write(out)
        os._exit(code)
    os.close(w)
    with os.fdopen(r) as f:
        raw = f.read()
    os.waitpid(pid, 0)
    res = json.loads(raw)
    if "error" in res:
        raise AssertionError("child failed:\n" + res["error"])
    return res["ok"]


def shared_tmp() -> Path:
    """A temp dir that uid 65534 can traverse (pytest's tmp_path is 0o700 for root)."""
    import tempfile

    d = Path(tempfile.mkdtemp(prefix="nrx-cache-"))
    d.chmod(0o755)
    return d


# Protocol-0 pickle, written by hand (no pickle import): unpickling it calls open(path, "w"), creating
# `path`. If the file ever appears, something unpickled the row.
def evil_pickle(path: Path) -> bytes:
    return b"c__builtin__\nopen\n(V" + str(path).encode() + b"\nVw\ntR."

"""Real cache servers in their own OS processes (`python -m cache_server`), on free loopback ports."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from cache_server import CacheClient
from cache_server._keys import HEALTH_SERVICE
from tests.conftest import REPO, free_port


def key_of(text: str | bytes) -> str:
    return hashlib.sha256(text.encode() if isinstance(text, str) else text).hexdigest()


class ServerProc:
    """One `neuron-cache-server` process. `start()` returns once health says SERVING."""

    def __init__(self, storage: str | Path, *extra: str, env: dict[str, str] | None = None,
                 port: int | None = None, argv: Sequence[str] | None = None, log: Path | None = None) -> None:
        self.port = port or free_port()
        self.storage = str(storage)
        self.address = f"127.0.0.1:{self.port}"
        self.argv = list(argv) if argv is not None else [
            sys.executable, "-m", "cache_server", "--listen", self.address, "--storage", self.storage,
            "--grace", "2", *extra]
        self.env = {**os.environ, **(env or {})}
        self.env["PYTHONPATH"] = str(REPO) + os.pathsep + self.env.get("PYTHONPATH", "")
        self.log = log
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 30.0, tls_client: CacheClient | None = None) -> "ServerProc":
        out = open(self.log, "wb") if self.log else subprocess.DEVNULL
        self.proc = subprocess.Popen(self.argv, env=self.env, stdout=out, stderr=subprocess.STDOUT if self.log
                                     else subprocess.DEVNULL, cwd=REPO)
        deadline = time.monotonic() + timeout
        probe = tls_client or CacheClient(self.address, timeout=1.0)
        try:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"server exited with {self.proc.returncode}: {self.read_log()}")
                try:
                    if probe.health(HEALTH_SERVICE, timeout=1.0) == "SERVING":
                        return self
                except Exception:
                    time.sleep(0.05)
        finally:
            if tls_client is None:
                probe.close()
        self.kill()
        raise RuntimeError(f"server did not become SERVING: {self.read_log()}")

    def read_log(self) -> str:
        return self.log.read_text() if self.log and self.log.exists() else ""

    def client(self, **kw: object) -> CacheClient:
        return CacheClient(self.address, **kw)  # type: ignore[arg-type]

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def terminate(self, timeout: float = 15.0) -> int:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def server_factory(tmp_path: Path) -> Iterator[type[ServerProc]]:
    started: list[ServerProc] = []

    class Tracked(ServerProc):
        def __init__(self, storage: str | Path | None = None, *extra: str, **kw: object) -> None:
            kw.setdefault("log", tmp_path / f"server-{len(started)}.log")
            super().__init__(storage or tmp_path / "store", *extra, **kw)  # type: ignore[arg-type]
            started.append(self)

    yield Tracked
    for s in started:
        s.kill()


@pytest.fixture
def server(server_factory: type[ServerProc]) -> ServerProc:
    return server_factory().start()


@pytest.fixture(scope="module")
def shared_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    """One server for a whole module (starting one per test dominated the run time)."""
    tmp = tmp_path_factory.mktemp("shared")
    s = ServerProc(tmp / "store", log=tmp / "server.log").start()
    yield s
    s.kill()

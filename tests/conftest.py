"""Shared fixtures: real servers on 127.0.0.1, never in-process mocks."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from typing import Any
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
# Helpers shared across the packages' test folders (rt_helpers.py, _httpcache.py) import by name.
sys.path.insert(0, str(REPO / "tests"))

# The bulk of the suite runs on the `reference` tier (no compiler); `aoti` tests opt in explicitly. A
# private local cache keeps tests off the user's ~/.cache. Set before any test imports torch.
os.environ.setdefault("TORCH_NEURONX_COMPILER", "reference")
# Ops wait for their compiles (deterministic counts) unless a test asks for the background service, and
# no test process writes a job manifest unless it means to.
os.environ.setdefault("TORCH_NEURONX_COMPILE_MODE", "sync")
os.environ.setdefault("TORCH_NEURONX_PREFETCH", "0")
# A compile service a test starts (background mode in this process) exits seconds after its last client,
# not after the default five minutes: the suite leaves no service behind.
os.environ.setdefault("TORCH_NEURONX_COMPILE_IDLE_TIMEOUT", "5")
os.environ.setdefault("TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR",
                      tempfile.mkdtemp(prefix="neuron-test-cache-"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class MotoS3:
    """A moto S3 server in its own OS process (s3fs and boto talk real HTTP to it)."""

    def __init__(self) -> None:
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                urllib.request.urlopen(self.endpoint + "/moto-api/", timeout=1).read()
                return
            except OSError:
                time.sleep(0.1)
        raise RuntimeError("moto server did not start")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def reset(self) -> None:
        """Drop every bucket (moto's reset API)."""
        req = urllib.request.Request(self.endpoint + "/moto-api/reset", method="POST")
        urllib.request.urlopen(req, timeout=5).read()

    def env(self) -> dict[str, str]:
        """The variables a client process (s3fs, boto) needs to reach this server."""
        return {
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ENDPOINT_URL_S3": self.endpoint,
            "FSSPEC_S3_ENDPOINT_URL": self.endpoint,
        }

    def make_bucket(self, name: str) -> None:
        import boto3

        boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1",
                     aws_access_key_id="testing", aws_secret_access_key="testing").create_bucket(Bucket=name)


@pytest.fixture(scope="session")
def moto_s3() -> Iterator[MotoS3]:
    """One moto S3 server for the session; tests use their own bucket names (or `reset()`)."""
    server = MotoS3()
    server.start()
    old = {k: os.environ.get(k) for k in server.env()}
    os.environ.update(server.env())
    try:
        yield server
    finally:
        server.stop()
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# ----------------------------------------------------------------------------------- Redis and HTTP caches


def _binary(name: str) -> str | None:
    import shutil

    return shutil.which(name) or next((p for p in (f"/usr/sbin/{name}", f"/usr/bin/{name}") if os.access(p, os.X_OK)), None)


def _wait_port(port: int, proc: subprocess.Popen[bytes], what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with status {proc.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"{what} did not listen on 127.0.0.1:{port}")


class RedisServer:
    """Debian's redis-server on 127.0.0.1, no persistence, with a password for the default user and an ACL
    user `neff` (password `neff-pw`) limited to keys under `neff:`. `restart()` keeps the port."""

    PASSWORD = "sesame"

    def __init__(self, workdir: Path, port: int | None = None, extra: list[str] | None = None) -> None:
        binary = _binary("redis-server")
        if binary is None:
            pytest.skip("redis-server is not installed (`make test` installs Debian's package when run as root)")
        self.binary = binary
        self.workdir = workdir
        self.port = port or free_port()
        self.extra = extra or []
        self.proc: subprocess.Popen[bytes] | None = None

    def argv(self) -> list[str]:
        return [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--dir", str(self.workdir), "--requirepass", self.PASSWORD,
                "--user", "neff", "on", ">neff-pw", "~neff:*", "&*", "+@all", *self.extra]

    def start(self) -> "RedisServer":
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(self.argv(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _wait_port(self.port, self.proc, "redis-server")
        return self

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def restart(self) -> None:
        self.stop()
        self.start()

    def url(self, prefix: str | None = None, **opts: str) -> str:
        q = "&".join(f"{k}={v}" for k, v in ({"prefix": prefix} if prefix else {}).items() | opts.items())
        return f"redis://:{self.PASSWORD}@127.0.0.1:{self.port}" + (f"?{q}" if q else "")

    def flush(self) -> None:
        import redis

        redis.Redis(port=self.port, password=self.PASSWORD).flushall()


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """One redis-server for the session; tests use their own key prefixes."""
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    try:
        yield server
    finally:
        server.stop()


class RedisCluster:
    """Three cluster-mode redis-servers joined with `redis-cli --cluster create` (no replicas)."""

    def __init__(self, workdir: Path) -> None:
        self.nodes = [RedisServer(workdir / f"n{i}", port=self._port(), extra=["--cluster-enabled", "yes", "--cluster-config-file",
                                                            "nodes.conf", "--masterauth", RedisServer.PASSWORD])
                      for i in range(3)]

    @staticmethod
    def _port() -> int:
        """A free port whose cluster bus port (port + 10000) is free too."""
        while True:
            port = free_port()
            if port + 10000 < 65536:
                try:
                    with socket.socket() as s:
                        s.bind(("127.0.0.1", port + 10000))
                    return port
                except OSError:
                    pass

    def start(self) -> "RedisCluster":
        import redis

        for n in self.nodes:
            n.start()
        cli = _binary("redis-cli")
        if cli is None:
            pytest.skip("redis-cli is not installed (Debian's redis-tools)")
        subprocess.run([cli, "-a", RedisServer.PASSWORD, "--no-auth-warning", "--cluster", "create",
                        *[f"127.0.0.1:{n.port}" for n in self.nodes], "--cluster-replicas", "0", "--cluster-yes"],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=60)
        deadline = time.monotonic() + 30
        for n in self.nodes:
            c = redis.Redis(port=n.port, password=RedisServer.PASSWORD)
            while c.cluster("info")["cluster_state"] != "ok":
                if time.monotonic() > deadline:
                    raise RuntimeError("redis cluster did not become ok")
                time.sleep(0.1)
        return self

    def stop(self) -> None:
        for n in self.nodes:
            n.stop()

    def url(self, prefix: str) -> str:
        return f"redis://:{RedisServer.PASSWORD}@127.0.0.1:{self.nodes[0].port}?cluster=1&prefix={prefix}"


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisCluster]:
    cluster = RedisCluster(tmp_path_factory.mktemp("redis-cluster"))
    try:
        yield cluster.start()
    finally:
        cluster.stop()


@pytest.fixture(scope="session")
def http_cache() -> Iterator[Any]:
    """Our bazel-remote-API test server (tests/_httpcache.py), in a thread; tests use their own instance
    prefix, or `reset()` a private one."""
    from _httpcache import CacheServer  # type: ignore[import-not-found]

    server = CacheServer(users={"ci": "ci-pw"}, tokens={"ci-token"}).start()
    try:
        yield server
    finally:
        server.stop()


class NginxDav:
    """Debian's nginx with WebDAV PUT, configured by deploy/nginx/neff-cache.conf (the file operators use):
    only its listen port, data root and htpasswd path are swapped for this run's."""

    USER, PASSWORD = "ci", "ci-pw"

    def __init__(self, workdir: Path) -> None:
        import base64
        import hashlib
        import re

        binary = _binary("nginx")
        if binary is None:
            pytest.skip("nginx is not installed (`make test` installs Debian's nginx-light when run as root)")
        self.binary, self.workdir, self.port = binary, workdir, free_port()
        root = workdir / "data"
        root.mkdir(parents=True)
        htpasswd = workdir / "writers.htpasswd"
        sha = base64.b64encode(hashlib.sha1(self.PASSWORD.encode()).digest()).decode()
        htpasswd.write_text(f"{self.USER}:{{SHA}}{sha}\n")
        site = (REPO / "deploy/nginx/neff-cache.conf").read_text()
        swaps = [(r"listen\s+\d+;", f"listen 127.0.0.1:{self.port};"), (r"root\s+\S+;", f"root {root};"),
                 (r"auth_basic_user_file\s+\S+;", f"auth_basic_user_file {htpasswd};"),
                 (r"client_body_temp_path\s+\S+;", f"client_body_temp_path {root}/.tmp;")]
        for pattern, repl in swaps:
            site, n = re.subn(pattern, repl, site)
            assert n == 1, f"deploy/nginx/neff-cache.conf: expected one {pattern!r}"
        user = "user root root;" if os.geteuid() == 0 else ""
        (workdir / "nginx.conf").write_text(f"""
{user}
daemon off;
worker_processes 2;
pid {workdir}/nginx.pid;
error_log {workdir}/error.log warn;
events {{ worker_connections 256; }}
http {{
    access_log off;
    {site}
}}
""")

    def start(self) -> "NginxDav":
        self.proc = subprocess.Popen([self.binary, "-c", str(self.workdir / "nginx.conf"), "-p", str(self.workdir)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        _wait_port(self.port, self.proc, "nginx")
        return self

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)

    def url(self, instance: str, auth: bool = True) -> str:
        cred = f"{self.USER}:{self.PASSWORD}@" if auth else ""
        return f"http://{cred}127.0.0.1:{self.port}/{instance}"


@pytest.fixture(scope="session")
def nginx_dav(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NginxDav]:
    server = NginxDav(tmp_path_factory.mktemp("nginx")).start()
    try:
        yield server
    finally:
        server.stop()

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
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

# The bulk of the suite runs on the `reference` tier (no compiler); `aoti` tests opt in explicitly. A
# private local cache keeps tests off the user's ~/.cache. Set before any test imports torch.
os.environ.setdefault("TORCH_NEURONX_COMPILER", "reference")
# Ops wait for their compiles (deterministic counts) unless a test asks for the background service, and
# no test process writes a job manifest unless it means to.
os.environ.setdefault("TORCH_NEURONX_COMPILE_MODE", "sync")
os.environ.setdefault("TORCH_NEURONX_PREFETCH", "0")
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

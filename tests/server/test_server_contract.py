"""The runtime's one backend contract suite (tests/cache/test_contract.py), run against grpc:// and a real
server process per test."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import torch  # noqa: F401  isort: skip  (see test_server_grpc_backend.py: torch loads neuron_runtime)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cache"))
from test_contract import BackendContract  # type: ignore[import-not-found]  # noqa: E402

from neuron_runtime.cache._grpc import GrpcBackend  # noqa: E402
from tests.conftest import free_port  # noqa: E402
from tests.server.conftest import ServerProc  # noqa: E402

pytestmark = pytest.mark.timeout(120)


class TestGrpcBackend(BackendContract):
    @pytest.fixture
    def backend(self, shared_server: ServerProc) -> Iterator[GrpcBackend]:
        # One server for the class; each test starts from an empty store.
        with shared_server.client() as c:
            for e in list(c.list()):
                c.delete(e.key)
        b = GrpcBackend(f"grpc://{shared_server.address}", timeout_s=10)
        yield b
        b.close()

    @pytest.fixture
    def broken(self) -> GrpcBackend:
        return GrpcBackend(f"grpc://127.0.0.1:{free_port()}", timeout_s=3)

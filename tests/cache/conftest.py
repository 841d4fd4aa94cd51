"""Fixtures for the cache tests: buckets on the session's moto server, and private moto servers."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest

# neuron_runtime/__init__.py registers the torch device on import; importing torch first gives these
# tests the import order users have. The cache layer itself never imports torch
# (test_the_cache_layer_is_torch_free checks it in a fresh process).
import torch  # noqa: F401


@pytest.fixture
def s3_url(moto_s3: Any) -> str:
    """A fresh bucket on the session's moto server."""
    name = f"neff-{uuid.uuid4().hex[:12]}"
    moto_s3.make_bucket(name)
    return f"s3://{name}/cache"


@pytest.fixture
def private_moto(moto_s3: Any) -> Iterator[Any]:
    """A moto server of this test's own (to stop it, or to turn IAM auth on), same class as `moto_s3`."""
    server = type(moto_s3)()
    server.start()
    try:
        yield server
    finally:
        server.stop()



@pytest.fixture(autouse=True)
def _no_stray_workers() -> Iterator[None]:
    """Kill any worker process a test started and left running (a failed assertion mid-test)."""
    from _cachetest import kill_started  # type: ignore[import-not-found]

    yield
    kill_started()

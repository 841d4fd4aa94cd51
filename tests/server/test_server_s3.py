"""Two server replicas on one (moto) S3 bucket see each other's entries; first writer wins across them."""

from __future__ import annotations

import uuid

import pytest

from tests.conftest import MotoS3
from tests.server.conftest import ServerProc, key_of

pytestmark = pytest.mark.timeout(120)


def test_two_replicas_share_one_bucket(moto_s3: MotoS3, server_factory: type[ServerProc]) -> None:
    bucket = f"neff-{uuid.uuid4().hex[:8]}"
    moto_s3.make_bucket(bucket)
    url = f"s3://{bucket}/fleet"
    a = server_factory(url, "--max-size", "1MiB", env=moto_s3.env()).start()
    b = server_factory(url, "--max-size", "1MiB", env=moto_s3.env()).start()
    ca, cb = a.client(), b.client()
    k1, k2 = key_of("from-a"), key_of("from-b")
    assert ca.put(k1, b"written by a")
    assert cb.get(k1) == b"written by a"
    assert cb.put(k2, b"written by b")
    assert ca.lookup([k1, k2, key_of("nobody")]) == [True, True, False]
    assert ca.get(k2) == b"written by b"
    # Create-only PutObject: the second replica's write of the same key is a no-op.
    assert cb.put(k1, b"late") is False
    assert ca.get(k1) == b"written by a"
    assert {e.key for e in cb.list()} == {k1, k2}
    # Per-entry cap on S3.
    from cache_server import TooLarge

    with pytest.raises(TooLarge):
        ca.put(key_of("huge"), b"x" * (1024 * 1024 + 1))
    # A delete through one replica is seen by the other once its positive cache is bypassed by a Get.
    assert ca.delete(k2) is True
    assert cb.get(k2) is None


def test_missing_bucket_fails_at_start(moto_s3: MotoS3, server_factory: type[ServerProc]) -> None:
    with pytest.raises(RuntimeError, match="cannot reach"):
        server_factory("s3://no-such-bucket-here/x", env=moto_s3.env()).start()

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


def test_leases_are_shared_by_replicas(moto_s3: MotoS3, server_factory: type[ServerProc]) -> None:
    """A lease granted through one replica holds on the other; waiters there see the entry or the release."""
    import threading
    import time

    from cache_server import LeaseState

    bucket = f"lease-{uuid.uuid4().hex[:8]}"
    moto_s3.make_bucket(bucket)
    url = f"s3://{bucket}/fleet"
    a = server_factory(url, env=moto_s3.env()).start()
    b = server_factory(url, env=moto_s3.env()).start()
    ca, cb = a.client(), b.client()
    k = key_of("shared-lease")
    held = ca.acquire_lease(k, ttl_s=60, holder="a")
    assert held.acquired
    assert not cb.acquire_lease(k, ttl_s=60).acquired  # the other replica sees it
    assert not ca.acquire_lease(k, ttl_s=60).acquired
    threading.Timer(0.5, lambda: (ca.put(k, b"compiled once"), ca.release_lease(k, held.lease_id))).start()
    assert cb.wait_for(k, 20) is LeaseState.STORED
    assert cb.get(k) == b"compiled once"
    assert cb.acquire_lease(k, ttl_s=60).exists
    # Released without an entry: a waiter on the other replica is told to compile itself.
    k2 = key_of("gave-up")
    lease = cb.acquire_lease(k2, ttl_s=60)
    assert lease.acquired
    threading.Timer(0.5, lambda: cb.release_lease(k2, lease.lease_id)).start()
    assert ca.wait_for(k2, 20) is LeaseState.RELEASED
    assert ca.wait_for(key_of("nobody"), 5) is LeaseState.NO_LEASE
    # An expired lease is taken over exactly once, and its late release does not drop the new holder.
    k3 = key_of("stale")
    dead = ca.acquire_lease(k3, ttl_s=0.3)
    assert dead.acquired
    time.sleep(0.6)
    takers = [c.acquire_lease(k3, ttl_s=60) for c in (ca, cb, ca, cb)]
    assert sum(t.acquired for t in takers) == 1
    assert ca.release_lease(k3, dead.lease_id) is False
    assert not cb.acquire_lease(k3, ttl_s=60).acquired

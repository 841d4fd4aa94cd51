"""One contract (neuron_runtime/cache/_base.py), every backend: memory, local diskcache, shared path, S3.

Each backend class supplies `backend` (a fresh, working store) and `broken` (the same kind of store in a
state where every call fails: missing bucket, closed port, a file where a directory should be).
"""

from __future__ import annotations

import threading
import time
import uuid
import warnings
from pathlib import Path
from typing import Any

import pytest
from _cachetest import free_port, key_of, make_entry  # type: ignore[import-not-found]

from neuron_runtime.cache import (
    CacheBackend,
    CacheWarning,
    InvalidKeyError,
    HttpStore,
    LocalCache,
    MemoryStore,
    RedisStore,
    S3Store,
    SharedPathStore,
)

BAD_KEYS = ["", "A" * 64, "a" * 63, "a" * 65, "../" + "a" * 61, "a" * 32 + "/" + "a" * 31, "g" * 64, None, 7]


def check_cap(store: CacheBackend) -> str:
    """`put` on a store whose `max_entry` is 1024: bigger values are skipped writes, counted as
    `too_large` with one warning naming the option; a value at the cap is stored. Returns the warning."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert store.put(key_of("big"), b"x" * 1025) is False
        assert store.put(key_of("big2"), b"x" * 4096) is False
        assert store.put(key_of("small"), b"x" * 1024) is True
    shown = [str(w.message) for w in caught if issubclass(w.category, CacheWarning)]
    assert len(shown) == 1 and "max_entry" in shown[0] and "1024" in shown[0], shown
    assert store.faults.counts == {"too_large": 2}
    assert store.get(key_of("big")) is None and store.get(key_of("small")) == b"x" * 1024
    return shown[0]


class BackendContract:
    """The contract; subclasses provide the `backend` and `broken` fixtures."""

    supports_leases = True

    @pytest.fixture(autouse=True)
    def _capabilities(self, request: pytest.FixtureRequest) -> None:
        name = request.node.name
        if not self.supports_leases and name.startswith(("test_lease", "test_stale_lease", "test_wait_for_sees")):
            pytest.skip("this tier has no fleet leases (single-flight is per host: TieredCache's flock)")
        if name == "test_entries" and "backend" in request.fixturenames:
            if not request.getfixturevalue("backend").lists_entries:
                pytest.skip("this store cannot list its entries (the HTTP cache API has no listing)")

    def test_miss_is_none(self, backend: CacheBackend) -> None:
        assert backend.get(key_of("nothing")) is None

    def test_put_then_get_returns_exact_bytes(self, backend: CacheBackend) -> None:
        k = key_of(1)
        data = make_entry(k, bytes(range(256)) * 600)  # > 64 KiB: diskcache stores it as a file
        assert backend.put(k, data) is True
        assert backend.get(k) == data
        small = key_of(2)
        assert backend.put(small, b"\x00small")
        assert backend.get(small) == b"\x00small"

    def test_first_writer_wins(self, backend: CacheBackend) -> None:
        k = key_of("fww")
        assert backend.put(k, b"first") is True
        assert backend.put(k, b"second") is True  # existing key: a no-op that reports success
        assert backend.get(k) == b"first"

    def test_bytes_like_values_are_stored_as_bytes(self, backend: CacheBackend) -> None:
        k = key_of("ba")
        assert backend.put(k, bytearray(b"abc"))  # type: ignore[arg-type]
        got = backend.get(k)
        assert type(got) is bytes and got == b"abc"

    def test_values_that_are_not_bytes_are_refused(self, backend: CacheBackend) -> None:
        k = key_of("not bytes")
        for bad in ("text", 7, None, [1, 2]):
            with pytest.raises(TypeError, match="cache values are bytes"):
                backend.put(k, bad)  # type: ignore[arg-type]
        assert backend.get(k) is None

    def test_entry_over_max_entry_is_a_counted_skipped_write(self, backend: CacheBackend) -> None:
        # The contract's rule for every store; a store sets its cap from `?max_entry=` (or not at all).
        backend.max_entry = 1024
        check_cap(backend)

    def test_contains_many(self, backend: CacheBackend) -> None:
        present = [key_of(f"c{i}") for i in range(5)]
        absent = [key_of(f"x{i}") for i in range(5)]
        for k in present:
            backend.put(k, b"v")
        assert backend.contains_many(present + absent) == set(present)
        assert backend.contains_many([]) == set()

    def test_delete(self, backend: CacheBackend) -> None:
        k = key_of("del")
        backend.put(k, b"v")
        assert backend.delete(k) is True
        assert backend.get(k) is None
        assert backend.delete(k) is False
        assert backend.put(k, b"again") and backend.get(k) == b"again"

    def test_entries(self, backend: CacheBackend) -> None:
        keys = {key_of(f"e{i}"): b"x" * (i + 1) for i in range(4)}
        for k, v in keys.items():
            backend.put(k, v)
        listed = {e.key: e for e in backend.entries()}
        assert set(listed) == set(keys)
        for k, v in keys.items():
            assert listed[k].size == len(v)
            assert listed[k].mtime > 0

    def test_concurrent_writers_leave_one_whole_entry(self, backend: CacheBackend) -> None:
        k = key_of("race")
        values = [bytes([i]) * 100_000 for i in range(8)]
        barrier = threading.Barrier(len(values))
        results: list[bool] = []

        def write(v: bytes) -> None:
            barrier.wait()
            results.append(backend.put(k, v))

        threads = [threading.Thread(target=write, args=(v,)) for v in values]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert results == [True] * len(values)
        assert backend.get(k) in values

    def test_invalid_keys_never_reach_storage(self, backend: CacheBackend) -> None:
        for bad in BAD_KEYS:
            with pytest.raises(InvalidKeyError):
                backend.get(bad)  # type: ignore[arg-type]
            with pytest.raises(InvalidKeyError):
                backend.put(bad, b"x")  # type: ignore[arg-type]
            with pytest.raises(InvalidKeyError):
                backend.delete(bad)  # type: ignore[arg-type]
            with pytest.raises(InvalidKeyError):
                backend.contains_many([key_of(1), bad])  # type: ignore[list-item]
            if self.supports_leases:
                with pytest.raises(InvalidKeyError):
                    backend.try_lease(bad, 10)  # type: ignore[arg-type]
        assert list(backend.entries()) == []

    def test_lease_is_exclusive_until_released(self, backend: CacheBackend) -> None:
        k = key_of("lease")
        lease = backend.try_lease(k, 60)
        assert lease is not None
        assert backend.try_lease(k, 60) is None
        lease.release()
        lease.release()  # idempotent
        again = backend.try_lease(k, 60)
        assert again is not None
        again.release()

    def test_stale_lease_is_taken_over_once(self, backend: CacheBackend) -> None:
        k = key_of("stale")
        dead = backend.try_lease(k, 0.3)  # its holder "crashes": never released
        assert dead is not None
        time.sleep(0.5)
        takers = [backend.try_lease(k, 60) for _ in range(3)]
        assert sum(t is not None for t in takers) == 1
        dead.release()  # a late release of a taken-over lease must not drop the new holder's
        assert backend.try_lease(k, 60) is None
        for t in takers:
            if t is not None:
                t.release()

    def test_wait_for_sees_the_holders_entry(self, backend: CacheBackend) -> None:
        k = key_of("wait")
        lease = backend.try_lease(k, 60)
        assert lease is not None

        def holder() -> None:
            time.sleep(0.2)
            backend.put(k, b"compiled")
            lease.release()

        t = threading.Thread(target=holder)
        t.start()
        assert backend.wait_for(k, 30) == b"compiled"
        t.join()

    def test_wait_for_gives_up_without_a_holder(self, backend: CacheBackend) -> None:
        # No entry and no live lease: returns None rather than sleeping out the whole timeout.
        assert backend.wait_for(key_of("nobody"), 0.5) is None

    def test_failure_is_a_miss(self, broken: CacheBackend) -> None:
        k = key_of("broken")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert broken.get(k) is None
            assert broken.put(k, b"v") is False
            assert broken.put(key_of("broken2"), b"v") is False
            assert broken.contains_many([k]) == set()
            assert broken.delete(k) is False
            assert list(broken.entries()) == []
            broken.try_lease(k, 1)  # a no-op lease or None, never an exception
            assert broken.wait_for(k, 0.2) is None
        cache_warnings = [w for w in caught if issubclass(w.category, CacheWarning)]
        assert cache_warnings, "a failing backend must warn"
        faults = getattr(broken, "faults")
        assert faults.total >= 3
        # once per kind of problem, not once per call
        assert len(cache_warnings) == len(faults.counts), [str(w.message) for w in cache_warnings]


class TestMemoryStore(BackendContract):
    @pytest.fixture
    def backend(self) -> MemoryStore:
        return MemoryStore()

    @pytest.fixture
    def broken(self) -> Any:
        pytest.skip("an in-process dict cannot fail")

    def test_failure_is_a_miss(self, broken: CacheBackend) -> None:  # noqa: D102
        pass


class TestLocalCache(BackendContract):
    supports_leases = False

    @pytest.fixture
    def backend(self, tmp_path: Path) -> LocalCache:
        return LocalCache(str(tmp_path / "local"), 1 << 30)

    @pytest.fixture
    def broken(self, tmp_path: Path) -> LocalCache:
        (tmp_path / "file").write_text("not a directory")
        return LocalCache(str(tmp_path / "file" / "local"), 1 << 30)


class TestSharedPathStore(BackendContract):
    @pytest.fixture
    def backend(self, tmp_path: Path) -> SharedPathStore:
        return SharedPathStore(str(tmp_path / "fleet"))

    @pytest.fixture
    def broken(self, tmp_path: Path) -> SharedPathStore:
        (tmp_path / "file").write_text("not a directory")
        return SharedPathStore(str(tmp_path / "file" / "fleet"))

    def test_layout_is_versioned_one_file_per_key(self, backend: SharedPathStore, tmp_path: Path) -> None:
        k = key_of("layout")
        backend.put(k, b"v")
        path = tmp_path / "fleet" / "v1" / k[:2] / k[2:4] / f"{k}.neff"
        assert path.read_bytes() == b"v"
        assert not [p for p in path.parent.iterdir() if p.name.startswith(".tmp-")]

    def test_crashed_writer_leaves_no_entry(self, backend: SharedPathStore, tmp_path: Path) -> None:
        k = key_of("torn")
        d = tmp_path / "fleet" / "v1" / k[:2] / k[2:4]
        d.mkdir(parents=True)
        (d / f".tmp-{k}.neff-deadbeef").write_bytes(b"half an ent")  # what a SIGKILLed writer leaves
        assert backend.get(k) is None
        assert [e.key for e in backend.entries()] == []
        assert backend.put(k, b"whole") and backend.get(k) == b"whole"


    def test_sweep_removes_old_debris_only(self, backend: SharedPathStore, tmp_path: Path) -> None:
        import os

        k = key_of("sweep")
        backend.put(k, b"entry")
        d = tmp_path / "fleet" / "v1" / k[:2] / k[2:4]
        old_tmp, new_tmp = d / f".tmp-{k}.neff-1", d / f".tmp-{k}.neff-2"
        old_tmp.write_bytes(b"torn")
        new_tmp.write_bytes(b"being written")
        os.utime(old_tmp, (1, 1))
        assert backend.sweep(max_age_s=3600) == 1
        assert not old_tmp.exists() and new_tmp.exists() and backend.get(k) == b"entry"


class TestS3Store(BackendContract):
    @pytest.fixture
    def backend(self, s3_url: str) -> S3Store:
        return S3Store(s3_url, timeout_s=10)

    @pytest.fixture
    def broken(self, moto_s3: Any) -> S3Store:
        # A closed port: connection refused on every call.
        return S3Store("s3://no-such-bucket/x", timeout_s=3, endpoint_url=f"http://127.0.0.1:{free_port()}")

    def test_missing_bucket_is_a_counted_fault(self, moto_s3: Any) -> None:
        store = S3Store("s3://bucket-that-does-not-exist/x", timeout_s=5)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            assert store.get(key_of(1)) is None
            assert store.put(key_of(1), b"v") is False
        assert store.faults.total == 2

    def test_create_only_put_uses_if_none_match(self, backend: S3Store) -> None:
        """moto 5.2 enforces If-None-Match: a second create of the same object gets 412."""
        import botocore.exceptions
        import boto3

        k = key_of("412")
        assert backend.put(k, b"first")
        client = boto3.client("s3")
        with pytest.raises(botocore.exceptions.ClientError) as ei:
            client.put_object(Bucket=backend.bucket, Key=f"{backend.prefix}/{backend.relpath(k)}", Body=b"x",
                              IfNoneMatch="*")
        assert ei.value.response["Error"]["Code"] == "PreconditionFailed"
        assert backend.get(k) == b"first"


class TestRedisStore(BackendContract):
    @pytest.fixture
    def backend(self, redis_server: Any) -> RedisStore:
        return RedisStore(redis_server.url(prefix=f"t{uuid.uuid4().hex[:8]}:"), timeout_s=5)

    @pytest.fixture
    def broken(self) -> RedisStore:
        return RedisStore(f"redis://127.0.0.1:{free_port()}", timeout_s=2)

    def test_layout_and_prefix(self, backend: RedisStore, redis_server: Any) -> None:
        import redis

        k = key_of("layout")
        backend.put(k, b"v")
        raw = redis.Redis(port=redis_server.port, password=redis_server.PASSWORD)
        assert raw.get(f"{backend.prefix}v1:{k}") == b"v"
        lease = backend.try_lease(k, 30)
        assert lease is not None
        ttl = raw.pttl(f"{backend.prefix}v1:lease:{k}")
        assert 0 < ttl <= 30_000  # the server expires a dead holder's lease
        lease.release()
        assert raw.exists(f"{backend.prefix}v1:lease:{k}") == 0

    def test_ttl_is_set_and_renewed_by_reads(self, redis_server: Any) -> None:
        import redis

        store = RedisStore(redis_server.url(prefix=f"ttl{uuid.uuid4().hex[:6]}:", ttl="60s"), timeout_s=5)
        raw = redis.Redis(port=redis_server.port, password=redis_server.PASSWORD)
        k = key_of("ttl")
        store.put(k, b"v")
        name = f"{store.prefix}v1:{k}"
        assert 0 < raw.pttl(name) <= 60_000
        raw.pexpire(name, 5_000)
        assert store.get(k) == b"v"
        assert raw.pttl(name) > 50_000  # the read renewed it

    def test_entry_over_the_cap_is_refused_with_one_clear_warning(self, redis_server: Any) -> None:
        store = RedisStore(redis_server.url(prefix=f"cap{uuid.uuid4().hex[:6]}:", max_entry="1KiB"), timeout_s=5)
        assert store.max_entry == 1024
        assert "proto-max-bulk-len" in check_cap(store)  # the warning names Redis's own limit too

    def test_acl_user_is_confined_to_its_prefix(self, redis_server: Any) -> None:
        ok = RedisStore(f"redis://neff:neff-pw@127.0.0.1:{redis_server.port}?prefix=neff:acl:", timeout_s=5)
        assert ok.put(key_of("acl"), b"v") and ok.get(key_of("acl")) == b"v"
        outside = RedisStore(f"redis://neff:neff-pw@127.0.0.1:{redis_server.port}?prefix=other:", timeout_s=5)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            assert outside.put(key_of("acl"), b"v") is False
        assert outside.faults.counts == {"permission": 1}

    def test_password_never_reaches_messages(self, redis_server: Any) -> None:
        store = RedisStore(f"redis://neff:wrong-secret@127.0.0.1:{redis_server.port}", timeout_s=5)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert store.get(key_of(1)) is None
        assert "wrong-secret" not in store.url and all("wrong-secret" not in str(w.message) for w in caught)
        assert store.faults.counts == {"permission": 1}


class TestRedisClusterStore(BackendContract):
    @pytest.fixture
    def backend(self, redis_cluster: Any) -> RedisStore:
        return RedisStore(redis_cluster.url(prefix=f"c{uuid.uuid4().hex[:8]}:"), timeout_s=5)

    @pytest.fixture
    def broken(self) -> RedisStore:
        return RedisStore(f"redis://127.0.0.1:{free_port()}?cluster=1", timeout_s=2)

    def test_keys_spread_over_every_node(self, backend: RedisStore, redis_cluster: Any) -> None:
        import redis

        keys = [key_of(f"spread{i}") for i in range(30)]
        for k in keys:
            assert backend.put(k, b"v")
        per_node = [len(redis.Redis(port=n.port, password=n.PASSWORD).keys(f"{backend.prefix}*"))
                    for n in redis_cluster.nodes]
        assert sum(per_node) == 30 and all(per_node), per_node
        assert backend.contains_many(keys) == set(keys)
        assert set(backend.get_many(keys)) == set(keys)


class TestHttpStore(BackendContract):
    """Our bazel-remote-API server (tests/_httpcache.py)."""

    supports_leases = False

    @pytest.fixture
    def backend(self, http_cache: Any) -> HttpStore:
        return HttpStore(f"http://ci:ci-pw@127.0.0.1:{http_cache.port}/t{uuid.uuid4().hex[:8]}", timeout_s=5)

    @pytest.fixture
    def broken(self) -> HttpStore:
        return HttpStore(f"http://127.0.0.1:{free_port()}/x", timeout_s=2)

    def test_bazel_remote_layout(self, backend: HttpStore, http_cache: Any) -> None:
        import hashlib

        from neuron_runtime.cache._http import parse_record

        k = key_of("layout")
        data = make_entry(k)
        assert backend.put(k, data)
        instance = backend.base.strip("/")
        digest = hashlib.sha256(data).hexdigest()
        assert http_cache.blobs[(instance, "cas", digest)] == data
        ac = hashlib.sha256(f"neuron-runtime:v1:{k}".encode()).hexdigest()
        record = http_cache.blobs[(instance, "ac", ac)]  # rewritten by the server (worker metadata added)
        assert parse_record(record, k) == (digest, len(data))
        assert parse_record(record, key_of("other")) is None  # a record names the key it is for

    def test_bearer_token_and_wrong_credentials(self, http_cache: Any) -> None:
        good = HttpStore(f"http://127.0.0.1:{http_cache.port}/bearer", token="ci-token", timeout_s=5)
        assert good.put(key_of("b"), b"v") and good.get(key_of("b")) == b"v"
        bad = HttpStore(f"http://ci:nope@127.0.0.1:{http_cache.port}/bearer", timeout_s=5)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert bad.get(key_of("b")) is None and bad.put(key_of("c"), b"v") is False
        assert bad.faults.counts == {"permission": 2}
        shown = [str(w.message) for w in caught if issubclass(w.category, CacheWarning)]
        assert len(shown) == 1 and "401" in shown[0] and "nope" not in shown[0]


class TestNginxHttpStore(BackendContract):
    """nginx's WebDAV PUT (Debian), configured by deploy/nginx/neff-cache.conf."""

    supports_leases = False

    @pytest.fixture
    def backend(self, nginx_dav: Any) -> HttpStore:
        return HttpStore(nginx_dav.url(f"t{uuid.uuid4().hex[:8]}"), timeout_s=5)

    @pytest.fixture
    def broken(self) -> HttpStore:
        return HttpStore(f"http://127.0.0.1:{free_port()}/x", timeout_s=2)

    def test_readers_need_no_password_writers_do(self, nginx_dav: Any) -> None:
        writer = HttpStore(nginx_dav.url("ro"), timeout_s=5)
        reader = HttpStore(nginx_dav.url("ro", auth=False), timeout_s=5)
        k = key_of("ro")
        data = make_entry(k)
        assert writer.put(k, data)
        assert reader.get(k) == data
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            assert reader.put(key_of("ro2"), b"v") is False
        assert reader.faults.counts == {"permission": 1}

    def test_a_big_entry_goes_through(self, backend: HttpStore) -> None:
        k = key_of("big")
        data = make_entry(k, b"\x01" * (3 << 20))  # over nginx's default 1 MiB body cap
        assert backend.put(k, data) and backend.get(k) == data

"""TieredCache in one process: verification and quarantine, fills, modes, threads single-flight."""

from __future__ import annotations

import dataclasses
import sqlite3
import sys
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _cachetest import key_of, make_cfg, make_entry  # type: ignore[import-not-found]

from neuron_runtime.cache import envelope
from neuron_runtime.cache import (
    CacheBackend,
    CacheMissError,
    CacheWarning,
    EntryInfo,
    IntegrityError,
    LocalCache,
    MemoryStore,
    SharedPathStore,
    StoreConfigError,
    TieredCache,
    open_store,
)

SECRET = b"signing key"


def tiered(tmp_path: Path, fleet: CacheBackend | None = None, **cfg_over: Any) -> tuple[TieredCache, dict[str, Any]]:
    cfg = make_cfg(tmp_path, **cfg_over)
    stats: dict[str, Any] = {}
    return TieredCache(LocalCache(cfg.local_cache_dir, cfg.cache_max_size), fleet, cfg, stats), stats


class Compiler:
    """A compile_fn factory that counts calls (thread-safe) and can be slowed down or made to fail."""

    def __init__(self, signing_key: bytes | None = None, delay: float = 0.0, fail_first: int = 0) -> None:
        self.calls = 0
        self.lock = threading.Lock()
        self.signing_key, self.delay, self.fail_first = signing_key, delay, fail_first

    def __call__(self, key: str) -> Any:
        def compile_fn() -> bytes:
            with self.lock:
                self.calls += 1
                n = self.calls
            if self.delay:
                threading.Event().wait(self.delay)
            if n <= self.fail_first:
                raise RuntimeError("compiler crashed")
            return make_entry(key, f"payload {key}".encode(), self.signing_key)

        return compile_fn


def test_stats_keys_exist_from_the_start(tmp_path: Path) -> None:
    _, stats = tiered(tmp_path, MemoryStore())
    assert stats == {"hits": {"local": 0, "fleet": 0}, "misses": 0, "compiles": 0, "corrupt": 0,
                     "fleet_errors": 0, "writes_skipped": 0, "lease_waits": 0}


def test_miss_compile_then_hits(tmp_path: Path) -> None:
    fleet = MemoryStore()
    cache, stats = tiered(tmp_path, fleet)
    k = key_of("op")
    comp = Compiler()
    assert cache.get(k) == (None, "miss")
    entry, source = cache.get_or_compile(k, comp(k))
    assert (entry.payload, source) == (f"payload {k}".encode(), "compiled")
    assert fleet.get(k) is not None and cache.local.get(k) is not None  # written through
    assert cache.get_or_compile(k, comp(k))[1] == "local"
    data, tier = cache.get(k)
    assert tier == "local" and envelope.unpack(data, expected_key=k, signing_key=None).payload == entry.payload
    assert comp.calls == 1
    assert stats["compiles"] == 1 and stats["misses"] == 2 and stats["hits"]["local"] == 2


def test_fleet_hit_fills_local(tmp_path: Path) -> None:
    fleet = MemoryStore()
    k = key_of("shared")
    fleet.put(k, make_entry(k, b"from another host"))
    cache, stats = tiered(tmp_path, fleet)
    entry, source = cache.get_or_compile(k, Compiler()(k))
    assert (entry.payload, source) == (b"from another host", "fleet")
    assert cache.local.get(k) == fleet.get(k)
    assert cache.get_entry(k)[1] == "local"
    assert stats["hits"] == {"local": 1, "fleet": 1} and stats["compiles"] == 0


def test_put_verifies_and_writes_through(tmp_path: Path) -> None:
    fleet = MemoryStore()
    cache, _ = tiered(tmp_path, fleet)
    k = key_of("p")
    assert cache.put(k, cache.pack(k, {"signature": {}, "fingerprint": {}}, b"x"))
    assert fleet.get(k) and cache.local.get(k)
    with pytest.raises(IntegrityError):
        cache.put(key_of("q"), make_entry(k))  # an entry for another key: a producer bug, loud


BAD_ENTRIES = {
    "key": lambda k: make_entry(key_of("someone else")),
    "digest": lambda k: make_entry(k, b"p" * 100)[:-60] + b"X" + make_entry(k, b"p" * 100)[-59:],
    "truncated": lambda k: make_entry(k, b"p" * 100)[:-10],
    "magic": lambda k: b"garbage" * 10,
    "signature": lambda k: make_entry(k, b"p", b"forger's key"),
    "unsigned": lambda k: make_entry(k, b"p"),
}


@pytest.mark.parametrize("tier", ["local", "fleet"])
@pytest.mark.parametrize("reason", sorted(BAD_ENTRIES))
def test_planted_bad_entries_are_refused_quarantined_counted(tmp_path: Path, tier: str, reason: str) -> None:
    fleet = SharedPathStore(str(tmp_path / "fleet"))
    cache, stats = tiered(tmp_path, fleet, signing_key=SECRET)
    k = key_of(f"victim-{reason}")
    backend = cache.local if tier == "local" else fleet
    assert backend.put(k, BAD_ENTRIES[reason](k))
    comp = Compiler(signing_key=SECRET)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        entry, source = cache.get_or_compile(k, comp(k))
    assert (entry.payload, source) == (f"payload {k}".encode(), "compiled")
    assert stats["corrupt"] == 1
    assert any(issubclass(w.category, CacheWarning) and reason in str(w.message) for w in caught)
    # quarantined and replaced by the recompiled, signed entry
    envelope.unpack(backend.get(k) or b"", expected_key=k, signing_key=SECRET)
    assert comp.calls == 1


def test_corrupt_warning_is_shown_once_per_reason(tmp_path: Path) -> None:
    cache, stats = tiered(tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(5):
            k = key_of(f"c{i}")
            cache.local.put(k, b"garbage" * 10)
            assert cache.get(k) == (None, "miss")
    assert stats["corrupt"] == 5
    assert sum(issubclass(w.category, CacheWarning) for w in caught) == 1


@pytest.mark.parametrize("damage", ["flip", "truncate"])
@pytest.mark.parametrize("size", [100, 200_000])  # inline SQLite blob, and a diskcache value file
def test_damaged_local_entries_on_disk_are_detected(tmp_path: Path, damage: str, size: int) -> None:
    cache, stats = tiered(tmp_path)
    k = key_of(f"disk-{size}")
    cache.get_or_compile(k, lambda: make_entry(k, b"q" * size))
    db_dir = Path(cache.local.entries_dir)  # type: ignore[attr-defined]
    cache.local.close()
    con = sqlite3.connect(db_dir / "cache.db")
    filename, value = con.execute("SELECT filename, value FROM Cache WHERE key = ?", (k,)).fetchone()
    if filename:
        path = db_dir / filename
        data = bytearray(path.read_bytes())
        path.write_bytes(bytes(data[: len(data) // 2]) if damage == "truncate" else _flip(data))
    else:
        data = bytearray(value)
        new = bytes(data[:-5]) if damage == "truncate" else _flip(data)
        con.execute("UPDATE Cache SET value = ? WHERE key = ?", (sqlite3.Binary(new), k))
        con.commit()
    con.close()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        entry, source = cache.get_or_compile(k, lambda: make_entry(k, b"fresh"))
    assert (entry.payload, source) == (b"fresh", "compiled")
    assert stats["corrupt"] == 1


def _flip(data: bytearray) -> bytes:
    data[len(data) // 2] ^= 0x40
    return bytes(data)


def test_readonly_mode_writes_and_deletes_nothing(tmp_path: Path) -> None:
    fleet = MemoryStore()
    seeded, bad = key_of("seeded"), key_of("bad")
    fleet.put(seeded, make_entry(seeded))
    fleet.put(bad, b"garbage" * 10)
    cache, stats = tiered(tmp_path, fleet, cache_mode="readonly")
    assert cache.get_or_compile(seeded, Compiler()(seeded))[1] == "fleet"
    assert cache.local.get(seeded) is None  # no fill
    k = key_of("new")
    assert cache.get_or_compile(k, Compiler()(k))[1] == "compiled"
    assert fleet.get(k) is None and cache.local.get(k) is None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert cache.get(bad) == (None, "miss")
    assert fleet.get(bad) is not None  # refused, but not deleted from a store we must not change
    assert stats["corrupt"] == 1 and stats["writes_skipped"] == 0
    assert not cache.put(k, make_entry(k))


def test_strict_mode_raises_on_a_miss_and_serves_hits(tmp_path: Path) -> None:
    fleet = MemoryStore()
    hit = key_of("warm")
    fleet.put(hit, make_entry(hit))
    cache, stats = tiered(tmp_path, fleet, cache_mode="strict")
    assert cache.get_or_compile(hit, Compiler()(hit))[1] == "fleet"
    comp = Compiler()
    with pytest.raises(CacheMissError) as ei:
        cache.get_or_compile(key_of("cold"), comp(key_of("cold")))
    assert key_of("cold") in str(ei.value) and "strict" in str(ei.value)
    assert comp.calls == 0 and stats["misses"] == 1


def test_threads_share_one_compile(tmp_path: Path) -> None:
    cache, stats = tiered(tmp_path, MemoryStore())
    keys = [key_of(f"t{i}") for i in range(3)]
    comp = Compiler(delay=0.3)
    barrier = threading.Barrier(12)
    results: list[tuple[str, bytes, str]] = []
    lock = threading.Lock()

    def run(k: str) -> None:
        barrier.wait()
        entry, source = cache.get_or_compile(k, comp(k))
        with lock:
            results.append((k, entry.payload, source))

    threads = [threading.Thread(target=run, args=(keys[i % 3],)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert comp.calls == 3 and stats["compiles"] == 3
    assert all(p == f"payload {k}".encode() for k, p, _ in results)
    assert sorted(s for _, _, s in results).count("compiled") == 3


def test_a_compile_finished_before_the_host_lock_is_taken_is_not_repeated(tmp_path: Path) -> None:
    """Two processes of one host miss the same key; the first compiles, writes and lets the lock go
    before the second takes it, so the second never waits for the lock: it must still find the entry."""
    first, _ = tiered(tmp_path)
    second, stats = tiered(tmp_path)  # another process: its own flights and counters, the same dirs
    key = key_of("raced")
    comp = Compiler()
    real_acquire = second._host_locks.acquire

    def acquire_after_the_other_process(k: str, timeout_s: float) -> Any:
        first.get_or_compile(k, comp(k))  # runs start to finish between our lookup and our lock
        return real_acquire(k, timeout_s)

    second._host_locks.acquire = acquire_after_the_other_process  # type: ignore[method-assign]
    entry, source = second.get_or_compile(key, comp(key))
    assert comp.calls == 1 and stats["compiles"] == 0 and source == "local"
    assert entry.payload == f"payload {key}".encode()


def test_waiting_threads_compile_themselves_when_the_leader_fails(tmp_path: Path) -> None:
    cache, _ = tiered(tmp_path)
    k = key_of("flaky")
    comp = Compiler(delay=0.2, fail_first=1)
    errors: list[BaseException] = []
    outcomes: list[str] = []
    barrier = threading.Barrier(3)

    def run() -> None:
        barrier.wait()
        try:
            outcomes.append(cache.get_or_compile(k, comp(k))[1])
        except RuntimeError as e:
            errors.append(e)

    threads = [threading.Thread(target=run) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(errors) == 1  # only the caller whose compile crashed sees it
    assert len(outcomes) == 2


def test_unwritable_local_tier_counts_skipped_writes_and_never_fails(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    cfg = make_cfg(tmp_path, local_cache_dir=str(tmp_path / "file" / "local"))
    stats: dict[str, Any] = {}
    cache = TieredCache(LocalCache(cfg.local_cache_dir, cfg.cache_max_size), None, cfg, stats)
    k = key_of("nowhere")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert cache.get_or_compile(k, Compiler()(k))[1] == "compiled"
        assert cache.get_or_compile(k, Compiler()(k))[1] == "compiled"
    assert stats["writes_skipped"] == 2 and stats["compiles"] == 2


class Exploding(CacheBackend):
    """A backend that breaks the never-raise contract."""

    url = "boom://"

    def get(self, key: str) -> bytes | None:
        raise ConnectionError("boom")

    def put(self, key: str, data: bytes) -> bool:
        raise ConnectionError("boom")

    def delete(self, key: str) -> bool:
        raise ConnectionError("boom")

    def entries(self) -> Iterator[EntryInfo]:
        raise ConnectionError("boom")

    def try_lease(self, key: str, ttl_s: float) -> Any:
        raise ConnectionError("boom")


def test_a_raising_backend_is_a_miss_and_counted(tmp_path: Path) -> None:
    cache, stats = tiered(tmp_path, Exploding())
    k = key_of("x")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert cache.get_or_compile(k, Compiler()(k))[1] == "compiled"
    assert stats["fleet_errors"] >= 3 and stats["writes_skipped"] == 1


def test_fleet_faults_are_counted_in_stats(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    cache, stats = tiered(tmp_path, SharedPathStore(str(tmp_path / "file" / "fleet")))
    k = key_of("y")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert cache.get_or_compile(k, Compiler()(k))[1] == "compiled"
    assert stats["fleet_errors"] >= 2  # get, lease, put
    assert stats["writes_skipped"] == 1
    assert cache.local.get(k) is not None


def test_single_flight_off_still_correct(tmp_path: Path) -> None:
    cache, stats = tiered(tmp_path, MemoryStore(), single_flight=False)
    k = key_of("nsf")
    assert cache.get_or_compile(k, Compiler()(k))[1] == "compiled"
    assert cache.get_or_compile(k, Compiler()(k))[1] == "local"


# --------------------------------------------------------------------------- registry


def test_open_store_by_url(tmp_path: Path, moto_s3: Any) -> None:
    cfg = make_cfg(tmp_path)
    assert isinstance(open_store(str(tmp_path / "a"), cfg), SharedPathStore)
    store = open_store(f"file://{tmp_path}/b", cfg)
    assert isinstance(store, SharedPathStore) and store.root == f"{tmp_path}/b"
    s3 = open_store("s3://bucket-x/prefix/", cfg)
    assert (type(s3).__name__, s3.bucket, s3.prefix) == ("S3Store", "bucket-x", "prefix")  # type: ignore[attr-defined]
    assert type(open_store("memory://", cfg)).__name__ == "MemoryStore"


def test_open_store_errors_are_clear(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = make_cfg(tmp_path)
    with pytest.raises(StoreConfigError) as ei:
        open_store("ftp://host/x", cfg)
    for scheme in ("s3://", "grpc://", "grpcs://", "file://", "plain path"):
        assert scheme in str(ei.value)
    with pytest.raises(StoreConfigError, match="file:///path"):
        open_store("file://otherhost/x", cfg)
    with pytest.raises(StoreConfigError, match="s3://bucket"):
        open_store("s3://", cfg)
    monkeypatch.setitem(sys.modules, "s3fs", None)  # as if s3fs were not installed
    with pytest.raises(StoreConfigError, match="pip install 's3fs'"):
        open_store("s3://b/p", cfg)


def test_grpc_urls_go_to_the_grpc_backend(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = make_cfg(tmp_path)
    monkeypatch.setitem(sys.modules, "neuron_runtime.cache._grpc", None)  # as if it were not built
    with pytest.raises(StoreConfigError, match="neuron_runtime.cache._grpc"):
        open_store("grpc://cache:50051", cfg)
    monkeypatch.setitem(sys.modules, "grpc", None)
    with pytest.raises(StoreConfigError, match="pip install 'grpcio'"):
        open_store("grpcs://cache:50051", cfg)


def test_from_config(tmp_path: Path) -> None:
    cfg = dataclasses.replace(make_cfg(tmp_path), cache_dir=str(tmp_path / "fleet"))
    stats: dict[str, Any] = {}
    cache = TieredCache.from_config(cfg, stats)
    assert [n for n, _ in cache.tiers] == ["local", "fleet"]
    assert isinstance(cache.fleet, SharedPathStore)
    local_only = TieredCache.from_config(make_cfg(tmp_path / "2"), {})
    assert local_only.fleet is None


@pytest.mark.parametrize("kind", ["path", "s3"])
def test_quarantine_spares_a_good_entry_republished_meanwhile(kind: str, tmp_path: Path,
                                                             request: pytest.FixtureRequest) -> None:
    from neuron_runtime.cache import S3Store

    store: Any = (SharedPathStore(str(tmp_path / "fleet")) if kind == "path"
                  else S3Store(request.getfixturevalue("s3_url"), timeout_s=10))
    k = key_of("republished")
    bad = make_entry(k, b"p" * 100)[:-7]
    store.put(k, bad)
    seen = store.get(k)  # host A reads the bad entry ...
    store.delete(k)  # ... host B quarantines it and republishes a good one
    good = make_entry(k, b"good")
    store.put(k, good)
    assert store.quarantine(k, seen) is False  # A's late quarantine must not remove B's entry
    assert store.get(k) == good
    assert store.quarantine(k, good) is True  # (the same call on the bad bytes would have removed it)
    assert store.get(k) is None and list(store.entries()) == []

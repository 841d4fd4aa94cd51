"""The host-local diskcache tier: bytes only, pickled rows refused unread, byte cap, private dirs,
unwritable and full directories."""

from __future__ import annotations

import os
import sqlite3
import stat
import time
import warnings
from pathlib import Path

import diskcache
import pytest
from _cachetest import evil_pickle, fork_call, key_of, make_cfg, make_entry, shared_tmp  # type: ignore[import-not-found]

from neuron_runtime.cache import CacheWarning, IntegrityError, LocalCache, TieredCache
from neuron_runtime.cache._local import filesystem_type, is_network_fs


def plant_pickled_row(db_dir: Path, key: str, payload: bytes, as_file: bool = False) -> None:
    """Insert a MODE_PICKLE row straight into diskcache's SQLite table, as an attacker with write access
    to the directory would (diskcache itself would happily write one for any non-bytes value)."""
    con = sqlite3.connect(db_dir / "cache.db")
    now = time.time()
    if as_file:
        (db_dir / "ab").mkdir(exist_ok=True)
        (db_dir / "ab" / "evil.val").write_bytes(payload)
        row = (key, now, now, 0, len(payload), diskcache.core.MODE_PICKLE, "ab/evil.val", None)
    else:
        row = (key, now, now, 0, 0, diskcache.core.MODE_PICKLE, None, sqlite3.Binary(payload))
    con.execute(
        "INSERT INTO Cache (key, raw, store_time, expire_time, access_time, access_count, tag, size, mode,"
        " filename, value) VALUES (?, 1, ?, NULL, ?, ?, NULL, ?, ?, ?, ?)",
        row,
    )
    con.commit()
    con.close()


def test_stock_diskcache_would_run_the_planted_pickle(tmp_path: Path) -> None:
    """The control: without our Disk, reading the planted row executes it (CVE-2025-69872)."""
    db = tmp_path / "stock"
    diskcache.Cache(str(db)).close()
    marker = tmp_path / "pwned"
    plant_pickled_row(db, key_of(1), evil_pickle(marker))
    diskcache.Cache(str(db)).get(key_of(1))
    assert marker.exists()


@pytest.mark.parametrize("as_file", [False, True])
def test_pickled_row_is_refused_never_unpickled_and_counted(tmp_path: Path, as_file: bool) -> None:
    cfg = make_cfg(tmp_path)
    local = LocalCache(cfg.local_cache_dir, cfg.cache_max_size)
    k = key_of("victim")
    assert local.put(key_of("other"), make_entry(key_of("other")))  # creates the database
    marker = tmp_path / "pwned"
    plant_pickled_row(Path(local.entries_dir), k, evil_pickle(marker), as_file=as_file)

    with pytest.raises(IntegrityError) as ei:
        local.get(k)
    assert ei.value.reason == "pickled"
    assert k not in local.contains_many([k])
    assert k in {e.key for e in local.entries()}  # listed (so `verify`/`prune` can find it), not read

    stats: dict[str, object] = {}
    cache = TieredCache(local, None, cfg, stats)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert cache.get(k) == (None, "miss")
    assert stats["corrupt"] == 1
    assert any(issubclass(w.category, CacheWarning) and "pickled" in str(w.message) for w in caught)
    assert k not in {e.key for e in local.entries()}  # quarantined: the row is gone
    entry, source = cache.get_or_compile(k, lambda: make_entry(k, b"recompiled"))
    assert (entry.payload, source) == (b"recompiled", "compiled")
    assert not marker.exists(), "the pickle payload ran"


def test_non_bytes_values_are_never_pickled(tmp_path: Path) -> None:
    local = LocalCache(str(tmp_path / "l"), 1 << 30)
    local._db("put")
    db = local._cache
    assert db is not None
    with pytest.raises(TypeError):
        db.set(key_of(1), {"an": "object"})  # the Disk itself refuses, whoever calls it
    assert local.put(key_of(2), memoryview(b"mv"))  # type: ignore[arg-type]
    modes = {m for (m,) in sqlite3.connect(Path(local.entries_dir) / "cache.db").execute("SELECT mode FROM Cache")}
    assert modes <= {diskcache.core.MODE_RAW, diskcache.core.MODE_BINARY}


def test_directories_are_private(tmp_path: Path) -> None:
    d = tmp_path / "loose"
    d.mkdir(mode=0o777)
    d.chmod(0o777)
    local = LocalCache(str(d), 1 << 30)
    assert local.put(key_of(1), b"x")
    for p in (d, Path(local.entries_dir)):
        assert stat.S_IMODE(p.stat().st_mode) == 0o700, p


def test_byte_cap_evicts_least_recently_used(tmp_path: Path) -> None:
    cap = 1 << 20
    local = LocalCache(str(tmp_path / "l"), cap)
    keys = [key_of(f"lru{i}") for i in range(12)]
    blob = b"z" * 150_000
    local.put(keys[0], blob)
    for k in keys[1:]:
        assert local.get(keys[0]) == blob  # keep the first one hot
        local.put(k, blob)
    present = local.contains_many(keys)
    assert keys[0] in present, "the most recently used entry was evicted"
    assert keys[1] not in present, "the least recently used entry survived"
    assert local.volume() <= cap
    assert len(present) < len(keys)


def test_unwritable_directory_warns_once_and_never_raises() -> None:
    base = shared_tmp()
    (base / "ro").mkdir()
    (base / "ro").chmod(0o555)

    def scenario() -> list[object]:
        local = LocalCache(str(base / "ro" / "cache"), 1 << 30)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            results = [local.put(key_of(i), b"x") for i in range(5)] + [local.get(key_of(1))]
        return [results, sum(issubclass(w.category, CacheWarning) for w in caught), local.faults.counts]

    results, n_warnings, counts = fork_call(scenario, unprivileged=True)
    assert results == [False] * 5 + [None]
    assert n_warnings == 1
    assert counts == {"permission": 6}


def test_directory_owned_by_someone_else_is_refused(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to chown")
    d = tmp_path / "theirs"
    d.mkdir(mode=0o700)
    os.chown(d, 65534, 65534)
    local = LocalCache(str(d), 1 << 30)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert local.put(key_of(1), b"x") is False
    assert local.faults.counts == {"permission": 1}


def test_full_disk_skips_the_write_and_keeps_working(tmp_path: Path) -> None:
    local_dir = tmp_path / "full"
    LocalCache(str(local_dir), 1 << 30).put(key_of("small"), b"s")  # the database exists

    def scenario() -> list[object]:
        local = LocalCache(str(local_dir), 1 << 30)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            big = local.put(key_of("big"), b"b" * 2_000_000)
            got = local.get(key_of("small"))
            small = got.decode() if got else None
        return [big, small, sorted(local.faults.counts), sum(issubclass(w.category, CacheWarning) for w in caught)]

    big, small, kinds, n_warnings = fork_call(scenario, fsize=1_000_000)
    assert big is False
    assert small == "s"
    assert kinds == ["full"]
    assert n_warnings == 1


def test_network_filesystems_are_detected() -> None:
    mountinfo = (
        "22 1 8:1 / / rw,relatime - ext4 /dev/sda1 rw\n"
        "40 22 0:50 / /fsx rw,relatime - lustre 10.0.0.1@tcp:/fsx rw\n"
        "41 22 0:51 / /mnt/efs rw - nfs4 fs-1.efs:/ rw\n"
        "42 41 0:52 / /mnt/efs/local rw - ext4 /dev/sdb rw\n"
    )
    assert filesystem_type("/home/u/.cache", mountinfo) == "ext4"
    assert is_network_fs("/fsx/neff", mountinfo)
    assert is_network_fs("/mnt/efs/x", mountinfo)
    assert not is_network_fs("/mnt/efs/local/x", mountinfo)  # the longest mount point wins
    assert not is_network_fs("/fsxother", mountinfo)


def test_a_held_database_lock_is_a_bounded_miss(tmp_path: Path) -> None:
    """Another process stuck inside a write transaction: calls give up after the SQLite timeout."""
    local = LocalCache(str(tmp_path / "l"), 1 << 30, sqlite_timeout_s=0.2)
    k = key_of("locked")
    assert local.put(k, b"v")
    holder = sqlite3.connect(Path(local.entries_dir) / "cache.db", isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")  # holds the write lock until we let go
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            assert local.put(key_of("other"), b"v") is False
            assert local.get(k) is None  # an LRU read updates access time: a write
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    assert local.faults.counts == {"timeout": 2}
    assert local.get(k) == b"v"

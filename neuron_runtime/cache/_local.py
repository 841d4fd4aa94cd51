"""The host-local tier: diskcache (SQLite + files) under `TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR`.

Layout: `<dir>/v1/` is the diskcache directory (the envelope format version is part of the path), and
`<dir>/locks/` holds the per-key host lock files (`_locks.py`). Directories are created `0o700`: the
entries are executables, so whoever can write them can run code in this user's processes.

Values are bytes only. diskcache pickles any value that is not bytes/str/int/float and unpickles such
rows on read (CVE-2025-69872: a planted row runs code). `_BytesOnlyDisk` refuses to store anything but
bytes and refuses to *read* a pickled row: it raises `IntegrityError("pickled")` from the row's mode
column before any unpickling could happen. This is the one case where this backend's `get` raises: the
row cannot be returned as bytes without executing it. The tiered cache quarantines and counts it.

SQLite locking is unreliable on network filesystems, so the tier refuses (one warning, then every call
is a miss) to open a directory on NFS, Lustre, SMB, FUSE network mounts and the like.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import stat
import threading
from collections.abc import Iterable, Iterator
from typing import Any

import diskcache
from diskcache.core import MODE_BINARY, MODE_PICKLE, MODE_RAW

from neuron_runtime.cache._base import CacheBackend, EntryInfo, check_key
from neuron_runtime.cache._errors import IntegrityError
from neuron_runtime.cache._faults import FaultCounter

log = logging.getLogger(__name__)

LAYOUT_VERSION = "v1"

# Filesystem types on which SQLite's locks cannot be trusted (or which are shared between hosts).
_NETWORK_FS = frozenset({
    "nfs", "nfs4", "cifs", "smb3", "smbfs", "lustre", "ceph", "glusterfs", "gpfs", "beegfs", "afs",
    "ocfs2", "gfs2", "9p", "fuse.glusterfs", "fuse.sshfs", "fuse.s3fs", "fuse.mountpoint-s3",
    "fuse.goofys", "fuse.gcsfuse", "fuse.juicefs", "fuse.cephfs", "virtiofs",
})


def filesystem_type(path: str, mountinfo: str | None = None) -> str | None:
    """The filesystem type of the mount holding `path` (Linux `/proc/self/mountinfo`), or None."""
    if mountinfo is None:
        try:
            with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
                mountinfo = f.read()
        except OSError:
            return None
    target = os.path.realpath(path)
    best, best_type = "", None
    for line in mountinfo.splitlines():
        left, sep, right = line.partition(" - ")
        fields = left.split()
        if not sep or len(fields) < 5 or not right.split():
            continue
        mount = fields[4].replace("\\040", " ")
        if (target == mount or target.startswith(mount.rstrip("/") + "/")) and len(mount) >= len(best):
            best, best_type = mount, right.split()[0]
    return best_type


def is_network_fs(path: str, mountinfo: str | None = None) -> bool:
    fstype = filesystem_type(path, mountinfo)
    return fstype is not None and (fstype in _NETWORK_FS or fstype.split(".")[0] in _NETWORK_FS)


def make_private_dir(path: str) -> None:
    """Create `path` (and parents) and make it 0o700; refuse a directory owned by another user."""
    os.makedirs(path, mode=0o700, exist_ok=True)
    st = os.stat(path)
    if st.st_uid != os.geteuid():
        raise PermissionError(f"{path} is owned by uid {st.st_uid}, not by this user: refusing to use it")
    if stat.S_IMODE(st.st_mode) != 0o700:
        os.chmod(path, 0o700)


class _BytesOnlyDisk(diskcache.Disk):  # type: ignore[misc]
    """A diskcache Disk that stores and returns bytes only and never unpickles (see module docstring)."""

    def store(self, value: Any, read: bool, key: Any = diskcache.core.UNKNOWN) -> Any:
        if type(value) is not bytes:
            raise TypeError(f"the local cache stores bytes only, not {type(value).__name__}")
        return super().store(value, read, key)

    def fetch(self, mode: int, filename: str | None, value: Any, read: bool) -> Any:
        # Decide from the mode column alone; MODE_PICKLE never reaches diskcache's pickle.load.
        if mode == MODE_PICKLE:
            raise IntegrityError("pickled", "a pickled row in the local cache (refused, never unpickled)")
        if mode not in (MODE_RAW, MODE_BINARY):  # (`read`: a file's handle, for a bounded read)
            raise IntegrityError("header", f"unexpected diskcache row mode {mode} (expected bytes)")
        return super().fetch(mode, filename, value, read)

    def get(self, key: Any, raw: bool) -> Any:
        # Keys are stored raw (str); a non-raw key would be unpickled by diskcache on iteration.
        if not raw:
            raise IntegrityError("pickled", "a pickled key in the local cache (refused, never unpickled)")
        return super().get(key, raw)


class LocalCache(CacheBackend):
    """diskcache-backed host-private tier with a byte cap and least-recently-used eviction.

    Opening is lazy; if the directory cannot be used (unwritable, on a network FS, owned by someone
    else, corrupt database) the tier warns once and then behaves as an always-missing cache whose
    `put` returns False. A full disk or a write error: one warning per kind, `put` returns False.
    """

    tier = "local"

    def __init__(self, directory: str, max_size: int, *, sqlite_timeout_s: float = 10.0) -> None:
        # Every call is bounded by `sqlite_timeout_s` (SQLite's busy timeout; diskcache's retry=False):
        # a process stuck holding the database lock makes the others miss, not hang.
        self.directory = os.path.abspath(os.path.expanduser(directory))
        self.url = self.directory
        self.max_size = max_size
        self.faults = FaultCounter(self.tier, self.directory)
        self._timeout = sqlite_timeout_s
        self._cache: diskcache.Cache | None = None
        self._unusable = ""  # the fault kind that made the directory unusable
        self._open_lock = threading.Lock()

    @property
    def entries_dir(self) -> str:
        return os.path.join(self.directory, LAYOUT_VERSION)

    @property
    def locks_dir(self) -> str:
        return os.path.join(self.directory, "locks")

    def _db(self, op: str) -> diskcache.Cache | None:
        cache = self._cache
        if cache is not None:
            return cache
        if self._unusable:
            # Counted under the kind of the original failure (warned about once, at open).
            self.faults.record(self._unusable, op, "local tier disabled")
            return None
        with self._open_lock:
            if self._cache is not None or self._unusable:
                return self._cache
            try:
                make_private_dir(self.directory)
                if is_network_fs(self.directory):
                    raise OSError(f"{self.directory} is on a network filesystem "
                                  f"({filesystem_type(self.directory)}); SQLite must not be used there. "
                                  "Point TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR at a local disk")
                make_private_dir(self.entries_dir)
                self._cache = diskcache.Cache(
                    self.entries_dir,
                    timeout=self._timeout,
                    disk=_BytesOnlyDisk,
                    size_limit=self.max_size,
                    eviction_policy="least-recently-used",
                    # diskcache evicts in batches of cull_limit (default 10) once over the cap, which
                    # on a small cap throws out hot entries too; evict one at a time instead.
                    cull_limit=1,
                    statistics=False,
                )
            except (OSError, sqlite3.Error, diskcache.Timeout) as e:
                self._unusable = _kind(e)
                self.faults.record(self._unusable, "open", e)
            return self._cache

    def get(self, key: str, limit: int | None = None) -> bytes | None:
        """The stored bytes or None. Raises `IntegrityError("pickled")` for a pickled row (see module).
        With `limit`, a value stored in a file is measured (`fstat`) before it is read, and read no further
        than `limit` + 1 bytes."""
        check_key(key)
        db = self._db("get")
        if db is None:
            return None
        try:
            value = db.get(key, default=None, retry=False, read=limit is not None)
            if limit is not None and value is not None and not isinstance(value, bytes):
                with value:  # a value file's handle
                    if os.fstat(value.fileno()).st_size > limit:
                        return None
                    value = value.read(limit + 1)
            if limit is not None and isinstance(value, bytes) and len(value) > limit:
                return None
        except IntegrityError:
            raise
        except (OSError, sqlite3.Error, diskcache.Timeout) as e:
            self.faults.record(_kind(e), "get", e)
            return None
        return value if isinstance(value, bytes) else None

    def peek(self, key: str) -> bytes | None:
        """Like `get`, but leaves the entry's last-use time alone: a scan (`neuron-cache ls`, `verify`,
        `export`) must not make every entry look recently used to LRU eviction and `prune --older-than`.
        Same refusal of pickled rows as `get` (the row's mode is checked before anything is read)."""
        check_key(key)
        db = self._db("peek")
        if db is None:
            return None
        try:
            row = db._sql(  # noqa: SLF001 - one read-only query; diskcache's get would update access_time
                "SELECT mode, filename, value FROM Cache WHERE key = ? AND raw = 1", (key,)
            ).fetchone()
            if row is None:
                return None
            value = db.disk.fetch(row[0], row[1], row[2], False)
        except IntegrityError:
            raise
        except FileNotFoundError:
            return None  # deleted between the row and the file: a miss, as in `get`
        except (OSError, sqlite3.Error, diskcache.Timeout) as e:
            self.faults.record(_kind(e), "peek", e)
            return None
        return value if isinstance(value, bytes) else None

    def _put(self, key: str, data: bytes) -> bool:
        # `put` hands over exact `bytes`: diskcache would pickle anything else (bytearray, memoryview, ...).
        db = self._db("put")
        if db is None:
            return False
        try:
            # `add` is a no-op when the key exists: first writer wins, atomically (one SQLite transaction).
            if db.add(key, data, retry=False):
                self._enforce_cap(db)
            return True
        except (OSError, sqlite3.Error, diskcache.Timeout) as e:
            self.faults.record(_kind(e), "put", e)
            return False

    def _enforce_cap(self, db: diskcache.Cache) -> None:
        """Evict least-recently-used entries until the volume is under the cap (bounded: 1,000 rows)."""
        for _ in range(1000):
            if db.volume() <= self.max_size:
                return
            row = db._sql("SELECT key FROM Cache WHERE raw = 1 ORDER BY access_time LIMIT 1").fetchone()  # noqa: SLF001
            if row is None:
                return
            db.delete(row[0], retry=False)

    def contains_many(self, keys: Iterable[str]) -> set[str]:
        wanted = [check_key(k) for k in keys]
        db = self._db("contains_many")
        if db is None or not wanted:
            return set()
        found: set[str] = set()
        try:
            for i in range(0, len(wanted), 500):  # SQLite's bound-parameter limit
                chunk = wanted[i : i + 500]
                rows = db._sql(  # noqa: SLF001 - one query instead of N; read-only
                    "SELECT key FROM Cache WHERE raw = 1 AND mode != ? AND key IN (%s)" % ",".join("?" * len(chunk)),
                    (MODE_PICKLE, *chunk),
                ).fetchall()
                found.update(r[0] for r in rows)
        except (OSError, sqlite3.Error) as e:
            self.faults.record(_kind(e), "contains_many", e)
        return found

    def delete(self, key: str) -> bool:
        check_key(key)
        db = self._db("delete")
        if db is None:
            return False
        try:
            return bool(db.delete(key, retry=False))
        except (OSError, sqlite3.Error, diskcache.Timeout) as e:
            self.faults.record(_kind(e), "delete", e)
            return False

    def entries(self) -> Iterator[EntryInfo]:
        db = self._db("entries")
        if db is None:
            return
        try:
            rows = db._sql(  # noqa: SLF001 - reads columns only; never goes through Disk.get/fetch
                "SELECT key, CASE WHEN filename IS NULL THEN length(value) ELSE size END, access_time"
                " FROM Cache WHERE raw = 1"
            ).fetchall()
        except (OSError, sqlite3.Error) as e:
            self.faults.record(_kind(e), "entries", e)
            return
        for key, size, atime in rows:
            if isinstance(key, str):
                yield EntryInfo(key=key, size=int(size or 0), mtime=float(atime or 0.0))

    def volume(self) -> int:
        """Bytes used on disk (database + value files), as diskcache measures it for eviction."""
        db = self._db("volume")
        try:
            return int(db.volume()) if db is not None else 0
        except (OSError, sqlite3.Error) as e:
            self.faults.record(_kind(e), "volume", e)
            return 0

    def close(self) -> None:
        with self._open_lock:
            if self._cache is not None:
                self._cache.close()
                self._cache = None


def _kind(e: BaseException) -> str:
    """A short fault kind for counting and warn-once."""
    import errno

    if isinstance(e, diskcache.Timeout):
        return "timeout"
    if isinstance(e, PermissionError):
        return "permission"
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return "full"
    if isinstance(e, sqlite3.Error):
        text = str(e).lower()
        if "full" in text:
            return "full"
        if "readonly" in text or "read-only" in text or "unable to open" in text:
            return "permission"
        if "locked" in text or "busy" in text:
            return "timeout"
        return "database"
    return "io"

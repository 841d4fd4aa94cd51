"""The fleet store on a shared filesystem path (`/path`, `file:///path`): one file per key.

Layout and leases as every fleet store's (`_fleet`). Writes are create-only and first-writer-wins: temp
file + fsync + `os.link` (which fails if the name exists; `os.replace` where links are not supported).
Leases are created the same exclusive way; a stale one is taken over by an atomic rename of the stale
file, then an exclusive create.

Every filesystem call runs under the store's whole-call deadline (`FleetStore._guard`), so a hung mount
costs a step at most `TORCH_NEURONX_FLEET_TIMEOUT`. Reads go through `read_file`: a regular file only
(a FIFO, a device, a symlink to `/dev/zero` are refused unread), its size checked before the first read,
never more than `max_entry` + 1 bytes read (leases: `MAX_LEASE`).
"""

from __future__ import annotations

import errno
import logging
import os
import time
import uuid
from collections.abc import Iterable, Iterator

from neuron_runtime.cache._base import EntryInfo, Lease, NullLease, OnceLease, check_key
from neuron_runtime.cache._fleet import (
    DEFAULT_MAX_ENTRY,
    LAYOUT_VERSION,
    MAX_LEASE,
    SUFFIX,
    FleetStore,
    is_stale,
    lease_body,
    ReadRefused,
    parse_lease,
    read_file,
)

log = logging.getLogger(__name__)


class SharedPathStore(FleetStore):
    """One file per key on a POSIX filesystem shared by many hosts (FSx, EFS/NFS, Lustre), no SQLite.

    Plain `os` calls rather than fsspec's local filesystem: the guarantees here need `fsync`,
    `O_EXCL` and `link`, which fsspec does not expose. A crashed writer leaves only a `.tmp-*` file,
    never a partial entry under a real name.
    """

    max_entry: int

    def __init__(self, root: str, timeout_s: float = 10.0, max_entry: int = DEFAULT_MAX_ENTRY) -> None:
        root = os.path.abspath(os.path.expanduser(root))
        super().__init__(root, timeout_s)
        self.root = root
        self.max_entry = max_entry

    def _path(self, key: str) -> str:
        return os.path.join(self.root, self.relpath(check_key(key)))

    def _lease_path(self, key: str) -> str:
        return os.path.join(self.root, self.lease_relpath(check_key(key)))

    def get(self, key: str, limit: int | None = None) -> bytes | None:
        path = self._path(key)
        cap = self.cap(self.max_entry, limit)
        assert cap is not None  # (the path store always has a max_entry)

        def read() -> bytes | None:
            try:
                return read_file(path, cap)
            except FileNotFoundError:
                return None

        return self._guard("get", None, read)

    def _put(self, key: str, data: bytes) -> bool:
        path = self._path(key)
        return self._guard("put", False, lambda: self._publish(path, data))

    def _publish(self, path: str, data: bytes) -> bool:
        if os.path.exists(path):
            return True
        directory = os.path.dirname(path)
        os.makedirs(directory, exist_ok=True)
        tmp = os.path.join(directory, f".tmp-{os.path.basename(path)}-{uuid.uuid4().hex}")
        # 1. Write the whole entry to a private temp name and fsync it, so the final name never points
        #    at a partial file, even after a crash or power loss.
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            # 2. Publish it: link() fails if the name exists, so the first writer wins and later ones
            #    leave the winner's bytes untouched.
            try:
                os.link(tmp, path)
            except FileExistsError:
                pass
            except OSError as e:
                if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK):
                    raise
                # No hard links here (some FUSE/SMB mounts): replace() is still atomic, only not
                # first-writer-wins; racing writers then store equivalent entries for the same key.
                if not os.path.exists(path):
                    os.replace(tmp, path)
        finally:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
        # 3. Persist the directory entry too (best effort: not every filesystem allows it).
        try:
            dfd = os.open(directory, os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
        except OSError:
            pass
        return True

    def contains_many(self, keys: Iterable[str]) -> set[str]:
        paths = {k: self._path(k) for k in keys}
        return self._guard("contains_many", set(), lambda: {k for k, p in paths.items() if os.path.exists(p)})

    def delete(self, key: str) -> bool:
        path = self._path(key)

        def remove() -> bool:
            try:
                os.unlink(path)
                return True
            except FileNotFoundError:
                return False

        return self._guard("delete", False, remove)

    def quarantine(self, key: str, bad: bytes) -> bool:
        """Move the entry to `v1/quarantine/` (kept for forensics, never read) if it still holds `bad`.

        Several hosts may refuse the same entry at once; one of them may already have republished a
        good one under the name. So: rename away (atomic), compare, and put it back if it was not the
        bad entry. True if the bad entry was removed."""
        path = self._path(key)
        qdir = os.path.join(self.root, LAYOUT_VERSION, "quarantine")

        def move() -> bool:
            os.makedirs(qdir, exist_ok=True)
            qpath = os.path.join(qdir, f"{key}.{int(time.time())}.{uuid.uuid4().hex[:8]}")
            try:
                os.rename(path, qpath)
            except FileNotFoundError:
                return False
            try:
                moved: bytes | None = read_file(qpath, len(bad))
            except ReadRefused:
                moved = None  # not the bytes we refused (those were within the cap): put it back
            if moved == bad:
                return True
            try:
                os.link(qpath, path)  # not ours to remove: restore it (unless yet another one appeared)
            except FileExistsError:
                pass
            os.unlink(qpath)
            return False

        return self._guard("quarantine", False, move)

    def sweep(self, max_age_s: float = 3600.0) -> int:
        """Remove debris older than `max_age_s`: temp files of crashed writers, leftover lease temp
        files, and quarantined entries (for `neuron-cache prune`). Returns how many files went."""
        base = os.path.join(self.root, LAYOUT_VERSION)
        cutoff = time.time() - max_age_s
        removed = [0]

        def walk() -> None:
            for dirpath, _, filenames in os.walk(base):
                in_quarantine = os.path.basename(dirpath) == "quarantine"
                for name in filenames:
                    if not (in_quarantine or name.startswith(".tmp-") or ".tmp-" in name or ".stale-" in name):
                        continue
                    path = os.path.join(dirpath, name)
                    try:
                        if os.stat(path).st_mtime < cutoff:
                            os.unlink(path)
                            removed[0] += 1
                    except FileNotFoundError:
                        pass

        self._guard("sweep", None, walk, bounded=False)
        return removed[0]

    def entries(self) -> Iterator[EntryInfo]:
        base = os.path.join(self.root, LAYOUT_VERSION)
        found: list[EntryInfo] = []

        def walk() -> None:
            for dirpath, dirnames, filenames in os.walk(base):
                dirnames[:] = [d for d in dirnames if d not in ("leases", "quarantine")]
                for name in filenames:
                    if name.endswith(SUFFIX) and not name.startswith("."):
                        try:
                            st = os.stat(os.path.join(dirpath, name))
                        except FileNotFoundError:
                            continue
                        found.append(EntryInfo(key=name[: -len(SUFFIX)], size=st.st_size, mtime=st.st_mtime))

        self._guard("entries", None, walk, bounded=False)
        return iter(found)

    # -- leases

    def try_lease(self, key: str, ttl_s: float) -> Lease | None:
        path = self._lease_path(key)
        # A store we cannot write leases to must not make everyone wait: hand out a no-op lease.
        no_lease: Lease | None = NullLease()
        result: Lease | None = self._guard("lease", no_lease, lambda: self._try_lease(path, ttl_s))
        return result

    def _create_lease(self, path: str, ttl_s: float) -> Lease | None:
        """Exclusive create with the body already in place (temp file + link, the NFS-safe lock-file
        idiom; O_EXCL where links are unsupported), so nobody ever reads a half-written lease."""
        body, nonce = lease_body(ttl_s)
        tmp = f"{path}.tmp-{nonce}"
        with open(tmp, "wb") as f:
            f.write(body)
        try:
            os.link(tmp, path)
        except FileExistsError:
            return None
        except OSError as e:
            if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK):
                raise
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                return None
            with os.fdopen(fd, "wb") as f:
                f.write(body)
        finally:
            os.unlink(tmp)
        return _FileLease(self, path, nonce)

    def _try_lease(self, path: str, ttl_s: float) -> Lease | None:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        lease = self._create_lease(path, ttl_s)
        if lease is not None:
            return lease
        try:
            seen = read_file(path, MAX_LEASE)
        except FileNotFoundError:
            return self._create_lease(path, ttl_s)  # released meanwhile
        body = parse_lease(seen)
        if not is_stale(body):
            return None
        if body is None and time.time() - _mtime(path) < 5.0:
            return None  # an O_EXCL-created lease whose holder is still writing its body
        # Stale: move it aside under a name only we use. rename() is atomic, so of several hosts taking
        # over only one moves *this* file; the others get ENOENT and go back to exclusive create.
        tomb = f"{path}.stale-{uuid.uuid4().hex}"
        try:
            os.rename(path, tomb)
        except FileNotFoundError:
            return self._create_lease(path, ttl_s)
        try:
            try:
                moved = read_file(tomb, MAX_LEASE)
            except ReadRefused:
                moved = b""
            if moved != seen:
                # Someone took over between our read and our rename: we moved *their* fresh lease.
                # Put it back (link fails if yet another one appeared) and stand down.
                try:
                    os.link(tomb, path)
                except FileExistsError:
                    pass
                return None
        finally:
            os.unlink(tomb)
        log.debug("took over stale lease %s (held by %s)", path, body.get("holder") if body else "?")
        return self._create_lease(path, ttl_s)

    def _lease_live(self, key: str) -> bool:
        path = self._lease_path(key)

        def live() -> bool:
            try:
                raw = read_file(path, MAX_LEASE)
            except FileNotFoundError:
                return False
            body = parse_lease(raw)
            return not is_stale(body) or (body is None and time.time() - _mtime(path) < 5.0)

        return self._guard("lease", False, live)


def _mtime(path: str) -> float:
    try:
        return os.stat(path).st_mtime
    except FileNotFoundError:
        return 0.0


class _FileLease(OnceLease):
    def __init__(self, store: SharedPathStore, path: str, nonce: str) -> None:
        self._store, self._path, self._nonce = store, path, nonce

    def _drop(self) -> None:
        def drop() -> None:
            try:
                body = parse_lease(read_file(self._path, MAX_LEASE))
            except FileNotFoundError:
                return
            # Only remove our own lease: after our TTL another host may legitimately hold it.
            if body is not None and body.get("nonce") == self._nonce:
                os.unlink(self._path)

        self._store._guard("lease release", None, drop)

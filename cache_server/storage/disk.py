"""Entries as files under a local directory, with a byte cap and LRU eviction.

Layout (the format version is part of the path, like bazel-remote's `ac.v2`):
    <root>/v1/<key[:2]>/<key>       complete entries, never modified after their rename
    <root>/tmp/<key>.<random>.part  uploads in progress; removed at start (a crash leaves them behind)

Writes go temp file → fsync → link into place → fsync dir. `os.link` fails when the target exists, which
gives first-writer-wins without a lock, and a crash at any point leaves either no entry or a whole one.
The LRU order lives in memory and each hit also bumps the file's mtime, so at start the order is rebuilt
from mtimes (least recently used first).
"""

from __future__ import annotations

import asyncio
import collections
import errno
import logging
import os
import secrets
from collections.abc import AsyncIterator
from pathlib import Path

from .._errors import ConfigError, TooLarge
from ._base import EntryInfo, Storage, Writer

log = logging.getLogger(__name__)

_VERSION_DIR = "v1"
# Reads at or below this size happen inline on the event loop: a page-cache read of 4 MiB takes well under
# a millisecond, while a thread hop costs about as much as the read for small entries (DESIGN §3).
_INLINE_READ_MAX = 4 << 20


class DiskStorage(Storage):
    def __init__(self, root: str, max_bytes: int) -> None:
        if max_bytes <= 0:
            raise ConfigError("--max-size must be positive for disk storage")
        self.root = Path(root).expanduser().resolve()
        self.location = str(self.root)
        self.max_bytes = max_bytes
        self._data = self.root / _VERSION_DIR
        self._tmp = self.root / "tmp"
        self._data_s = str(self._data)
        # key -> size, least recently used first
        self._index: collections.OrderedDict[str, int] = collections.OrderedDict()
        self._bytes = 0

    def _path(self, key: str) -> Path:
        return self._data / key[:2] / key

    def _spath(self, key: str) -> str:
        # The hit path builds plain strings: pathlib objects cost more than the file read for small entries.
        return f"{self._data_s}/{key[:2]}/{key}"

    async def start(self) -> None:
        await asyncio.to_thread(self._start_sync)

    def _start_sync(self) -> None:
        # 1. Private directories: whoever can write here can run code on every reader.
        for d in (self.root, self._data, self._tmp):
            d.mkdir(mode=0o700, parents=True, exist_ok=True)
        # 2. Uploads that were in progress when the last server died are garbage.
        removed = 0
        for p in self._tmp.iterdir():
            try:
                p.unlink()
                removed += 1
            except OSError as e:
                log.warning("cannot remove stale upload %s: %s", p, e)
        # 3. Rebuild the index, oldest first, ignoring anything that is not a well-formed entry.
        found: list[tuple[float, str, int]] = []
        for sub in self._data.iterdir():
            if not sub.is_dir():
                continue
            for p in sub.iterdir():
                name = p.name
                if len(name) != 64 or name[:2] != sub.name or not all(c in "0123456789abcdef" for c in name):
                    continue
                st = p.stat()
                found.append((st.st_mtime, name, st.st_size))
        found.sort()
        for _, key, size in found:
            self._index[key] = size
            self._bytes += size
        log.info("disk storage ready", extra={"fields": {
            "root": self.location, "entries": len(self._index), "bytes": self._bytes,
            "max_bytes": self.max_bytes, "stale_uploads_removed": removed}})
        # 4. An index over the cap (the cap was lowered) is trimmed now rather than on the next write.
        self._evict(0)

    def usage(self) -> tuple[int, int]:
        return len(self._index), self._bytes

    async def contains_many(self, keys: list[str]) -> list[bool]:
        index = self._index
        return [k in index for k in keys]

    async def size(self, key: str) -> int | None:
        return self._index.get(key)

    def _touch(self, key: str) -> None:
        if key in self._index:
            self._index.move_to_end(key)
            # Record the access on disk too, so the LRU order survives a restart (the index is rebuilt
            # from mtimes). One utime per hit is a few microseconds against a whole gRPC call.
            try:
                os.utime(self._spath(key))
            except OSError:
                pass

    async def read(self, key: str) -> bytes | None:
        size = self._index.get(key)
        if size is None:
            return None
        try:
            if size <= _INLINE_READ_MAX:
                with open(self._spath(key), "rb") as f:
                    data = f.read()
            else:
                data = await asyncio.to_thread(self._path(key).read_bytes)
        except FileNotFoundError:
            # Deleted behind our back (an operator, or eviction racing this read): a miss.
            self._forget(key)
            return None
        self._touch(key)
        return data

    async def read_chunks(self, key: str, chunk: int) -> AsyncIterator[bytes]:
        if key not in self._index:
            return
        try:
            # An unlinked file stays readable through its open handle, so eviction cannot tear this read.
            f = open(self._path(key), "rb")
        except FileNotFoundError:
            self._forget(key)
            return
        self._touch(key)
        with f:
            while True:
                piece = await asyncio.to_thread(f.read, chunk)
                if not piece:
                    return
                yield piece

    async def open_writer(self, key: str, size: int) -> Writer:
        if size > self.max_bytes:
            raise TooLarge(f"entry {key} is {size} bytes, larger than the cache ({self.max_bytes} bytes)")
        tmp = self._tmp / f"{key}.{secrets.token_hex(8)}.part"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        return _DiskWriter(self, key, size, tmp, fd)

    def _commit_sync(self, tmp: Path, fd: int, key: str) -> bool:
        os.fsync(fd)
        os.close(fd)
        final = self._path(key)
        final.parent.mkdir(mode=0o700, exist_ok=True)
        try:
            os.link(tmp, final)
            created = True
        except FileExistsError:
            created = False
        finally:
            tmp.unlink(missing_ok=True)
        if created:
            dfd = os.open(final.parent, os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
        return created

    def _added(self, key: str, size: int) -> None:
        if key in self._index:
            return
        # Make room first so the cap holds at every moment a reader could observe.
        self._evict(size)
        self._index[key] = size
        self._bytes += size

    def _evict(self, incoming: int) -> None:
        while self._index and self._bytes + incoming > self.max_bytes:
            key, size = self._index.popitem(last=False)
            self._bytes -= size
            self.evictions += 1
            try:
                self._path(key).unlink()
            except FileNotFoundError:
                pass
            except OSError as e:
                log.warning("cannot evict %s: %s", key, e)
            log.debug("evicted %s (%d bytes)", key, size)

    def _forget(self, key: str) -> None:
        size = self._index.pop(key, None)
        if size is not None:
            self._bytes -= size

    async def delete(self, key: str) -> bool:
        existed = key in self._index
        self._forget(key)
        try:
            self._path(key).unlink()
        except FileNotFoundError:
            return existed
        return True

    async def entries(self) -> AsyncIterator[EntryInfo]:
        for key, size in list(self._index.items()):
            try:
                mtime = self._path(key).stat().st_mtime
            except FileNotFoundError:
                continue
            yield EntryInfo(key, size, mtime)


class _DiskWriter(Writer):
    def __init__(self, store: DiskStorage, key: str, size: int, tmp: Path, fd: int) -> None:
        self._store, self._key, self._size, self._tmp, self._fd = store, key, size, tmp, fd
        self._closed = False

    async def write(self, chunk: bytes) -> None:
        view = memoryview(chunk)
        while view:
            n = os.write(self._fd, view)
            view = view[n:]

    async def commit(self) -> bool:
        self._closed = True
        created = await asyncio.to_thread(self._store._commit_sync, self._tmp, self._fd, self._key)
        if created or self._key not in self._store._index:
            self._store._added(self._key, self._size)
        else:
            self._store._touch(self._key)
        return created

    async def abort(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            os.close(self._fd)
        except OSError as e:
            if e.errno != errno.EBADF:
                raise
        self._tmp.unlink(missing_ok=True)


__all__ = ["DiskStorage"]

"""Entries as objects under an S3 prefix (s3fs), so several server replicas can share one bucket.

Layout: `s3://bucket/prefix/v1/<key>`. Writes are one PutObject with `If-None-Match: *` (create-only), so
the first writer wins across replicas without a coordinator and a reader never sees a torn object.

The byte cap bounds a single entry here; evicting by LRU would need every replica to agree on an access
order, so expiry is left to a bucket lifecycle rule (docs/server.md says how). Entries are write-once, so a
replica remembers keys it has seen present and only asks S3 about the others.
"""

from __future__ import annotations

import asyncio
import errno
import io
import logging
from collections.abc import AsyncIterator
from typing import Any

from .._errors import ConfigError, TooLarge
from ._base import EntryInfo, Storage, Writer

log = logging.getLogger(__name__)

_VERSION_DIR = "v1"
# Bound on concurrent HEAD requests for one batch lookup (S3 throttles far above this; moto is slower).
_HEAD_CONCURRENCY = 32
_KNOWN_MAX = 1_000_000


class S3Storage(Storage):
    def __init__(self, url: str, max_bytes: int) -> None:
        rest = url[len("s3://"):].strip("/")
        if not rest:
            raise ConfigError(f"--storage {url!r}: name a bucket, e.g. s3://my-bucket/neff")
        self.location = f"s3://{rest}"
        self._base = f"{rest}/{_VERSION_DIR}"
        self.max_bytes = max_bytes
        self._fs: Any = None
        # keys seen present (write-once entries: a positive answer stays true until a delete)
        self._known: dict[str, int] = {}

    def _path(self, key: str) -> str:
        return f"{self._base}/{key}"

    async def start(self) -> None:
        try:
            import s3fs
        except ImportError as e:  # pragma: no cover - s3fs is a declared dependency
            raise ConfigError("S3 storage needs s3fs: pip install s3fs") from e
        self._fs = s3fs.S3FileSystem(asynchronous=True, skip_instance_cache=True)
        await self._fs.set_session()
        # Fail at start, not on the first request, when the bucket is missing or unreachable.
        bucket = self._base.split("/", 1)[0]
        try:
            await self._fs._ls(bucket)
        except Exception as e:
            raise ConfigError(f"cannot reach {self.location}: {e}") from e
        log.info("s3 storage ready", extra={"fields": {"location": self.location, "max_entry_bytes": self.max_bytes}})

    async def close(self) -> None:
        fs, self._fs = self._fs, None
        if fs is not None and getattr(fs, "_s3", None) is not None:
            try:
                await fs._s3.close()
            except Exception as e:  # closing must never fail shutdown
                log.debug("closing s3 session: %s", e)

    def usage(self) -> tuple[int, int]:
        # What this replica has seen, not the bucket's total (that needs a full listing: see `entries`).
        return len(self._known), sum(self._known.values())

    def _remember(self, key: str, size: int) -> None:
        if len(self._known) >= _KNOWN_MAX:
            self._known.clear()
        self._known[key] = size

    async def size(self, key: str) -> int | None:
        if key in self._known:
            return self._known[key]
        try:
            info = await self._fs._info(self._path(key), refresh=True)
        except FileNotFoundError:
            return None
        size = int(info["size"])
        self._remember(key, size)
        return size

    async def contains_many(self, keys: list[str]) -> list[bool]:
        sem = asyncio.Semaphore(_HEAD_CONCURRENCY)

        async def one(key: str) -> bool:
            if key in self._known:
                return True
            async with sem:
                return await self.size(key) is not None

        return list(await asyncio.gather(*(one(k) for k in keys)))

    async def read(self, key: str) -> bytes | None:
        try:
            data: bytes = await self._fs._cat_file(self._path(key))
        except FileNotFoundError:
            self._known.pop(key, None)
            return None
        self._remember(key, len(data))
        return data

    async def read_chunks(self, key: str, chunk: int) -> AsyncIterator[bytes]:
        size = await self.size(key)
        if size is None:
            return
        for start in range(0, size, chunk):
            try:
                piece: bytes = await self._fs._cat_file(self._path(key), start=start, end=min(start + chunk, size))
            except FileNotFoundError:
                # Deleted mid-read: the caller sees a short stream and rejects it by size.
                self._known.pop(key, None)
                return
            yield piece

    async def open_writer(self, key: str, size: int) -> Writer:
        if size > self.max_bytes:
            raise TooLarge(f"entry {key} is {size} bytes, larger than --max-size ({self.max_bytes} bytes)")
        return _S3Writer(self, key, size)

    async def _create(self, key: str, data: bytes) -> bool:
        try:
            await self._fs._pipe_file(self._path(key), data, mode="create")
        except FileExistsError:
            created = False
        except OSError as e:
            # Older s3fs/botocore pairs map 412 PreconditionFailed to EINVAL rather than FileExistsError.
            if e.errno != errno.EINVAL or "recondition" not in str(e):
                raise
            created = False
        else:
            created = True
        self._remember(key, len(data))
        return created

    async def delete(self, key: str) -> bool:
        self._known.pop(key, None)
        try:
            await self._fs._rm_file(self._path(key))
        except FileNotFoundError:
            return False
        return True

    async def entries(self) -> AsyncIterator[EntryInfo]:
        try:
            found = await self._fs._find(self._base, detail=True)
        except FileNotFoundError:
            return
        for path, info in found.items():
            key = path.rsplit("/", 1)[-1]
            if len(key) != 64:
                continue
            mtime = info.get("LastModified")
            ts = mtime.timestamp() if hasattr(mtime, "timestamp") else 0.0
            yield EntryInfo(key, int(info.get("size", 0)), ts)


class _S3Writer(Writer):
    """Buffers the upload in memory (entries are bounded by --max-size) and creates the object at commit,
    so an aborted or crashed upload never leaves an object behind."""

    def __init__(self, store: S3Storage, key: str, size: int) -> None:
        self._store, self._key = store, key
        self._buf = io.BytesIO()

    async def write(self, chunk: bytes) -> None:
        self._buf.write(chunk)

    async def commit(self) -> bool:
        data, self._buf = self._buf.getvalue(), io.BytesIO()
        return await self._store._create(self._key, data)

    async def abort(self) -> None:
        self._buf = io.BytesIO()


__all__ = ["S3Storage"]

"""Entries as objects under an S3 prefix (s3fs), so several server replicas can share one bucket.

Layout: `s3://bucket/prefix/v1/<key>`. Writes are one PutObject with `If-None-Match: *` (create-only), so
the first writer wins across replicas without a coordinator and a reader never sees a torn object.

Compile leases live in the bucket too (`prefix/leases/v1/<key>/<generation>`, each created with
`If-None-Match: *`), so replicas behind a load balancer grant one lease per key between them: the next
generation can be created by exactly one taker once the latest has been released (deleted) or has expired.

The byte cap bounds a single entry here; evicting by LRU would need every replica to agree on an access
order, so expiry is left to a bucket lifecycle rule (docs/server.md says how). Entries are write-once, so a
replica remembers keys it has seen present and only asks S3 about the others.
"""

from __future__ import annotations

import asyncio
import errno
import io
import json
import logging
import secrets
import time
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
        self._leases = f"{rest}/leases/{_VERSION_DIR}"
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

    async def _create_entry(self, key: str, data: bytes) -> bool:
        created = await self._create(self._path(key), data)
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


    # -- fleet-wide leases ---------------------------------------------------------------------------------

    #: the server asks the storage for leases instead of keeping them in memory
    shared_leases = True

    async def _lease_objects(self, key: str) -> list[str]:
        try:
            names = await self._fs._ls(f"{self._leases}/{key}", refresh=True)
        except FileNotFoundError:
            return []
        # zero-padded generations: string order is numeric order
        return sorted(str(n) for n in names if str(n).rsplit("/", 1)[-1].isdigit())

    async def _lease_body(self, path: str) -> dict[str, Any] | None:
        try:
            body = json.loads(await self._fs._cat_file(path))
        except FileNotFoundError:
            return None
        except ValueError:
            return {"expires": 0}  # unreadable: treat as expired so it cannot block the key forever
        return body if isinstance(body, dict) else {"expires": 0}

    async def _create(self, path: str, data: bytes) -> bool:
        try:
            await self._fs._pipe_file(path, data, mode="create")
        except FileExistsError:
            return False
        except OSError as e:
            # Older s3fs/botocore pairs map 412 PreconditionFailed to EINVAL rather than FileExistsError.
            if e.errno != errno.EINVAL or "recondition" not in str(e):
                raise
            return False
        return True

    async def lease_acquire(self, key: str, ttl_s: float, holder: str) -> str | None:
        """1. Find the latest generation; 2. refuse if it is live; 3. create the next one create-only (one
        taker wins a race); 4. remove the older generations (best effort)."""
        objs = await self._lease_objects(key)
        gen = 0
        if objs:
            gen = int(objs[-1].rsplit("/", 1)[-1]) + 1
            body = await self._lease_body(objs[-1])
            if body is not None and float(body.get("expires", 0)) > time.time():
                return None
        lease_id = secrets.token_hex(12)
        data = json.dumps({"id": lease_id, "expires": time.time() + ttl_s, "holder": holder}).encode()
        if not await self._create(f"{self._leases}/{key}/{gen:012d}", data):
            return None
        for old in objs:
            try:
                await self._fs._rm_file(old)
            except OSError as e:
                log.debug("cannot remove old lease %s: %s", old, e)
        return f"{gen}:{lease_id}"

    async def lease_release(self, key: str, lease_id: str) -> bool:
        gen, _, lid = lease_id.partition(":")
        if not gen.isdigit() or not lid:
            return False
        path = f"{self._leases}/{key}/{int(gen):012d}"
        body = await self._lease_body(path)
        if body is None or body.get("id") != lid:
            return False  # taken over after expiry: never drop the new holder's lease
        try:
            await self._fs._rm_file(path)
        except FileNotFoundError:
            return False
        return True

    async def lease_live(self, key: str) -> bool:
        objs = await self._lease_objects(key)
        if not objs:
            return False
        body = await self._lease_body(objs[-1])
        return body is not None and float(body.get("expires", 0)) > time.time()

    async def stored(self, key: str) -> bool:
        """Whether the entry exists now, asking S3 rather than this replica's memory of it."""
        self._known.pop(key, None)
        return await self.size(key) is not None


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
        return await self._store._create_entry(self._key, data)

    async def abort(self) -> None:
        self._buf = io.BytesIO()


__all__ = ["S3Storage"]

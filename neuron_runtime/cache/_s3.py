"""The fleet store behind `s3://bucket/prefix` (and `s3a://`): one object per key, through s3fs.

Layout and leases as every fleet store's (`_fleet`). Writes are create-only and first-writer-wins:
`PutObject` with `If-None-Match: *` (a 412 means another host won). Leases are created the same way; a
stale one is taken over with `PutObject` and `If-Match: <stale ETag>`, which exactly one host wins.

Each call is bounded as a whole by `TORCH_NEURONX_FLEET_TIMEOUT` (`FleetStore._guard`; the first call also
builds the botocore client, local CPU work allowed up to 30 s). Reads check the object's
`ContentLength` before reading its body and never read more than `max_entry` + 1 bytes (leases: `MAX_LEASE`).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from neuron_runtime.cache._base import EntryInfo, Lease, NullLease, OnceLease, check_key
from neuron_runtime.cache._deadline import remaining
from neuron_runtime.cache._fleet import (
    DEFAULT_MAX_ENTRY,
    LAYOUT_VERSION,
    MAX_LEASE,
    SUFFIX,
    FleetStore,
    ReadRefused,
    is_stale,
    lease_body,
    parse_lease,
    s3_code,
)

log = logging.getLogger(__name__)


class S3Store(FleetStore):
    """`s3://bucket/prefix` through s3fs (async calls on fsspec's loop, each bounded by `timeout_s`).

    Endpoint, region and credentials come from the usual AWS variables (`AWS_ENDPOINT_URL_S3`,
    `AWS_PROFILE`, ...) and `FSSPEC_S3_*` (e.g. `FSSPEC_S3_ENDPOINT_URL`), as s3fs reads them.
    """

    max_entry: int

    def __init__(self, url: str, timeout_s: float = 10.0, max_entry: int = DEFAULT_MAX_ENTRY,
                 **storage_options: Any) -> None:
        import s3fs

        super().__init__(url, timeout_s)
        self.max_entry = max_entry
        rest = url.split("://", 1)[1]
        self.bucket, _, prefix = rest.partition("/")
        if not self.bucket:
            raise ValueError(f"{url!r}: expected s3://bucket[/prefix]")
        self.prefix = prefix.strip("/")
        options: dict[str, Any] = {
            k[len("FSSPEC_S3_"):].lower(): v for k, v in os.environ.items() if k.startswith("FSSPEC_S3_")
        }
        options.update(storage_options)
        config = dict(options.pop("config_kwargs", None) or {})
        # Bounded: one botocore retry, short connects. The overall bound is the per-call timeout
        # passed to fsspec's sync().
        config.setdefault("connect_timeout", min(timeout_s, 5.0))
        config.setdefault("read_timeout", timeout_s)
        config.setdefault("retries", {"max_attempts": 2, "mode": "standard"})
        self.fs = s3fs.S3FileSystem(skip_instance_cache=True, use_listings_cache=False, config_kwargs=config, **options)
        # s3fs's own retry loop (a class attribute, not an __init__ argument) would multiply botocore's
        # attempts; one botocore retry is enough for a cache, the breaker handles a struggling store.
        self.fs.retries = 1
        self._session_ready = False

    def _key(self, rel: str) -> str:
        return f"{self.prefix}/{rel}" if self.prefix else rel

    def deadline_s(self) -> float:
        # The first call builds the botocore client (local CPU, see `_call`): it gets that bound too.
        return self.timeout_s if self._session_ready else max(30.0, self.timeout_s)

    def _call(self, coro_fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        from fsspec.asyn import sync

        if not self._session_ready:
            # Building the botocore client loads service models (~1 s of CPU, more on a busy host):
            # do it once under its own, looser bound, so it does not eat the first request's timeout.
            sync(self.fs.loop, self.fs.set_session, timeout=max(30.0, self.timeout_s))
            self._session_ready = True
        # What is left of the whole call's deadline: the request stops there too, not only our wait.
        return sync(self.fs.loop, coro_fn, *args, timeout=remaining(self.timeout_s), **kwargs)

    async def _read(self, key: str, limit: int = MAX_LEASE) -> tuple[bytes, str] | None:
        """The object's bytes and ETag (None if absent); `ReadRefused` past `limit` bytes, told by the
        ContentLength before the body is read, and by reading at most `limit` + 1 bytes of it."""
        try:
            resp = await self.fs._call_s3("get_object", Bucket=self.bucket, Key=key)
        except FileNotFoundError as e:
            if s3_code(e) == "NoSuchBucket":
                raise  # a misconfiguration, not a miss: count and warn
            return None
        async with resp["Body"] as body:
            length = resp.get("ContentLength")
            if isinstance(length, int) and length > limit:
                raise ReadRefused("too_large", f"s3://{self.bucket}/{key} is {length} bytes, over the "
                                  f"{limit}-byte read cap")
            parts: list[bytes] = []
            got = 0
            while got <= limit:  # read(n) answers what has arrived, up to n: loop to the end or the cap
                chunk = await body.read(min(limit + 1 - got, 1 << 20))
                if not chunk:
                    break
                parts.append(chunk)
                got += len(chunk)
            data = b"".join(parts)
        if len(data) > limit:
            raise ReadRefused("too_large", f"s3://{self.bucket}/{key} sent more than the {limit}-byte read cap")
        return data, str(resp.get("ETag", ""))

    async def _put_object(self, key: str, data: bytes, **cond: str) -> bool:
        """True if written, False if the precondition failed (exists / changed)."""
        try:
            await self.fs._call_s3("put_object", Bucket=self.bucket, Key=key, Body=data, **cond)
            return True
        except FileExistsError:
            return False
        except OSError as e:
            if s3_code(e) in ("PreconditionFailed", "412", "ConditionalRequestConflict", "409"):
                return False
            raise

    def get(self, key: str, limit: int | None = None) -> bytes | None:
        k = self._key(self.relpath(check_key(key)))
        cap = self.cap(self.max_entry, limit)

        def read() -> bytes | None:
            got = self._call(self._read, k, cap)
            return None if got is None else bytes(got[0])

        return self._guard("get", None, read)

    def _put(self, key: str, data: bytes) -> bool:
        k = self._key(self.relpath(key))
        # Create-only: a 412 means the key exists (another host won), which is success for a cache.
        return self._guard("put", False, lambda: self._call(self._put_object, k, data, IfNoneMatch="*") or True)

    def contains_many(self, keys: Iterable[str]) -> set[str]:
        wanted = {k: self._key(self.relpath(check_key(k))) for k in keys}

        async def heads() -> set[str]:
            async def one(k: str, obj: str) -> str | None:
                try:
                    await self.fs._call_s3("head_object", Bucket=self.bucket, Key=obj)
                    return k
                except FileNotFoundError:
                    return None

            found = await asyncio.gather(*(one(k, o) for k, o in wanted.items()))
            return {k for k in found if k is not None}

        result: set[str] = self._guard("contains_many", set(), lambda: self._call(heads))
        return result

    def delete(self, key: str) -> bool:
        k = self._key(self.relpath(check_key(key)))

        async def remove() -> bool:
            # DeleteObject answers 204 whether or not the object existed; HEAD tells us which.
            try:
                await self.fs._call_s3("head_object", Bucket=self.bucket, Key=k)
            except FileNotFoundError:
                return False
            await self.fs._call_s3("delete_object", Bucket=self.bucket, Key=k)
            return True

        result: bool = self._guard("delete", False, lambda: self._call(remove))
        return result

    def quarantine(self, key: str, bad: bytes) -> bool:
        """Delete the entry only if it is still `bad`: read it with its ETag, compare, then delete with
        `If-Match: <that ETag>`, so a good entry another host republished meanwhile survives. (Not
        assuming ETag == MD5, which does not hold for SSE-KMS or multipart objects.)"""
        k = self._key(self.relpath(check_key(key)))

        async def remove() -> bool:
            try:
                current = await self._read(k, len(bad))
            except ReadRefused:
                return False  # bigger than the entry we refused: not it
            if current is None or current[0] != bad:
                return False
            try:
                await self.fs._call_s3("delete_object", Bucket=self.bucket, Key=k, IfMatch=current[1])
                return True
            except FileNotFoundError:
                return False
            except OSError as e:
                if s3_code(e) in ("PreconditionFailed", "412"):
                    return False
                raise

        result: bool = self._guard("quarantine", False, lambda: self._call(remove))
        return result

    def entries(self) -> Iterator[EntryInfo]:
        prefix = self._key(LAYOUT_VERSION + "/")

        async def listing() -> list[EntryInfo]:
            out: list[EntryInfo] = []
            token: dict[str, str] = {}
            while True:
                resp = await self.fs._call_s3("list_objects_v2", Bucket=self.bucket, Prefix=prefix, **token)
                for obj in resp.get("Contents", []):
                    name = obj["Key"].rsplit("/", 1)[-1]
                    if name.endswith(SUFFIX) and "/leases/" not in obj["Key"]:
                        out.append(EntryInfo(key=name[: -len(SUFFIX)], size=int(obj["Size"]),
                                             mtime=obj["LastModified"].timestamp()))
                if not resp.get("IsTruncated"):
                    return out
                token = {"ContinuationToken": resp["NextContinuationToken"]}

        found: list[EntryInfo] = self._guard("entries", [], lambda: self._call(listing), bounded=False)
        return iter(found)

    # -- leases

    def try_lease(self, key: str, ttl_s: float) -> Lease | None:
        k = self._key(self.lease_relpath(check_key(key)))
        no_lease: Lease | None = NullLease()
        result: Lease | None = self._guard("lease", no_lease, lambda: self._call(self._try_lease, k, ttl_s))
        return result

    async def _try_lease(self, k: str, ttl_s: float) -> Lease | None:
        body, nonce = lease_body(ttl_s)
        if await self._put_object(k, body, IfNoneMatch="*"):
            return _S3Lease(self, k, nonce)
        seen = await self._read(k)
        if seen is None:  # released meanwhile
            return _S3Lease(self, k, nonce) if await self._put_object(k, body, IfNoneMatch="*") else None
        raw, etag = seen
        old = parse_lease(raw)
        if not is_stale(old):
            return None
        # Take over a stale lease only if it is still the object we read: If-Match makes exactly one
        # of several hosts succeed.
        if await self._put_object(k, body, IfMatch=etag):
            log.debug("took over stale lease %s (held by %s)", k, old.get("holder") if old else "?")
            return _S3Lease(self, k, nonce)
        return None

    def _lease_live(self, key: str) -> bool:
        k = self._key(self.lease_relpath(check_key(key)))

        def live() -> bool:
            seen = self._call(self._read, k)
            return seen is not None and not is_stale(parse_lease(seen[0]))

        return self._guard("lease", False, live)

    def close(self) -> None:
        pass  # s3fs closes its session with fsspec's I/O loop at exit; nothing to release eagerly


class _S3Lease(OnceLease):
    def __init__(self, store: S3Store, key: str, nonce: str) -> None:
        self._store, self._key, self._nonce = store, key, nonce

    def _drop(self) -> None:
        store = self._store

        async def drop() -> None:
            seen = await store._read(self._key)
            if seen is None:
                return
            body = parse_lease(seen[0])
            if body is None or body.get("nonce") != self._nonce:
                return  # someone took it over after our TTL: not ours to delete
            try:
                # If-Match: never delete a lease another host wrote after our read.
                await store.fs._call_s3("delete_object", Bucket=store.bucket, Key=self._key, IfMatch=seen[1])
            except FileNotFoundError:
                pass
            except OSError as e:
                if s3_code(e) not in ("PreconditionFailed", "412", "NotImplemented", "501"):
                    raise

        store._guard("lease release", None, lambda: store._call(drop))

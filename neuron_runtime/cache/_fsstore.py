"""Fleet stores without a server: a shared filesystem path and an S3 bucket.

Both use one layout under a versioned root (the envelope format version is part of the path, so a new
format never reads an old one)::

    <root>/v1/ab/cd/<key>.neff      one immutable object per entry (ab, cd: the key's first 4 hex digits)
    <root>/v1/leases/<key>.lease    a compile lease: JSON {holder, nonce, expires, ttl}

Writes are create-only and first-writer-wins: on a filesystem, temp file + fsync + `os.link` (which fails
if the name exists; `os.replace` where links are not supported); on S3, `PutObject` with
`If-None-Match: *` (a 412 means another host won). Leases are created the same exclusive way; a lease
whose `expires` has passed is stale and may be taken over (filesystem: atomic rename of the stale file,
then exclusive create; S3: `PutObject` with `If-Match: <stale ETag>`), so a crashed holder blocks the
fleet for at most its TTL. Lease expiry uses wall clocks: hosts need roughly synchronised clocks (NTP);
skew adds to or subtracts from the TTL.

Every failure (timeouts, 5xx, throttling, permission, connection refused) is a miss or a skipped write,
counted in `self.faults` and warned about once per kind; calls are bounded by `timeout_s`.
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

from neuron_runtime.cache._base import CacheBackend, EntryInfo, Lease, NullLease, OnceLease, check_key
from neuron_runtime.cache._faults import FaultCounter

log = logging.getLogger(__name__)

LAYOUT_VERSION = "v1"
SUFFIX = ".neff"
_T = TypeVar("_T")


def _holder() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def _lease_body(ttl_s: float) -> tuple[bytes, str]:
    nonce = uuid.uuid4().hex
    body = {"holder": _holder(), "nonce": nonce, "expires": time.time() + ttl_s, "ttl": ttl_s}
    return json.dumps(body, sort_keys=True).encode(), nonce


def _parse_lease(raw: bytes) -> dict[str, Any] | None:
    """The lease's JSON, or None when it is unreadable (a torn lease counts as stale)."""
    try:
        body = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(body, dict) or not isinstance(body.get("expires"), (int, float)):
        return None
    return body


def _stale(body: dict[str, Any] | None) -> bool:
    return body is None or float(body["expires"]) <= time.time()


class FleetStore(CacheBackend):
    """What the shared-path and S3 stores share: layout, key checks, fault accounting, `wait_for`."""

    tier = "fleet"

    def __init__(self, url: str, timeout_s: float) -> None:
        self.url = url
        self.timeout_s = timeout_s
        self.faults = FaultCounter(self.tier, url)
        # Circuit breaker: after a connection failure, timeout, throttling or 5xx, skip the store for a
        # while instead of paying timeouts and retries on every op of the user's step (a down store
        # then costs one timeout per cooldown, not one per call; a throttling one gets some rest).
        self.cooldown_s = max(1.0, min(30.0, 3 * timeout_s))
        self._open_until = 0.0

    @staticmethod
    def relpath(key: str) -> str:
        return f"{LAYOUT_VERSION}/{key[:2]}/{key[2:4]}/{key}{SUFFIX}"

    @staticmethod
    def lease_relpath(key: str) -> str:
        return f"{LAYOUT_VERSION}/leases/{key}.lease"

    def _guard(self, op: str, default: _T, fn: Callable[[], _T]) -> _T:
        # The contract: backend trouble is a miss / skipped write, never an exception in the user's op.
        # Hence the broad except: whatever the transport raises (OSError, botocore, asyncio, fsspec
        # timeouts) is classified, counted and swallowed here, in one place.
        if self._open_until and time.monotonic() < self._open_until:
            self.faults.record("unavailable", op, "skipped: the store failed recently (circuit open)")
            return default
        try:
            return fn()
        except Exception as e:  # noqa: BLE001
            kind = self._classify(e)
            if kind in ("unavailable", "timeout", "throttled", "server"):
                self._open_until = time.monotonic() + self.cooldown_s
            self.faults.record(kind, op, e)
            log.debug("%s %s failed", self.url, op, exc_info=True)
            return default

    def _classify(self, e: BaseException) -> str:
        """The fault kind of a transport exception (a store with its own client library refines it)."""
        return classify(e)

    def _lease_live(self, key: str) -> bool:
        """True while a lease on `key` exists and has not expired (False on any error)."""
        raise NotImplementedError

    def wait_for(self, key: str, timeout_s: float) -> bytes | None:
        """Poll (with backoff, 50 ms up to 1 s) until the entry appears. Returns None when `timeout_s`
        runs out, and early when no live lease remains (the holder died or gave up without writing),
        so the caller can take the lease itself instead of waiting for nothing."""
        check_key(key)
        deadline = time.monotonic() + max(0.0, timeout_s)
        delay = 0.05
        while True:
            data = self.get(key)
            if data is not None:
                return data
            if not self._lease_live(key):
                # The holder may have written and released between our two reads: look once more.
                return self.get(key)
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            time.sleep(min(delay, left))
            delay = min(delay * 1.5, 1.0)


# --------------------------------------------------------------------------- shared filesystem


class SharedPathStore(FleetStore):
    """One file per key on a POSIX filesystem shared by many hosts (FSx, EFS/NFS, Lustre), no SQLite.

    Plain `os` calls rather than fsspec's local filesystem: the guarantees here need `fsync`,
    `O_EXCL` and `link`, which fsspec does not expose. A crashed writer leaves only a `.tmp-*` file,
    never a partial entry under a real name.
    """

    def __init__(self, root: str, timeout_s: float = 10.0) -> None:
        root = os.path.abspath(os.path.expanduser(root))
        super().__init__(root, timeout_s)
        self.root = root

    def _path(self, key: str) -> str:
        return os.path.join(self.root, self.relpath(check_key(key)))

    def _lease_path(self, key: str) -> str:
        return os.path.join(self.root, self.lease_relpath(check_key(key)))

    def get(self, key: str) -> bytes | None:
        path = self._path(key)

        def read() -> bytes | None:
            try:
                with open(path, "rb") as f:
                    return f.read()
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
            with open(qpath, "rb") as f:
                moved = f.read()
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

        self._guard("sweep", None, walk)
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

        self._guard("entries", None, walk)
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
        body, nonce = _lease_body(ttl_s)
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
            with open(path, "rb") as f:
                seen = f.read()
        except FileNotFoundError:
            return self._create_lease(path, ttl_s)  # released meanwhile
        body = _parse_lease(seen)
        if not _stale(body):
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
            with open(tomb, "rb") as f:
                moved = f.read()
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
                with open(path, "rb") as f:
                    raw = f.read()
            except FileNotFoundError:
                return False
            body = _parse_lease(raw)
            return not _stale(body) or (body is None and time.time() - _mtime(path) < 5.0)

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
                with open(self._path, "rb") as f:
                    body = _parse_lease(f.read())
            except FileNotFoundError:
                return
            # Only remove our own lease: after our TTL another host may legitimately hold it.
            if body is not None and body.get("nonce") == self._nonce:
                os.unlink(self._path)

        self._store._guard("lease release", None, drop)


# --------------------------------------------------------------------------- S3


class S3Store(FleetStore):
    """`s3://bucket/prefix` through s3fs (async calls on fsspec's loop, each bounded by `timeout_s`).

    Endpoint, region and credentials come from the usual AWS variables (`AWS_ENDPOINT_URL_S3`,
    `AWS_PROFILE`, ...) and `FSSPEC_S3_*` (e.g. `FSSPEC_S3_ENDPOINT_URL`), as s3fs reads them.
    """

    def __init__(self, url: str, timeout_s: float = 10.0, **storage_options: Any) -> None:
        import s3fs

        super().__init__(url, timeout_s)
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

    def _call(self, coro_fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        from fsspec.asyn import sync

        if not self._session_ready:
            # Building the botocore client loads service models (~1 s of CPU, more on a busy host):
            # do it once under its own, looser bound, so it does not eat the first request's timeout.
            sync(self.fs.loop, self.fs.set_session, timeout=max(30.0, self.timeout_s))
            self._session_ready = True
        return sync(self.fs.loop, coro_fn, *args, timeout=self.timeout_s, **kwargs)

    async def _read(self, key: str) -> tuple[bytes, str] | None:
        try:
            resp = await self.fs._call_s3("get_object", Bucket=self.bucket, Key=key)
        except FileNotFoundError as e:
            if _s3_code(e) == "NoSuchBucket":
                raise  # a misconfiguration, not a miss: count and warn
            return None
        async with resp["Body"] as body:
            data: bytes = await body.read()
        return data, str(resp.get("ETag", ""))

    async def _put_object(self, key: str, data: bytes, **cond: str) -> bool:
        """True if written, False if the precondition failed (exists / changed)."""
        try:
            await self.fs._call_s3("put_object", Bucket=self.bucket, Key=key, Body=data, **cond)
            return True
        except FileExistsError:
            return False
        except OSError as e:
            if _s3_code(e) in ("PreconditionFailed", "412", "ConditionalRequestConflict", "409"):
                return False
            raise

    def get(self, key: str) -> bytes | None:
        k = self._key(self.relpath(check_key(key)))

        def read() -> bytes | None:
            got = self._call(self._read, k)
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
            current = await self._read(k)
            if current is None or current[0] != bad:
                return False
            try:
                await self.fs._call_s3("delete_object", Bucket=self.bucket, Key=k, IfMatch=current[1])
                return True
            except FileNotFoundError:
                return False
            except OSError as e:
                if _s3_code(e) in ("PreconditionFailed", "412"):
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

        found: list[EntryInfo] = self._guard("entries", [], lambda: self._call(listing))
        return iter(found)

    # -- leases

    def try_lease(self, key: str, ttl_s: float) -> Lease | None:
        k = self._key(self.lease_relpath(check_key(key)))
        no_lease: Lease | None = NullLease()
        result: Lease | None = self._guard("lease", no_lease, lambda: self._call(self._try_lease, k, ttl_s))
        return result

    async def _try_lease(self, k: str, ttl_s: float) -> Lease | None:
        body, nonce = _lease_body(ttl_s)
        if await self._put_object(k, body, IfNoneMatch="*"):
            return _S3Lease(self, k, nonce)
        seen = await self._read(k)
        if seen is None:  # released meanwhile
            return _S3Lease(self, k, nonce) if await self._put_object(k, body, IfNoneMatch="*") else None
        raw, etag = seen
        old = _parse_lease(raw)
        if not _stale(old):
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
            return seen is not None and not _stale(_parse_lease(seen[0]))

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
            body = _parse_lease(seen[0])
            if body is None or body.get("nonce") != self._nonce:
                return  # someone took it over after our TTL: not ours to delete
            try:
                # If-Match: never delete a lease another host wrote after our read.
                await store.fs._call_s3("delete_object", Bucket=store.bucket, Key=self._key, IfMatch=seen[1])
            except FileNotFoundError:
                pass
            except OSError as e:
                if _s3_code(e) not in ("PreconditionFailed", "412", "NotImplemented", "501"):
                    raise

        store._guard("lease release", None, lambda: store._call(drop))


# --------------------------------------------------------------------------- errors


def _s3_code(e: BaseException) -> str:
    """The S3 error code behind an s3fs-translated exception ("" if none)."""
    for err in (e, e.__cause__, e.__context__):
        response = getattr(err, "response", None)
        if isinstance(response, dict):
            error = response.get("Error", {})
            code = str(error.get("Code", ""))
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            return code or str(status or "")
    return ""


def classify(e: BaseException) -> str:
    """A short fault kind for counting and warn-once: timeout, throttled, server, permission,
    unavailable, full, io."""
    code = _s3_code(e)
    name = type(e).__name__
    text = f"{name} {code} {e}".lower()
    if code in ("SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded", "503") or "slow down" in text:
        return "throttled"
    if "timeout" in text or isinstance(e, (TimeoutError, asyncio.TimeoutError)):
        return "timeout"
    if isinstance(e, PermissionError) or code in ("AccessDenied", "403", "InvalidAccessKeyId",
                                                  "SignatureDoesNotMatch"):
        return "permission"
    if code.startswith("5") or code in ("InternalError", "ServiceUnavailable"):
        return "server"
    if isinstance(e, ConnectionError) or "connect" in text or "endpoint" in text:
        return "unavailable"
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS):
        return "full" if e.errno != errno.EROFS else "permission"
    return "io"

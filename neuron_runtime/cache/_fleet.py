"""What the fleet stores share: the object layout, the JSON lease, fault kinds, and `FleetStore` (the
circuit-breaker guard and the polling `wait_for` of the path, S3, Redis and HTTP stores).

The path and S3 stores use one layout under a versioned root (the envelope format version is part of the
path, so a new format never reads an old one); Redis and HTTP derive their names from `LAYOUT_VERSION`::

    <root>/v1/ab/cd/<key>.neff      one immutable object per entry (ab, cd: the key's first 4 hex digits)
    <root>/v1/leases/<key>.lease    a compile lease: JSON {holder, nonce, expires, ttl}

Writes are create-only and first-writer-wins, leases are created the same exclusive way (see each store).
A lease whose `expires` has passed is stale and may be taken over, so a crashed holder blocks the fleet
for at most its TTL. Lease expiry uses wall clocks: hosts need roughly synchronised clocks (NTP); skew
adds to or subtracts from the TTL.

Every failure (timeouts, 5xx, throttling, permission, connection refused) is a miss or a skipped write,
counted in `self.faults` and warned about once per kind.

Deadlines: every call through `FleetStore._guard` has one *whole-call* deadline, `timeout_s`
(`TORCH_NEURONX_FLEET_TIMEOUT`): connect, send, receive and retries together. The call runs in one of the
store's worker threads (`_deadline.DeadlineRunner`) and the caller stops waiting at the deadline: a store
that drips its answer, or a filesystem call that never returns, costs the caller at most `timeout_s`, then
the call is a miss (fault kind `timeout`) and the breaker skips the store for `cooldown_s`. Listing
(`entries`, `sweep`: the CLI's, never a step's) is not bounded this way.

Read bounds: every read checks the size it is told first (stat, Content-Length, the RESP bulk length) and
never reads more than `max_entry` + 1 bytes of an entry, or `MAX_LEASE` of a lease.
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import os
import socket
import stat
import time
import uuid
from collections.abc import Callable
from typing import Any, TypeVar

from neuron_runtime.cache._base import CacheBackend, check_key
from neuron_runtime.cache._deadline import DeadlineRunner
from neuron_runtime.cache._faults import FaultCounter

log = logging.getLogger(__name__)

LAYOUT_VERSION = "v1"
SUFFIX = ".neff"
#: the default `max_entry` of the stores without a limit of their own (path, S3): reads stop past it.
DEFAULT_MAX_ENTRY = 1024**3
#: a lease is ~150 bytes of JSON; anything past this is not a lease (read no further).
MAX_LEASE = 64 * 1024
_T = TypeVar("_T")


class ReadRefused(Exception):
    """An answer refused before it is read whole: `kind` "too_large" (over the cap it announced or
    would reach) or "not_regular" (a path entry that is a FIFO, a device, a socket)."""

    def __init__(self, kind: str, detail: str) -> None:
        self.kind = kind
        super().__init__(detail)


def read_file(path: str, limit: int) -> bytes:
    """The bytes of the regular file at `path`, at most `limit` of them: `ReadRefused` for anything else
    (checked on the open file: `fstat` before the first read, and never more than `limit` + 1 bytes read,
    so a file that grows meanwhile costs no more). `FileNotFoundError` when there is none.
    O_NONBLOCK: a FIFO put where an entry belongs opens at once (then is refused) instead of waiting for
    a writer."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ReadRefused("not_regular", f"{path} is not a regular file (mode {stat.filemode(st.st_mode)}); "
                              "refused unread")
        if st.st_size > limit:
            raise ReadRefused("too_large", f"{path} is {st.st_size} bytes, over the {limit}-byte read cap")
        parts: list[bytes] = []
        got = 0
        while got <= limit:
            # What fstat announced plus one byte (which tells a file that grew since), then 64 KiB at a
            # time: never past limit + 1 in all.
            chunk = os.read(fd, min(max(st.st_size + 1 - got, 1 << 16), limit + 1 - got))
            if not chunk:
                break
            parts.append(chunk)
            got += len(chunk)
        if got > limit:
            raise ReadRefused("too_large", f"{path} grew past the {limit}-byte read cap while being read")
        return b"".join(parts) if len(parts) != 1 else parts[0]
    finally:
        os.close(fd)


def _holder() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def lease_body(ttl_s: float) -> tuple[bytes, str]:
    """A new lease's JSON bytes, expiring `ttl_s` from now, and its nonce (only its holder knows it)."""
    nonce = uuid.uuid4().hex
    body = {"holder": _holder(), "nonce": nonce, "expires": time.time() + ttl_s, "ttl": ttl_s}
    return json.dumps(body, sort_keys=True).encode(), nonce


def parse_lease(raw: bytes) -> dict[str, Any] | None:
    """The lease's JSON, or None when it is unreadable (a torn lease counts as stale)."""
    try:
        body = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(body, dict) or not isinstance(body.get("expires"), (int, float)):
        return None
    return body


def is_stale(body: dict[str, Any] | None) -> bool:
    """True for a lease past its `expires` (or unreadable): it may be taken over."""
    return body is None or float(body["expires"]) <= time.time()


class FleetStore(CacheBackend):
    """What the fleet stores share: layout, fault accounting, the whole-call deadline and the circuit
    breaker, `wait_for`. A subclass wraps each of its calls in `_guard` (see the module docstring)."""

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
        self.calls = DeadlineRunner(type(self).__name__)

    @staticmethod
    def relpath(key: str) -> str:
        return f"{LAYOUT_VERSION}/{key[:2]}/{key[2:4]}/{key}{SUFFIX}"

    @staticmethod
    def lease_relpath(key: str) -> str:
        return f"{LAYOUT_VERSION}/leases/{key}.lease"

    def deadline_s(self) -> float:
        """The whole-call deadline of the next call (a store with a one-time setup may allow it more)."""
        return self.timeout_s

    def _guard(self, op: str, default: _T, fn: Callable[[], _T], *, bounded: bool = True) -> _T:
        """`fn()` under the store's whole-call deadline (`bounded`) and breaker; `default` on any trouble.

        The contract: backend trouble is a miss / skipped write, never an exception in the user's op.
        Hence the broad except: whatever the transport raises (OSError, botocore, asyncio, fsspec
        timeouts) is classified, counted and swallowed here, in one place."""
        if self._open_until and time.monotonic() < self._open_until:
            self.faults.record("unavailable", op, "skipped: the store failed recently (circuit open)")
            return default
        try:
            return self.calls.run(fn, self.deadline_s()) if bounded else fn()
        except Exception as e:  # noqa: BLE001
            # The whole-call deadline, or a transport's own timeout (builtin, urllib3, redis, fsspec).
            kind = "timeout" if isinstance(e, TimeoutError) else self._classify(e)
            if kind in ("unavailable", "timeout", "throttled", "server"):
                self._open_until = time.monotonic() + self.cooldown_s
            detail: object = e
            if kind == "timeout":
                detail = (f"{e}; the store is skipped for {self.cooldown_s:g} s "
                          f"(TORCH_NEURONX_FLEET_TIMEOUT={self.timeout_s:g} s bounds each whole call)")
            self.faults.record(kind, op, detail)
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


def s3_code(e: BaseException) -> str:
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
    unavailable, full, io. (S3's error codes first: s3fs's exceptions carry them, others have none.)"""
    if isinstance(e, ReadRefused):
        return e.kind
    code = s3_code(e)
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

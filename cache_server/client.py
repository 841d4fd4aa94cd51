"""A small synchronous client for the cache server (torch-free; the runtime's grpc:// backend uses it).

Every method takes an optional `timeout` (seconds; default the client's) and raises a `CacheServerError`
subclass named after the status (NotFound, Unauthenticated, Unavailable, ...). Retries, circuit breaking
and "errors are misses" are the caller's policy (see `neuron_runtime/cache/_grpc.py`), not this layer's.
"""

from __future__ import annotations

import enum
import hashlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc

from ._errors import CacheServerError, InvalidRequest, NotFound, StreamRequired, TooLarge, from_status
from ._keys import CHUNK, MESSAGE_MAX, PUT_HEADER_MD, SERVICE, SIZE_MD, UNARY_MAX, check_key
from ._proto.neuron_cache.v1 import cache_pb2 as pb

T = TypeVar("T")


class LeaseState(enum.Enum):
    STORED = pb.WaitForResponse.STORED
    RELEASED = pb.WaitForResponse.RELEASED
    TIMEOUT = pb.WaitForResponse.TIMEOUT
    NO_LEASE = pb.WaitForResponse.NO_LEASE


@dataclass(frozen=True)
class LeaseResult:
    acquired: bool
    lease_id: str = ""
    exists: bool = False


@dataclass(frozen=True)
class Entry:
    key: str
    size: int
    mtime: float


def _options() -> list[tuple[str, Any]]:
    return [
        ("grpc.max_receive_message_length", MESSAGE_MAX),
        ("grpc.max_send_message_length", MESSAGE_MAX),
        # Reconnect quickly after a server restart (the default backoff grows to two minutes).
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.min_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 2000),
        # Retries are the caller's policy (deadline budget, circuit breaker), not the channel's.
        ("grpc.enable_retries", 0),
    ]


_allocator_primed = False


def _prime_allocator() -> None:
    """Let glibc keep blob-sized replies on the heap, once per process.

    Every GET returns a fresh blob-sized bytes object. glibc serves an allocation at or above its mmap
    threshold (128 KiB at start) with a fresh mapping, page-faulted on first touch and unmapped on free,
    which in a process with gRPC's threads costs a TLB shootdown per unmap: measured ~530 page faults and
    ~2.4 ms of CPU per 1 MiB GET (114 → 190-400 GETs/s without them). glibc raises its *dynamic* threshold
    to the size of any mmapped block that is freed, so freeing one 8 MiB buffer moves blobs below 8 MiB to
    the heap: the same adaptation any program that frees a large buffer triggers (training processes
    usually have already). No malloc setting is changed.
    """
    global _allocator_primed
    if not _allocator_primed:
        _allocator_primed = True
        buf = bytearray(8 << 20)
        del buf


class CacheClient:
    """Talks to one server (or a load balancer in front of replicas).

    target: `HOST:PORT`. tls: use TLS (system roots unless `root_certificates`); `client_cert`/`client_key`
    for mTLS; `server_name` overrides the name checked against the certificate. Thread-safe.
    """

    def __init__(self, target: str, *, token: str | None = None, tls: bool = False,
                 root_certificates: bytes | None = None, client_cert: bytes | None = None,
                 client_key: bytes | None = None, server_name: str | None = None, timeout: float = 10.0) -> None:
        _prime_allocator()
        self.target = target
        self.timeout = timeout
        self._md: tuple[tuple[str, str], ...] = (("authorization", f"Bearer {token}"),) if token else ()
        opts = _options()
        if server_name:
            opts.append(("grpc.ssl_target_name_override", server_name))
        if tls or root_certificates or client_cert:
            creds = grpc.ssl_channel_credentials(root_certificates, client_key, client_cert)
            self._channel = grpc.secure_channel(target, creds, options=opts)
        else:
            self._channel = grpc.insecure_channel(target, options=opts)
        ch = self._channel
        # No serializers anywhere: blobs travel raw, control messages are (de)serialized here.
        self._lookup = ch.unary_unary(f"/{SERVICE}/Lookup")
        self._get = ch.unary_unary(f"/{SERVICE}/Get")
        self._get_stream = ch.unary_stream(f"/{SERVICE}/GetStream")
        self._put = ch.stream_unary(f"/{SERVICE}/Put")
        self._delete = ch.unary_unary(f"/{SERVICE}/Delete")
        self._list = ch.unary_stream(f"/{SERVICE}/List")
        self._acquire = ch.unary_unary(f"/{SERVICE}/AcquireLease")
        self._release = ch.unary_unary(f"/{SERVICE}/ReleaseLease")
        self._wait = ch.unary_unary(f"/{SERVICE}/WaitFor")
        self._stats = ch.unary_unary(f"/{SERVICE}/Stats")

    def __enter__(self) -> "CacheClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    def _t(self, timeout: float | None) -> float:
        return self.timeout if timeout is None else timeout

    def _call(self, stub: Any, request: Any, timeout: float | None, metadata: Sequence[tuple[str, Any]] = ()
              ) -> Any:
        try:
            return stub(request, timeout=self._t(timeout), metadata=self._md + tuple(metadata))
        except grpc.RpcError as e:
            raise _error(e) from None

    # -- blobs -----------------------------------------------------------------------------------------

    def get(self, key: str, timeout: float | None = None, limit: int | None = None) -> bytes | None:
        """The entry, or None when the server has none. `limit`: `TooLarge` for an entry over that many
        bytes, decided on the size the server announces before any chunk, and never more than `limit`
        plus one chunk received (a unary answer is bounded by `MESSAGE_MAX` anyway)."""
        req = pb.GetRequest(key=check_key(key)).SerializeToString()
        try:
            data: bytes = self._call(self._get, req, timeout)
        except NotFound:
            return None
        except StreamRequired:
            return self._get_streamed(req, timeout, limit)
        if limit is not None and len(data) > limit:
            raise TooLarge(f"entry {key} is {len(data)} bytes, over the {limit}-byte read cap")
        return data

    def _get_streamed(self, req: bytes, timeout: float | None, limit: int | None = None) -> bytes | None:
        call = None
        try:
            call = self._get_stream(req, timeout=self._t(timeout), metadata=self._md)
            size = -1
            for k, v in call.initial_metadata() or ():
                if k == SIZE_MD:
                    size = int(v)
            if limit is not None and size > limit:
                raise TooLarge(f"the server announced a {size}-byte entry, over the {limit}-byte read cap")
            parts, got = [], 0
            for chunk in call:
                parts.append(chunk)
                got += len(chunk)
                if limit is not None and got > limit:
                    raise TooLarge(f"the server sent more than the {limit}-byte read cap")
            data = b"".join(parts)
        except grpc.RpcError as e:
            err = _error(e)
            if isinstance(err, NotFound):
                return None
            raise err from None
        except TooLarge:
            if call is not None:
                call.cancel()  # stop the stream: nothing more of it is read
            raise
        if size >= 0 and len(data) != size:
            # Deleted or evicted mid-stream: treat as a miss rather than hand out a torn entry.
            return None
        return data

    def put(self, key: str, data: bytes, timeout: float | None = None) -> bool:
        """Upload; True when this call created the entry, False when it already existed."""
        header = pb.PutHeader(key=check_key(key), size=len(data), sha256=hashlib.sha256(data).digest())
        return self.put_raw(header.SerializeToString(), _chunks(data), timeout)

    def put_raw(self, header: bytes, chunks: Iterable[bytes], timeout: float | None = None) -> bool:
        """Upload with a caller-built header and chunks (tests use it to send lies)."""
        resp = self._call(self._put, iter(chunks), timeout, ((PUT_HEADER_MD, header),))
        return bool(pb.PutResponse.FromString(resp).created)

    def delete(self, key: str, timeout: float | None = None) -> bool:
        resp = self._call(self._delete, pb.DeleteRequest(key=check_key(key)).SerializeToString(), timeout)
        return bool(pb.DeleteResponse.FromString(resp).existed)

    # -- metadata --------------------------------------------------------------------------------------

    def lookup(self, keys: Sequence[str], timeout: float | None = None) -> list[bool]:
        """For each key, in order, whether the server has it (one round trip)."""
        digests = _digests(keys)
        resp = self._call(self._lookup, pb.LookupRequest(digests=digests).SerializeToString(), timeout)
        present = pb.LookupResponse.FromString(resp).present
        if len(present) != len(keys):
            raise CacheServerError(f"lookup answered {len(present)} keys for {len(keys)}")
        return [b == 1 for b in present]

    def list(self, timeout: float | None = None) -> Iterator[Entry]:
        try:
            for raw in self._list(pb.ListRequest().SerializeToString(), timeout=self._t(timeout),
                                  metadata=self._md):
                e = pb.EntryInfo.FromString(raw)
                yield Entry(e.key, e.size, e.mtime)
        except grpc.RpcError as err:
            raise _error(err) from None

    def stats(self, timeout: float | None = None) -> dict[str, Any]:
        resp = pb.StatsResponse.FromString(self._call(self._stats, pb.StatsRequest().SerializeToString(), timeout))
        return {f.name: getattr(resp, f.name) for f in resp.DESCRIPTOR.fields}

    # -- leases ----------------------------------------------------------------------------------------

    def acquire_lease(self, key: str, ttl_s: float, holder: str = "", timeout: float | None = None) -> LeaseResult:
        req = pb.AcquireLeaseRequest(key=check_key(key), ttl_ms=max(1, int(ttl_s * 1000)), holder=holder)
        resp = pb.AcquireLeaseResponse.FromString(self._call(self._acquire, req.SerializeToString(), timeout))
        return LeaseResult(resp.acquired, resp.lease_id, resp.exists)

    def release_lease(self, key: str, lease_id: str, timeout: float | None = None) -> bool:
        req = pb.ReleaseLeaseRequest(key=check_key(key), lease_id=lease_id)
        return bool(pb.ReleaseLeaseResponse.FromString(self._call(self._release, req.SerializeToString(), timeout))
                    .released)

    def wait_for(self, key: str, timeout_s: float) -> LeaseState:
        """Block until the key is stored or its lease ends, at most `timeout_s` (plus a round trip)."""
        req = pb.WaitForRequest(key=check_key(key), timeout_ms=max(0, int(timeout_s * 1000)))
        resp = self._call(self._wait, req.SerializeToString(), timeout_s + max(1.0, self.timeout))
        return LeaseState(pb.WaitForResponse.FromString(resp).state)

    def health(self, service: str = "", timeout: float | None = None) -> str:
        """The standard health check's answer for `service` ("SERVING", "NOT_SERVING", ...)."""
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        stub = health_pb2_grpc.HealthStub(self._channel)
        try:
            resp = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=self._t(timeout))
        except grpc.RpcError as e:
            raise _error(e) from None
        return str(health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status))


def _digests(keys: Sequence[str]) -> bytes:
    """Keys → concatenated 32-byte digests, validated in bulk: per-key checks (or one regex over the joined
    text) were most of a 1,000-key lookup's time. `fromhex(...).hex() == text` holds only for lowercase hex
    without whitespace, and every key must be 64 characters long."""
    raw: bytes | None
    try:
        joined = "".join(keys)
        raw = bytes.fromhex(joined)
    except (TypeError, ValueError):
        raw = None
    if raw is None or raw.hex() != joined or not set(map(len, keys)) <= {64}:
        for k in keys:
            check_key(k)  # raises InvalidKey naming the first bad one
        raise InvalidRequest("invalid keys")  # pragma: no cover - check_key raised above
    return raw


def _chunks(data: bytes) -> Iterator[bytes]:
    if len(data) <= UNARY_MAX:
        yield data
        return
    view = memoryview(data)
    for i in range(0, len(data), CHUNK):
        yield bytes(view[i:i + CHUNK])


def _error(e: grpc.RpcError) -> CacheServerError:
    code = e.code() if hasattr(e, "code") else grpc.StatusCode.UNKNOWN
    details = e.details() if hasattr(e, "details") else str(e)
    err = from_status(code, details or "")
    if isinstance(err, StreamRequired) and hasattr(e, "trailing_metadata"):
        for k, v in e.trailing_metadata() or ():
            if k == SIZE_MD:
                err.size = int(v)
    return err

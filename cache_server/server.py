"""The gRPC cache server (grpc.aio): handlers, lifecycle and the listening sockets.

Every method is registered through a generic handler *without* serializers: blob-carrying calls move raw
bytes (DESIGN §3), and control calls are parsed here so a malformed message is INVALID_ARGUMENT rather than
an opaque INTERNAL from the framework.

Lifecycle (STYLE 15):
  1. open and index the storage (removing incomplete uploads), then bind and start;
  2. health SERVING for "" and `neuron_cache.v1.Cache`;
  3. on SIGTERM/SIGINT: health NOT_SERVING (load balancers and probes stop sending), then
     `stop(grace)` lets in-flight calls finish, then close the storage.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import grpc
from google.protobuf.message import DecodeError, Message
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from . import __version__
from ._errors import CacheServerError, ConfigError, DataLoss, InvalidRequest, NotFound, StreamRequired, TooLarge
from ._keys import CHUNK, HEALTH_SERVICE, MESSAGE_MAX, PUT_HEADER_MD, SERVICE, SIZE_MD, UNARY_MAX, check_key
from ._leases import Leases
from ._proto.neuron_cache.v1 import cache_pb2 as pb
from .auth import Auth, Role
from .metrics import Metrics, serve_metrics
from .storage import Storage, open_storage
from .storage.s3 import S3Storage

log = logging.getLogger(__name__)

_MAX_LOOKUP_KEYS = 100_000
_MAX_WAIT_S = 600.0
_MAX_TTL_MS = 24 * 3600 * 1000
# How often a WaitFor on S3 storage looks at the bucket (leases there can end on another replica).
_SHARED_POLL_S = 0.2

M = TypeVar("M", bound=Message)


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    listen: str = "0.0.0.0:50051"
    storage: str = "/var/cache/neuron-cache"
    max_size: int = 10 * 1024**3
    max_blob_size: int = 1024**3
    tokens_file: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None
    metrics_listen: str | None = None
    reflection: bool = False
    grace_s: float = 10.0

    def check(self) -> None:
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ConfigError("--tls-cert and --tls-key go together")
        if self.tls_client_ca and not self.tls_cert:
            raise ConfigError("--tls-client-ca (mTLS) needs --tls-cert and --tls-key")
        if self.max_size <= 0 or self.max_blob_size <= 0:
            raise ConfigError("--max-size and --max-blob-size must be positive")
        split_host_port(self.listen, "--listen")
        if self.metrics_listen:
            split_host_port(self.metrics_listen, "--metrics-listen")


def split_host_port(text: str, flag: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not (0 <= int(port) < 65536):
        raise ConfigError(f"{flag} {text!r}: expected HOST:PORT, e.g. 0.0.0.0:50051")
    return host.strip("[]") or "0.0.0.0", int(port)


def _parse(cls: type[M], raw: bytes) -> M:
    try:
        return cls.FromString(raw)
    except (DecodeError, ValueError) as e:
        raise InvalidRequest(f"malformed {cls.__name__}: {e}") from e


def _md(context: grpc.aio.ServicerContext[Any, Any], name: str) -> str | bytes | None:
    for k, v in context.invocation_metadata() or ():
        if k == name:
            return v  # type: ignore[no-any-return]
    return None


class CacheService:
    """The handlers. One instance per server; all state is touched only from the event loop thread."""

    def __init__(self, storage: Storage, auth: Auth, metrics: Metrics, max_blob_size: int) -> None:
        self.storage, self.auth, self.metrics = storage, auth, metrics
        self.max_blob = min(max_blob_size, storage.max_bytes)
        self.leases = Leases()
        self.hits = self.misses = self.puts = 0
        metrics.gauge("neuron_cache_entries", "entries stored (this replica's view)", lambda: storage.usage()[0])
        metrics.gauge("neuron_cache_bytes", "bytes stored (this replica's view)", lambda: storage.usage()[1])
        metrics.gauge("neuron_cache_max_bytes", "the byte cap (--max-size)", lambda: storage.max_bytes)
        metrics.gauge("neuron_cache_evictions", "entries evicted to stay under the cap", lambda: storage.evictions)
        metrics.gauge("neuron_cache_active_leases", "compile leases held now", lambda: self.leases.active())

    # -- plumbing --------------------------------------------------------------------------------------

    async def _fail(self, context: grpc.aio.ServicerContext[Any, Any], method: str, e: BaseException) -> None:
        """Turn an exception into the precise status. Never lets one escape as a crash."""
        if isinstance(e, CacheServerError):
            code, text = e.code, str(e)
            if isinstance(e, StreamRequired):
                context.set_trailing_metadata(((SIZE_MD, str(e.size)),))
        elif isinstance(e, OSError):
            code, text = grpc.StatusCode.UNAVAILABLE, f"storage error: {e}"
            log.warning("storage error in %s: %s", method, e)
        else:
            code, text = grpc.StatusCode.INTERNAL, f"internal error: {type(e).__name__}"
            log.exception("unexpected error in %s", method, exc_info=e)
        self.metrics.inc("neuron_cache_requests_total", method=method, code=code.name)
        await context.abort(code, text)

    def _single(self, method: str, need: Role,
                fn: Callable[[Any, grpc.aio.ServicerContext[Any, Any]], Awaitable[bytes]],
                make: Callable[..., grpc.RpcMethodHandler]) -> grpc.RpcMethodHandler:
        """A handler with one response (`make`: unary-unary, or stream-unary with `fn` taking the stream)."""
        async def handler(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> bytes:
            try:
                self.auth.check(context.invocation_metadata() or (), need)
                out = await fn(request, context)
            except (asyncio.CancelledError, grpc.aio.AbortError):
                raise
            except Exception as e:
                await self._fail(context, method, e)
                raise AssertionError("unreachable: abort raises") from e
            self.metrics.inc("neuron_cache_requests_total", method=method, code="OK")
            return out

        return make(handler)

    def unary(self, method: str, need: Role,
              fn: Callable[[bytes, grpc.aio.ServicerContext[Any, Any]], Awaitable[bytes]]) -> grpc.RpcMethodHandler:
        return self._single(method, need, fn, grpc.unary_unary_rpc_method_handler)

    def server_stream(self, method: str, need: Role,
                      fn: Callable[[bytes, grpc.aio.ServicerContext[Any, Any]], AsyncIterator[bytes]]
                      ) -> grpc.RpcMethodHandler:
        async def handler(request: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[bytes]:
            try:
                self.auth.check(context.invocation_metadata() or (), need)
                async for item in fn(request, context):
                    yield item
            except (asyncio.CancelledError, grpc.aio.AbortError):
                raise
            except Exception as e:
                await self._fail(context, method, e)
                return
            self.metrics.inc("neuron_cache_requests_total", method=method, code="OK")

        return grpc.unary_stream_rpc_method_handler(handler)

    def client_stream(self, method: str, need: Role,
                      fn: Callable[[AsyncIterator[bytes], grpc.aio.ServicerContext[Any, Any]], Awaitable[bytes]]
                      ) -> grpc.RpcMethodHandler:
        return self._single(method, need, fn, grpc.stream_unary_rpc_method_handler)

    def generic_handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(SERVICE, {
            "Lookup": self.unary("Lookup", Role.READ, self.lookup),
            "Get": self.unary("Get", Role.READ, self.get),
            "GetStream": self.server_stream("GetStream", Role.READ, self.get_stream),
            "Put": self.client_stream("Put", Role.WRITE, self.put),
            "Delete": self.unary("Delete", Role.WRITE, self.delete),
            "List": self.server_stream("List", Role.READ, self.list),
            "AcquireLease": self.unary("AcquireLease", Role.WRITE, self.acquire_lease),
            "ReleaseLease": self.unary("ReleaseLease", Role.WRITE, self.release_lease),
            "WaitFor": self.unary("WaitFor", Role.READ, self.wait_for),
            "Stats": self.unary("Stats", Role.READ, self.stats),
        })

    # -- handlers --------------------------------------------------------------------------------------

    async def lookup(self, raw: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> bytes:
        digests = _parse(pb.LookupRequest, raw).digests
        if len(digests) % 32:
            raise InvalidRequest(f"digests is {len(digests)} bytes, not a multiple of 32")
        n = len(digests) // 32
        if n > _MAX_LOOKUP_KEYS:
            raise TooLarge(f"{n} keys in one lookup; at most {_MAX_LOOKUP_KEYS}")
        hexed = digests.hex()
        keys = [hexed[i:i + 64] for i in range(0, 64 * n, 64)]
        present = await self.storage.contains_many(keys)
        self.metrics.inc("neuron_cache_lookup_keys_total", n)
        return pb.LookupResponse(present=bytes(present)).SerializeToString()

    async def get(self, raw: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> bytes:
        key = check_key(_parse(pb.GetRequest, raw).key)
        size = await self.storage.size(key)
        if size is not None and size > UNARY_MAX:
            raise StreamRequired(f"entry {key} is {size} bytes; fetch it with GetStream", size)
        data = None if size is None else await self.storage.read(key)
        if data is None:
            self.misses += 1
            self.metrics.inc("neuron_cache_misses_total")
            raise NotFound(f"no entry {key}")
        self.hits += 1
        self.metrics.inc("neuron_cache_hits_total")
        self.metrics.inc("neuron_cache_sent_bytes_total", len(data))
        return data

    async def get_stream(self, raw: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[bytes]:
        key = check_key(_parse(pb.GetRequest, raw).key)
        size = await self.storage.size(key)
        if size is None:
            self.misses += 1
            self.metrics.inc("neuron_cache_misses_total")
            raise NotFound(f"no entry {key}")
        await context.send_initial_metadata(((SIZE_MD, str(size)),))
        self.hits += 1
        self.metrics.inc("neuron_cache_hits_total")
        async for piece in self.storage.read_chunks(key, CHUNK):
            self.metrics.inc("neuron_cache_sent_bytes_total", len(piece))
            yield piece

    async def put(self, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext[Any, Any]) -> bytes:
        # 1. Everything that can be refused is refused before a byte of the blob is read.
        raw = _md(context, PUT_HEADER_MD)
        if not isinstance(raw, bytes):
            raise InvalidRequest(f"Put needs the `{PUT_HEADER_MD}` metadata (a serialized PutHeader)")
        header = _parse(pb.PutHeader, raw)
        key = check_key(header.key)
        if len(header.sha256) != 32:
            raise InvalidRequest("PutHeader.sha256 must be the 32-byte sha256 of the blob")
        if header.size > self.max_blob:
            raise TooLarge(f"entry {key} is {header.size} bytes; this server accepts at most {self.max_blob}")
        # 2. First writer wins: an existing key makes the upload a no-op (the client may stop sending).
        if await self.storage.size(key) is not None:
            return pb.PutResponse(created=False).SerializeToString()
        # 3. Stream into an invisible temporary, hashing as we go.
        writer = await self.storage.open_writer(key, header.size)
        committed = False
        try:
            h = hashlib.sha256()
            got = 0
            async for chunk in requests:
                got += len(chunk)
                if got > header.size:
                    raise DataLoss(f"entry {key}: received more than the declared {header.size} bytes; nothing stored")
                h.update(chunk)
                await writer.write(chunk)
            # 4. Verify size and digest; only then does the entry become visible.
            if got != header.size:
                raise DataLoss(f"entry {key}: received {got} bytes, declared {header.size}; nothing stored")
            if h.digest() != header.sha256:
                raise DataLoss(f"entry {key}: sha256 mismatch (sent {h.hexdigest()}, declared "
                               f"{header.sha256.hex()}); nothing stored")
            created = await writer.commit()
            committed = True
        finally:
            if not committed:
                await writer.abort()
        self.leases.stored(key)
        if created:
            self.puts += 1
            self.metrics.inc("neuron_cache_puts_total")
            self.metrics.inc("neuron_cache_received_bytes_total", header.size)
        return pb.PutResponse(created=created).SerializeToString()

    async def delete(self, raw: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> bytes:
        key = check_key(_parse(pb.DeleteRequest, raw).key)
        existed = await self.storage.delete(key)
        if existed:
            log.info("deleted", extra={"fields": {"key": key, "peer": context.peer()}})
        return pb.DeleteResponse(existed=existed).SerializeToString()

    async def list(self, raw: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[bytes]:
        _parse(pb.ListRequest, raw)
        async for e in self.storage.entries():
            yield pb.EntryInfo(key=e.key, size=e.size, mtime=e.mtime).SerializeToString()

    async def acquire_lease(self, raw: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> bytes:
        req = _parse(pb.AcquireLeaseRequest, raw)
        key = check_key(req.key)
        if not 0 < req.ttl_ms <= _MAX_TTL_MS:
            raise InvalidRequest(f"ttl_ms must be in 1..{_MAX_TTL_MS}")
        if await self.storage.size(key) is not None:
            return pb.AcquireLeaseResponse(acquired=False, exists=True).SerializeToString()
        if isinstance(self.storage, S3Storage):
            lease_id = await self.storage.lease_acquire(key, req.ttl_ms / 1000, req.holder[:200])
        else:
            lease_id = self.leases.acquire(key, req.ttl_ms / 1000, req.holder[:200])
        if lease_id is None:
            return pb.AcquireLeaseResponse(acquired=False).SerializeToString()
        self.metrics.inc("neuron_cache_leases_acquired_total")
        return pb.AcquireLeaseResponse(acquired=True, lease_id=lease_id).SerializeToString()

    async def release_lease(self, raw: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> bytes:
        req = _parse(pb.ReleaseLeaseRequest, raw)
        key = check_key(req.key)
        if isinstance(self.storage, S3Storage):
            released = await self.storage.lease_release(key, req.lease_id)
        else:
            released = self.leases.release(key, req.lease_id)
        return pb.ReleaseLeaseResponse(released=released).SerializeToString()

    async def wait_for(self, raw: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> bytes:
        req = _parse(pb.WaitForRequest, raw)
        key = check_key(req.key)
        timeout = min(req.timeout_ms / 1000, _MAX_WAIT_S)
        remaining = context.time_remaining()
        if remaining is not None:
            # Answer TIMEOUT a little before the client's deadline rather than let the call fail.
            timeout = max(0.0, min(timeout, remaining - 0.05))
        S = pb.WaitForResponse
        if await self.storage.size(key) is not None:
            return S(state=S.STORED).SerializeToString()
        if isinstance(self.storage, S3Storage):
            return S(state=await self._wait_shared(self.storage, key, timeout)).SerializeToString()
        ended = await self.leases.wait(key, timeout)
        if await self.storage.size(key) is not None:
            state = S.STORED
        elif ended is None:
            state = S.NO_LEASE
        else:
            state = S.RELEASED if ended else S.TIMEOUT
        return S(state=state).SerializeToString()

    async def _wait_shared(self, storage: S3Storage, key: str, timeout: float) -> int:
        """Leases in the bucket can end on another replica: poll (bounded) for the entry or the lease's end."""
        S = pb.WaitForResponse
        if not await storage.lease_live(key):
            return S.STORED if await storage.stored(key) else S.NO_LEASE
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            await asyncio.sleep(min(_SHARED_POLL_S, max(0.0, deadline - time.monotonic())))
            if await storage.stored(key):
                return S.STORED
            if not await storage.lease_live(key):
                return S.STORED if await storage.stored(key) else S.RELEASED
        return S.TIMEOUT

    async def stats(self, raw: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> bytes:
        _parse(pb.StatsRequest, raw)
        entries, nbytes = self.storage.usage()
        return pb.StatsResponse(
            entries=entries, bytes=nbytes, max_bytes=self.storage.max_bytes, hits=self.hits,
            misses=self.misses, puts=self.puts, evictions=self.storage.evictions,
            active_leases=self.leases.active(), storage=self.storage.location, version=__version__,
        ).SerializeToString()


def _read(path: str, flag: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise ConfigError(f"{flag} {path}: {e}") from e


def _enable_reflection(server: grpc.aio.Server) -> None:
    try:
        from grpc_reflection.v1alpha import reflection  # type: ignore[import-not-found,unused-ignore]
    except ImportError as e:
        raise ConfigError("--reflection needs grpcio-reflection: pip install grpcio-reflection") from e
    reflection.enable_server_reflection((SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME), server)


async def serve(cfg: ServerConfig, stop: asyncio.Event | None = None) -> None:
    """Run until SIGTERM/SIGINT (or until `stop` is set), then drain and return."""
    cfg.check()
    auth = Auth.from_file(cfg.tokens_file)
    storage = open_storage(cfg.storage, cfg.max_size)
    await storage.start()
    metrics = Metrics()
    service = CacheService(storage, auth, metrics, cfg.max_blob_size)
    server = grpc.aio.server(options=[
        ("grpc.max_receive_message_length", MESSAGE_MAX),
        ("grpc.max_send_message_length", MESSAGE_MAX),
        # Without this two servers can bind one port and split its traffic (grpc's default is on).
        ("grpc.so_reuseport", 0),
    ])
    server.add_generic_rpc_handlers((service.generic_handler(),))
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    if cfg.reflection:
        _enable_reflection(server)
    if cfg.tls_cert and cfg.tls_key:
        creds = grpc.ssl_server_credentials(
            [(_read(cfg.tls_key, "--tls-key"), _read(cfg.tls_cert, "--tls-cert"))],
            root_certificates=_read(cfg.tls_client_ca, "--tls-client-ca") if cfg.tls_client_ca else None,
            require_client_auth=bool(cfg.tls_client_ca),
        )
        port = server.add_secure_port(cfg.listen, creds)
    else:
        port = server.add_insecure_port(cfg.listen)
    metrics_server = None
    try:
        await server.start()
        if cfg.metrics_listen:
            mhost, mport = split_host_port(cfg.metrics_listen, "--metrics-listen")
            metrics_server = await serve_metrics(metrics, mhost, mport)
        for name in ("", HEALTH_SERVICE):
            await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
        if auth.open:
            log.warning("no --tokens-file: the cache is OPEN, anyone who can reach it can read and write "
                        "entries that every client will run")
        log.info("serving", extra={"fields": {
            "listen": cfg.listen, "port": port, "tls": bool(cfg.tls_cert), "mtls": bool(cfg.tls_client_ca),
            "storage": storage.location, "max_bytes": storage.max_bytes, "auth": "open" if auth.open else "tokens",
            "metrics": cfg.metrics_listen, "reflection": cfg.reflection, "version": __version__}})
        stop = stop or asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                loop.add_signal_handler(sig, stop.set)
            except (NotImplementedError, RuntimeError, ValueError):  # not the main thread
                pass
        await stop.wait()
        # 3. Drain: stop advertising, let in-flight calls finish, then stop.
        t0 = time.monotonic()
        log.info("draining", extra={"fields": {"grace_s": cfg.grace_s}})
        await health_servicer.enter_graceful_shutdown()
        await server.stop(cfg.grace_s)
        log.info("stopped", extra={"fields": {"drain_s": round(time.monotonic() - t0, 3)}})
    finally:
        if metrics_server is not None:
            metrics_server.close()
        await server.stop(None)
        await storage.close()

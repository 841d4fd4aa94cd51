"""The fleet store behind `grpc://HOST:PORT` and `grpcs://HOST:PORT` (our `neuron-cache-server`).

URL: `grpc[s]://HOST:PORT[?ca=FILE&cert=FILE&key=FILE&server_name=NAME&breaker=SECONDS]`.
`grpcs://` uses TLS with the system roots unless `ca=` names a bundle; `cert=`/`key=` add a client
certificate (mTLS). The bearer token is `TORCH_NEURONX_CACHE_TOKEN` (config `cache_token`).

Failure policy (the contract in `_base`: a server problem is a miss or a skipped write, never an error in
the user's step):
  1. Every operation has one deadline budget, `TORCH_NEURONX_FLEET_TIMEOUT` seconds; retries (UNAVAILABLE
     only, exponential backoff with jitter) spend from that same budget, never beyond it.
  2. When an operation still fails with UNAVAILABLE or DEADLINE_EXCEEDED, the circuit breaker opens for
     `breaker` seconds (default 30): every call in that window answers at once (miss / skipped write),
     counted as a `circuit_open` fault; `unavailable` faults count spent deadlines.
  3. After the window one call probes the server (the others keep answering at once); success closes the
     breaker, failure opens it for another window. So a dead server costs at most one deadline per window.
Auth and other refusals are counted and warned once (FaultCounter) but do not open the breaker.

The deadline is gRPC's own (a deadline on the whole RPC, streamed chunks included), so a server that
drips its answer costs at most `TORCH_NEURONX_FLEET_TIMEOUT`. Reads are bounded: `get` refuses an entry
whose announced size is over 1 GiB before reading a chunk, and stops a stream that sends more.
"""

from __future__ import annotations

import logging
import os
import random
import socket
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from neuron_runtime.cache._base import CacheBackend, EntryInfo, Lease, NullLease, OnceLease, check_key, check_keys
from neuron_runtime.cache._errors import StoreConfigError
from neuron_runtime.cache._faults import FaultCounter

if TYPE_CHECKING:
    from cache_server.client import CacheClient

    from neuron_runtime._config import Config

log = logging.getLogger(__name__)

T = TypeVar("T")

_LOOKUP_BATCH = 10_000
_RETRY_BASE_S = 0.05
_DEFAULT_BREAKER_S = 30.0
_READ_LIMIT = 1024**3


class _Breaker:
    """Closed → (failure) open for `window_s` → one probe → closed or open again. Thread-safe."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._open_until = 0.0
        self._probing = False
        self._lock = threading.Lock()
        self.trips = 0

    def allow(self) -> bool:
        with self._lock:
            if self._open_until == 0.0:
                return True
            if time.monotonic() < self._open_until or self._probing:
                return False
            self._probing = True  # this caller is the one probe of the half-open state
            return True

    def success(self) -> None:
        with self._lock:
            self._open_until = 0.0
            self._probing = False

    def failure(self) -> None:
        with self._lock:
            self._open_until = time.monotonic() + self.window_s
            self._probing = False
            self.trips += 1

    def done(self) -> None:
        """The probe ended without telling us anything about the server (e.g. a refusal)."""
        with self._lock:
            if self._probing:
                self._probing = False
                self._open_until = 0.0

    @property
    def is_open(self) -> bool:
        return self._open_until != 0.0


class _ServerLease(OnceLease):
    def __init__(self, backend: "GrpcBackend", key: str, lease_id: str) -> None:
        self._backend, self._key, self._id = backend, key, lease_id

    def _drop(self) -> None:
        # A failed release is harmless: the lease expires at its TTL and waiters then compile.
        self._backend._guard("release_lease", lambda c, t: c.release_lease(self._key, self._id, timeout=t), False)


class GrpcBackend(CacheBackend):
    tier = "fleet"

    def __init__(self, url: str, *, token: str | None = None, timeout_s: float = 10.0,
                 breaker_s: float | None = None, retries: int = 2) -> None:
        from cache_server import CacheServerError
        from cache_server.client import CacheClient

        u = urllib.parse.urlsplit(url)
        if u.scheme not in ("grpc", "grpcs") or not u.hostname or not u.port:
            raise StoreConfigError(f"{url!r}: expected grpc://HOST:PORT or grpcs://HOST:PORT")
        q = {k: v[-1] for k, v in urllib.parse.parse_qs(u.query).items()}
        unknown = set(q) - {"ca", "cert", "key", "server_name", "breaker"}
        if unknown:
            raise StoreConfigError(f"{url!r}: unknown option(s) {', '.join(sorted(unknown))}")

        def read(name: str) -> bytes | None:
            if name not in q:
                return None
            try:
                return Path(q[name]).expanduser().read_bytes()
            except OSError as e:
                raise StoreConfigError(f"{url!r}: cannot read {name}={q[name]}: {e}") from e

        self.url = url
        self.timeout_s = timeout_s
        self.retries = retries
        #: the largest entry `get` reads (the server's announced size is checked before any chunk)
        self.read_limit = _READ_LIMIT
        self.faults = FaultCounter(self.tier, url.split("?", 1)[0])
        self.breaker = _Breaker(float(q.get("breaker", breaker_s if breaker_s is not None else _DEFAULT_BREAKER_S)))
        host = u.hostname if ":" not in u.hostname else f"[{u.hostname}]"
        self._client: CacheClient = CacheClient(
            f"{host}:{u.port}", token=token, tls=u.scheme == "grpcs", root_certificates=read("ca"),
            client_cert=read("cert"), client_key=read("key"), server_name=q.get("server_name"),
            timeout=timeout_s)
        self._server_error: type[Exception] = CacheServerError
        self._holder = f"{socket.gethostname()}:{os.getpid()}"
        self._closed = False

    # -- the policy ------------------------------------------------------------------------------------

    def _guard(self, op: str, fn: Callable[["CacheClient", float], T], default: T) -> T:
        """Run `fn(client, remaining_seconds)` under the deadline budget, retries and breaker."""
        from cache_server import Unavailable

        if self._closed:
            return default
        if not self.breaker.allow():
            # Answered at once without touching the network; still a miss caused by the server, so counted
            # (its own kind: one warning, and "unavailable" keeps counting only spent deadlines).
            self.faults.record("circuit_open", op, "the server failed recently; retrying after the breaker window")
            return default
        deadline = time.monotonic() + self.timeout_s
        attempt = 0
        while True:
            remaining = deadline - time.monotonic()
            try:
                result = fn(self._client, max(remaining, 0.001))
            except Unavailable as e:
                remaining = deadline - time.monotonic()
                backoff = _RETRY_BASE_S * (2 ** attempt) * (0.5 + random.random())
                if attempt >= self.retries or remaining <= backoff:
                    self.breaker.failure()
                    self.faults.record("unavailable", op, f"{e} (breaker open for {self.breaker.window_s:g} s)")
                    return default
                attempt += 1
                time.sleep(backoff)
                continue
            except self._server_error as e:
                # The server answered: it is alive, this request was refused.
                self.breaker.done()
                kind = type(e).__name__.lower()
                self.faults.record("auth" if kind in ("unauthenticated", "permissiondenied") else kind, op, e)
                return default
            except Exception as e:  # anything else from the transport is a miss, never the user's problem
                self.breaker.done()
                self.faults.record("error", op, repr(e))
                return default
            self.breaker.success()
            return result

    # -- the contract ----------------------------------------------------------------------------------

    def get(self, key: str, limit: int | None = None) -> bytes | None:
        check_key(key)
        cap = self.cap(self.read_limit, limit)
        return self._guard("get", lambda c, t: c.get(key, timeout=t, limit=cap), None)

    def _put(self, key: str, data: bytes) -> bool:
        # Created or already present: either way the key is now in the store.
        return self._guard("put", lambda c, t: (c.put(key, data, timeout=t), True)[1], False)

    def contains_many(self, keys: Iterable[str]) -> set[str]:
        wanted = check_keys(list(dict.fromkeys(keys)))
        found: set[str] = set()
        for i in range(0, len(wanted), _LOOKUP_BATCH):
            batch = wanted[i:i + _LOOKUP_BATCH]
            present = self._guard("contains_many", lambda c, t: c.lookup(batch, timeout=t), None)
            if present is None:
                break
            found.update(k for k, p in zip(batch, present) if p)
        return found

    def delete(self, key: str) -> bool:
        check_key(key)
        return self._guard("delete", lambda c, t: c.delete(key, timeout=t), False)

    def entries(self) -> Iterator[EntryInfo]:
        # Listing can be long: it gets a generous deadline, and is materialized inside the guard so a
        # failure midway is one counted fault rather than an exception out of the iterator.
        def run(c: "CacheClient", t: float) -> list[EntryInfo]:
            return [EntryInfo(e.key, e.size, e.mtime) for e in c.list(timeout=max(t, 60.0))]

        yield from self._guard("entries", run, [])

    def try_lease(self, key: str, ttl_s: float) -> Lease | None:
        check_key(key)
        res = self._guard("try_lease", lambda c, t: c.acquire_lease(key, ttl_s, self._holder, timeout=t), None)
        if res is None:
            # No server answer: compile without a lease (correctness is unaffected; puts are first-wins).
            return NullLease()
        if res.acquired:
            return _ServerLease(self, key, res.lease_id)
        # Held by someone else, or already stored: either way the caller waits (and finds it at once).
        return None

    def wait_for(self, key: str, timeout_s: float) -> bytes | None:
        from cache_server import LeaseState

        check_key(key)
        deadline = time.monotonic() + timeout_s
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return self.get(key)
            # Server-side waits are chunked so a lost connection is noticed within a deadline or so.
            step = min(remaining, max(self.timeout_s, 1.0) * 3)
            state = self._guard("wait_for", lambda c, t: c.wait_for(key, step), None)
            if state is None:
                return self.get(key)
            if state is LeaseState.STORED:
                return self.get(key)
            if state in (LeaseState.RELEASED, LeaseState.NO_LEASE):
                # The holder gave up or died: one last look, then the caller compiles itself.
                return self.get(key)

    def server_stats(self) -> dict[str, object] | None:
        return self._guard("stats", lambda c, t: c.stats(timeout=t), None)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._client.close()


def open_grpc(url: str, cfg: "Config | None" = None) -> GrpcBackend:
    """Factory for the URL registry: `grpc://` and `grpcs://` URLs."""
    if cfg is None:
        from neuron_runtime import _config

        cfg = _config.get()
    return GrpcBackend(url, token=cfg.cache_token, timeout_s=cfg.fleet_timeout_s)


__all__ = ["GrpcBackend", "open_grpc"]

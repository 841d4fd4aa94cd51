"""The fleet store behind `redis://` and `rediss://` (TLS): a Redis server or cluster a fleet already runs.

URL: `redis[s]://[USER[:PASSWORD]@]HOST:PORT[/DB][?prefix=P&ttl=30d&max_entry=256MiB&cluster=1&ca=FILE&cert=FILE&key=FILE]`.
Without a password in the URL, `TORCH_NEURONX_CACHE_TOKEN` is the password (AUTH, with USER for an ACL
user). `cluster=1` talks to a Redis Cluster (the node in the URL is where discovery starts).

Layout (one string per key, bytes only)::

    {prefix}v1:{key}          the entry (the envelope's bytes)
    {prefix}v1:lease:{key}    a compile lease: a random nonce, with the lease's TTL as the key's expiry

Guarantees:
  * `put` is `SET NX` (+ `PX ttl`): atomic and first-writer-wins, in one command.
  * Leases are `SET NX PX`: exactly one holder fleet-wide; the server expires a dead holder's lease (its
    clock, not the hosts'), and release is a compare-and-delete script, so a late release never drops a
    newer holder's lease.
  * `ttl=` gives every entry an expiry that each read renews (`GETEX PX`, Redis >= 6.2): entries nobody
    reads leave. Without it entries stay until deleted or evicted by the server's `maxmemory-policy`
    (use `allkeys-lru`, or `volatile-lru` with `ttl=`); an evicted entry is a miss and is recompiled.
  * `max_entry=` (default 256 MiB; Redis refuses values over its `proto-max-bulk-len`, 512 MiB by
    default) is checked before sending: a bigger entry is a skipped write with one clear warning.

Failure policy: as the other fleet stores (`FleetStore`): a miss or a skipped write, counted by kind
(`timeout`, `unavailable`, `permission` for wrong credentials or ACLs, `full` for an OOM refusal,
`too_large`), one warning per kind, and after a timeout or connection failure the store is skipped for a
cooldown (so a Redis being restarted costs one timeout, not one per op). Each call is bounded as a whole
by `TORCH_NEURONX_FLEET_TIMEOUT` (`FleetStore._guard`: connect, send, every reply byte and the one retry
together); a dropped connection is retried once (a restarted server's stale pooled connection), then
counted.

Read bounds (`_BoundedParser`, the reply parser of every connection): a bulk reply announced over
`max_entry` bytes is refused from its length line, before one byte of it is read (fault kind
`too_large`, the connection dropped); a reply line over 64 KiB or an array over a million items is
refused too; and every socket read is bounded by what is left of the call's deadline, so an abandoned
call ends there too.
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket
import threading
import time
import urllib.parse
import uuid
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

from neuron_runtime.cache import _urls
from neuron_runtime.cache._base import EntryInfo, Lease, NullLease, OnceLease, check_key, check_keys
from neuron_runtime.cache._deadline import deadline, remaining
from neuron_runtime.cache._errors import StoreConfigError
from neuron_runtime.cache._fleet import LAYOUT_VERSION, FleetStore, ReadRefused

if TYPE_CHECKING:
    from neuron_runtime._config import Config

log = logging.getLogger(__name__)

DEFAULT_PREFIX = "neff:"
DEFAULT_MAX_ENTRY = 256 * 1024**2
_OPTIONS = {"prefix", "ttl", "max_entry", "cluster", "ca", "cert", "key"}

# Compare-and-delete: only the holder whose nonce is stored may drop the lease.
_RELEASE = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end return 0"
# Delete the entry only if it still holds the bytes we refused (by their sha1), so a good entry another
# host republished meanwhile survives.
_QUARANTINE = ("local v = redis.call('get', KEYS[1]) "
               "if v and redis.sha1hex(v) == ARGV[1] then return redis.call('del', KEYS[1]) end return 0")


class RedisStore(FleetStore):
    """`redis://` / `rediss://`: see the module docstring for the URL, layout and guarantees."""

    max_entry: int
    max_entry_note = " (Redis itself refuses values over its proto-max-bulk-len, 512 MiB by default)"

    def __init__(self, url: str, *, password: str | None = None, timeout_s: float = 10.0) -> None:
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        parts, opts, port = _urls.split(url, "redis", "rediss", _OPTIONS, "redis://HOST:PORT or rediss://HOST:PORT")
        super().__init__(_urls.redact(url), timeout_s)
        self.prefix = opts.get("prefix", DEFAULT_PREFIX)
        self.ttl_ms = int(_urls.duration(url, "ttl", opts["ttl"]) * 1000) if "ttl" in opts else None
        self.max_entry = _urls.size(url, "max_entry", opts["max_entry"]) if "max_entry" in opts else DEFAULT_MAX_ENTRY
        self.cluster = opts.get("cluster", "0").lower() in ("1", "true", "yes")
        db = parts.path.strip("/")
        if db and (not db.isdigit() or self.cluster):
            raise StoreConfigError(f"{_urls.redact(url)!r}: the path is a database number (and a cluster has only 0)")
        kwargs: dict[str, Any] = {
            "host": parts.hostname,
            "port": port or 6379,
            "username": urllib.parse.unquote(parts.username) if parts.username else None,
            "password": urllib.parse.unquote(parts.password) if parts.password else password,
            "socket_timeout": timeout_s,
            "socket_connect_timeout": min(timeout_s, 5.0),
            # One retry: the first command after a server restart meets a dead pooled connection.
            "retry": Retry(NoBackoff(), 1),
            "client_name": f"neuron-runtime:{socket.gethostname()}:{os.getpid()}",
            # Every connection parses its replies with the bounds of `bounded_parser`.
            "redis_connect_func": self._on_connect,
        }
        if parts.scheme == "rediss":
            kwargs.update(ssl=True, ssl_ca_certs=opts.get("ca"), ssl_certfile=opts.get("cert"),
                          ssl_keyfile=opts.get("key"))
        self._kwargs = kwargs
        self._db = int(db or 0)
        self._client: Any = None
        self._client_lock = threading.Lock()
        self._redis_errors = redis.exceptions
        self._parsers: dict[type, type] = {}

    def _on_connect(self, connection: Any) -> None:
        """redis-py's hook for a new connection: our reply parser, then (not in a cluster, whose client
        ran it already) the usual handshake (AUTH, SELECT, CLIENT SETNAME)."""
        base = type(connection._parser)  # RESP2 or RESP3, as the client chose
        if base not in self._parsers.values():
            if base not in self._parsers:
                self._parsers[base] = bounded_parser(base, self.max_entry)
            connection.set_parser(self._parsers[base])
        if self.cluster:
            connection._parser.on_connect(connection)
        else:
            connection.on_connect()

    @property
    def client(self) -> Any:
        """The redis-py client, made on first use: a cluster client connects while it is made (slot
        discovery), which must happen under `_guard` (a down cluster is a miss, never an error here)."""
        if self._client is None:
            with self._client_lock:
                if self._client is None:
                    import redis

                    if self.cluster:
                        from redis.cluster import RedisCluster

                        self._client = RedisCluster(**self._kwargs)
                    else:
                        self._client = redis.Redis(db=self._db, **self._kwargs)
        return self._client

    # ------------------------------------------------------------------ layout and errors

    def _k(self, key: str) -> str:
        return f"{self.prefix}{LAYOUT_VERSION}:{check_key(key)}"

    def _lk(self, key: str) -> str:
        return f"{self.prefix}{LAYOUT_VERSION}:lease:{check_key(key)}"

    def _classify(self, e: BaseException) -> str:
        errors = self._redis_errors
        text = str(e).upper()
        if isinstance(e, (errors.AuthenticationError, errors.AuthorizationError, errors.NoPermissionError,
                          errors.ReadOnlyError)) or text.startswith(("NOAUTH", "WRONGPASS", "NOPERM")):
            return "permission"
        if isinstance(e, errors.TimeoutError):
            return "timeout"
        if isinstance(e, errors.ConnectionError):
            return "unavailable"
        if isinstance(e, errors.OutOfMemoryError) or text.startswith("OOM"):
            return "full"
        if isinstance(e, errors.ResponseError):
            return "server"
        return super()._classify(e)

    # ------------------------------------------------------------------ the contract

    def get(self, key: str, limit: int | None = None) -> bytes | None:
        k = self._k(key)

        def read() -> bytes | None:
            # A call's own limit below the store's cap: the value's length first (STRLEN), one round trip
            # more; the reply parser still stops at `max_entry` should it grow in between.
            if limit is not None and limit < self.max_entry and int(self.client.strlen(k)) > limit:
                return None
            data = self.client.getex(k, px=self.ttl_ms) if self.ttl_ms else self.client.get(k)
            return None if data is None else bytes(data)

        return self._guard("get", None, read)

    def get_many(self, keys: Iterable[str], parallel: int = 8) -> dict[str, bytes]:
        """One pipelined round trip (per cluster node) for all `keys`: no separate existence check."""
        wanted = check_keys(list(dict.fromkeys(keys)))
        if not wanted:
            return {}

        def read() -> dict[str, bytes]:
            pipe = self.client.pipeline(transaction=False)
            for key in wanted:
                if self.ttl_ms:
                    pipe.getex(self._k(key), px=self.ttl_ms)
                else:
                    pipe.get(self._k(key))
            return {key: bytes(v) for key, v in zip(wanted, pipe.execute()) if v is not None}

        found: dict[str, bytes] = self._guard("get_many", {}, read)
        return found

    def _put(self, key: str, data: bytes) -> bool:
        k = self._k(key)
        # SET NX: created, or None when the key exists (another host won): either way the key is stored.
        return self._guard("put", False, lambda: (self.client.set(k, data, nx=True, px=self.ttl_ms), True)[1])

    def contains_many(self, keys: Iterable[str]) -> set[str]:
        wanted = check_keys(list(dict.fromkeys(keys)))
        if not wanted:
            return set()

        def exists() -> set[str]:
            pipe = self.client.pipeline(transaction=False)
            for key in wanted:
                pipe.exists(self._k(key))
            return {key for key, n in zip(wanted, pipe.execute()) if n}

        found: set[str] = self._guard("contains_many", set(), exists)
        return found

    def delete(self, key: str) -> bool:
        k = self._k(key)
        return self._guard("delete", False, lambda: bool(self.client.delete(k)))

    def quarantine(self, key: str, bad: bytes) -> bool:
        """Delete the entry only if it still holds `bad` (compared by sha1 on the server)."""
        k = self._k(key)
        digest = hashlib.sha1(bad, usedforsecurity=False).hexdigest()
        return self._guard("quarantine", False, lambda: bool(self.client.eval(_QUARANTINE, 1, k, digest)))

    def entries(self) -> Iterator[EntryInfo]:
        """SCAN over the prefix (every primary of a cluster); size from STRLEN, time from OBJECT IDLETIME
        (the last read or write; now where the server's eviction policy does not track it)."""
        pattern = _glob_escape(f"{self.prefix}{LAYOUT_VERSION}:") + "?" * 64
        start = len(self.prefix) + len(LAYOUT_VERSION) + 1

        def listing() -> list[EntryInfo]:
            names = [n.decode() if isinstance(n, bytes) else n
                     for n in self.client.scan_iter(match=pattern, count=1000)]
            keys = [n[start:] for n in names]
            keys = [k for k in keys if len(k) == 64 and k == k.lower() and all(c in "0123456789abcdef" for c in k)]
            now = time.time()
            out = []
            for key in keys:
                size = self.client.strlen(self._k(key))
                try:
                    idle = float(self.client.object("idletime", self._k(key)) or 0)
                except self._redis_errors.ResponseError:
                    idle = 0.0  # an LFU eviction policy keeps no idle time
                if size:
                    out.append(EntryInfo(key=key, size=int(size), mtime=now - idle))
            return out

        found: list[EntryInfo] = self._guard("entries", [], listing, bounded=False)
        return iter(found)

    # ------------------------------------------------------------------ leases

    def try_lease(self, key: str, ttl_s: float) -> Lease | None:
        k = self._lk(key)
        nonce = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex}"
        ttl_ms = max(1, int(ttl_s * 1000))

        def take() -> Lease | None:
            return _RedisLease(self, k, nonce) if self.client.set(k, nonce, nx=True, px=ttl_ms) else None

        no_lease: Lease | None = NullLease()
        result: Lease | None = self._guard("lease", no_lease, take)
        return result

    def _lease_live(self, key: str) -> bool:
        k = self._lk(key)
        return self._guard("lease", False, lambda: bool(self.client.exists(k)))

    def close(self) -> None:
        if self._client is None:
            return
        try:
            self._client.close()
        except Exception:  # noqa: BLE001 - closing a broken connection pool is not worth a fault
            pass


class _RedisLease(OnceLease):
    def __init__(self, store: RedisStore, name: str, nonce: str) -> None:
        self._store, self._name, self._nonce = store, name, nonce

    def _drop(self) -> None:
        store = self._store
        # A failed release is harmless: the server expires the lease at its TTL.
        store._guard("lease release", None, lambda: store.client.eval(_RELEASE, 1, self._name, self._nonce))


_MAX_LINE = 64 * 1024
_MAX_ITEMS = 1 << 20


def bounded_parser(base: type, limit: int) -> type:
    """redis-py's reply parser `base` (RESP2 or RESP3) with read bounds (see the module docstring): bulk
    replies of at most `limit` bytes, decided on the announced length; every socket read within the
    call's deadline."""
    from redis._parsers.socket import SENTINEL, SocketBuffer
    from redis.exceptions import ConnectionError as RedisConnectionError
    from redis.exceptions import InvalidResponse

    class Buffer(SocketBuffer):  # type: ignore[misc]
        def _read_from_socket(self, length: int | None = None, timeout: object = SENTINEL,
                              raise_on_timeout: bool | None = True) -> bool:
            if deadline() is None:
                return bool(super()._read_from_socket(length, timeout, raise_on_timeout))
            # One recv at a time, each within what is left of the call (a drip never outlasts it).
            start = self.unread_bytes()
            while True:
                left = remaining()
                assert left is not None
                t = left if timeout is SENTINEL or timeout is None else min(float(timeout), left)  # type: ignore[arg-type]
                if not super()._read_from_socket(None, t, raise_on_timeout):
                    return False
                if length is None or self.unread_bytes() - start >= length:
                    return True

        def readline(self, timeout: object = SENTINEL) -> bytes:
            buf = self._buffer
            data = buf.readline()
            while not data.endswith(b"\r\n"):
                if len(data) > _MAX_LINE:
                    raise InvalidResponse(f"a reply line over {_MAX_LINE} bytes: not a Redis server's answer")
                self._read_from_socket(timeout=timeout)
                data += buf.readline()
            return bytes(data[:-2])

    class BoundedParser(base):  # type: ignore[misc, valid-type]
        def on_connect(self, connection: Any) -> None:
            super().on_connect(connection)
            self._buffer = Buffer(self._sock, self.socket_read_size, connection.socket_timeout)

        def _read_response(self, *args: Any, **kwargs: Any) -> Any:
            raw = self._buffer.readline(timeout=kwargs.get("timeout", SENTINEL))
            if not raw:
                raise RedisConnectionError("Connection closed by server.")
            byte, rest = raw[:1], raw[1:]
            if byte in b"$=!" and rest != b"-1":  # a bulk string, verbatim string, blob error
                n = _length(rest)
                if n > limit:
                    raise ReadRefused("too_large", f"the server announced a {n}-byte value, over this store's "
                                      f"max_entry of {limit} bytes; refused unread (raise it with ?max_entry=)")
            elif byte in b"*%~>" and rest != b"-1" and _length(rest) > _MAX_ITEMS:
                raise InvalidResponse(f"a reply of {rest[:32]!r} items: not a Redis server's answer")
            self._buffer.rewind(self._buffer.get_pos() - len(raw) - 2)  # the checked line, for the parser
            return super()._read_response(*args, **kwargs)

    def _length(text: bytes) -> int:
        if not text.isdigit():
            raise InvalidResponse(f"bad length {text[:32]!r} in a reply")
        return int(text)

    return BoundedParser


def _glob_escape(text: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


def open_redis(url: str, cfg: Config) -> RedisStore:
    """Factory for the URL registry: `redis://` and `rediss://` URLs."""
    return RedisStore(url, password=cfg.cache_token, timeout_s=cfg.fleet_timeout_s)


__all__ = ["RedisStore", "open_redis"]

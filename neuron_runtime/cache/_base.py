"""The one contract every cache tier implements.

Keys are 64 lowercase hex characters (sha256 of the canonical signature JSON; see `_signature.py`).
Values are *bytes only*: whole envelopes (see `neuron_runtime.cache.envelope`), never Python objects.

Failure rules (every backend, every method):
  * A backend problem (I/O error, timeout, throttling, permission, server down) is never raised to the
    caller: `get` returns None, `put` returns False, `contains_many` returns what it could confirm. The
    backend counts it and warns once per kind of problem (`logging` + `warnings`).
  * Time and memory are bounded whatever the store answers: a fleet store's call returns within its
    whole-call deadline (`TORCH_NEURONX_FLEET_TIMEOUT`: connect, send, receive and retries together;
    past it a miss, counted as `timeout`, and the store is skipped for a while), and a read checks the
    size it is told before reading and never reads more than its cap + 1 byte (`FleetStore` in `_fleet`
    does both for the path, S3, Redis and HTTP stores; the gRPC backend uses gRPC's deadlines).
  * Integrity is *not* the backend's job: it returns the bytes it has; the tiered cache verifies the
    envelope and calls `delete` (or `quarantine`) on a bad entry. That failure is loud and counted.
  * `put` is first-writer-wins and atomic: a reader sees either no entry or a whole one, never a torn one.
    Writing a key that exists is a no-op that returns True.
  * `put`'s opening checks are the contract's, the same for every backend, and run once in
    `CacheBackend.put` before the backend's own `_put`: a key that is not 64 lowercase hex characters
    raises `InvalidKeyError` and a value that is not bytes-like raises `TypeError` (misuse: loud, nothing
    stored); a value over the store's `max_entry` (None: no cap) is a skipped write (False), counted in
    the store's `faults` as `too_large` with one warning naming `?max_entry=`. `_put` gets exact `bytes`.

Concurrency: every method may be called from several threads at once, and several processes (or hosts,
for fleet stores) may share the same store.
"""

from __future__ import annotations

import abc
import re
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from neuron_runtime.cache._faults import FaultCounter

KEY_RE = re.compile(r"^[0-9a-f]{64}$")


class CacheError(Exception):
    """Base of the runtime's cache errors (raised only for misuse and integrity failures)."""


class InvalidKeyError(CacheError, ValueError):
    """A key that is not 64 lowercase hex characters (never reaches a path or an object name)."""


def check_key(key: str) -> str:
    if not isinstance(key, str) or not KEY_RE.match(key):
        raise InvalidKeyError(f"invalid cache key {key!r}: expected 64 lowercase hex characters")
    return key


def check_keys(keys: list[str]) -> list[str]:
    """`check_key` for many keys at once (a per-key regex was most of a 1,000-key lookup's client time):
    `fromhex(joined).hex() == joined` holds only for lowercase hex, and each key must be 64 long."""
    try:
        joined = "".join(keys)
        ok = bytes.fromhex(joined).hex() == joined and set(map(len, keys)) <= {64}
    except (TypeError, ValueError):
        ok = False
    if not ok:
        for k in keys:
            check_key(k)
    return keys


@dataclass(frozen=True)
class EntryInfo:
    key: str
    size: int
    mtime: float  # seconds since the epoch; last write (or last access where the tier tracks it)


class Lease(abc.ABC):
    """A claim to compile one key, held until `release()` or until its TTL expires.

    Whoever holds the lease compiles and `put`s; others `wait` (bounded) and then `get`.
    """

    @abc.abstractmethod
    def release(self) -> None: ...

    def __enter__(self) -> "Lease":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class CacheBackend(abc.ABC):
    """A byte store keyed by cache key. See the module docstring for the failure and concurrency rules."""

    #: tier name used in `stats()["hits"]` ("memory", "local", "fleet").
    tier: str = "fleet"
    #: the URL or path it was opened with (for messages and `neuron-cache stats`).
    url: str = ""
    #: False where the store cannot enumerate its entries (an HTTP cache): `entries()` is then empty and
    #: the CLI says so instead of reporting an empty tier.
    lists_entries: bool = True
    #: the largest value `put` sends, in bytes (None: no cap of the store's own); see the module docstring.
    max_entry: int | None = None
    #: what the `too_large` warning adds after naming `?max_entry=` (a store's own limit behind the cap).
    max_entry_note: str = ""
    #: counts the store's faults by kind, warning once per kind (`put` records `too_large` here).
    faults: FaultCounter

    @abc.abstractmethod
    def get(self, key: str, limit: int | None = None) -> bytes | None:
        """The stored bytes, or None on a miss or any backend problem. With `limit`, a value over `limit`
        bytes is a miss too, found without reading it (a stat, a Content-Length, a length first where the
        store has one) and never by reading more than `limit` + 1 bytes of it; the store's own read cap
        (`max_entry`) applies either way. For data with a small bound of its own (a job's manifest
        segments): a store holding a 1 GiB value under such a key costs its reader nothing."""

    def put(self, key: str, data: bytes) -> bool:
        """Store atomically, first writer wins. True if the key is now present, False if skipped.

        Runs the contract's opening checks (module docstring), then the backend's `_put`."""
        check_key(key)
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise TypeError(f"cache values are bytes, not {type(data).__name__}")
        blob = bytes(data)
        if self.max_entry is not None and len(blob) > self.max_entry:
            self.faults.record("too_large", "put",
                               f"entry {key} is {len(blob)} bytes, over this store's per-entry cap of "
                               f"{self.max_entry} bytes; raise it with ?max_entry={self.max_entry_note}")
            return False
        return self._put(key, blob)

    def _put(self, key: str, data: bytes) -> bool:
        """The backend's own write of `put`, after its checks: `key` is valid and `data` is exact `bytes`
        within `max_entry`. Same return and failure rules as `put`. (Not abstract, so that a backend
        written before `_put` existed, which overrides `put` itself, still works.)"""
        raise NotImplementedError(f"{type(self).__name__} implements neither _put nor put")

    def contains_many(self, keys: Iterable[str]) -> set[str]:
        """The subset of `keys` present (one round trip where the backend can batch)."""
        return {k for k in keys if self.get(k) is not None}

    @staticmethod
    def cap(max_entry: int | None, limit: int | None) -> int | None:
        """The read cap of one `get`: the smaller of the store's `max_entry` and the call's `limit`."""
        return limit if max_entry is None else max_entry if limit is None else min(max_entry, limit)

    def get_many(self, keys: Iterable[str], parallel: int = 8) -> dict[str, bytes]:
        """The stored bytes of those `keys` that are present: one `contains_many`, then up to `parallel`
        `get`s in flight (a prefetch of a job's entries). Same failure rules as `get`."""
        present = sorted(self.contains_many(keys))
        if not present:
            return {}
        out: dict[str, bytes] = {}
        with ThreadPoolExecutor(max_workers=max(1, min(parallel, len(present))),
                                thread_name_prefix="neuron-cache-get") as pool:
            for key, data in zip(present, pool.map(self.get, present)):
                if data is not None:
                    out[key] = data
        return out

    @abc.abstractmethod
    def delete(self, key: str) -> bool:
        """Remove an entry (used for quarantine and prune). True if it existed."""

    @abc.abstractmethod
    def entries(self) -> Iterator[EntryInfo]:
        """Every entry with its size and time (for `neuron-cache ls/stats/verify/prune`)."""

    def try_lease(self, key: str, ttl_s: float) -> Lease | None:
        """Claim the compile of `key` fleet-wide. None if someone else holds a live lease.

        Backends without leases return a no-op lease (everyone compiles; correctness is unaffected)."""
        return NullLease()

    def wait_for(self, key: str, timeout_s: float) -> bytes | None:
        """Wait (bounded) for another holder's entry to appear; None when the wait ran out."""
        return self.get(key)

    def close(self) -> None:
        """Release resources. Idempotent."""


class NullLease(Lease):
    """No claim at all: handed out by stores without leases, or that cannot hold one right now (down,
    read-only). The holder compiles; first-writer-wins puts keep the result correct."""

    def release(self) -> None:
        pass


class OnceLease(Lease):
    """A lease whose `release` runs `_drop` at most once, however often it is called (holders release in
    `finally` blocks and context managers alike). `_drop` must not raise (a store guards it)."""

    _released = False

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        self._drop()

    @abc.abstractmethod
    def _drop(self) -> None: ...

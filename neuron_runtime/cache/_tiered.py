"""The executable cache as the dispatcher sees it: local tier, then the fleet store, then a compile.

`TieredCache.get_or_compile(key, compile_fn)` is the whole miss path:

1. Look the key up in each tier, fastest first. Every entry is verified (`envelope.unpack`: digest,
   key, and the HMAC when a signing key is set) before it is returned; a bad one is quarantined (deleted
   from that tier, counted in `stats["corrupt"]`, warned about once per tier and reason) and is a miss.
   A hit in a slower tier is copied into the faster ones.
2. Single-flight, so each key is compiled once per fleet, with every wait bounded:
   a. per process: the first thread becomes the leader; other threads wait for its result
      (`lock_timeout_s`);
   b. per host: a per-key `flock` in the local cache directory (`lock_timeout_s`; a dead holder's lock
      is dropped by the kernel);
   c. per fleet: the store's lease; others `wait_for` the entry, then load it. A dead holder's lease
      is taken over after `lease_ttl_s`; the whole wait is bounded by `max(lock_timeout_s, lease_ttl_s)`.
   After each wait the tiers are checked again; when a wait runs out, the waiter compiles itself.
3. Compile, verify the new entry, and write it through to every tier (not in `readonly` mode).

Stats (a dict owned by the runtime, updated in place, thread-safe): `hits` (a dict by tier name:
`local`, `fleet`), `misses` (lookups that found nothing usable; once per `get_or_compile`), `compiles`,
`corrupt` (entries refused and quarantined), `fleet_errors` (fleet backend faults: timeouts, 5xx,
throttling, permission, down), `writes_skipped` (a tier's `put` that failed), `lease_waits` (times a
compile waited for another holder's lease).

Modes (`TORCH_NEURONX_CACHE_MODE`): `readwrite`; `readonly` (nothing is written or deleted in any tier,
no leases are taken); `strict` (like readwrite, but a miss raises `CacheMissError` instead of compiling).
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from neuron_runtime import _profiling

from neuron_runtime.cache import envelope
from neuron_runtime.cache._base import CacheBackend, Lease, check_key
from neuron_runtime.cache._errors import CacheMissError, IntegrityError
from neuron_runtime.cache._faults import WarnOnce
from neuron_runtime.cache._locks import Flights, HostLocks

if TYPE_CHECKING:
    from neuron_runtime._config import Config

log = logging.getLogger(__name__)

STAT_KEYS = ("misses", "compiles", "corrupt", "fleet_errors", "writes_skipped", "lease_waits")
#: `get`/`get_or_compile` report where the entry came from: a tier name, or one of these.
MISS, COMPILED, WAITED = "miss", "compiled", "waited"
_FAILED: Any = object()  # sentinel: a backend call raised


class TieredCache:
    """Verified reads from `local` then `fleet`; single-flight compiles; write-through puts.

    `local` and `fleet` are `CacheBackend`s (`fleet` may be None: the local tier is then the whole
    cache). `cfg` supplies `signing_key`, `cache_mode`, `single_flight`, `lock_timeout_s`, `lease_ttl_s`
    and `local_cache_dir` (for host lock files). Never raises for backend trouble; raises
    `IntegrityError` only for an entry produced by `compile_fn`/`put` that does not verify (a bug in
    the producer), and `CacheMissError` on a miss in strict mode.
    """

    def __init__(self, local: CacheBackend, fleet: CacheBackend | None, cfg: Config, stats: dict[str, Any]) -> None:
        self.local = local
        self.fleet = fleet
        self.cfg = cfg
        self.stats = stats
        self._stats_lock = threading.Lock()
        with self._stats_lock:
            hits = stats.setdefault("hits", {})
            for name in ("local", "fleet"):
                hits.setdefault(name, 0)
            for name in STAT_KEYS:
                stats.setdefault(name, 0)
        self.tiers: list[tuple[str, CacheBackend]] = [("local", local)]
        if fleet is not None:
            self.tiers.append(("fleet", fleet))
            faults = getattr(fleet, "faults", None)
            if faults is not None and hasattr(faults, "subscribe"):
                faults.subscribe(lambda kind, op: self._count("fleet_errors"))
        self._flights = Flights()
        lock_dir = getattr(local, "locks_dir", None) or os.path.join(cfg.local_cache_dir, "locks")
        self._host_locks = HostLocks(lock_dir)
        self._warn = WarnOnce()

    @classmethod
    def from_config(cls, cfg: Config, stats: dict[str, Any]) -> TieredCache:
        """The runtime's cache: `LocalCache` under `cfg.local_cache_dir`, plus `open_store(cfg.cache_dir)`."""
        from neuron_runtime.cache._local import LocalCache
        from neuron_runtime.cache._registry import open_store

        local = LocalCache(cfg.local_cache_dir, cfg.cache_max_size)
        fleet = open_store(cfg.cache_dir, cfg) if cfg.cache_dir else None
        return cls(local, fleet, cfg, stats)

    # ------------------------------------------------------------------ helpers

    @property
    def writable(self) -> bool:
        return self.cfg.cache_mode != "readonly"

    def _count(self, name: str, tier: str | None = None) -> None:
        with self._stats_lock:
            if tier is None:
                self.stats[name] = self.stats.get(name, 0) + 1
            else:
                hits = self.stats.setdefault(name, {})
                hits[tier] = hits.get(tier, 0) + 1

    def verify(self, key: str, data: bytes) -> envelope.Entry:
        """`envelope.unpack` with this cache's signing key and policy; raises `IntegrityError`."""
        return envelope.unpack(data, expected_key=key, signing_key=self.cfg.signing_key)

    _verify = verify  # the name the dispatcher used first

    def _quarantine(self, name: str, backend: CacheBackend, key: str, err: IntegrityError,
                    bad: bytes | None = None) -> None:
        self._count("corrupt")
        self._warn(
            f"corrupt:{name}:{err.reason}",
            "neuron-runtime: refused a %s cache entry for key %s (%s); quarantined and treated as a miss. "
            "Further %r refusals in this tier are counted in stats()['corrupt'], not shown",
            name, key, err, err.reason,
        )
        if not self.writable:
            return
        # Stores that can remove "this entry only if it is still the bad one" do so: another host may
        # have republished a good entry under the key since we read it.
        quarantine = getattr(backend, "quarantine", None)
        if bad is not None and quarantine is not None:
            self._safe(name, "quarantine", lambda: quarantine(key, bad), False)
        else:
            self._safe(name, "delete", lambda: backend.delete(key), False)

    def _safe(self, name: str, op: str, fn: Callable[[], Any], default: Any) -> Any:
        """Call a backend method; a backend that breaks the never-raise contract is a fault, not a crash."""
        try:
            return fn()
        except IntegrityError:
            raise
        except Exception as e:  # noqa: BLE001 - contract: backend trouble never reaches the user's op
            if name == "fleet":
                self._count("fleet_errors")
            self._warn(f"raise:{name}:{op}:{type(e).__name__}",
                       "neuron-runtime: %s cache %s raised %r; treated as a miss / skipped write", name, op, e)
            return default

    def _read(self, name: str, backend: CacheBackend, key: str,
              limit: int | None = None) -> tuple[envelope.Entry, bytes] | None:
        data: bytes | None = None
        try:
            data = self._safe(name, "get", lambda: _get(backend, key, limit), None)
            if data is None:
                return None
            return self._verify(key, data), data
        except IntegrityError as e:
            self._quarantine(name, backend, key, e, data)
            return None

    def _fill(self, upto: int, key: str, data: bytes) -> None:
        """Copy an entry found in tier `upto` into the faster tiers before it."""
        if not self.writable:
            return
        for name, backend in self.tiers[:upto]:
            with _profiling.span(f"neuron::cache.put[{name}]"):
                stored = self._safe(name, "put", functools.partial(backend.put, key, data), False)
            if not stored:
                self._count("writes_skipped")

    def _lookup(self, key: str, upto: int | None = None) -> tuple[envelope.Entry, bytes, str] | None:
        for i, (name, backend) in enumerate(self.tiers[:upto]):
            data: bytes | None = None
            try:
                with _profiling.span(f"neuron::cache.get[{name}]", key=key):
                    data = self._safe(name, "get", functools.partial(backend.get, key), None)
                    if data is None:
                        continue
                    entry = self._verify(key, data)
            except IntegrityError as e:
                self._quarantine(name, backend, key, e, data)
                continue
            self._count("hits", name)
            self._fill(i, key, data)
            return entry, data, name
        return None

    def _find(self, key: str) -> tuple[envelope.Entry, bytes, str] | None:
        """`_lookup` in every tier for a public read: checks the key first, counts a miss."""
        check_key(key)
        found = self._lookup(key)
        if found is None:
            self._count("misses")
        return found

    # ------------------------------------------------------------------ public API

    def get(self, key: str) -> tuple[bytes | None, str]:
        """(verified envelope bytes, tier name) or (None, "miss"). Counts a hit or a miss."""
        found = self._find(key)
        return (None, MISS) if found is None else (found[1], found[2])

    def get_entry(self, key: str) -> tuple[envelope.Entry | None, str]:
        """Like `get`, returning the parsed, verified `Entry` (no second verification needed)."""
        found = self._find(key)
        return (None, MISS) if found is None else (found[0], found[2])

    def get_local(self, key: str) -> envelope.Entry | None:
        """The verified entry if the local tier holds it: no fleet store call (which may take up to the
        fleet timeout), no miss counted. For callers that must not wait on a network."""
        check_key(key)
        found = self._lookup(key, upto=1)
        return None if found is None else found[0]

    def get_many(self, keys: list[str]) -> dict[str, envelope.Entry]:
        """Verified entries of those `keys` any tier holds, in as few round trips as each tier allows:
        the local tier key by key, then the fleet store's `get_many` (one batch lookup, parallel gets)
        for the rest; fleet hits fill the local tier. Bad entries are quarantined and left out."""
        out: dict[str, envelope.Entry] = {}
        rest = [check_key(k) for k in dict.fromkeys(keys)]
        for i, (name, backend) in enumerate(self.tiers):
            if not rest:
                break
            with _profiling.span(f"neuron::cache.get_many[{name}]", keys=len(rest)):
                if i == 0:
                    got = {k: d for k in rest if (d := self._safe(name, "get", functools.partial(backend.get, k), None))}
                else:
                    got = self._safe(name, "get_many", functools.partial(backend.get_many, rest), {})
            for key, data in got.items():
                try:
                    out[key] = self._verify(key, data)
                except IntegrityError as e:
                    self._quarantine(name, backend, key, e, data)
                    continue
                self._count("hits", name)
                self._fill(i, key, data)
            rest = [k for k in rest if k not in out]
        return out

    def pack(self, key: str, header: dict[str, Any], payload: bytes) -> bytes:
        """`envelope.pack` with this cache's signing key: what `compile_fn` should return."""
        return envelope.pack(key, header, payload, self.cfg.signing_key)

    def put(self, key: str, data: bytes) -> bool:
        """Verify `data` (raises `IntegrityError` if it is not a valid entry for `key`: a producer bug),
        then write it to every tier, first writer wins. True if at least one tier holds it; False in
        readonly mode or when every tier skipped the write (each skip counted in `writes_skipped`)."""
        check_key(key)
        self._verify(key, data)
        return self._write(key, data)

    def read_tier(self, name: str, key: str, limit: int | None = None) -> envelope.Entry | None:
        """The verified entry tier `name` holds for `key` (a bad one is quarantined), without looking at
        the other tiers or filling them: for data each tier keeps on its own (a job's manifest). With
        `limit`, an entry over `limit` bytes is not read (`CacheBackend.get`): None, as for a miss."""
        check_key(key)
        got = self._read(name, dict(self.tiers)[name], key, limit)
        return None if got is None else got[0]

    def holds(self, name: str, key: str) -> bool:
        """Whether tier `name` has an entry under `key` (whatever it is; nothing of it is read)."""
        check_key(key)
        backend = dict(self.tiers)[name]
        return bool(self._safe(name, "contains", lambda: key in backend.contains_many([key]), False))

    def put_tier(self, name: str, key: str, data: bytes) -> bool:
        """Verify `data`, then write it to tier `name` only (first writer wins); False when skipped."""
        check_key(key)
        self._verify(key, data)
        if not self.writable:
            return False
        backend = dict(self.tiers)[name]
        if self._safe(name, "put", functools.partial(backend.put, key, data), False):
            return True
        self._count("writes_skipped")
        return False

    def _write(self, key: str, data: bytes) -> bool:
        if not self.writable:
            return False
        stored = False
        for name, backend in self.tiers:
            with _profiling.span(f"neuron::cache.put[{name}]", key=key):
                ok = self._safe(name, "put", functools.partial(backend.put, key, data), False)
            if ok:
                stored = True
            else:
                self._count("writes_skipped")
        return stored

    def get_or_compile(
        self, key: str, compile_fn: Callable[[], bytes], *, single_flight: bool | None = None
    ) -> tuple[envelope.Entry, str]:
        """The verified entry for `key` and where it came from: "local", "fleet", "compiled" (this call
        ran `compile_fn`) or "waited" (another thread of this process compiled it).

        `compile_fn()` returns a whole envelope for `key` (see `pack`); it runs at most once per call and,
        with single-flight on (`cfg.single_flight`, or the argument), once per key across the threads,
        processes and hosts sharing these tiers, up to the bounded waits described in the module
        docstring. Its exceptions propagate to this caller; waiting threads then compile themselves.
        """
        found = self._find(key)
        if found is not None:
            return found[0], found[2]
        if self.cfg.cache_mode == "strict":
            raise CacheMissError(key)
        if not (self.cfg.single_flight if single_flight is None else single_flight):
            return self._compile(key, compile_fn), COMPILED

        # 2a. per process
        flight, leader = self._flights.join(key)
        if not leader:
            with _profiling.span("neuron::wait[thread]", key=key):  # another thread compiles the key
                landed = flight.done.wait(self.cfg.lock_timeout_s)
            if landed and not flight.failed:
                result = flight.result
                assert isinstance(result, tuple)
                return result[0], WAITED
            # The leader failed or is stuck: do the work ourselves (with host/fleet single-flight).
            return self._compile_once(key, compile_fn)
        try:
            result = self._compile_once(key, compile_fn)
        except BaseException:
            self._flights.land(key, flight, None, failed=True)
            raise
        self._flights.land(key, flight, result, failed=False)
        return result

    def _compile_once(self, key: str, compile_fn: Callable[[], bytes]) -> tuple[envelope.Entry, str]:
        # 2b. per host
        with _profiling.span("neuron::wait[host]", key=key):  # (another process may hold the key's lock)
            host_lock = self._host_locks.acquire(key, self.cfg.lock_timeout_s)
        try:
            # Look again even if the lock was free: another process may have compiled the entry and let
            # the lock go between our first lookup and this acquire (then it is written already).
            found = self._lookup(key)
            if found is not None:
                return found[0], found[2]
            # 2c. per fleet
            lease: Lease | None = None
            if self.fleet is not None and self.writable:
                got = self._fleet_lease(key)
                if isinstance(got, tuple):
                    return got
                lease = got
            try:
                return self._compile(key, compile_fn), COMPILED
            finally:
                if lease is not None:
                    self._safe("fleet", "lease release", lease.release, None)
        finally:
            if host_lock is not None:
                host_lock.release()

    def _fleet_lease(self, key: str) -> Lease | tuple[envelope.Entry, str] | None:
        """Take the fleet lease for `key`, or wait for its holder's entry. Returns the lease, the entry
        (someone else compiled it), or None (compile without a lease).

        A dead holder's lease goes stale after `lease_ttl_s` and one waiter takes it over; the whole
        wait is bounded by `max(lock_timeout_s, lease_ttl_s)` even if holders keep changing."""
        assert self.fleet is not None
        fleet, ttl = self.fleet, self.cfg.lease_ttl_s
        bound = max(self.cfg.lock_timeout_s, ttl)
        deadline = time.monotonic() + bound
        counted = False
        delay = 0.05
        while True:
            lease = self._safe("fleet", "lease", lambda: fleet.try_lease(key, ttl), _FAILED)
            if lease is _FAILED:
                return None  # the store cannot hold leases right now: compile without one
            if lease is not None:
                assert isinstance(lease, Lease)
                # The previous holder may have finished between our lookup and our lease.
                got = self._read("fleet", fleet, key)
                if got is None:
                    return lease
                self._safe("fleet", "lease release", lease.release, None)
                return self._fleet_hit(key, *got)
            if not counted:
                self._count("lease_waits")
                counted = True
            left = deadline - time.monotonic()
            if left <= 0:
                self._warn("lease-timeout", "neuron-runtime: waited %.0f s for another host to compile %s; "
                           "compiling it here", bound, key)
                return None
            started = time.monotonic()
            with _profiling.span("neuron::wait[lease]", key=key):  # another host compiles the key
                data = self._safe("fleet", "wait_for", lambda: fleet.wait_for(key, left), _FAILED)
            if data is _FAILED:
                return None
            if data is not None:
                try:
                    return self._fleet_hit(key, self._verify(key, data), data)
                except IntegrityError as e:
                    self._quarantine("fleet", fleet, key, e, data)
                    return None
            if time.monotonic() - started < delay:
                # wait_for came back at once (the lease just changed hands): don't spin on try_lease.
                time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
                delay = min(delay * 2, 1.0)

    def _fleet_hit(self, key: str, entry: envelope.Entry, data: bytes) -> tuple[envelope.Entry, str]:
        self._count("hits", "fleet")
        self._fill(1, key, data)
        return entry, "fleet"

    def _compile(self, key: str, compile_fn: Callable[[], bytes]) -> envelope.Entry:
        data = compile_fn()
        self._count("compiles")
        entry = self._verify(key, data)
        self._write(key, data)
        return entry

    def close(self) -> None:
        for name, backend in self.tiers:
            self._safe(name, "close", backend.close, None)


@functools.lru_cache(maxsize=None)
def _takes_limit(cls: type) -> bool:
    return "limit" in inspect.signature(cls.get).parameters


def _get(backend: CacheBackend, key: str, limit: int | None) -> bytes | None:
    """`backend.get(key, limit)`; a backend written before `limit` existed is asked for the whole value,
    which is then refused past `limit` (bounded by its own cap only)."""
    if limit is None:
        return backend.get(key)
    if _takes_limit(type(backend)):
        return backend.get(key, limit=limit)
    data = backend.get(key)
    return None if data is None or len(data) > limit else data

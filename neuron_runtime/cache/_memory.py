"""An in-process byte store (`memory://`): the contract's reference implementation, for tests and tools.

It is *not* the runtime's memory tier (that one holds loaded executables, in the dispatcher).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

from neuron_runtime.cache._base import CacheBackend, EntryInfo, Lease, check_key
from neuron_runtime.cache._faults import FaultCounter


class MemoryStore(CacheBackend):
    tier = "fleet"

    def __init__(self, url: str = "memory://") -> None:
        self.url = url
        self.faults = FaultCounter(self.tier, url)  # nothing fails in a dict; `put`'s `max_entry` counts here
        self._data: dict[str, tuple[bytes, float]] = {}
        self._leases: dict[str, tuple[object, float]] = {}
        self._lock = threading.Lock()

    def get(self, key: str, limit: int | None = None) -> bytes | None:
        check_key(key)
        with self._lock:
            item = self._data.get(key)
        return None if item is None or (limit is not None and len(item[0]) > limit) else item[0]

    def _put(self, key: str, data: bytes) -> bool:
        with self._lock:
            self._data.setdefault(key, (data, time.time()))
        return True

    def delete(self, key: str) -> bool:
        check_key(key)
        with self._lock:
            return self._data.pop(key, None) is not None

    def entries(self) -> Iterator[EntryInfo]:
        with self._lock:
            items = list(self._data.items())
        return iter(EntryInfo(key=k, size=len(v), mtime=t) for k, (v, t) in items)

    def try_lease(self, key: str, ttl_s: float) -> Lease | None:
        check_key(key)
        token = object()
        with self._lock:
            held = self._leases.get(key)
            if held is not None and held[1] > time.monotonic():
                return None
            self._leases[key] = (token, time.monotonic() + ttl_s)
        return _MemoryLease(self, key, token)

    def wait_for(self, key: str, timeout_s: float) -> bytes | None:
        deadline = time.monotonic() + timeout_s
        while True:
            data = self.get(key)
            with self._lock:
                held = self._leases.get(key)
                live = held is not None and held[1] > time.monotonic()
            if data is not None or not live or time.monotonic() >= deadline:
                return data
            time.sleep(0.01)

    def _release(self, key: str, token: object) -> None:
        with self._lock:
            if self._leases.get(key, (None, 0.0))[0] is token:
                del self._leases[key]


class _MemoryLease(Lease):
    def __init__(self, store: MemoryStore, key: str, token: object) -> None:
        self._store, self._key, self._token = store, key, token

    def release(self) -> None:
        self._store._release(self._key, self._token)

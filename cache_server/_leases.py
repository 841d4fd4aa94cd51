"""Compile leases: one holder per key at a time, each with a TTL, and waiters woken when it ends.

These leases live in the server's memory: the disk storage's (one server owns one directory, so they are
fleet-wide). S3 storage keeps its leases in the bucket instead (`storage/s3.py`), shared by every replica.
A lease that is never released simply expires.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from dataclasses import dataclass, field


@dataclass
class _Lease:
    lease_id: str
    expires: float
    holder: str
    event: asyncio.Event = field(default_factory=asyncio.Event)


class Leases:
    def __init__(self) -> None:
        self._held: dict[str, _Lease] = {}

    def _live(self, key: str) -> _Lease | None:
        lease = self._held.get(key)
        if lease is not None and lease.expires <= time.monotonic():
            del self._held[key]
            lease.event.set()
            return None
        return lease

    def active(self) -> int:
        now = time.monotonic()
        return sum(1 for lease in self._held.values() if lease.expires > now)

    def acquire(self, key: str, ttl_s: float, holder: str) -> str | None:
        if self._live(key) is not None:
            return None
        lease_id = secrets.token_hex(12)
        self._held[key] = _Lease(lease_id, time.monotonic() + ttl_s, holder)
        return lease_id

    def release(self, key: str, lease_id: str) -> bool:
        lease = self._held.get(key)
        if lease is None or lease.lease_id != lease_id:
            return False
        del self._held[key]
        lease.event.set()
        return True

    def stored(self, key: str) -> None:
        """The entry arrived: the lease has done its job, wake the waiters."""
        lease = self._held.pop(key, None)
        if lease is not None:
            lease.event.set()

    async def wait(self, key: str, timeout_s: float) -> bool | None:
        """Wait for the live lease on `key` to end. None: there was none; True: it ended; False: timed out."""
        lease = self._live(key)
        if lease is None:
            return None
        deadline = time.monotonic() + timeout_s
        while True:
            now = time.monotonic()
            budget = min(deadline, lease.expires) - now
            if budget <= 0:
                if self._live(key) is not lease:
                    return True
                return False
            try:
                await asyncio.wait_for(lease.event.wait(), budget)
                return True
            except asyncio.TimeoutError:
                continue

"""Single-flight below the fleet: threads of one process, and processes of one host.

* `Flights` (per process): the first thread to miss a key becomes its leader and compiles; the others
  wait on the leader's event (bounded) and take its result, even when no cache tier could store it.
* `HostLocks` (per host): one lock file per key under the local cache directory, held with
  `fcntl.flock`. The kernel drops a flock when its holder dies, so a crashed (even SIGKILLed) holder
  never blocks anyone; a live but stuck holder blocks others for at most the wait bound, after which they
  compile themselves. The lock directory is host-private (never on a shared filesystem, where flock
  semantics vary), like the local tier.
"""

from __future__ import annotations

import fcntl
import logging
import os
import threading
import time
from dataclasses import dataclass, field

log = logging.getLogger(__name__)


@dataclass
class Flight:
    """One in-process compile of a key; followers wait on `done`."""

    done: threading.Event = field(default_factory=threading.Event)
    result: object = None
    failed: bool = False


class Flights:
    """Per-process, per-key leader election (a dict of events under one lock)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._flights: dict[str, Flight] = {}

    def join(self, key: str) -> tuple[Flight, bool]:
        """(flight, is_leader). The leader must call `land` exactly once."""
        with self._lock:
            flight = self._flights.get(key)
            if flight is not None:
                return flight, False
            flight = self._flights[key] = Flight()
            return flight, True

    def land(self, key: str, flight: Flight, result: object, failed: bool) -> None:
        flight.result, flight.failed = result, failed
        with self._lock:
            if self._flights.get(key) is flight:
                del self._flights[key]
        flight.done.set()


class HostLock:
    def __init__(self, fd: int) -> None:
        self._fd: int | None = fd

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_UN)
            finally:
                os.close(fd)

    def __enter__(self) -> "HostLock":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class HostLocks:
    """Per-key `flock` files in `directory` (created 0o700)."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self._ready = False

    def acquire(self, key: str, timeout_s: float) -> HostLock | None:
        """The lock, or None when the wait ran out or lock files cannot be used (then the caller goes on
        without host-level single-flight: correctness never depends on it). Polls with backoff (10 ms up
        to 250 ms) because flock has no timed wait."""
        try:
            if not self._ready:
                os.makedirs(self.directory, mode=0o700, exist_ok=True)
                self._ready = True
            fd = os.open(os.path.join(self.directory, f"{key}.lock"), os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as e:
            log.debug("host lock for %s unavailable: %s", key, e)
            return None
        deadline = time.monotonic() + timeout_s
        delay = 0.01
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return HostLock(fd)
            except BlockingIOError:
                pass
            except OSError as e:
                os.close(fd)
                log.debug("host lock for %s failed: %s", key, e)
                return None
            left = deadline - time.monotonic()
            if left <= 0:
                os.close(fd)
                return None
            time.sleep(min(delay, left))
            delay = min(delay * 1.5, 0.25)

"""Counting and reporting backend trouble: count every failure, warn once per kind.

A backend never raises for I/O trouble (see `_base`); it calls `FaultCounter.record` instead. The tiered
cache subscribes to a backend's counter to keep `stats()["fleet_errors"]` in the runtime's stats dict.
"""

from __future__ import annotations

import logging
import threading
import warnings
from collections.abc import Callable

log = logging.getLogger(__name__)


class CacheWarning(UserWarning):
    """Cache trouble that the runtime worked around (a miss, a skipped write, a quarantined entry)."""


class FaultCounter:
    """Thread-safe counts of failures by kind; the first of each kind is logged and warned about."""

    def __init__(self, tier: str, where: str) -> None:
        self.tier = tier
        self.where = where
        self.counts: dict[str, int] = {}
        self._lock = threading.Lock()
        self._listeners: list[Callable[[str, str], None]] = []

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def subscribe(self, listener: Callable[[str, str], None]) -> None:
        """Call `listener(kind, op)` on every recorded fault (from the failing thread)."""
        with self._lock:
            self._listeners.append(listener)

    def record(self, kind: str, op: str, detail: object = "") -> None:
        """Count one fault of `kind` (e.g. "timeout", "permission", "unavailable") during `op`."""
        with self._lock:
            first = kind not in self.counts
            self.counts[kind] = self.counts.get(kind, 0) + 1
            listeners = list(self._listeners)
        if first:
            # All f-string: `detail` may hold a store's own words, '%' included (never a format string).
            msg = (f"neuron-runtime: {self.tier} cache {self.where}: {op} failed ({kind}): {detail}; "
                   f"treating it as a miss / skipped write (further '{kind}' faults are counted, not shown)")
            log.warning("%s", msg)
            warnings.warn(msg, CacheWarning, stacklevel=3)
        else:
            log.debug("%s cache %s: %s failed (%s): %s", self.tier, self.where, op, kind, detail)
        for listener in listeners:
            listener(kind, op)


class WarnOnce:
    """One log line + warning per distinct message key (for things that are not backend faults)."""

    def __init__(self) -> None:
        self._seen: set[str] = set()
        self._lock = threading.Lock()

    def __call__(self, what: str, msg: str, *args: object) -> None:
        with self._lock:
            if what in self._seen:
                log.debug(msg, *args)
                return
            self._seen.add(what)
        log.warning(msg, *args)
        warnings.warn(msg % args if args else msg, CacheWarning, stacklevel=3)

"""The cache's named errors (all subclasses of `CacheError`).

Backend trouble is never raised (see `_base`); these are for misuse, integrity and strict mode.
"""

from __future__ import annotations

from neuron_runtime.cache._base import CacheError


class IntegrityError(CacheError):
    """An entry failed verification: bad magic or version, truncated, digest or key mismatch, a missing
    or forged signature, or a row that could only be read by unpickling it. Never loaded; the tiered
    cache quarantines it, counts it in `stats["corrupt"]` and recompiles."""

    def __init__(self, reason: str, detail: str = "") -> None:
        #: a short machine-readable reason: "magic", "version", "truncated", "digest", "key",
        #: "unsigned", "signature", "header", "payload" (it records another signature), "pickled".
        self.reason = reason
        super().__init__(f"{reason}: {detail}" if detail else reason)


class CacheMissError(CacheError):
    """A miss in `TORCH_NEURONX_CACHE_MODE=strict`, where compiling is not allowed."""

    def __init__(self, key: str, message: str = "") -> None:
        self.key = key
        super().__init__(
            message
            or f"cache miss for key {key} in strict mode (TORCH_NEURONX_CACHE_MODE=strict): "
            "warm the cache first (`neuron-cache warm -- <your job>`) or use readwrite mode"
        )


class StoreConfigError(CacheError, ValueError):
    """A cache URL the runtime cannot open: an unknown scheme or a missing optional package."""

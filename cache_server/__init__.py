"""neuron-cache-server: the fleet cache service and its client. Never imports torch (a test enforces it)."""

from __future__ import annotations

__version__ = "0.1.0"

from ._errors import (
    CacheServerError,
    ConfigError,
    DataLoss,
    InvalidKey,
    InvalidRequest,
    NotFound,
    PermissionDenied,
    StreamRequired,
    TooLarge,
    Unauthenticated,
    Unavailable,
)
from .client import CacheClient, LeaseState

__all__ = [
    "CacheClient",
    "CacheServerError",
    "ConfigError",
    "DataLoss",
    "InvalidKey",
    "InvalidRequest",
    "LeaseState",
    "NotFound",
    "PermissionDenied",
    "StreamRequired",
    "TooLarge",
    "Unauthenticated",
    "Unavailable",
    "__version__",
]

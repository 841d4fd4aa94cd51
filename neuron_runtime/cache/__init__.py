"""The executable cache, below "a key and some bytes": tiers, verification, single-flight. Torch-free.

    TieredCache            local tier -> fleet store -> single-flight compile   (_tiered.py)
    LocalCache             host-private diskcache, bytes only, LRU byte cap     (_local.py)
    SharedPathStore        shared filesystem, one file per key, O_EXCL leases   (_pathstore.py)
    S3Store                s3://, create-only puts, conditional-put leases      (_s3.py)
    RedisStore             redis://, rediss://: SET NX entries and leases       (_redis.py)
    HttpStore              http(s)://: bazel-remote's /cas + /ac API, WebDAV    (_http.py)
    open_store(url, cfg)   picks a fleet backend by URL scheme                  (_registry.py)

The entry format lives in `neuron_runtime.cache.envelope`; the backend contract in `_base.py`; what the
path, S3, Redis and HTTP stores share (layout, JSON leases, fault kinds, circuit breaker, bounded reads)
in `_fleet.py`; the whole-call deadline of their calls (worker threads the caller stops waiting for) in
`_deadline.py`.
"""

from neuron_runtime.cache._base import CacheBackend, CacheError, EntryInfo, InvalidKeyError, Lease, check_key
from neuron_runtime.cache._errors import CacheMissError, IntegrityError, StoreConfigError
from neuron_runtime.cache._faults import CacheWarning
from neuron_runtime.cache._http import HttpStore
from neuron_runtime.cache._local import LocalCache
from neuron_runtime.cache._memory import MemoryStore
from neuron_runtime.cache._pathstore import SharedPathStore
from neuron_runtime.cache._redis import RedisStore
from neuron_runtime.cache._registry import open_store, register_scheme
from neuron_runtime.cache._s3 import S3Store
from neuron_runtime.cache._tiered import TieredCache

__all__ = [
    "CacheBackend",
    "CacheError",
    "CacheMissError",
    "CacheWarning",
    "EntryInfo",
    "HttpStore",
    "IntegrityError",
    "InvalidKeyError",
    "Lease",
    "LocalCache",
    "MemoryStore",
    "RedisStore",
    "S3Store",
    "SharedPathStore",
    "StoreConfigError",
    "TieredCache",
    "check_key",
    "open_store",
    "register_scheme",
]

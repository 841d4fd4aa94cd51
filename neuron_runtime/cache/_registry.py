"""Open a cache backend from a URL: the scheme picks the class.

    /abs/path, rel/path, file:///path  -> SharedPathStore   (a shared filesystem: FSx, NFS, Lustre)
    s3://bucket/prefix                 -> S3Store           (needs s3fs)
    grpc://host:port, grpcs://host:port -> neuron_runtime.cache._grpc.open_grpc  (our cache server)
    redis://host:port, rediss://…      -> RedisStore        (a Redis server or cluster; needs redis)
    http://host/instance, https://…    -> HttpStore         (bazel-remote's HTTP cache API, WebDAV)
    memory://                          -> MemoryStore       (this process only; tests and tools)

Backends are imported lazily, so an unused optional package is never needed; a missing one gives a
`StoreConfigError` that prints the install command. `register_scheme` adds a scheme.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING
from urllib.parse import unquote, urlsplit

from neuron_runtime.cache._base import CacheBackend
from neuron_runtime.cache._errors import StoreConfigError

if TYPE_CHECKING:
    from neuron_runtime._config import Config

Factory = Callable[[str, "Config"], CacheBackend]

# The pip requirement that provides each optional module a backend needs.
_INSTALL = {"s3fs": "s3fs", "redis": "redis", "urllib3": "urllib3", "grpc": "grpcio", "grpc_health": "grpcio-health-checking", "google.protobuf": "protobuf"}


def _need(module: str, scheme: str) -> None:
    try:
        importlib.import_module(module)
    except ImportError as e:
        raise StoreConfigError(
            f"{scheme}:// cache URLs need the {module!r} package: pip install '{_INSTALL.get(module, module)}'"
        ) from e


def _open_path(url: str, cfg: Config) -> CacheBackend:
    from neuron_runtime.cache._pathstore import SharedPathStore

    if url.startswith("file://"):
        parts = urlsplit(url)
        if parts.netloc not in ("", "localhost"):
            raise StoreConfigError(f"{url!r}: file:// URLs name a local path (file:///path), not host {parts.netloc!r}")
        url = unquote(parts.path)
    if not url:
        raise StoreConfigError("empty cache path")
    return SharedPathStore(url, timeout_s=cfg.fleet_timeout_s)


def _open_s3(url: str, cfg: Config) -> CacheBackend:
    _need("s3fs", "s3")
    from neuron_runtime.cache._s3 import S3Store

    try:
        return S3Store(url, timeout_s=cfg.fleet_timeout_s)
    except ValueError as e:
        raise StoreConfigError(str(e)) from e


def _open_grpc(url: str, cfg: Config) -> CacheBackend:
    _need("grpc", "grpc")
    try:
        module = importlib.import_module("neuron_runtime.cache._grpc")
    except ModuleNotFoundError as e:
        if e.name != "neuron_runtime.cache._grpc":
            raise StoreConfigError(f"grpc:// cache URLs need the {e.name!r} package: "
                                   f"pip install '{_INSTALL.get(str(e.name), str(e.name))}'") from e
        raise StoreConfigError(
            f"{url!r}: the grpc:// backend (neuron_runtime.cache._grpc) is not part of this installation"
        ) from e
    backend: CacheBackend = module.open_grpc(url, cfg)
    return backend


def _open_redis(url: str, cfg: Config) -> CacheBackend:
    _need("redis", "redis")
    from neuron_runtime.cache._redis import open_redis

    return open_redis(url, cfg)


def _open_http(url: str, cfg: Config) -> CacheBackend:
    _need("urllib3", url.split("://", 1)[0])
    from neuron_runtime.cache._http import open_http

    return open_http(url, cfg)


def _open_memory(url: str, cfg: Config) -> CacheBackend:
    from neuron_runtime.cache._memory import MemoryStore

    return MemoryStore(url)


_SCHEMES: dict[str, Factory] = {
    "": _open_path,
    "file": _open_path,
    "s3": _open_s3,
    "s3a": _open_s3,
    "grpc": _open_grpc,
    "grpcs": _open_grpc,
    "redis": _open_redis,
    "rediss": _open_redis,
    "http": _open_http,
    "https": _open_http,
    "memory": _open_memory,
}


def register_scheme(scheme: str, factory: Factory) -> None:
    """Make `scheme://…` URLs open with `factory(url, cfg)`."""
    _SCHEMES[scheme.lower()] = factory


def supported_schemes() -> list[str]:
    return sorted(f"{s}://" for s in _SCHEMES if s) + ["a plain path"]


def open_store(url: str, cfg: Config) -> CacheBackend:
    """The fleet backend for `url` (`TORCH_NEURONX_NEFF_CACHE_DIR`). Raises `StoreConfigError` for an
    unknown scheme or a missing optional package; never does I/O that could fail here (stores connect
    lazily, so a store that is down is a miss later, not an error now)."""
    url = url.strip()
    scheme = url.split("://", 1)[0].lower() if "://" in url else ""
    factory = _SCHEMES.get(scheme)
    if factory is None:
        raise StoreConfigError(
            f"unsupported cache URL {url!r}: scheme {scheme + '://'!r} is not one of {', '.join(supported_schemes())}"
        )
    return factory(url, cfg)

"""`neuron-cache-server` / `python -m cache_server`: flags (each with an env twin) → `server.serve`."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from ._errors import ConfigError
from ._keys import parse_size
from .server import ServerConfig, serve

log = logging.getLogger("cache_server")

ENV_PREFIX = "NEURON_CACHE_SERVER_"


@dataclass(frozen=True)
class Flag:
    name: str  # --flag
    kind: str  # str | size | float | bool
    default: str | None
    help: str
    metavar: str = ""

    @property
    def dest(self) -> str:
        return self.name[2:].replace("-", "_")

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.dest.upper()


# Every flag, as data: the parser, the env twins, docs/server.md's table and the deploy tests read this.
FLAGS: tuple[Flag, ...] = (
    Flag("--listen", "str", "0.0.0.0:50051", "gRPC address HOST:PORT", "HOST:PORT"),
    Flag("--storage", "str", None, "a directory, or s3://bucket/prefix (required)", "DIR|s3://BUCKET/PREFIX"),
    Flag("--max-size", "size", "10GiB", "byte cap of the store (10GiB, 500MB or bytes); LRU eviction on disk",
         "SIZE"),
    Flag("--max-blob-size", "size", "1GiB", "largest single entry accepted (RESOURCE_EXHAUSTED above)", "SIZE"),
    Flag("--tokens-file", "str", None, "`TOKEN ROLE` lines (role read or write); without it the server is open",
         "FILE"),
    Flag("--tls-cert", "str", None, "PEM certificate chain (enables TLS; needs --tls-key)", "FILE"),
    Flag("--tls-key", "str", None, "PEM private key", "FILE"),
    Flag("--tls-client-ca", "str", None, "PEM CA bundle; require client certificates signed by it (mTLS)", "FILE"),
    Flag("--metrics-listen", "str", None, "serve Prometheus metrics on HOST:PORT at /metrics", "HOST:PORT"),
    Flag("--reflection", "bool", "0", "enable gRPC server reflection (needs grpcio-reflection)"),
    Flag("--grace", "float", "10", "seconds in-flight calls get to finish after SIGTERM", "SECONDS"),
    Flag("--log-level", "str", "INFO", "DEBUG, INFO, WARNING or ERROR (JSON lines on stderr)", "LEVEL"),
)


def _truthy(v: str) -> bool:
    return v.strip().lower() not in ("", "0", "false", "no", "off")


def _build_parser(env: dict[str, str] | None = None) -> argparse.ArgumentParser:
    env = dict(os.environ if env is None else env)
    p = argparse.ArgumentParser(
        prog="neuron-cache-server",
        description="The neuron-runtime fleet cache server. Every flag has an environment twin "
                    f"({ENV_PREFIX}<FLAG>, e.g. {ENV_PREFIX}LISTEN); a flag beats its twin.")
    for f in FLAGS:
        default = env.get(f.env) or f.default
        text = f"{f.help} [env {f.env}]"
        if f.kind == "bool":
            p.add_argument(f.name, dest=f.dest, action="store_true", default=_truthy(default or ""), help=text)
        else:
            p.add_argument(f.name, dest=f.dest, default=default, metavar=f.metavar or None, help=text)
    return p


def config_from_args(argv: Sequence[str] | None = None, env: dict[str, str] | None = None
                     ) -> tuple[ServerConfig, str]:
    """Parse flags + env into a ServerConfig (and the log level). Raises ConfigError on bad values."""
    ns = _build_parser(env).parse_args(argv)
    if not ns.storage:
        raise ConfigError(f"--storage is required (or set {ENV_PREFIX}STORAGE): a directory or s3://bucket/prefix")
    try:
        grace = float(ns.grace)
    except ValueError as e:
        raise ConfigError(f"--grace {ns.grace!r}: not a number") from e
    cfg = ServerConfig(
        listen=ns.listen, storage=ns.storage, max_size=parse_size(ns.max_size),
        max_blob_size=parse_size(ns.max_blob_size), tokens_file=ns.tokens_file or None,
        tls_cert=ns.tls_cert or None, tls_key=ns.tls_key or None, tls_client_ca=ns.tls_client_ca or None,
        metrics_listen=ns.metrics_listen or None, reflection=bool(ns.reflection), grace_s=grace,
    )
    cfg.check()
    return cfg, str(ns.log_level)


def _tune_malloc() -> None:
    """Keep blob-sized buffers on the heap instead of fresh mmaps.

    Every GET allocates a blob-sized bytes object. glibc serves allocations above its mmap threshold
    (128 KiB until it adapts) with a fresh mmap that page-faults on first touch and is unmapped on free, so
    each 1 MiB reply paid ~256 page faults: measured 3.4 → 1.4 ms of server CPU per 1 MiB GET with a
    32 MiB threshold. Only this server process is tuned (never a library user's process); non-glibc
    platforms keep their defaults.
    """
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return
    m_trim_threshold, m_mmap_threshold = -1, -3
    mallopt(m_mmap_threshold, 32 << 20)
    mallopt(m_trim_threshold, 256 << 20)


def main(argv: Sequence[str] | None = None) -> int:
    from . import _log

    try:
        cfg, level = config_from_args(argv)
    except ConfigError as e:
        print(f"neuron-cache-server: error: {e}", file=sys.stderr)
        return 2
    _log.configure(level)
    _tune_malloc()
    try:
        asyncio.run(serve(cfg))
    except ConfigError as e:
        log.error("cannot start: %s", e)
        print(f"neuron-cache-server: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`python -m cache_server.probe [HOST:PORT]`: exit 0 when the server's health check says SERVING.

For container HEALTHCHECKs and scripts (Kubernetes uses its native gRPC probe instead). The address
defaults to NEURON_CACHE_SERVER_LISTEN with a wildcard host replaced by 127.0.0.1.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from ._keys import HEALTH_SERVICE


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m cache_server.probe")
    p.add_argument("address", nargs="?", default=os.environ.get("NEURON_CACHE_SERVER_LISTEN", "127.0.0.1:50051"))
    p.add_argument("--service", default=HEALTH_SERVICE)
    p.add_argument("--timeout", type=float, default=3.0)
    args = p.parse_args(argv)
    host, _, port = args.address.rpartition(":")
    if host in ("", "0.0.0.0", "[::]", "::"):
        host = "127.0.0.1"
    from .client import CacheClient

    with CacheClient(f"{host}:{port}", timeout=args.timeout) as c:
        try:
            status = c.health(args.service)
        except Exception as e:
            print(f"unhealthy: {e}", file=sys.stderr)
            return 1
    print(status)
    return 0 if status == "SERVING" else 1


if __name__ == "__main__":
    sys.exit(main())

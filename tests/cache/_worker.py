"""One "host" for the multi-process tests: its own local tier, a shared fleet store, get_or_compile.

argv[1] is a JSON spec: store, local_dir, keys, count_dir, compile_s, lease_ttl_s, go (barrier file),
hang_on (a key whose compile never returns, after writing `<count_dir>/<key>-<name>-started`).
Prints one JSON line: the stats dict and where each key came from.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
import time
import types
import warnings
from pathlib import Path

# The cache layer is torch-free; load it without running neuron_runtime/__init__.py (which registers the
# torch device) so each "host" starts in a fraction of a second. This also proves the layer needs no torch.
_pkg = types.ModuleType("neuron_runtime")
_pkg.__path__ = [str(Path(__file__).resolve().parents[2] / "neuron_runtime")]
sys.modules.setdefault("neuron_runtime", _pkg)

from neuron_runtime._config import Config  # noqa: E402
from neuron_runtime.cache import LocalCache, TieredCache, open_store  # noqa: E402


def main() -> int:
    spec = json.loads(sys.argv[1])
    cfg = dataclasses.replace(
        Config(),
        local_cache_dir=spec["local_dir"],
        cache_dir=spec["store"],
        lease_ttl_s=float(spec.get("lease_ttl_s", 60.0)),
        lock_timeout_s=float(spec.get("lock_timeout_s", 60.0)),
        fleet_timeout_s=30.0,  # generous: a busy test host must not turn into fleet faults
        single_flight=bool(spec.get("single_flight", True)),
        signing_key=spec["signing_key"].encode() if spec.get("signing_key") else None,
    )
    stats: dict[str, object] = {}
    fleet = open_store(spec["store"], cfg) if spec["store"] else None  # None: processes of one host
    cache = TieredCache(LocalCache(cfg.local_cache_dir, cfg.cache_max_size), fleet, cfg, stats)
    count_dir = spec["count_dir"]
    os.makedirs(count_dir, exist_ok=True)
    name = spec["name"]

    def compiler(key: str):  # noqa: ANN202
        def compile_fn() -> bytes:
            if key == spec.get("hang_on"):
                open(os.path.join(count_dir, f"{key}-{name}-started"), "w").close()
                time.sleep(3600)  # killed by the test
            # One file per compile: the test counts compiles across all processes from these.
            open(os.path.join(count_dir, f"{key}-{name}-{os.getpid()}"), "w").close()
            time.sleep(float(spec.get("compile_s", 0.2)))
            return cache.pack(key, {"signature": {"op": key[:8]}, "fingerprint": {}}, f"payload {key}".encode())

        return compile_fn

    # Connect before the barrier (s3fs builds its client on first use), so the hosts race on the keys.
    if fleet is not None:
        fleet.get("0" * 64)
    deadline = time.monotonic() + 120  # never outlive a test that failed before releasing us
    while not os.path.exists(spec["go"]):
        if time.monotonic() > deadline:
            return 3
        time.sleep(0.005)
    sources = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for key in spec["keys"]:
            entry, source = cache.get_or_compile(key, compiler(key))
            assert entry.payload == f"payload {key}".encode(), entry.payload
            sources[key] = source
    assert "torch" not in sys.modules, "the cache layer imported torch"
    # What the shared store holds for each key, as this host sees it (racing writers: one entry).
    shared = fleet if fleet is not None else cache.local
    digests = {k: hashlib.sha256(shared.get(k) or b"").hexdigest() for k in spec["keys"]}
    print(json.dumps({"stats": stats, "sources": sources, "digests": digests}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

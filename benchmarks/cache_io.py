"""Cache I/O below the dispatcher: envelope pack/verify, and get/put latency per tier (JSON on stdout).

    python benchmarks/cache_io.py [--entries 200] [--size 360000] [--s3]

Entries default to 360 kB, the size of a stripped AOTInductor executable (DESIGN §3). `--s3` also
measures an S3 store on a moto server started for the run (loopback; moto is far slower than S3).
Reports medians and p95 in milliseconds; measured with OMP_NUM_THREADS=1 on a noisy shared machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import types
import urllib.request
from collections.abc import Callable
from pathlib import Path

# The cache layer is torch-free: load it without neuron_runtime/__init__.py (which registers the device).
_ROOT = Path(__file__).resolve().parents[1]
_pkg = types.ModuleType("neuron_runtime")
_pkg.__path__ = [str(_ROOT / "neuron_runtime")]
sys.modules.setdefault("neuron_runtime", _pkg)

from neuron_runtime import envelope  # noqa: E402
from neuron_runtime._config import Config  # noqa: E402
from neuron_runtime.cache import CacheBackend, LocalCache, S3Store, SharedPathStore, TieredCache  # noqa: E402


def _ms(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {"p50_ms": round(statistics.median(ordered) * 1e3, 4),
            "p95_ms": round(ordered[int(0.95 * (len(ordered) - 1))] * 1e3, 4)}


def _time(fn: Callable[[], object], n: int) -> list[float]:
    out = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def _backend(name: str, store: CacheBackend, keys: list[str], blobs: dict[str, bytes]) -> dict[str, object]:
    print(f"  {name}: put/get {len(keys)} entries", file=sys.stderr)
    puts, gets = [], []
    for k in keys:
        t = time.perf_counter()
        store.put(k, blobs[k])
        puts.append(time.perf_counter() - t)
    for k in keys:
        t = time.perf_counter()
        data = store.get(k)
        gets.append(time.perf_counter() - t)
        assert data == blobs[k]
    return {"put": _ms(puts), "get": _ms(gets)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--entries", type=int, default=200)
    ap.add_argument("--size", type=int, default=360_000)
    ap.add_argument("--s3", action="store_true")
    args = ap.parse_args(argv)
    import hashlib

    payload = os.urandom(args.size)
    keys = [hashlib.sha256(str(i).encode()).hexdigest() for i in range(args.entries)]
    header = {"signature": {"op": "aten::add.Tensor", "args": [["f32", [64]], ["f32", [64]]]},
              "fingerprint": {"tier": "aoti", "torch": "2.13.0", "isa": "x86-64-v3"}}
    secret = b"benchmark signing key"
    blobs = {k: envelope.pack(k, header, payload, None) for k in keys}
    signed = envelope.pack(keys[0], header, payload, secret)
    result: dict[str, object] = {"entry_bytes": len(blobs[keys[0]]), "entries": args.entries}

    print("envelope", file=sys.stderr)
    n = min(args.entries, 200)
    result["envelope"] = {
        "pack": _ms(_time(lambda: envelope.pack(keys[0], header, payload, None), n)),
        "pack_signed": _ms(_time(lambda: envelope.pack(keys[0], header, payload, secret), n)),
        "unpack": _ms(_time(lambda: envelope.unpack(blobs[keys[0]], expected_key=keys[0], signing_key=None), n)),
        "unpack_signed": _ms(_time(lambda: envelope.unpack(signed, expected_key=keys[0], signing_key=secret), n)),
    }

    with tempfile.TemporaryDirectory() as tmp:
        tiers: dict[str, object] = {}
        local = LocalCache(os.path.join(tmp, "local"), 10 * 1024**3)
        tiers["local"] = _backend("local", local, keys, blobs)
        tiers["shared_path"] = _backend("shared_path", SharedPathStore(os.path.join(tmp, "fleet")), keys, blobs)
        cfg = dataclasses.replace(Config(), local_cache_dir=os.path.join(tmp, "local"))
        cache = TieredCache(local, None, cfg, {})
        hit = _time(lambda: cache.get_entry(keys[len(keys) // 2]), n)
        tiers["tiered_local_hit_verified"] = {"get_entry": _ms(hit)}
        if args.s3:
            tiers["s3_moto"] = _s3(keys, blobs)
        result["tiers"] = tiers
    json.dump(result, sys.stdout, indent=2)
    print()
    return 0


def _s3(keys: list[str], blobs: dict[str, bytes]) -> dict[str, object]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    endpoint = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(300):
            try:
                urllib.request.urlopen(endpoint + "/moto-api/", timeout=1).read()
                break
            except OSError:
                time.sleep(0.1)
        os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1")
        req = urllib.request.Request(f"{endpoint}/neff-bench", method="PUT")
        urllib.request.urlopen(req, timeout=5).read()
        store = S3Store("s3://neff-bench/c", timeout_s=10, endpoint_url=endpoint)
        return _backend("s3 (moto)", store, keys[:50], blobs)
    finally:
        proc.kill()
        proc.wait()


if __name__ == "__main__":
    sys.exit(main())

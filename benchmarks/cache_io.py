"""Cache I/O below the dispatcher: envelope pack/verify, and get/put latency per tier (JSON on stdout).

    python benchmarks/cache_io.py [--entries 200] [--size 360000] [--s3] [--redis] [--http]

Entries default to 360 kB, the size of a stripped AOTInductor executable (DESIGN §3). `--s3` also
measures an S3 store on a moto server started for the run (loopback; moto is far slower than S3).
`--redis` (Debian's redis-server) and `--http` (nginx WebDAV from deploy/nginx/, else our test server)
measure the Redis and HTTP stores against the same client reading the same bytes from the same server
without our code (1 MiB entries, interleaved rounds, medians; target >= 0.7x), and a 1,000-key lookup
(target <= 50 ms). Reports medians and p95 in milliseconds, and the load average with every number.
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

from neuron_runtime.cache import envelope  # noqa: E402
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
    ap.add_argument("--redis", action="store_true")
    ap.add_argument("--http", action="store_true")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--store-entry-bytes", type=int, default=1 << 20,
                    help="entry size for --redis/--http (default 1 MiB, the target's size)")
    args = ap.parse_args(argv)
    import hashlib

    print(f"loadavg {_load()} (2 shared cores: other sessions' work moves these numbers)", file=sys.stderr)
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
        if args.redis or args.http:
            result["stores_vs_raw_client"] = _stores(Path(tmp), args.redis, args.http, args.rounds,
                                                     args.store_entry_bytes)
    result["loadavg"] = [round(x, 2) for x in os.getloadavg()]
    json.dump(result, sys.stdout, indent=2)
    print()
    return 0


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def _vs_raw(name: str, ours: Callable[[str], object], raw: Callable[[str], object], keys: list[str], size: int,
            rounds: int) -> dict[str, object]:
    """1 MiB reads of `keys` through our store vs the bare client, interleaved rounds: throughput medians."""
    from _ab import interleaved_medians  # type: ignore[import-not-found]

    def timed(fn: Callable[[str], object]) -> Callable[[], float]:
        def run() -> float:
            t = time.perf_counter()
            for k in keys:
                assert fn(k) is not None
            return time.perf_counter() - t
        return run

    t_ours, t_raw = interleaved_medians(timed(ours), timed(raw), rounds)
    mb = len(keys) * size / 1e6
    out = {"entries": len(keys), "entry_bytes": size, "ours_MBps": round(mb / t_ours, 1),
           "raw_MBps": round(mb / t_raw, 1), "ratio": round(t_raw / t_ours, 3), "loadavg": _load()}
    print(f"  {name}: {out}", file=sys.stderr)
    return out


def _batch_vs_raw(name: str, store: CacheBackend, raw: Callable[[str], object], keys: list[str], size: int,
                  rounds: int) -> dict[str, object]:
    """A prefetch (`get_many`) vs the bare client reading the same blobs with the same parallelism (16)."""
    from concurrent.futures import ThreadPoolExecutor

    from _ab import interleaved_medians  # type: ignore[import-not-found]

    pool = ThreadPoolExecutor(16)

    def ours() -> float:
        t = time.perf_counter()
        assert len(store.get_many(keys)) == len(keys)
        return time.perf_counter() - t

    def bare() -> float:
        t = time.perf_counter()
        assert all(d is not None for d in pool.map(raw, keys))
        return time.perf_counter() - t

    t_ours, t_raw = interleaved_medians(ours, bare, rounds)
    pool.shutdown()
    mb = len(keys) * size / 1e6
    out = {"entries": len(keys), "entry_bytes": size, "ours_MBps": round(mb / t_ours, 1),
           "raw_MBps": round(mb / t_raw, 1), "ratio": round(t_raw / t_ours, 3), "loadavg": _load()}
    print(f"  {name} get_many: {out}", file=sys.stderr)
    return out


def _lookup(name: str, store: CacheBackend, present: list[str], rounds: int) -> dict[str, object]:
    import hashlib

    absent = [hashlib.sha256(f"absent{i}".encode()).hexdigest() for i in range(1000 - len(present))]
    wanted = present + absent
    samples = []
    for _ in range(rounds):
        t = time.perf_counter()
        found = store.contains_many(wanted)
        samples.append(time.perf_counter() - t)
        assert found == set(present), (len(found), len(present))
    out = {"keys": len(wanted), "present": len(present), "p50_ms": round(statistics.median(samples) * 1e3, 2),
           "max_ms": round(max(samples) * 1e3, 2), "loadavg": _load()}
    print(f"  {name} 1,000-key lookup: {out}", file=sys.stderr)
    return out


def _stores(tmp: Path, redis_on: bool, http_on: bool, rounds: int, size: int) -> dict[str, object]:
    import hashlib

    for extra in (_ROOT, _ROOT / "tests", _ROOT / "benchmarks"):
        sys.path.insert(0, str(extra))
    n = 24
    keys = [hashlib.sha256(f"mib{i}".encode()).hexdigest() for i in range(n)]
    header = {"signature": {"op": "aten::mm"}, "fingerprint": {"tier": "bench"}}
    blobs = {k: envelope.pack(k, header, os.urandom(size - 400), None) for k in keys}
    out: dict[str, object] = {}
    if redis_on:
        import redis

        from neuron_runtime.cache import RedisStore
        from tests.conftest import RedisServer  # type: ignore[import-not-found]

        server = RedisServer(tmp / "redis").start()
        try:
            store = RedisStore(server.url(prefix="bench:"), timeout_s=10)
            for k in keys:
                assert store.put(k, blobs[k])
            raw = redis.Redis(port=server.port, password=server.PASSWORD)
            r = {"server": "redis-server " + str(raw.info()["redis_version"])}
            r["read_1MiB"] = _vs_raw("redis", store.get, lambda k: raw.get(f"bench:v1:{k}"), keys, len(blobs[keys[0]]),
                                     rounds)
            r["get_many_1MiB"] = _batch_vs_raw("redis", store, lambda k: raw.get(f"bench:v1:{k}"), keys,
                                               len(blobs[keys[0]]), rounds)
            more = [hashlib.sha256(f"lk{i}".encode()).hexdigest() for i in range(500)]
            for k in more:
                store.put(k, b"x" * 64)
            r["lookup_1000"] = _lookup("redis", store, more, rounds)
            out["redis"] = r
        finally:
            server.stop()
    if http_on:
        import urllib3

        from neuron_runtime.cache import HttpStore

        try:
            from tests.conftest import NginxDav  # type: ignore[import-not-found]

            nginx = NginxDav(tmp / "nginx").start()
            url, label, stop = nginx.url("bench"), "nginx WebDAV (deploy/nginx/neff-cache.conf)", nginx.stop
        except BaseException as e:  # noqa: BLE001 - pytest.skip when nginx is missing: fall back to ours
            print(f"  nginx unavailable ({e}); using tests/_httpcache.py", file=sys.stderr)
            from _httpcache import CacheServer  # type: ignore[import-not-found]

            ours = CacheServer().start()
            url, label, stop = f"{ours.url}/bench", "tests/_httpcache.py (Python)", ours.stop
        try:
            store = HttpStore(url, timeout_s=10)
            for k in keys:
                assert store.put(k, blobs[k])
            pool = urllib3.PoolManager(maxsize=16)
            origin = store.origin
            digests = {k: hashlib.sha256(blobs[k]).hexdigest() for k in keys}

            def raw_get(k: str) -> bytes:
                resp = pool.request("GET", f"{origin}/bench/cas/{digests[k]}")
                assert resp.status == 200
                return bytes(resp.data)

            h: dict[str, object] = {"server": label}
            h["read_1MiB"] = _vs_raw("http", store.get, raw_get, keys, len(blobs[keys[0]]), rounds)
            h["get_many_1MiB"] = _batch_vs_raw("http", store, raw_get, keys, len(blobs[keys[0]]), rounds)
            t = time.perf_counter()
            for k in keys:
                hashlib.sha256(blobs[k]).hexdigest()
            h["digest_check_ms_per_entry"] = round((time.perf_counter() - t) / len(keys) * 1e3, 3)
            more = [hashlib.sha256(f"lk{i}".encode()).hexdigest() for i in range(500)]
            for k in more:
                store.put(k, b"x" * 64)
            h["lookup_1000"] = _lookup("http", store, more, rounds)
            out["http"] = h
        finally:
            stop()
    return out


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

"""Fleet simulation (JSON on stdout): N "hosts" (separate processes, each with an empty local tier) start
the same small training job at once against one fleet store. Reports total compiles across the fleet,
unique keys, the slowest host's wall time — with single-flight on and off — for a shared path, S3 (a moto
server in its own process on 127.0.0.1), Redis (Debian's redis-server) and an HTTP cache (nginx WebDAV
from deploy/nginx/, bazel-remote's API), whether every host ends with every entry, and a host joining
the warm store. Targets (issue 31): 4 hosts on Redis compile each key once; on HTTP (no fleet lease)
compiles <= hosts x unique keys and every host ends with every entry.

    python benchmarks/fleet.py [--hosts 4] [--tier reference|aoti] [--stores path,s3,redis,http]
    python benchmarks/fleet.py --shards 2 [--shard-rounds 1]

`--shards N` measures sharded warming instead: one `neuron-cache compile` of a recorded manifest (aoti,
--jobs 1) against N concurrent `compile --shard I/N --jobs 1` processes (each a "host": its own local
tier, Inductor cache and TMPDIR; one Redis store), interleaved rounds; target: N=2 wall time <= 0.6x,
and the shards' union = the unsharded set (`verify --manifest`).

The `reference` tier (default) compiles in milliseconds, which makes races between hosts as tight as
they get; `aoti` shows real compile times (several seconds per op). Every number comes with the load
average (this 2-core machine is shared)."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "benchmarks"))

JOB = """
import json, os, sys, time, torch, neuron_runtime
from neuron_runtime.aten import _runtime
t0 = time.perf_counter()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)).to('neuron')
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
x, y = torch.randn(8, 16, device='neuron'), torch.randint(0, 4, (8,), device='neuron')
for _ in range(3):
    opt.zero_grad(); torch.nn.functional.cross_entropy(model(x), y).backward(); opt.step()
s = neuron_runtime.stats()
print(json.dumps({'compiles': s['compiles'], 'hits': s['hits'], 'lease_waits': s.get('lease_waits', 0),
                  'fleet_errors': s.get('fleet_errors', 0), 'corrupt': s.get('corrupt', 0),
                  'keys': sorted(_runtime.runtime().by_digest), 'wall_s': time.perf_counter() - t0}))
"""


# Another workload: a transformer block, a new batch every step, sequence lengths that vary, and
# `loss.item()` every step (benchmarks/_models.py on the child's PYTHONPATH).
JOB_BLOCK = """
import json, time, torch, neuron_runtime, _models
from neuron_runtime.aten import _runtime
t0 = time.perf_counter()
torch.manual_seed(0)
model, _ = _models.block()
model = model.to('neuron')
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
for seq in (16, 24, 32, 16, 24):
    x = torch.randn(4, seq, 64, device='neuron')
    opt.zero_grad(); loss = model(x).square().mean(); loss.backward(); opt.step(); loss.item()
s = neuron_runtime.stats()
print(json.dumps({'compiles': s['compiles'], 'hits': s['hits'], 'lease_waits': s.get('lease_waits', 0),
                  'fleet_errors': s.get('fleet_errors', 0), 'corrupt': s.get('corrupt', 0),
                  'keys': sorted(_runtime.runtime().by_digest), 'wall_s': time.perf_counter() - t0}))
"""
JOBS = {"mlp": JOB, "block": JOB_BLOCK}


def run_fleet(n: int, store_url: str, env_base: dict[str, str], work: Path, single_flight: bool,
              job: str = "mlp") -> dict[str, object]:
    procs = []
    for i in range(n):
        env = dict(env_base, TORCH_NEURONX_NEFF_CACHE_DIR=store_url,
                   TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR=str(work / f"host{i}"),
                   TORCH_NEURONX_SINGLE_FLIGHT="1" if single_flight else "0")
        if job != "mlp":
            from _models import child_env  # type: ignore[import-not-found]

            env = child_env(env)
        procs.append(subprocess.Popen([sys.executable, "-c", JOBS[job]], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=3600)
        if p.returncode != 0:
            raise RuntimeError(f"host failed: {err[-2000:]}")
        outs.append(json.loads(out.strip().splitlines()[-1]))
    keys = set().union(*(set(o["keys"]) for o in outs))  # type: ignore[arg-type]
    total = sum(int(o["compiles"]) for o in outs)  # type: ignore[arg-type]
    return {"hosts": n, "single_flight": single_flight, "fleet_compiles": total, "unique_keys": len(keys),
            "compiles_per_key": round(total / max(1, len(keys)), 2),
            "every_host_has_every_entry": all(set(o["keys"]) == keys for o in outs),  # type: ignore[arg-type]
            "slowest_host_s": round(max(float(o["wall_s"]) for o in outs), 2),  # type: ignore[arg-type]
            "lease_waits": sum(int(o["lease_waits"]) for o in outs),  # type: ignore[arg-type]
            "fleet_errors": sum(int(o["fleet_errors"]) for o in outs),  # type: ignore[arg-type]
            "loadavg": [round(x, 2) for x in os.getloadavg()]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hosts", type=int, default=4)
    p.add_argument("--tier", default="reference", choices=["reference", "aoti"])
    p.add_argument("--stores", default="path,s3,redis,http")
    p.add_argument("--job", default="mlp", choices=sorted(JOBS), help="mlp (default) or block (a transformer "
                   "block, variable sequence lengths, loss.item() every step)")
    p.add_argument("--shards", type=int, default=0, help="measure sharded warming with N shards instead")
    p.add_argument("--shard-rounds", type=int, default=1)
    args = p.parse_args()
    print(f"loadavg {[round(x, 2) for x in os.getloadavg()]}", file=sys.stderr)
    if args.shards:
        return shard_bench(args.shards, args.shard_rounds)
    env = dict(os.environ, TORCH_NEURONX_COMPILER=args.tier, OMP_NUM_THREADS="1",
               TORCH_NEURONX_COMPILE_MODE="sync", TORCH_NEURONX_PREFETCH="0")
    results: list[dict[str, object]] = []
    moto = None
    servers: list[object] = []
    tmp_root = Path(tempfile.mkdtemp(prefix="neuron-fleet-servers-"))
    try:
        from conftest import NginxDav, RedisServer

        for store in args.stores.split(","):
            for single_flight in (True, False):
                work = Path(tempfile.mkdtemp(prefix="neuron-fleet-"))
                try:
                    tag = f"{store}{int(time.time() * 1000) % 10**9}{int(single_flight)}"
                    if store == "path":
                        url = str(work / "fleet")
                    elif store == "redis":
                        redis_srv = next((s for s in servers if isinstance(s, RedisServer)), None)
                        if redis_srv is None:
                            redis_srv = RedisServer(tmp_root / "redis").start()
                            servers.append(redis_srv)
                        url = redis_srv.url(prefix=f"{tag}:")
                    elif store == "http":
                        nginx = next((s for s in servers if isinstance(s, NginxDav)), None)
                        if nginx is None:
                            nginx = NginxDav(tmp_root / "nginx").start()
                            servers.append(nginx)
                        url = nginx.url(tag)
                    else:
                        if moto is None:
                            from conftest import MotoS3

                            moto = MotoS3()
                            moto.start()
                            env.update(moto.env())
                        bucket = f"fleet-{int(time.time() * 1000) % 10**9}-{int(single_flight)}"
                        moto.make_bucket(bucket)
                        url = f"s3://{bucket}/neff"
                    r = run_fleet(args.hosts, url, env, work, single_flight, args.job)
                    r["store"], r["job"] = store, args.job
                    if single_flight:
                        joiner = run_fleet(1, url, env, work / "joiner", True, args.job)
                        r["joining_host_compiles"] = joiner["fleet_compiles"]
                    results.append(r)
                    print(json.dumps(r), file=sys.stderr, flush=True)
                finally:
                    shutil.rmtree(work, ignore_errors=True)
    finally:
        if moto is not None:
            moto.stop()
        for srv in servers:
            srv.stop()  # type: ignore[attr-defined]
        shutil.rmtree(tmp_root, ignore_errors=True)
    print(json.dumps({"tier": args.tier, "runs": results}, indent=2))
    return 0


def _cli(argv: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "neuron_runtime.cli", *argv], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _finish(procs: list[subprocess.Popen[str]]) -> list[dict[str, object]]:
    outs = []
    for proc in procs:
        out, err = proc.communicate(timeout=7200)
        if proc.returncode != 0:
            raise RuntimeError(f"neuron-cache failed ({proc.returncode}): {err[-3000:]}")
        outs.append(json.loads(out))
    return outs


def shard_bench(n: int, rounds: int) -> int:
    """One unsharded `compile` vs `n` concurrent shards of the same manifest, aoti tier, interleaved."""
    from conftest import RedisServer

    work = Path(tempfile.mkdtemp(prefix="neuron-shard-"))
    redis_srv = RedisServer(work / "redis").start()
    try:
        manifest = work / "manifest.jsonl"
        env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCH_NEURONX_", "NEURON_CACHE_"))}
        env.update(OMP_NUM_THREADS="1", TORCH_NEURONX_COMPILE_MODE="sync", TORCH_NEURONX_PREFETCH="0")
        rec = dict(env, TORCH_NEURONX_COMPILER="reference", TORCH_NEURONX_RECORD_FILE=str(manifest),
                   TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR=str(work / "record"))
        subprocess.run([sys.executable, "-c", JOB], env=rec, check=True, capture_output=True, timeout=600)
        total = len(manifest.read_text().splitlines())
        print(f"manifest: {total} signatures", file=sys.stderr)
        runs: list[dict[str, object]] = []
        for r in range(rounds):
            for mode in ("one", "shards"):
                tag = f"r{r}{mode}"
                url = redis_srv.url(prefix=f"{tag}:")
                parts = [None] if mode == "one" else [f"{i}/{n}" for i in range(n)]
                procs = []
                t0 = time.perf_counter()
                for i, part in enumerate(parts):
                    host = work / tag / f"host{i}"
                    (host / "tmp").mkdir(parents=True)
                    henv = dict(env, TORCHINDUCTOR_CACHE_DIR=str(host / "inductor"), TMPDIR=str(host / "tmp"))
                    argv = ["compile", str(manifest), "--tier", "aoti", "--jobs", "1", "--to", url, "--local-dir",
                            str(host / "local"), "--json", "--no-progress"] + (["--shard", part] if part else [])
                    procs.append(_cli(argv, henv))
                outs = _finish(procs)
                wall = time.perf_counter() - t0
                check = _cli(["verify", "--manifest", str(manifest), "--tier", "aoti", "--fleet", url, "--local-dir",
                              str(work / tag / "verify"), "--json"], env)
                out, err = check.communicate(timeout=600)
                verify = json.loads(out) if out.strip() else {"error": err[-500:]}
                row = {"round": r, "mode": mode, "processes": len(parts), "wall_s": round(wall, 1),
                       "per_process": [{"shard": o.get("shard"), "signatures": o["signatures"],
                                        "compiled": o["compiled"], "refused": o["refused"], "seconds": o["seconds"]}
                                       for o in outs],
                       "compiled_total": sum(int(o["compiled"]) for o in outs),  # type: ignore[call-overload]
                       "verify_missing": len(verify.get("missing", [])) if "missing" in verify else verify,
                       "loadavg": [round(x, 2) for x in os.getloadavg()]}
                runs.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
        one = [float(r["wall_s"]) for r in runs if r["mode"] == "one"]  # type: ignore[arg-type]
        shards = [float(r["wall_s"]) for r in runs if r["mode"] == "shards"]  # type: ignore[arg-type]
        import statistics

        summary = {"shards": n, "manifest_signatures": total, "runs": runs,
                   "median_one_s": statistics.median(one), "median_shards_s": statistics.median(shards),
                   "ratio": round(statistics.median(shards) / statistics.median(one), 3)}
        print(json.dumps(summary, indent=2))
    finally:
        redis_srv.stop()
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

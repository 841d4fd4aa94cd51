"""Fleet simulation (JSON on stdout): N "hosts" (separate processes, each with an empty local tier) start
the same small training job at once against one fleet store. Reports total compiles across the fleet,
unique keys, the slowest host's wall time — with single-flight on and off — for a shared path and for S3
(a moto server in its own process on 127.0.0.1), and a host joining the warm store.

    python benchmarks/fleet.py [--hosts 8] [--tier reference|aoti] [--stores path,s3]

The `reference` tier (default) compiles in milliseconds, which makes races between hosts as tight as
they get; `aoti` shows real compile times (several seconds per op)."""

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

JOB = """
import json, os, sys, time, torch, neuron_runtime
from neuron_runtime.aten import _dispatch
t0 = time.perf_counter()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)).to('neuron')
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
x, y = torch.randn(8, 16, device='neuron'), torch.randint(0, 4, (8,), device='neuron')
for _ in range(3):
    opt.zero_grad(); torch.nn.functional.cross_entropy(model(x), y).backward(); opt.step()
s = neuron_runtime.stats()
print(json.dumps({'compiles': s['compiles'], 'hits': s['hits'], 'lease_waits': s.get('lease_waits', 0),
                  'keys': sorted(_dispatch.runtime().by_digest), 'wall_s': time.perf_counter() - t0}))
"""


def run_fleet(n: int, store_url: str, env_base: dict[str, str], work: Path, single_flight: bool) -> dict[str, object]:
    procs = []
    for i in range(n):
        env = dict(env_base, TORCH_NEURONX_NEFF_CACHE_DIR=store_url,
                   TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR=str(work / f"host{i}"),
                   TORCH_NEURONX_SINGLE_FLIGHT="1" if single_flight else "0")
        procs.append(subprocess.Popen([sys.executable, "-c", JOB], env=env, stdout=subprocess.PIPE,
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
            "slowest_host_s": round(max(float(o["wall_s"]) for o in outs), 2),  # type: ignore[arg-type]
            "lease_waits": sum(int(o["lease_waits"]) for o in outs)}  # type: ignore[arg-type]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hosts", type=int, default=8)
    p.add_argument("--tier", default="reference", choices=["reference", "aoti"])
    p.add_argument("--stores", default="path,s3")
    args = p.parse_args()
    env = dict(os.environ, TORCH_NEURONX_COMPILER=args.tier, OMP_NUM_THREADS="1")
    results: list[dict[str, object]] = []
    moto = None
    try:
        for store in args.stores.split(","):
            for single_flight in (True, False):
                work = Path(tempfile.mkdtemp(prefix="neuron-fleet-"))
                try:
                    if store == "path":
                        url = str(work / "fleet")
                    else:
                        if moto is None:
                            from conftest import MotoS3

                            moto = MotoS3()
                            moto.start()
                            env.update(moto.env())
                        bucket = f"fleet-{int(time.time() * 1000) % 10**9}-{int(single_flight)}"
                        moto.make_bucket(bucket)
                        url = f"s3://{bucket}/neff"
                    r = run_fleet(args.hosts, url, env, work, single_flight)
                    r["store"] = store
                    if single_flight:
                        joiner = run_fleet(1, url, env, work / "joiner", True)
                        r["joining_host_compiles"] = joiner["fleet_compiles"]
                    results.append(r)
                    print(json.dumps(r), file=sys.stderr, flush=True)
                finally:
                    shutil.rmtree(work, ignore_errors=True)
    finally:
        if moto is not None:
            moto.stop()
    print(json.dumps({"tier": args.tier, "runs": results}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Slow and hostile fleet stores, for the record (issue 41; JSON on stdout, progress on stderr).

    python benchmarks/store_fuzz.py [--cases 10000]      the fuzz suite of tests/cache/_storefuzz.py
    python benchmarks/store_fuzz.py --public-api        x + x against a store that drips a byte every 2 s

`--cases`: that many hypothesis cases over the stores' answers (sizes, drips, truncations, lies, hangs;
HTTP, Redis and path stores); every case is judged (hang past the deadline, wrong result, unbounded
read, false miss) and counted, not stopped at the first failure. Targets: 0 of each.

`--public-api`: for an HTTP and a Redis store on 127.0.0.1 that answer every read one byte every 2 s,
with TORCH_NEURONX_FLEET_TIMEOUT=3, a fresh process runs `x + x` on `neuron` (reference compiler): in
`sync` mode it must return the right result within 20 s; in `background` mode
`wait_for_compiles(20)` must be True (the op compiled). Also the load average with every number.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests" / "cache"))
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO))


def fuzz(n: int) -> dict[str, object]:
    from hypothesis import HealthCheck, given, settings

    from _storefuzz import DEADLINE, LIMIT, Case, cases, check_case  # type: ignore[import-not-found]

    counts: Counter[str] = Counter()
    failures: list[str] = []
    slowest = [0.0]
    tmp = Path(tempfile.mkdtemp(prefix="store-fuzz-"))

    @settings(max_examples=n, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(cases())
    def one(case: Case) -> None:
        t0 = time.monotonic()
        try:
            counts[check_case(case, tmp)] += 1
        except AssertionError as e:
            kind = str(e).split(" (", 1)[0].split(":", 1)[0]
            counts[kind] += 1
            failures.append(str(e))
        except Exception as e:  # noqa: BLE001 - a store that raised broke its contract: count it, go on
            counts["crash"] += 1
            failures.append(f"crash {e!r}: {case.describe()}")
        counts[f"store:{case.store}"] += 1
        slowest[0] = max(slowest[0], time.monotonic() - t0)
        done = sum(v for k, v in counts.items() if k.startswith("store:"))
        if done % 500 == 0:
            print(f"{done} cases, load {os.getloadavg()[0]:.1f}: {dict(counts)}", file=sys.stderr)

    t0 = time.monotonic()
    one()
    return {"cases": sum(v for k, v in counts.items() if k.startswith("store:")), "counts": dict(counts),
            "hangs_past_deadline": counts["hang past the deadline"], "wrong_results": counts["wrong result"],
            "unbounded_reads": counts["unbounded read"], "false_misses": counts["false miss"],
            "crashes": counts["crash"],
            "failures": failures[:20], "deadline_s": DEADLINE, "limit_bytes": LIMIT,
            "slowest_case_s": round(slowest[0], 3), "wall_s": round(time.monotonic() - t0, 1)}


_JOB = """
import os, sys, time, torch, neuron_runtime
x = torch.arange(6.)
t0 = time.monotonic()
y = (x.to('neuron') + x.to('neuron')).cpu()
took = time.monotonic() - t0
ok = bool(torch.equal(y, x + x))
compiled = neuron_runtime.wait_for_compiles(20) if os.environ['TORCH_NEURONX_COMPILE_MODE'] == 'background' else None
print(took, ok, compiled, neuron_runtime.stats().get('compiles'), flush=True)
"""


def public_api() -> list[dict[str, object]]:
    from _scripted import Answer, ScriptedServer  # type: ignore[import-not-found]

    out = []
    for proto in ("http", "resp"):
        for mode in ("sync", "background"):
            with ScriptedServer(proto, Answer(body=b"x" * 4096, chunk=1, drip_s=2.0)) as server:
                with tempfile.TemporaryDirectory() as tmp:
                    env = dict(os.environ, PYTHONPATH=str(REPO), TORCH_NEURONX_NEFF_CACHE_DIR=server.url(),
                               TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR=str(Path(tmp) / "local"),
                               TORCH_NEURONX_FLEET_TIMEOUT="3", TORCH_NEURONX_COMPILER="reference",
                               TORCH_NEURONX_COMPILE_MODE=mode, OMP_NUM_THREADS="1")
                    t0 = time.monotonic()
                    r = subprocess.run([sys.executable, "-c", _JOB], env=env, capture_output=True, text=True,
                                       timeout=120, cwd=tmp)
                    wall = time.monotonic() - t0
            fields = r.stdout.split()
            row: dict[str, object] = {"store": proto, "mode": mode, "rc": r.returncode, "process_s": round(wall, 1),
                                      "load": round(os.getloadavg()[0], 2)}
            if len(fields) >= 3:
                row.update(op_s=round(float(fields[0]), 2), right=fields[1] == "True", compiled=fields[2],
                           compiles=fields[3] if len(fields) > 3 else None)
            else:
                row["stderr"] = r.stderr[-2000:]
            print(json.dumps(row), file=sys.stderr)
            out.append(row)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--cases", type=int, default=10_000)
    p.add_argument("--public-api", action="store_true", help="the drip-store x + x checks instead of the fuzz")
    args = p.parse_args(argv)
    result: dict[str, object] = {"load_before": os.getloadavg()}
    if args.public_api:
        result["public_api"] = public_api()
    else:
        result["fuzz"] = fuzz(args.cases)
    result["load_after"] = os.getloadavg()
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

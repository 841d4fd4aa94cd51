"""Instructions per hit-path call under callgrind (JSON on stdout): the repeatable measure of the hit path.

    python benchmarks/callgrind_hitpath.py [--code DIR ...] [--calls 10000,30000]

Wall-clock runs of `dispatch.py` on a shared machine move native `add` itself by ±30 % from run to run;
instruction counts do not. For each checkout (`--code`, default this one; e.g. a `git worktree` of main
before a change, side by side) and each case, the same script runs under `valgrind --tool=callgrind`
twice, with the call made N1 and N2 times after warm-up (`PYTHONHASHSEED=0`, reference tier, sync mode,
a fresh local tier each); instructions per call = the difference of the totals / (N2 - N1). Cases: a
64-float `add` (the hit path), `add(..., out=c)` (a hit of an out= op: the write-overlap test runs) and
`add_` (an in-place hit).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

SCRIPT = r"""
import sys, torch, neuron_runtime
case, n = sys.argv[1], int(sys.argv[2])
a, b, c = (torch.randn(64).to("neuron") for _ in range(3))
call = {"add": lambda: torch.add(a, b), "add_out": lambda: torch.add(a, b, out=c),
        "add_": lambda: c.add_(a)}[case]
for _ in range(200):  # compile, load, learn the native entry
    call()
for _ in range(n):
    call()
"""

CASES = ("add", "add_out", "add_")


def instructions(code: Path, case: str, n: int, work: Path) -> int:
    out = work / f"cg-{case}-{n}.out"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCH_NEURONX_")}
    env.update(PYTHONHASHSEED="0", OMP_NUM_THREADS="1", TORCH_NEURONX_COMPILER="reference",
               TORCH_NEURONX_COMPILE_MODE="sync", TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR=str(work / "neff"),
               PYTHONPATH=str(code))
    subprocess.run(["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", sys.executable, "-c", SCRIPT,
                    case, str(n)], env=env, cwd=str(code), check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    m = re.search(r"^summary:\s+(\d+)", out.read_text(), re.M) or re.search(r"^totals:\s+(\d+)", out.read_text(), re.M)
    assert m, "no summary line in the callgrind output"
    return int(m.group(1))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--code", action="append", help="checkout(s) to measure (default: this one)")
    p.add_argument("--calls", default="10000,30000")
    p.add_argument("--cases", default=",".join(CASES))
    args = p.parse_args()
    if shutil.which("valgrind") is None:  # (`make bench` runs every script: a host without it skips this one)
        print(json.dumps({"skipped": "valgrind is not installed"}))
        return 0
    n1, n2 = (int(x) for x in args.calls.split(","))
    codes = [Path(c) for c in (args.code or [str(REPO)])]
    out: dict[str, object] = {"calls": [n1, n2], "load_before": os.getloadavg(), "per_call": {}}
    for case in args.cases.split(","):
        for code in codes:  # checkouts side by side, case by case
            work = Path(tempfile.mkdtemp(prefix="neuron-cg-"))
            try:
                lo, hi = instructions(code, case, n1, work), instructions(code, case, n2, work)
            finally:
                shutil.rmtree(work, ignore_errors=True)
            per = round((hi - lo) / (n2 - n1))
            out["per_call"].setdefault(case, {})[str(code)] = per  # type: ignore[union-attr]
            print(f"{case} {code}: {per} instructions per call", file=sys.stderr, flush=True)
    out["load_after"] = os.getloadavg()
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The `aoti` tier by itself: compile seconds per op, load milliseconds per executable, hit-path call cost.

Method (JSON on stdout, progress on stderr):
  * compile: a handful of distinct op signatures compiled one after another in this process; the first
    also pays the process's imports, the fingerprint and, with `--cold`, Inductor's precompiled headers
    (a fresh scratch directory; otherwise the one under --root is reused as on a warm host).
  * load: each artifact loaded `--loads` times from bytes (what a hit in the local tier costs after the
    entry is read); p50 / p95.
  * call: 64-float `add` through the executable (`loader.run(list)`) vs native eager `torch.add`,
    interleaved rounds of N calls, medians and their ratio. OMP_NUM_THREADS=1, set before torch loads.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

from neuron_runtime.aten import _dispatch
from neuron_runtime.compiler._aoti import AotiCompiler  # noqa: E402
from neuron_runtime.signatures import _ops, _signature  # noqa: E402

torch.set_num_threads(1)


def _ops_to_compile() -> list[tuple[str, tuple[object, ...]]]:
    x64 = torch.randn(64)
    return [
        ("aten::add.Tensor", (x64, torch.randn(64), 1)),
        ("aten::mm", (torch.randn(32, 64), torch.randn(64, 16))),
        ("aten::sum.dim_IntList", (torch.randn(32, 64), [1], False, None)),
        ("aten::_foreach_add.ScalarList", ([torch.randn(64), torch.randn(8, 8)], [1e-3, 2e-3])),
        ("aten::relu", (torch.randn(32, 64),)),
    ]


def _us_per_call(fn, n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e6


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root", default=str(Path(tempfile.gettempdir()) / "neuron-aoti-bench"),
                   help="parent of the local cache dir; Inductor's scratch is kept here between runs")
    p.add_argument("--cold", action="store_true", help="start from an empty scratch directory")
    p.add_argument("--ops", type=int, default=5, help="how many of the op signatures to compile")
    p.add_argument("--loads", type=int, default=30)
    p.add_argument("--calls", type=int, default=20000)
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args(argv)

    root = Path(args.root)
    if args.cold:
        shutil.rmtree(root, ignore_errors=True)
    t_start = time.perf_counter()
    compiler = AotiCompiler(local_cache_dir=str(root / "neff"))
    compiler.fingerprint()
    fp_s = time.perf_counter() - t_start
    compiled = []
    for qualname, values in _ops_to_compile()[: args.ops]:
        info = _ops.classify(qualname)
        sig = _signature.build(info, values)
        t0 = time.perf_counter()
        payload = compiler.compile(sig)
        dt = time.perf_counter() - t0
        print(f"compiled {qualname} in {dt:.1f}s ({len(payload)} bytes)", file=sys.stderr)
        compiled.append({"op": qualname, "compile_s": round(dt, 2), "bytes": len(payload),
                         "info": info, "values": values, "payload": payload})

    loads = []
    for c in compiled:
        times = []
        for _ in range(args.loads):
            t0 = time.perf_counter()
            compiler.load(c["payload"])
            times.append(time.perf_counter() - t0)
        times.sort()
        loads.append({"op": c["op"], "p50_ms": round(statistics.median(times) * 1e3, 2),
                      "p95_ms": round(times[int(0.95 * (len(times) - 1))] * 1e3, 2)})

    add = compiled[0]
    exe = compiler.load(add["payload"])
    tensors, scalars = _dispatch.flatten(add["info"], add["values"])
    a, b = tensors

    def native() -> None:
        torch.add(a, b, alpha=1)

    def executable() -> None:
        exe(tensors, scalars)

    native(), executable()
    na, ex = [], []
    for _ in range(args.rounds):
        na.append(_us_per_call(native, args.calls))
        ex.append(_us_per_call(executable, args.calls))
    n_med, e_med = statistics.median(na), statistics.median(ex)
    result = {
        "cold": args.cold,
        "fingerprint_s": round(fp_s, 3),
        "compile": [{k: c[k] for k in ("op", "compile_s", "bytes")} for c in compiled],
        "compile_first_s": compiled[0]["compile_s"],
        "compile_later_median_s": round(statistics.median(c["compile_s"] for c in compiled[1:]), 2)
        if len(compiled) > 1 else None,
        "load": loads,
        "load_p50_ms_median": round(statistics.median(x["p50_ms"] for x in loads), 2),
        "call_add64": {"native_us": round(n_med, 2), "aoti_run_us": round(e_med, 2),
                       "ratio": round(e_med / n_med, 2)},
    }
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

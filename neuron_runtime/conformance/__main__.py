"""`python -m neuron_runtime.conformance`: run PyTorch's OpInfo database on `neuron` against CPU."""

from __future__ import annotations

import argparse
import json
import os
import sys


def _build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m neuron_runtime.conformance",
                                description="Run op_db's sample inputs on neuron and on CPU; write the coverage map.")
    p.add_argument("--tier", choices=("reference", "aoti"), default="reference", help="compiler tier")
    p.add_argument("--ops", action="append", metavar="PATTERN",
                   help="glob(s) over op names (name or name.variant), comma-separated or repeated")
    p.add_argument("--jobs", type=int, default=max(1, min(4, os.cpu_count() or 1)), help="worker processes")
    p.add_argument("--samples", type=int, default=None,
                   help="sample inputs per op (default 3 on reference, 1 on aoti)")
    p.add_argument("--timeout", type=float, default=None,
                   help="seconds per op before it counts as an error (default 120 reference, 900 aoti)")
    p.add_argument("--budget", type=float, default=None,
                   help="seconds for the whole sweep; ops not reached are listed as not run (partial)")
    p.add_argument("--dtypes", choices=("default", "all"), default="default",
                   help="default: each op's first CPU dtype (float32 where it has one) and the dtypes CUDA "
                        "accepts and CPU does not; all: every CPU dtype as well (forward only)")
    p.add_argument("--every-dtype", action="append", metavar="PATTERN",
                   help="glob(s) of ops that run every dtype (what --dtypes all does for every op)")
    p.add_argument("--only-dtypes", metavar="LIST",
                   help="comma-separated dtype names: the extra dtypes checked are only these (e.g. float16,bfloat16)")
    p.add_argument("--no-cuda-only", dest="cuda_only", action="store_false",
                   help="skip the CUDA-only dtype checks")
    p.add_argument("--cuda-only", dest="cuda_only", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--forward-only", action="store_true",
                   help="forward only: no backward, in-place or out= checks (default on aoti)")
    p.add_argument("--cache-dir", help="local executable cache (default: a fresh temporary directory)")
    p.add_argument("--out", help="JSON file to write (markdown goes beside it, .md)")
    p.add_argument("--update", action="store_true",
                   help="merge the ops this run checks into the existing --out file (their entries replaced, "
                        "the summary recomputed), e.g. to rerun a few ops of a sweep that took hours")
    p.add_argument("--json", action="store_true", help="print the summary as JSON on stdout")
    # Internal: one worker process.
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--names-file", help=argparse.SUPPRESS)
    p.add_argument("--results", help=argparse.SUPPRESS)
    p.add_argument("--list", action="store_true", help="list the selected op names and exit")
    return p


def _dtype_list(text: str | None) -> list[str] | None:
    if not text:
        return None
    import torch

    names = [n.strip().removeprefix("torch.") for n in text.split(",") if n.strip()]
    bad = [n for n in names if not isinstance(getattr(torch, n, None), torch.dtype)]
    if bad:
        raise SystemExit(f"--only-dtypes: not a dtype: {', '.join(bad)}")
    return names


def main(argv: list[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    samples = args.samples or (1 if args.tier == "aoti" else 3)
    timeout = args.timeout or (900.0 if args.tier == "aoti" else 120.0)
    from . import _runner

    if args.worker:
        with open(args.names_file) as f:
            names = [n for n in f.read().splitlines() if n]
        return _runner.worker(names, args.results, samples, timeout, args.cuda_only, args.forward_only,
                              args.every_dtype, _dtype_list(args.only_dtypes))
    from ._check import op_key

    names = _runner.select([op_key(op) for op in _runner.load_op_db()], args.ops)
    if args.list:
        print("\n".join(names))
        return 0
    if not names:
        print("no op matches --ops", file=sys.stderr)
        return 2
    if not args.out:
        print("--out FILE is required", file=sys.stderr)
        return 2
    print(f"neuron conformance: {len(names)} ops, tier {args.tier}, {args.jobs} jobs, {samples} sample(s)",
          file=sys.stderr)
    forward_only = args.forward_only or args.tier == "aoti"
    every = ["*"] if args.dtypes == "all" else args.every_dtype
    cov = _runner.sweep(names, args.tier, args.jobs, samples, timeout, args.cuda_only, args.budget, sys.stderr,
                        args.cache_dir, forward_only, every, _dtype_list(args.only_dtypes))
    if args.update:
        cov = _runner.merge(args.out, cov)
    path, md = _runner.write(cov, args.out)
    s = cov["summary"]
    print(f"{s['ops']} ops: {s['compiled']} compiled, {s['fallback']} fallback, {s['mismatch']} mismatch, "
          f"{s['error']} error, {s['skipped']} skipped; {s['matched_pct']} % match CPU "
          f"({'partial, ' if s['partial'] else ''}{s['seconds']} s) -> {path}, {md}", file=sys.stderr)
    if args.json:
        print(json.dumps(s, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`python -m neuron_runtime.conformance.upstream`: device-generic test files on neuron vs CPU."""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any


def _build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m neuron_runtime.conformance.upstream",
                                description="Run device-generic test files on neuron and on CPU; classify every "
                                            "difference; write JSON + markdown.")
    p.add_argument("--files", action="append", metavar="PATTERN",
                   help="globs over file names (default: every wheel suite, and every upstream file found)")
    p.add_argument("--file", action="append", dest="paths", metavar="PATH", default=[],
                   help="any other device-generic test file to run (repeatable)")
    p.add_argument("--pytorch-tests", default=os.environ.get("TORCH_NEURONX_PYTORCH_TESTS"),
                   help="a PyTorch checkout's test/ directory at torch's git version (env "
                        "TORCH_NEURONX_PYTORCH_TESTS); nothing is fetched")
    p.add_argument("--dtypes", default="sample",
                   help="'sample' (float32,int64,bfloat16), 'all', or a comma-separated list")
    p.add_argument("--jobs", type=int, default=2, help="worker processes at a time")
    p.add_argument("--shards", type=int, default=1, help="split each file's tests over this many workers")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per test before it is stopped")
    p.add_argument("--grace", type=float, default=30.0,
                   help="seconds past --timeout before a worker that cannot stop its test is killed")
    p.add_argument("--budget", type=float, default=None, help="seconds for the whole run (the rest not run)")
    p.add_argument("--out", help="JSON file to write (markdown beside it, .md)")
    p.add_argument("--list", action="store_true", help="list the files that would run and exit")
    p.add_argument("--json", action="store_true", help="print the summary as JSON on stdout")
    return p


def select(args: argparse.Namespace) -> tuple[list[tuple[str, Path, str]], list[str]]:
    """(name, path, kind) of each file to run, and the chosen upstream files that are missing."""
    from ._files import SUITES_DIR, UPSTREAM, WHEEL

    pats = [x for p in args.files or [] for x in p.split(",") if x]
    want = (lambda n: not pats or any(fnmatch.fnmatchcase(n, p) for p in pats))
    out = [(n, SUITES_DIR / n, "wheel") for n in WHEEL if want(n)]
    missing = []
    for n in UPSTREAM:
        if not want(n):
            continue
        path = Path(args.pytorch_tests) / n if args.pytorch_tests else None
        if path is not None and path.is_file():
            out.append((n, path, "upstream"))
        else:
            missing.append(n)
    out += [(Path(p).name, Path(p).resolve(), "other") for p in args.paths]
    return out, missing


def _source_commit(d: str | None) -> str | None:
    if not d:
        return None
    try:
        return subprocess.run(["git", "-C", d, "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def main(argv: list[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    from ._files import KNOWN, SAMPLE_DTYPES, UPSTREAM_COMMIT

    files, missing = select(args)
    if args.list:
        for n, p, k in files:
            print(f"{k}\t{n}\t{p}")
        for n in missing:
            print(f"missing\t{n}")
        return 0
    if not files:
        print("no file to run (see --files, --pytorch-tests)", file=sys.stderr)
        return 2
    dtypes = SAMPLE_DTYPES if args.dtypes == "sample" else [] if args.dtypes == "all" else \
        [d.strip().removeprefix("torch.") for d in args.dtypes.split(",") if d.strip()]
    commit = _source_commit(args.pytorch_tests)
    if commit and commit != UPSTREAM_COMMIT:
        print(f"warning: {args.pytorch_tests} is at {commit}, torch 2.13.0 was built from {UPSTREAM_COMMIT}",
              file=sys.stderr)
    from . import _report, _runner

    tasks = {(n, d, i): _runner.Task(p, d, f"{i}/{args.shards}" if args.shards > 1 else "")
             for n, p, _ in files for d in ("neuron", "cpu") for i in range(args.shards)}
    load_before = [round(x, 2) for x in os.getloadavg()]
    print(f"upstream suites: {len(files)} files x 2 devices, dtypes {','.join(dtypes) or 'all'}, "
          f"{args.jobs} jobs; load {load_before}", file=sys.stderr)
    wall = _runner.run(list(tasks.values()), args.jobs, dtypes, args.timeout, sys.stderr, args.budget, args.grace)
    merged: dict[str, dict[str, Any]] = {}
    for n, p, kind in files:
        f = merged[n] = {"path": p, "kind": kind}
        for d in ("neuron", "cpu"):
            parts = [tasks[(n, d, i)] for i in range(args.shards)]
            t = _runner.Task(p, d)
            for part in parts:
                t.results.update(part.results)
                t.collect_errors += [e for e in part.collect_errors if e not in t.collect_errors]
                t.seconds += part.seconds
                t.restarts += part.restarts
            f[d] = t
    import torch

    meta = {"torch": torch.__version__, "torch_git": torch.version.git_version, "upstream_commit": UPSTREAM_COMMIT,
            "source_dir": args.pytorch_tests, "source_commit": commit, "missing_upstream": missing,
            "tier": os.environ.get("TORCH_NEURONX_COMPILER", "reference"), "dtypes": dtypes,
            "timeout_s": args.timeout, "jobs": args.jobs, "seconds": round(wall, 1),
            "load_before": load_before, "load_after": [round(x, 2) for x in os.getloadavg()]}
    rep = _report.build(merged, KNOWN, meta)
    s = rep["summary"]
    c = s["counts"]
    print(f"{c['pass']} of {c['pass'] + c['neuron_only']} CPU-passing tests pass on neuron ({s['pass_rate']} %); "
          f"{c['neuron_only']} neuron-only failures, {c['shared']} shared with CPU, {c['skipped_neuron']} skipped on "
          f"neuron; import errors: {s['import_errors'] or 'none'}; {wall:.0f} s", file=sys.stderr)
    if missing:
        print(f"not run (no PyTorch checkout given, or the file is missing there): {', '.join(missing)}",
              file=sys.stderr)
    if args.out:
        path = Path(args.out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(rep, indent=1) + "\n")
        path.with_suffix(".md").write_text(_report.markdown(rep))
    if args.json:
        print(json.dumps(s, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

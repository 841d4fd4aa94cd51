"""The sweep over op_db: shards in worker processes, the coverage map, its JSON and markdown.

1. The parent lists op_db's names (matching `--ops`), deals them round-robin to `--jobs` workers.
2. Each worker (`python -m neuron_runtime.conformance --worker ...`) imports torch once, checks its ops one
   by one under a per-op time limit, and appends a JSON line per op to its results file (a `start` line
   first, so an op that kills the process is known).
3. A worker that dies is restarted on its remaining ops; the op it died on is an `error`.
4. The parent merges the lines into `{"tier", "ops", "summary"}` and writes the markdown beside the JSON.
"""

from __future__ import annotations

import fnmatch
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, TextIO

STATUSES = ("compiled", "fallback", "mismatch", "error", "skipped")


def load_op_db() -> list[Any]:
    from torch.testing._internal.common_methods_invocations import op_db

    return list(op_db)


def select(names: list[str], patterns: list[str] | None) -> list[str]:
    """Names matching any of the glob patterns (comma-separated or repeated); all if none."""
    if not patterns:
        return names
    pats = [p for pat in patterns for p in pat.split(",") if p]
    return [n for n in names if any(fnmatch.fnmatchcase(n, p) for p in pats)]


# -- worker ---------------------------------------------------------------------------------------------
class OpTimeout(Exception):
    pass


_FIRED: list[bool] = []


def _alarm(signum: int, frame: Any) -> None:
    # Remembered as well as raised: the runtime turns an exception inside a compile into a fallback, so the
    # op's result alone would hide the timeout.
    _FIRED.append(True)
    raise OpTimeout("the op's checks ran past the per-op time limit")


def worker(names: list[str], results: str, samples: int, timeout_s: float, cuda_only: bool,
           forward_only: bool = False, every_dtype: list[str] | None = None,
           only_dtypes: list[str] | None = None) -> int:
    """Check `names` in this process, appending one JSON line per op to `results`. `cuda_only`: also the
    dtypes CUDA accepts and CPU does not; `every_dtype`: globs of ops that also run every other CPU dtype
    (forward only); `only_dtypes`: of those extra dtypes, only these names."""
    import warnings

    warnings.simplefilter("ignore")
    import torch  # noqa: F401 - registers the neuron device

    from ._check import _HostLog, check_cuda_dtype, check_op, op_key
    from ._skips import SKIP, cpu_dtypes, cuda_only_dtypes

    by_name = {op_key(op): op for op in load_op_db()}
    every = set(select(names, every_dtype)) if every_dtype else set()
    log = _HostLog()
    signal.signal(signal.SIGALRM, _alarm)
    with open(results, "a", buffering=1) as f:
        for name in names:
            op = by_name[name]
            f.write(json.dumps({"start": name}) + "\n")
            signal.setitimer(signal.ITIMER_REAL, timeout_s)
            _FIRED.clear()
            try:
                res = check_op(op, k=samples, deadline_s=timeout_s * 0.5, log=log, forward_only=forward_only)
                entry = res.as_json()
                extra: dict[str, Any] = {}
                wanted = (lambda d: only_dtypes is None or str(d).removeprefix("torch.") in only_dtypes)
                if name not in SKIP and name in every:
                    for d in cpu_dtypes(op):
                        if str(d).removeprefix("torch.") == res.dtype or not wanted(d):
                            continue
                        r = check_op(op, k=samples, dtype=d, deadline_s=timeout_s * 0.1, log=log, forward_only=True)
                        extra[str(d).removeprefix("torch.")] = _brief(r.as_json())
                if name not in SKIP and (cuda_only or name in every):
                    for d in filter(wanted, cuda_only_dtypes(op)):
                        r = check_cuda_dtype(op, d, k=samples, log=log)
                        extra[str(d).removeprefix("torch.")] = {**_brief(r.as_json()), "cuda_only": True}
                if extra:
                    entry["dtypes"] = extra
            except OpTimeout as e:
                entry = {"status": "error", "reason": f"timeout: {e} ({timeout_s:g} s)"}
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
            if _FIRED:
                entry = {"status": "error", "reason": f"timeout: the op's checks ran past {timeout_s:g} s"}
            f.write(json.dumps({"op": name, **entry}) + "\n")
    return 0


def _brief(r: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in r.items() if k in ("status", "reason", "samples", "executions", "seconds", "checks")}


# -- parent ---------------------------------------------------------------------------------------------
def _read(path: Path) -> tuple[dict[str, dict[str, Any]], str | None]:
    done: dict[str, dict[str, Any]] = {}
    started: str | None = None
    if not path.exists():
        return done, None
    for line in path.read_text().splitlines():
        try:
            d = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by a crash
        if "start" in d:
            started = d["start"]
        elif "op" in d:
            name = d.pop("op")
            done[name] = d
            if started == name:
                started = None
    return done, started


def sweep(names: list[str], tier: str, jobs: int, samples: int, timeout_s: float, cuda_only: bool,
          budget_s: float | None, progress: TextIO, cache_dir: str | None = None,
          forward_only: bool = False, every_dtype: list[str] | None = None,
          only_dtypes: list[str] | None = None) -> dict[str, Any]:
    """Run the sweep over `names` with `jobs` worker processes; returns the coverage map."""
    t0 = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="neuron-conformance-"))
    env = dict(os.environ)
    env["TORCH_NEURONX_COMPILER"] = tier
    env["TORCH_NEURONX_FALLBACK"] = "1"
    # Every op compiles before it runs: the sweep says what runs through executables, and a background
    # compile would run the first calls on the host.
    env["TORCH_NEURONX_COMPILE_MODE"] = "sync"
    env["TORCH_NEURONX_COMPILE_AFTER"] = "1"
    env["TORCH_NEURONX_PREFETCH"] = "0"
    env.setdefault("OMP_NUM_THREADS", "1")
    env["TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR"] = cache_dir or str(work / "cache")
    env.pop("TORCH_NEURONX_CACHE_MODE", None)
    shards = [names[i::jobs] for i in range(max(1, jobs))]
    results: dict[str, dict[str, Any]] = {}
    procs: dict[int, tuple[subprocess.Popen[bytes], list[str], Path]] = {}
    restarts = 0

    def launch(i: int, todo: list[str]) -> None:
        nonlocal restarts
        restarts += 1
        path = work / f"shard{i}-{restarts}.jsonl"
        lst = work / f"shard{i}-{restarts}.names"
        lst.write_text("\n".join(todo))
        cmd = [sys.executable, "-m", "neuron_runtime.conformance", "--worker", "--names-file", str(lst),
               "--results", str(path), "--samples", str(samples), "--timeout", str(timeout_s)]
        cmd.append("--cuda-only" if cuda_only else "--no-cuda-only")
        if forward_only:
            cmd.append("--forward-only")
        for pat in every_dtype or ():
            cmd += ["--every-dtype", pat]
        if only_dtypes:
            cmd += ["--only-dtypes", ",".join(only_dtypes)]
        # stderr to a file, never a pipe: nobody reads a pipe until the worker exits, and a full one blocks it.
        with open(path.with_suffix(".err"), "wb") as err:
            procs[i] = (subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=err), todo, path)

    for i, shard in enumerate(shards):
        if shard:
            launch(i, shard)
    seen: dict[Path, int] = {}
    timed_out = False
    stop: list[int] = []
    # SIGTERM/SIGINT: stop the workers and write what is done, labelled partial.
    old_handlers = {sig: signal.signal(sig, lambda signum, frame: stop.append(signum))
                    for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        _loop(procs, names, results, seen, progress, budget_s, t0, stop, launch)
    finally:
        for sig, h in old_handlers.items():
            signal.signal(sig, h)
        for p, _, _ in procs.values():
            p.kill()
            p.wait()
    missing = [n for n in names if n not in results]
    cov = coverage_map(tier, results, missing, samples, time.monotonic() - t0)
    cov["summary"]["forward_only"] = forward_only
    cov["summary"]["every_dtype"] = list(every_dtype or [])
    cov["summary"]["only_dtypes"] = list(only_dtypes or [])
    return cov


def _loop(procs: dict[int, Any], names: list[str], results: dict[str, dict[str, Any]], seen: dict[Path, int],
          progress: TextIO, budget_s: float | None, t0: float, stop: list[int], launch: Any) -> None:
    timed_out = False
    while procs:
        time.sleep(0.5)
        for i, (p, todo, path) in list(procs.items()):
            done, started = _read(path)
            for n in list(done)[seen.get(path, 0):]:
                results[n] = done[n]
                r = done[n]
                progress.write(f"[{len(results)}/{len(names)}] {n}: {r['status']}"
                               f"{(' - ' + r['reason'][:120]) if r.get('reason') and r['status'] != 'compiled' else ''}\n")
            seen[path] = len(done)
            progress.flush()
            if p.poll() is None:
                if stop or (budget_s is not None and time.monotonic() - t0 > budget_s):
                    p.send_signal(signal.SIGTERM)
                    p.wait()
                    timed_out = True
                    del procs[i]
                continue
            err = path.with_suffix(".err").read_text(errors="replace")
            del procs[i]
            rest = [n for n in todo if n not in done]
            if rest and not timed_out:
                if started in rest:
                    tail = err.strip().splitlines()[-1:] or [""]
                    results[started] = {"status": "error",
                                        "reason": f"the worker process died (exit {p.returncode}): {tail[0][:200]}"}
                    progress.write(f"[{len(results)}/{len(names)}] {started}: error (worker died)\n")
                    rest.remove(started)
                elif p.returncode != 0:
                    progress.write(f"worker {i} failed (exit {p.returncode}):\n{err[-2000:]}\n")
                    raise SystemExit(2)
                if rest:
                    launch(i, rest)


def coverage_map(tier: str, results: dict[str, dict[str, Any]], missing: list[str], samples: int,
                 seconds: float) -> dict[str, Any]:
    import torch

    ops = {n: results[n] for n in sorted(results)}
    counts = {s: sum(1 for r in ops.values() if r["status"] == s) for s in STATUSES}
    total = len(ops)
    matched = counts["compiled"] + counts["fallback"]
    by_design = sum(1 for r in ops.values() if r["status"] == "fallback" and _by_design(r))
    compilable = total - counts["skipped"] - by_design
    summary: dict[str, Any] = {
        "ops": total,
        **counts,
        "matched": matched,
        "matched_pct": round(100.0 * matched / total, 2) if total else 0.0,
        "matched_pct_of_run": round(100.0 * matched / (total - counts["skipped"]), 2)
        if total - counts["skipped"] else 0.0,
        "compiled_pct": round(100.0 * counts["compiled"] / total, 2) if total else 0.0,
        # of the ops a compiler could compile: neither skipped nor on the host by design
        "compiled_pct_of_compilable": round(100.0 * counts["compiled"] / compilable, 2) if compilable else 0.0,
        "fallback_host_by_design": by_design,
        "fallback_compiler_refused": counts["fallback"] - by_design,
        "shapes": os.environ.get("TORCH_NEURONX_SHAPES", "auto").lower(),
        "per_shape": sum(1 for r in ops.values() if r.get("per_shape")),
        **dtype_summary(ops),
        "samples_per_op": samples,
        "partial": bool(missing),
        "not_run": len(missing),
        "seconds": round(seconds, 1),
        "torch": torch.__version__,
    }
    out: dict[str, Any] = {"tier": tier, "ops": ops, "summary": summary}
    if missing:
        out["not_run"] = missing
    return out


FAMILIES = {
    "float32": ("float32",), "float64": ("float64",), "half (float16, bfloat16)": ("float16", "bfloat16"),
    "complex (complex32, complex64, complex128)": ("complex32", "complex64", "complex128"),
    "integer": ("uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64"), "bool": ("bool",),
}
_MATCH = ("compiled", "fallback")


def _tally(rs: list[dict[str, Any]]) -> dict[str, Any]:
    n = len(rs)
    c = {s: sum(1 for r in rs if r["status"] == s) for s in STATUSES}
    m = c["compiled"] + c["fallback"]
    return {"checks": n, "matched": m, **c,
            "matched_pct": round(100.0 * m / n, 2) if n else 0.0,
            "matched_pct_of_run": round(100.0 * m / (n - c["skipped"]), 2) if n - c["skipped"] else 0.0}


def dtype_summary(ops: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Per dtype and dtype family: every (op, dtype) check (the op's own dtype, and its `dtypes` entries);
    and the CUDA-only pairs on their own."""
    by: dict[str, list[dict[str, Any]]] = {}
    cuda_only: list[dict[str, Any]] = []
    for r in ops.values():
        if r.get("dtype"):
            by.setdefault(r["dtype"], []).append(r)
        for d, x in r.get("dtypes", {}).items():
            by.setdefault(d, []).append(x)
            if x.get("cuda_only"):
                cuda_only.append(x)
    fams = {f: _tally([r for d in ds for r in by.get(d, [])]) for f, ds in FAMILIES.items()}
    return {"dtypes": {d: _tally(by[d]) for d in sorted(by)}, "families": {f: t for f, t in fams.items() if t["checks"]},
            "cuda_only": _tally(cuda_only)}


def _by_design(r: dict[str, Any]) -> bool:
    """A fallback op that ran on the host by design: a host op (random, ...) or refusals any compiler of
    aten ops would make (`_skips.refused_by_design`: the output's shape depends on the data)."""
    from ._skips import refused_by_design

    return all(refused_by_design(op, why) for op, why in r.get("fallback_ops", {}).items())


def markdown(cov: dict[str, Any]) -> str:
    s = cov["summary"]
    lines = [f"# op_db coverage on `neuron`, tier `{cov['tier']}`", ""]
    if s["partial"]:
        lines += [f"**Partial:** {s['not_run']} of {s['ops'] + s['not_run']} op_db entries did not run within "
                  "the time budget; the numbers below count only the entries that ran.", ""]
    lines += [
        f"torch {s['torch']}, {s['samples_per_op']} sample(s) per op in its first dtype (float32 where it has one; "
        + ("forward only" if s.get("forward_only") else "forward; backward where the OpInfo supports autograd; "
           "the in-place and out= variants on the first sample") + "), compared with CPU"
        + ("; every other dtype: " + ("all ops" if s.get("every_dtype") == ["*"] else
                                     ", ".join(f"`{p}`" for p in s.get("every_dtype", []))) + ", forward only"
           if s.get("every_dtype") else "") + ".", "",
        "| ops | compiled | fallback | mismatch | error | skipped | match CPU | compiled |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
        f"| {s['ops']} | {s['compiled']} | {s['fallback']} | {s['mismatch']} | {s['error']} | {s['skipped']} | "
        f"{s['matched_pct']} % | {s['compiled_pct']} % |", "",
        f"`fallback`: {s['fallback_host_by_design']} ops ran an aten op on the host by design (random ops, "
        f"data-dependent shapes, ...), {s['fallback_compiler_refused']} because the compiler refused one."
        + (f" Of the {s['ops'] - s['skipped'] - s['fallback_host_by_design']} ops neither skipped nor on the host "
           f"by design, {s['compiled_pct_of_compilable']} % compiled." if "compiled_pct_of_compilable" in s else ""),
        "",
    ]
    if s.get("cuda_only", {}).get("checks"):
        c = s["cuda_only"]
        lines += [f"CUDA-only dtypes (dtypes CUDA's kernel accepts and the op's CPU entry does not list): "
                  f"{c['matched']} of {c['checks']} (op, dtype) pairs match what CUDA computes ({c['matched_pct']} %; "
                  "reference: CPU in the nearest wider dtype, results in the dtypes CUDA returns).", ""]
    if s.get("families"):
        lines += ["## Per dtype", "",
                  "Every (op, dtype) check: the op's first dtype with the checks above, other CPU dtypes forward "
                  "only, CUDA-only dtypes against CPU computed wider. `match` = compiled + fallback.", "",
                  "| dtype family | checks | match | compiled | mismatch | error | skipped | match % | match % of run |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for fam, f in s["families"].items():
            lines.append(f"| {fam} | {f['checks']} | {f['matched']} | {f['compiled']} | {f['mismatch']} | {f['error']} | "
                         f"{f['skipped']} | {f['matched_pct']} % | {f['matched_pct_of_run']} % |")
        lines += ["", "| dtype | checks | match | compiled | mismatch | error | skipped | match % |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|"]
        for d, f in s["dtypes"].items():
            lines.append(f"| {d} | {f['checks']} | {f['matched']} | {f['compiled']} | {f['mismatch']} | {f['error']} | "
                         f"{f['skipped']} | {f['matched_pct']} % |")
        lines.append("")
    bad = [(n, r) for n, r in cov["ops"].items() if r["status"] in ("mismatch", "error")]
    if bad:
        from ._skips import KNOWN_FAILURES

        lines += ["## Mismatches and errors", "", "| op | status | reason | known cause |", "|---|---|---|---|"]
        lines += [f"| `{n}` | {r['status']} | {_cell(r.get('reason', ''))} | {_cell(KNOWN_FAILURES.get(n, ''))} |"
                  for n, r in bad]
        lines.append("")
    refused = [(n, r) for n, r in cov["ops"].items() if r["status"] == "fallback" and r.get("fallback_ops")]
    if refused:
        from ._skips import REFUSED_BY_DESIGN, REFUSED_HERE_ONLY, refused_by_design

        lines += ["## Refused by the compiler", "",
                  "Each op that ran an aten op on the host because the compiler refused it, and whether that "
                  "refusal is by design (the output's shape depends on the data: no compiler can build its "
                  "executable ahead of the values).", "",
                  "| op | aten op | by design | reason |", "|---|---|---|---|"]
        lines += [f"| `{n}` | `{q}` | {REFUSED_BY_DESIGN.get(q, 'yes') if refused_by_design(q, why) else REFUSED_HERE_ONLY.get(q, 'no')} | "
                  f"{_cell(why)} |" for n, r in refused for q, why in r["fallback_ops"].items()]
        lines.append("")
    fixed = [(n, q, why) for n, r in cov["ops"].items() for q, why in r.get("per_shape", {}).items()]
    if fixed:
        lines += ["## Compiled per shape", "",
                  f"Shape policy `{s.get('shapes', 'auto')}`: {s['per_shape']} ops ran an aten op whose shape class "
                  "has no generic executable (the compiler refused it), so it compiled per shape.", "",
                  "| op | aten op | reason |", "|---|---|---|"]
        lines += [f"| `{n}` | `{q}` | {_cell(why)} |" for n, q, why in fixed]
        lines.append("")
    pairs = [(n, d, r) for n, o in cov["ops"].items() for d, r in o.get("dtypes", {}).items() if r.get("cuda_only")]
    if pairs:
        lines += ["## CUDA-only dtypes", "", "| op | dtype | status | reason |", "|---|---|---|---|"]
        lines += [f"| `{n}` | {d} | {r['status']} | {_cell(r.get('reason', ''))} |" for n, d, r in pairs]
        lines.append("")
    other = [(n, d, r) for n, o in cov["ops"].items() for d, r in o.get("dtypes", {}).items()
             if not r.get("cuda_only") and r["status"] in ("mismatch", "error")]
    if other:
        lines += ["## Other dtypes: mismatches and errors", "", "| op | dtype | status | reason |",
                  "|---|---|---|---|"]
        lines += [f"| `{n}` | {d} | {r['status']} | {_cell(r.get('reason', ''))} |" for n, d, r in other]
        lines.append("")
    lines += ["## Every op", "", "| op | status | dtype | checks | reason |", "|---|---|---|---|---|"]
    for n, r in cov["ops"].items():
        lines.append(f"| `{n}` | {r['status']} | {r.get('dtype', '')} | {', '.join(r.get('checks', []))} | "
                     f"{_cell(r.get('reason', ''))} |")
    if cov.get("not_run"):
        lines += ["", "## Not run (time budget)", "", ", ".join(f"`{n}`" for n in cov["not_run"])]
    return "\n".join(lines) + "\n"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")[:300]


def merge(out: str, cov: dict[str, Any]) -> dict[str, Any]:
    """The coverage map in `out` with this run's ops replaced by `cov`'s results and the summary
    recomputed (`--update`). The two runs must be of one tier and sample count."""
    old = json.loads(Path(out).read_text())
    if old["tier"] != cov["tier"] or old["summary"]["samples_per_op"] != cov["summary"]["samples_per_op"]:
        raise SystemExit(f"--update: {out} is a {old['tier']} run with {old['summary']['samples_per_op']} "
                         f"sample(s) per op; this run is {cov['tier']} with {cov['summary']['samples_per_op']}")
    ops = {**old["ops"], **cov["ops"]}
    missing = [n for n in old.get("not_run", []) + cov.get("not_run", []) if n not in ops]
    merged = coverage_map(cov["tier"], ops, sorted(set(missing)), cov["summary"]["samples_per_op"],
                          old["summary"]["seconds"] + cov["summary"]["seconds"])
    for k in ("forward_only", "every_dtype", "only_dtypes"):
        merged["summary"][k] = old["summary"].get(k, cov["summary"].get(k))
    merged["summary"]["updated_ops"] = sorted(set(old["summary"].get("updated_ops", [])) | set(cov["ops"]))
    return merged


def write(cov: dict[str, Any], out: str) -> tuple[Path, Path]:
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(cov, indent=1, sort_keys=False) + "\n")
    md = path.with_suffix(".md")
    md.write_text(markdown(cov))
    return path, md

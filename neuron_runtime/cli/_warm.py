"""`neuron-cache warm -- JOB...` and `neuron-cache compile MANIFEST`.

What users call the manifest here (`--manifest`, MANIFEST, NEURON_CACHE_MANIFEST, the summary's
"manifest" keys) is a record file of signatures (`TORCH_NEURONX_RECORD_FILE`, executables' `_record`);
the code calls it that, and keeps "manifest" for a job's manifest of executables.

warm:
  1. Run the job once with recording on (TORCH_NEURONX_RECORD_FILE) on the `reference` tier (no real
     compiles: it only has to discover the signatures) and a throwaway local cache with no fleet store,
     so reference entries never reach the real caches.
  2. Compile the recorded signatures for the target tier, as `compile` does.
compile:
  1. Read the record file line by line; a bad line is reported with its number and skipped. With
     `--shard I/N`, keep only the signatures whose key falls in shard I (`shard_of`).
  2. Key every signature with the target tier's fingerprint and ask each target tier (local, and the fleet
     store if one is set) which keys it holds (one batched call per tier). Entries the local tier has
     and the fleet lacks are verified and pushed.
  3. Compile the rest in N worker processes (`_service/_worker.py`, JSON lines over pipes), each writing through
     the runtime's own `TieredCache`; a worker that dies or runs past --timeout costs only its current
     signature (reported with the reason) and is replaced.
  4. Confirm the fleet store holds every entry (a skipped fleet write is only a warning to the
     runtime, but a failure of a warm-up); push what is missing again, then report what still is.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

from neuron_runtime import _config

from neuron_runtime.cache import envelope
from neuron_runtime.cache import CacheError
from neuron_runtime.cli import _common
from neuron_runtime.cli._errors import PROBLEMS, JobError, UsageError
from neuron_runtime.compiler import make_compiler
from neuron_runtime.executables import RecordLine, scan_records, worker_env
from neuron_runtime.signatures import cache_key, is_class, tensor_descs

log = logging.getLogger(__name__)


def parse_shard(text: str | None, index_env: str | None = None) -> tuple[int, int] | None:
    """`I/N` -> (I, N); `N` alone takes I from `index_env` (Kubernetes' JOB_COMPLETION_INDEX); None -> None.
    Raises `UsageError` naming the fix."""
    if text is None or not text.strip():
        return None
    text = text.strip()
    raw_i, sep, raw_n = text.partition("/")
    if not sep:
        raw_i, raw_n = (index_env or "").strip(), text
        if not raw_i:
            raise UsageError(f"--shard {text}: the shard index comes from JOB_COMPLETION_INDEX, which is not set; "
                             f"pass --shard I/{text} (I from 0 to {text}-1)")
    try:
        i, n = int(raw_i), int(raw_n)
    except ValueError:
        raise UsageError(f"--shard {text!r}: expected I/N with 0 <= I < N (e.g. 0/4), or N with "
                         "JOB_COMPLETION_INDEX set") from None
    if n < 1 or not 0 <= i < n:
        raise UsageError(f"--shard {text!r}: expected 0 <= I < N (I={i}, N={n}; indexes start at 0)")
    return i, n


def _shard_arg(args: argparse.Namespace) -> tuple[int, int] | None:
    return parse_shard(args.shard if args.shard is not None else os.environ.get("NEURON_CACHE_SHARD"),
                       os.environ.get("JOB_COMPLETION_INDEX"))


def shard_of(key: str, n: int) -> int:
    """The shard (0..n-1) that compiles `key`. It depends on the key alone, never on the rest of the
    record file: shards that recorded their own files still agree, every key has exactly one shard, and
    the union of the shards is the unsharded set. (Keys are sha256: the split is even in expectation.)"""
    return int(key[:16], 16) % n


def key_records(record_file: str, fp: dict[str, Any]) -> tuple[list[tuple[RecordLine, str]],
                                                               list[dict[str, Any]]]:
    """The record file's good lines with their keys for fingerprint `fp`, and the bad lines (reported on
    stderr, each with its line number and reason)."""
    keyed: list[tuple[RecordLine, str]] = []
    errors: list[dict[str, Any]] = []
    for rec in scan_records(record_file):
        if rec.error is not None:
            log.error("%s", rec.error)
            print(f"neuron-cache: {rec.error}", file=sys.stderr)
            errors.append({"line": rec.line, "error": rec.error.reason})
            continue
        assert rec.signature is not None
        try:
            keyed.append((rec, cache_key(rec.signature, fp)))
        except (TypeError, ValueError) as e:
            errors.append({"line": rec.line, "error": f"cannot key this signature: {e}"})
    return keyed, errors


def compile_env(cfg: _config.Config, env: dict[str, str]) -> dict[str, str]:
    """The compile workers' environment (`worker_env`): `cfg` writing to its tiers (a read-only mode is
    the consumers' business, never a warm-up's), and an OMP_NUM_THREADS the user set kept (docs/cli.md)."""
    return worker_env(dataclasses.replace(cfg, cache_mode="readwrite"), env, keep_omp_threads=True)


def add_parsers(sub: Any) -> None:
    def compile_options(p: argparse.ArgumentParser, func: Any) -> None:
        p.add_argument("--jobs", "-j", type=int, default=None, metavar="N",
                       help="parallel compile worker processes [env NEURON_CACHE_JOBS, default: CPU count]")
        p.add_argument("--timeout", type=float, default=None, metavar="S",
                       help="give up on one signature after S seconds (its worker is killed and replaced) "
                            "[env NEURON_CACHE_COMPILE_TIMEOUT, default: no limit]")
        p.add_argument("--shard", metavar="I/N", default=None,
                       help="compile only shard I (0-based) of N: a stable split of the manifest's signatures by "
                            "key, so N CI jobs (or an Indexed Job) share the work; `N` alone takes I from "
                            "JOB_COMPLETION_INDEX [env NEURON_CACHE_SHARD]")
        p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
        _common.finish_command(p, func, fleet_flags=("--to", "--fleet"), tier=True)

    w = sub.add_parser("warm", help="record a job's op signatures, then compile them in parallel",
                       description="Run JOB once on the reference tier with recording on, then compile every "
                                   "recorded signature for the target tier into the local tier and the fleet store.",
                       usage="neuron-cache warm [options] -- JOB [ARGS...]")
    w.add_argument("--manifest", metavar="FILE",
                   help="where to write the recorded manifest (kept) [env NEURON_CACHE_MANIFEST, default: a temporary file]")
    w.add_argument("--allow-job-failure", action="store_true",
                   help="exit 0 even if the job itself fails (what it recorded is compiled either way)")
    compile_options(w, cmd_warm)
    w.add_argument("job", nargs=argparse.REMAINDER, help="the command to run, after `--`")

    c = sub.add_parser("compile", help="compile the signatures of a manifest (the second half of warm)",
                       description="Compile every signature of MANIFEST (JSON lines from TORCH_NEURONX_RECORD_FILE "
                                   "or `warm --manifest`) for the target tier.")
    c.add_argument("manifest", metavar="MANIFEST")
    compile_options(c, cmd_compile)


# ------------------------------------------------------------------------------------------ warm


def cmd_warm(args: argparse.Namespace) -> int:
    job = list(args.job)
    if job and job[0] == "--":
        job = job[1:]
    if not job:
        raise UsageError("warm needs the job to run: neuron-cache warm [options] -- python train.py ARGS")
    _shard_arg(args)  # a bad --shard is a usage error before the job runs, not after
    env = _common.runtime_env(args)
    cfg = _common.load_config(env)
    scratch = tempfile.mkdtemp(prefix="neuron-cache-warm-")
    try:
        # --manifest names the record file the job writes (TORCH_NEURONX_RECORD_FILE)
        record_file = os.path.abspath(args.manifest or os.environ.get("NEURON_CACHE_MANIFEST")
                                      or os.path.join(scratch, "manifest.jsonl"))
        # A fresh record file per warm-up: the recorder appends, and a stale one would compile signatures
        # this job no longer needs.
        if os.path.exists(record_file):
            os.remove(record_file)
        job_env = _common.runtime_env(
            args,
            TORCH_NEURONX_COMPILER="reference",
            TORCH_NEURONX_RECORD_FILE=record_file,
            TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR=os.path.join(scratch, "reference-cache"),
            TORCH_NEURONX_NEFF_CACHE_DIR=None,
            TORCH_NEURONX_CACHE_MODE="readwrite",
            # Recording needs every signature keyed as it is met, not a background service.
            TORCH_NEURONX_COMPILE_MODE="sync",
            TORCH_NEURONX_PREFETCH="0",
            # The recording run's counters are of no use to anyone; keep it off the user's stats file.
            TORCH_NEURONX_STATS_FILE=os.path.join(scratch, "record-stats.json"),
        )
        print(f"neuron-cache warm: recording {' '.join(job)} (reference tier) -> {record_file}", file=sys.stderr)
        t0 = time.monotonic()
        try:
            # With --json, stdout belongs to the summary: the job's own output goes to stderr (fd 2).
            rc = subprocess.call(job, env=job_env, stdout=2 if args.json else None)
        except OSError as e:
            raise JobError(f"cannot start {job[0]!r}: {e}; pass the job after `--`, e.g. "
                           "neuron-cache warm -- python train.py") from e
        job_info = {"command": job, "returncode": rc, "seconds": round(time.monotonic() - t0, 2)}
        if rc != 0:
            print(f"neuron-cache warm: the job exited with status {rc}; compiling what it recorded before that",
                  file=sys.stderr)
        if not os.path.exists(record_file):
            open(record_file, "w").close()  # the job ran no compiled op (or died first): nothing to compile
        summary = compile_records(cfg, env, record_file, args)
        summary["command"] = "warm"
        summary["job"] = job_info
        if args.manifest or os.environ.get("NEURON_CACHE_MANIFEST"):
            summary["manifest"] = record_file
        else:
            summary.pop("manifest", None)
        _common.record_run(cfg, _run_log(summary))
        _report(summary, args.json)
        status = 0 if summary["ok"] else PROBLEMS
        if rc != 0 and not args.allow_job_failure:
            status = PROBLEMS
        return status
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def cmd_compile(args: argparse.Namespace) -> int:
    if not os.path.isfile(args.manifest):
        raise UsageError(f"no manifest at {args.manifest}: record one with TORCH_NEURONX_RECORD_FILE=... or "
                         "`neuron-cache warm --manifest FILE -- JOB`")
    env = _common.runtime_env(args)
    cfg = _common.load_config(env)
    summary = compile_records(cfg, env, os.path.abspath(args.manifest), args)
    summary["command"] = "compile"
    _common.record_run(cfg, _run_log(summary))
    _report(summary, args.json)
    return 0 if summary["ok"] else PROBLEMS


# ------------------------------------------------------------------------------------------ compile


def compile_records(cfg: _config.Config, env: dict[str, str], record_file: str,
                     args: argparse.Namespace) -> dict[str, Any]:
    """Compile every signature of `record_file` for `cfg`'s tier into its local tier and fleet store.
    Returns the summary (see docs/cli.md)."""
    jobs = args.jobs if args.jobs is not None else _common.env_int("NEURON_CACHE_JOBS", os.cpu_count() or 1)
    if jobs < 1:
        raise UsageError(f"--jobs {jobs}: need at least 1 worker")
    timeout = args.timeout
    if timeout is None and os.environ.get("NEURON_CACHE_COMPILE_TIMEOUT"):
        timeout = float(os.environ["NEURON_CACHE_COMPILE_TIMEOUT"])
    t0 = time.monotonic()

    shard = _shard_arg(args)

    # 1-2. the record file (bad lines reported and skipped), keyed for the target tier, and this shard's part
    compiler = make_compiler(cfg)
    keyed, errors = key_records(record_file, compiler.fingerprint())
    total = len(keyed)
    if shard is not None:
        keyed = [(rec, key) for rec, key in keyed if shard_of(key, shard[1]) == shard[0]]
        print(f"neuron-cache: shard {shard[0]}/{shard[1]}: {len(keyed)} of {total} signature(s)", file=sys.stderr)
    local = _common.open_local(cfg)
    fleet = _common.open_fleet(cfg)
    keys = [k for _, k in keyed]
    in_local = local.contains_many(keys)
    in_fleet = fleet.contains_many(keys) if fleet is not None else set()
    present = pushed = 0
    todo: list[tuple[RecordLine, str]] = []
    for rec, key in keyed:
        if key in in_local and (fleet is None or key in in_fleet):
            present += 1
        elif key in in_fleet:
            present += 1  # consumers fill their local tier from the fleet on first use
        elif key in in_local and fleet is not None and _push(local, fleet, key, cfg):
            present += 1
            pushed += 1
        else:
            todo.append((rec, key))
    local.close()
    if fleet is not None:
        fleet.close()

    # 3. compile what is missing
    results: dict[int, dict[str, Any]] = {}
    if todo:
        n = min(jobs, len(todo))
        print(f"neuron-cache: compiling {len(todo)} signature(s) for tier {cfg.compiler} with {n} worker(s) "
              f"({present} already present)", file=sys.stderr)
        # Batches (one C++ translation unit each) small enough that the workers finish together.
        batch = max(1, min(cfg.compile_batch, -(-len(todo) // (2 * n))))
        pool = _Pool(n, compile_env(cfg, env), timeout,
                     _common.Progress(len(todo), "compile", enabled=not args.no_progress), batch=batch)
        results = pool.run([(i, rec.signature or {}) for i, (rec, _) in enumerate(todo)],
                           [rec.signature["op"] if rec.signature else "?" for rec, _ in todo])

    compiled = refused = failed = 0
    failures: list[dict[str, Any]] = []
    done: dict[str, tuple[RecordLine, str]] = {}  # key -> (line, "compiled" | "present")
    for rec, key in keyed:
        done[key] = (rec, "present")
    for i, (rec, key) in enumerate(todo):
        r = results.get(i, {"status": "failed", "reason": "not attempted (interrupted)"})
        status = r.get("status", "failed")
        if status == "compiled":
            compiled += 1
            done[key] = (rec, "compiled")
        elif status == "present":
            present += 1  # another host or process compiled it meanwhile
        else:
            done.pop(key, None)
            refused += status == "refused"
            failed += status != "refused"
            assert rec.signature is not None
            failures.append({"line": rec.line, "op": rec.signature["op"], "key": r.get("key", key),
                             "status": status, "reason": r.get("reason", "")})

    # 4. The fleet store must really hold every entry: a write the workers' fleet tier skipped (a timeout,
    #    an open circuit breaker) leaves a local-only entry that strict consumers elsewhere would miss.
    if cfg.cache_dir and done:
        for key in _confirm_fleet(cfg, list(done)):
            rec, was = done[key]
            assert rec.signature is not None
            compiled -= was == "compiled"
            present -= was == "present"
            failed += 1
            failures.append({"line": rec.line, "op": rec.signature["op"], "key": key, "status": "failed",
                             "reason": f"not in the fleet store {cfg.cache_dir} after retries (its writes were "
                                       "skipped: timeouts or an open circuit breaker; see the warnings above)"})
    return {
        "manifest": record_file,
        "tier": cfg.compiler,
        "local": cfg.local_cache_dir,
        "fleet": cfg.cache_dir,
        "jobs": jobs,
        "signatures": len(keyed),
        "shard": None if shard is None else f"{shard[0]}/{shard[1]}",
        "manifest_signatures": total,
        "compiled": compiled,
        "present": present,
        "pushed": pushed,
        "refused": refused,
        "failed": failed,
        "failures": failures,
        "manifest_errors": errors,
        "compile_seconds": round(sum(r.get("seconds", 0.0) for r in results.values()), 2),
        "seconds": round(time.monotonic() - t0, 2),
        "ok": failed == 0 and not errors,
    }


def _push(local: Any, fleet: Any, key: str, cfg: _config.Config) -> bool:
    """Copy a verified local entry to the fleet store (a bad one is left for the compile to replace)."""
    try:
        data = _common.read_entry(local, key)
        if data is None:
            return False
        envelope.unpack(data, expected_key=key, signing_key=cfg.signing_key)
    except CacheError as e:
        log.warning("local entry %s does not verify (%s); recompiling it", key, e)
        return False
    return bool(fleet.put(key, data))


def _confirm_fleet(cfg: _config.Config, keys: list[str], attempts: int = 3) -> list[str]:
    """The keys the fleet store still lacks after pushing them from the local tier, with a pause between
    attempts long enough for a store's circuit breaker to close again."""
    missing = keys
    for attempt in range(attempts):
        if attempt:
            time.sleep(min(30.0, max(1.0, 3 * cfg.fleet_timeout_s)))
        local, fleet = _common.open_local(cfg), _common.open_fleet(cfg)
        assert fleet is not None
        try:
            have = fleet.contains_many(missing)
            missing = [k for k in missing if k not in have and not _push(local, fleet, k, cfg)]
        finally:
            local.close()
            fleet.close()
        if not missing:
            break
        log.warning("%d entr%s not yet in the fleet store %s; retrying", len(missing),
                    "y" if len(missing) == 1 else "ies", cfg.cache_dir)
    return missing


def tensor_count(sig: dict[str, Any]) -> int:
    """The tensors a signature takes (a fused group's or graph's nodes' too): the order of its compile cost
    (a foreach op over a model's parameters lowers a kernel per tensor, seconds where an elementwise op
    takes a fraction of one). A malformed signature counts 0: its worker reports what is wrong with it."""
    try:
        return len(tensor_descs(sig))
    except (KeyError, TypeError, ValueError):
        return 0


def compile_order(tasks: list[tuple[int, dict[str, Any]]]) -> list[tuple[int, dict[str, Any]]]:
    """The costliest first (otherwise in record order), so the last batches are short ones that end
    together on every worker: an optimizer's foreach ops, recorded last, would be one worker's long tail."""
    return sorted(tasks, key=lambda t: -tensor_count(t[1]))


class _Pool:
    """N worker processes (`_service._pool.WorkerPool`) fed from one queue; a worker that dies or runs
    past --timeout costs only its current signature (reported with the reason) and is replaced."""

    def __init__(self, n: int, env: dict[str, str], timeout: float | None, progress: _common.Progress,
                 batch: int = 1) -> None:
        self.n = n
        self.batch = batch
        self.env = env
        self.timeout = timeout
        self.progress = progress

    def run(self, tasks: list[tuple[int, dict[str, Any]]], names: list[str]) -> dict[int, dict[str, Any]]:
        from neuron_runtime.executables import WorkerPool

        work: queue.SimpleQueue[tuple[int, dict[str, Any]]] = queue.SimpleQueue()
        for i, sig in compile_order(tasks):
            # A shape class falls back to the exact shape it was recorded with when the tier has no
            # generic executable for it (the worker tries the candidates in order).
            work.put((i, {"signatures": [sig, sig["example"]]} if is_class(sig) else {"signature": sig}))
        results: dict[int, dict[str, Any]] = {}
        all_done = threading.Event()
        lock = threading.Lock()

        def next_task() -> tuple[int, dict[str, Any]] | None:
            try:
                return work.get_nowait()
            except queue.Empty:
                return None

        def more_tasks(limit: int) -> list[tuple[int, dict[str, Any]]]:
            # Batches shrink as the queue does (each at most its share of half the tasks left per worker).
            limit = min(limit, -(-(work.qsize() + 1) // (2 * self.n)) - 1)
            out = []
            while len(out) < limit and (t := next_task()) is not None:
                out.append(t)
            return out

        def on_event(kind: str, i: int, answer: dict[str, Any]) -> None:
            if kind != "done":
                return
            with lock:
                results[i] = answer
                self.progress.step(answer.get("status", "failed"), names[i], answer.get("seconds"))
                if len(results) == len(tasks):
                    all_done.set()

        pool = WorkerPool(self.n, [sys.executable, "-m", "neuron_runtime.executables._service._worker"], self.env,
                          self.timeout, next_task, on_event, batch=self.batch, more_tasks=more_tasks)
        try:
            while not all_done.wait(0.2) and any(t.is_alive() for t in pool.threads):
                pass
        finally:
            pool.close(grace=60.0)
        return results


# ------------------------------------------------------------------------------------------ output


def _run_log(summary: dict[str, Any]) -> dict[str, Any]:
    keep = ("command", "tier", "fleet", "jobs", "signatures", "shard", "compiled", "present", "pushed", "refused",
            "failed", "seconds", "ok")
    out = {k: summary.get(k) for k in keep}
    out["finished"] = time.time()
    out["manifest_errors"] = len(summary.get("manifest_errors", []))
    return out


def _report(summary: dict[str, Any], as_json: bool) -> None:
    if as_json:
        _common.print_json(summary)
        return
    where = "local tier" + (f" + fleet {summary['fleet']}" if summary.get("fleet") else "")
    pushed = f" ({summary['pushed']} pushed to the fleet)" if summary["pushed"] else ""
    part = f" (shard {summary['shard']} of {summary['manifest_signatures']})" if summary.get("shard") else ""
    print(f"{summary['signatures']} signature(s){part}, tier {summary['tier']}, {where}: compiled {summary['compiled']}, "
          f"already present {summary['present']}{pushed}, refused {summary['refused']}, failed {summary['failed']} "
          f"in {summary['seconds']:.1f} s")
    for f in summary["failures"]:
        print(f"  {f['status']:<8} line {f['line']}: {f['op']} ({f['key'][:12]}): {f['reason']}")
    for e in summary["manifest_errors"]:
        print(f"  bad manifest line {e['line']}: {e['error']}")
    job = summary.get("job")
    if job and job["returncode"] != 0:
        print(f"  the job exited with status {job['returncode']}; what it recorded before that was compiled")
    if summary["refused"]:
        print("  refused ops run on the host; with TORCH_NEURONX_CACHE_MODE=strict they are misses (errors)")

"""One compile worker process (`python -m neuron_runtime.executables._service._worker`), for the host's compile
service and for `neuron-cache warm/compile`.

Protocol (JSON lines, no pickle): once imported and ready, the worker writes `{"ready": pid}`; then the
parent writes a task `{"i": n, "signatures": [...]}` (or one `"signature"`), or several at once,
`{"batch": [task, ...]}`, to stdin; the worker answers each task with `{"i": n, "key": ..., "found": ...,
"status": "compiled"|"present"|"refused"|"failed", "reason": ..., "seconds": ..., "phases": {...}}` on
its protocol stream (in any order), then waits for the next line. EOF on stdin ends it.

Every line is input: a line that is not a task, a task with no signature, or a signature that fails
the checks of `_checks.check_bounds` (tensors too large for this host to allocate examples of, and the
like) is answered `"failed"` with the reason, and the worker goes on to the next line. A compile that
fails for this host's reasons (a full disk, memory: `_entries.HostRefused`) is `"failed"` too: only
the compiler's verdict on the op is `"refused"` (and cached).

`signatures` are candidates, most general first (a shape class, then the exact signature): each is
looked up and, if missing, compiled in turn until one gives an executable; `key` is the first one's key,
`found` the key of the entry that answered (a refusal is cached under its candidate's key like any
refusal, so the next process skips straight to the one that works). With `"key"` in the task, the
worker checks it is the key it computes: a mismatch means the parent runs another configuration.

A batch is compiled together (`Compiler.compile_many`: one C++ translation unit for all its signatures),
then each entry goes through `TieredCache.get_or_compile` as a single one would: a key another worker or
host wrote meanwhile is taken from the tiers, and a signature that fails costs only its own answer.
`seconds` of a batched task is its share of the batch; `phases` its seconds per compile phase.

The configuration comes from the environment the parent prepared with `worker_env` (tier, local tier,
fleet store, signing key), and every entry goes through the same `TieredCache` the runtime uses, so host
and fleet single-flight apply between workers and between hosts warming the same store.
"""

from __future__ import annotations

import argparse
import base64
import ctypes
import json
import os
import signal
import socket
import sys
import time
from collections.abc import Mapping
from typing import IO, Any

from ... import _config

# A worker compiles and nothing else: it never records signatures, never writes a stats file, and never
# fetches (or writes) a job's manifest of executables.
_NOT_FOR_WORKERS = ("TORCH_NEURONX_RECORD_FILE", "TORCH_NEURONX_STATS_FILE", "TORCH_NEURONX_JOB")


def worker_env(cfg: _config.Config, environ: Mapping[str, str] | None = None,
               keep_omp_threads: bool = False) -> dict[str, str]:
    """The environment of a compile worker that compiles for `cfg`: the one rule for the compile
    service's workers and for `neuron-cache warm/compile`'s.

      1. `environ` (default: os.environ) less every `TORCH_NEURONX_*` variable, then `cfg`'s own
         (`_config.to_env`): the worker runs exactly `cfg`, whatever else was inherited;
      2. synchronous compiles, and none of `_NOT_FOR_WORKERS` (no recording, stats or job manifest);
      3. OMP_NUM_THREADS=1: one compile per worker, and OpenMP threads in every worker would only fight
         over the cores. With `keep_omp_threads`, an OMP_NUM_THREADS in `environ` wins: `neuron-cache`'s
         user set it for the compile itself (docs/cli.md), whereas a training process's is its own
         compute's, never a request to its compile service's workers.

    Secrets (the signing key) are in it: never put it on a command line."""
    inherited = os.environ if environ is None else environ
    env = {k: v for k, v in inherited.items() if not k.startswith("TORCH_NEURONX_")}
    env.update(_config.to_env(cfg))
    env["TORCH_NEURONX_COMPILE_MODE"] = "sync"
    for var in _NOT_FOR_WORKERS:
        env.pop(var, None)
    if not (keep_omp_threads and "OMP_NUM_THREADS" in env):
        env["OMP_NUM_THREADS"] = "1"
    return env


def _protocol_stream() -> IO[str]:
    """A private copy of stdout for answers; fd 1 then points at stderr, so whatever the compiler or its
    child processes print can never corrupt the protocol."""
    proto = os.fdopen(os.dup(1), "w", buffering=1, encoding="utf-8")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return proto


def _die_with_parent() -> None:
    """SIGKILL when the parent (the service, or the CLI) dies: a worker never outlives its owner. What it
    was compiling is lost, never half-written (entries are written whole or not at all)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() == 1:  # the parent died before prctl took effect
        os._exit(1)


def _warm(tier: str, compiler: Any) -> None:
    """Do what the first compile would (import Inductor's code generator and C++ builder, build or verify
    the host's shared runtime, lower one tiny op: seconds), so a worker started on first need is ready
    when its first task arrives."""
    if tier == "aoti":
        import torch._inductor.codecache
        import torch._inductor.compile_fx
        import torch.export  # noqa: F401

        prepare = getattr(compiler, "prepare", None)
        if prepare is not None:
            prepare()


def _build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m neuron_runtime.executables._service._worker")
    p.add_argument("--nice", type=int, default=0, help="lower this process's CPU priority by N")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    proto = _protocol_stream()
    _die_with_parent()
    if args.nice:
        os.nice(args.nice)
    from neuron_runtime import _config
    from neuron_runtime.cache import TieredCache
    from neuron_runtime.compiler import make_compiler

    cfg = _config.get()
    compiler = make_compiler(cfg)
    fp = compiler.fingerprint()
    stats: dict[str, Any] = {}
    cache = TieredCache.from_config(cfg, stats)
    producer = f"neuron-cache@{socket.gethostname()}:{os.getpid()}"
    try:
        _warm(cfg.compiler, compiler)
    except Exception as e:  # noqa: BLE001 - the first task reports the compiler's own error
        print(f"neuron compile worker: warm-up failed: {type(e).__name__}: {e}", file=sys.stderr)
    proto.write(json.dumps({"ready": os.getpid()}) + "\n")  # a task's timeout starts after this
    proto.flush()
    worker = _Worker(cfg, compiler, fp, cache, producer, proto)
    for line in sys.stdin:
        msg: Any = None
        try:
            msg = json.loads(line)
            if not isinstance(msg, dict):
                raise ValueError("a task is a JSON object")
            tasks = msg["batch"] if "batch" in msg else [msg]
            if not isinstance(tasks, list) or not tasks or not all(isinstance(t, dict) for t in tasks):
                raise ValueError("a batch is a non-empty list of task objects")
        except Exception as e:  # noqa: BLE001 - every line is answered; the worker lives
            worker.answer({"i": msg.get("i") if isinstance(msg, dict) else None, "status": "failed",
                           "reason": f"{type(e).__name__}: {str(e)[:1000]}", "seconds": 0.0})
            continue
        worker.run(tasks)
    cache.close()
    return 0


class _Worker:
    """Answers tasks (see the module docstring) one batch at a time."""

    def __init__(self, cfg: Any, compiler: Any, fp: dict[str, Any], cache: Any, producer: str, proto: IO[str]) -> None:
        self.cfg, self.compiler, self.fp, self.cache, self.producer, self.proto = cfg, compiler, fp, cache, producer, proto

    def answer(self, a: dict[str, Any]) -> None:
        self.proto.write(json.dumps(a) + "\n")
        self.proto.flush()

    def run(self, tasks: list[dict[str, Any]]) -> None:
        from neuron_runtime.compiler import CompileRefused
        from neuron_runtime.executables import _checks, _entries
        from neuron_runtime.signatures import cache_key

        t0 = time.perf_counter()
        # Per task: its candidates and keys, the candidate it is at, its answer so far.
        open_: list[dict[str, Any]] = []
        for task in tasks:
            answer: dict[str, Any] = {"i": task.get("i")}
            try:
                sigs = task.get("signatures") if "signatures" in task else [task.get("signature")]
                if not isinstance(sigs, list) or not sigs:
                    raise ValueError("a task needs 'signatures': a non-empty list (or one 'signature')")
                for sig in sigs:
                    _checks.check_bounds(sig)  # before anything allocates examples of its sizes
                keys = [cache_key(sig, self.fp) for sig in sigs]
                answer["key"] = keys[0]
                if task.get("key") not in (None, keys[0]):
                    raise ValueError(f"the parent keys this signature {task['key']}, this worker {keys[0]}: the "
                                     "two run different configurations")
            except Exception as e:  # noqa: BLE001 - reported per signature; the worker keeps going
                answer.update(status="failed", reason=f"{type(e).__name__}: {str(e)[:1000]}",
                              seconds=round(time.perf_counter() - t0, 3))
                self.answer(answer)
                continue
            open_.append({"answer": answer, "sigs": sigs, "keys": keys, "at": 0, "phases": {}})
        # Rounds: each open task's current candidate is looked up; the missing ones are compiled together;
        # a task whose candidate is refused moves on to its next candidate in the next round.
        while open_:
            missing = []
            for t in open_:
                key = t["keys"][t["at"]]
                entry, _ = self.cache.get_entry(key)
                if _entries.must_recompile(entry, self.cfg.cache_mode):
                    entry = None  # another version refused it: ask the compiler again
                t["entry"] = entry
                if entry is None:
                    missing.append(t)
            try:
                results = self.compiler.compile_many([t["sigs"][t["at"]] for t in missing]) if missing else []
            except Exception as e:  # noqa: BLE001 - the batch's tasks are answered; the worker lives
                gone = {id(t) for t in missing}
                for t in missing:
                    t["answer"].update(status="failed", reason=f"{type(e).__name__}: {str(e)[:1000]}",
                                       seconds=round(time.perf_counter() - t0, 3))
                    self.answer(t["answer"])
                open_ = [t for t in open_ if id(t) not in gone]
                continue
            for t, res in zip(missing, results):
                t["compiled"] = res
                for k, v in res.phases.items():
                    t["phases"][k] = t["phases"].get(k, 0.0) + v
            still = []
            for t in open_:
                try:
                    done = self._settle(t, _entries, CompileRefused)
                except Exception as e:  # noqa: BLE001 - reported per signature; the worker keeps going
                    t["answer"].update(status="failed", reason=f"{type(e).__name__}: {str(e)[:1000]}")
                    done = True
                if not done:
                    t["at"] += 1
                    still.append(t)
                    continue
                t["answer"]["seconds"] = round((time.perf_counter() - t0) / max(1, len(tasks)), 3)
                if t["phases"]:
                    t["answer"]["phases"] = {k: round(v, 4) for k, v in t["phases"].items()}
                self.answer(t["answer"])
            open_ = still

    def _settle(self, t: dict[str, Any], _entries: Any, CompileRefused: type) -> bool:
        """Store/confirm the task's current candidate; True when the task needs no further candidate
        (its answer has a status), False when it moves on to the next candidate."""
        sig, key = t["sigs"][t["at"]], t["keys"][t["at"]]
        last = t["at"] + 1 >= len(t["sigs"])
        compiled = t.pop("compiled", None)
        if compiled is not None and not isinstance(compiled.error, CompileRefused) and compiled.error is not None:
            raise compiled.error

        def compile_entry(sig: dict[str, Any] = sig, key: str = key) -> bytes:
            return _entries.build_entry(self.cache, self.compiler, key, sig, self.fp, self.producer, compiled)

        if compiled is not None and t.get("entry") is None:
            entry, where = _entries.get_or_compile(self.cache, key, compile_entry, self.cfg.cache_mode)
        else:
            entry, where = t["entry"], "present"
        try:
            _entries.check(entry)  # a refusal is cached too (strict consumers run the op on the host)
        except CompileRefused as e:
            if not last:
                return False  # e.g. no generic kernel for this class: the next candidate
            t["answer"].update(status="refused", reason=str(e))
            return True
        t["answer"].update(found=key, status="compiled" if where in ("compiled", _entries.RECOMPILED) else "present")
        if self.cache.local.get(key) is None:
            # The local tier refused the write (full disk, read-only directory): the entry travels in the
            # answer instead, and the parent verifies it as it would a tier's.
            t["answer"]["entry"] = base64.b64encode(self.cache.pack(key, dict(entry.header), entry.payload)).decode()
        return True


if __name__ == "__main__":
    status = main()
    # Every answer is flushed and every entry written whole with the cache closed: what is left is Python's own
    # teardown of torch and Inductor (~1.3 s of freeing objects, nothing written), which the parent waits for.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)

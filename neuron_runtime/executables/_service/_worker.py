"""One compile worker process (`python -m neuron_runtime.executables._service._worker`), for the host's compile
service and for `neuron-cache warm/compile`.

Protocol (JSON lines, no pickle): once imported and ready, the worker writes `{"ready": pid}`; then the
parent writes `{"i": n, "signatures": [...]}` (or one
`"signature"`) to stdin; the worker answers each with `{"i": n, "key": ..., "found": ..., "status":
"compiled"|"present"|"refused"|"failed", "reason": ..., "seconds": ...}` on its protocol stream, then
waits for the next. EOF on stdin ends it.

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

The configuration comes from the environment the parent prepared (tier, local tier, fleet store, signing
key), and every entry goes through the same `TieredCache` the runtime uses, so host and fleet
single-flight apply between workers and between hosts warming the same store.
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
from typing import IO, Any


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


def _warm(tier: str) -> None:
    """Import what the first compile would (Inductor's code generator and C++ builder: seconds), so a
    worker started on first need is ready when its first task arrives."""
    if tier == "aoti":
        import torch._inductor.codecache
        import torch._inductor.compile_fx
        import torch.export  # noqa: F401


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
    from neuron_runtime.compiler import CompileRefused
    from neuron_runtime.executables import _checks, _entries
    from neuron_runtime.signatures import _signature

    cfg = _config.get()
    compiler = make_compiler(cfg)
    fp = compiler.fingerprint()
    stats: dict[str, Any] = {}
    cache = TieredCache.from_config(cfg, stats)
    producer = f"neuron-cache@{socket.gethostname()}:{os.getpid()}"
    _warm(cfg.compiler)
    proto.write(json.dumps({"ready": os.getpid()}) + "\n")  # a task's timeout starts after this
    proto.flush()
    for line in sys.stdin:
        t0 = time.perf_counter()
        answer: dict[str, Any] = {"i": None}
        try:
            task = json.loads(line)
            if not isinstance(task, dict):
                raise ValueError("a task is a JSON object")
            answer["i"] = task.get("i")
            sigs = task.get("signatures") if "signatures" in task else [task.get("signature")]
            if not isinstance(sigs, list) or not sigs:
                raise ValueError("a task needs 'signatures': a non-empty list (or one 'signature')")
            for sig in sigs:
                _checks.check_bounds(sig)  # before anything allocates examples of its sizes
            keys = [_signature.cache_key(sig, fp) for sig in sigs]
            answer["key"] = keys[0]
            if task.get("key") not in (None, keys[0]):
                raise ValueError(f"the parent keys this signature {task['key']}, this worker {keys[0]}: the two "
                                 "run different configurations")
            for i, (sig, key) in enumerate(zip(sigs, keys)):
                def compile_entry(sig: dict[str, Any] = sig, key: str = key) -> bytes:
                    return _entries.build_entry(cache, compiler, key, sig, fp, producer)

                entry, where = cache.get_or_compile(key, compile_entry)
                if where != "compiled" and _entries.stale_refusal(entry) and cfg.cache_mode != "strict":
                    entry, where = _entries.replace(cache, key, compile_entry), "compiled"
                try:
                    _entries.check(entry)  # a refusal is cached too (strict consumers run the op on the host)
                except CompileRefused:
                    if i + 1 < len(sigs):
                        continue  # e.g. no generic kernel for this class: the next candidate
                    raise
                answer.update(found=key, status="compiled" if where == "compiled" else "present")
                if cache.local.get(key) is None:
                    # The local tier refused the write (full disk, read-only directory): the entry travels
                    # in the answer instead, and the parent verifies it as it would a tier's.
                    answer["entry"] = base64.b64encode(cache.pack(key, dict(entry.header), entry.payload)).decode()
                break
        except _entries.HostRefused as e:  # this host, not the op: nothing was cached
            answer.update(status="failed", reason=str(e))
        except CompileRefused as e:
            answer.update(status="refused", reason=str(e))
        except Exception as e:  # noqa: BLE001 - reported per task; the worker keeps going
            answer.update(status="failed", reason=f"{type(e).__name__}: {str(e)[:1000]}")
        answer["seconds"] = round(time.perf_counter() - t0, 3)
        proto.write(json.dumps(answer) + "\n")
        proto.flush()
    cache.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

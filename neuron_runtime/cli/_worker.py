"""One compile worker process of `neuron-cache warm/compile` (started as `python -m neuron_runtime.cli._worker`).

Protocol (JSON lines, no pickle): the parent writes `{"i": n, "signature": {...}}` to stdin; the worker
answers each with `{"i": n, "key": ..., "status": "compiled"|"present"|"refused"|"failed", "reason": ...,
"seconds": ...}` on its protocol stream, then waits for the next. EOF on stdin ends it.

The configuration comes from the environment the parent prepared (tier, local tier, fleet store, signing
key), and every entry goes through the same `TieredCache` the runtime uses, so host and fleet
single-flight apply between workers and between hosts warming the same store.
"""

from __future__ import annotations

import json
import os
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


def main() -> int:
    proto = _protocol_stream()
    from neuron_runtime import _config, _entries, _signature
    from neuron_runtime.cache import TieredCache
    from neuron_runtime.cli._warm import make_compiler
    from neuron_runtime.compiler import CompileRefused

    cfg = _config.get()
    compiler = make_compiler(cfg)
    fp = compiler.fingerprint()
    stats: dict[str, Any] = {}
    cache = TieredCache.from_config(cfg, stats)
    producer = f"neuron-cache@{socket.gethostname()}:{os.getpid()}"
    for line in sys.stdin:
        task = json.loads(line)
        sig = task["signature"]
        t0 = time.perf_counter()
        answer: dict[str, Any] = {"i": task["i"]}
        try:
            key = _signature.cache_key(sig, fp)
            answer["key"] = key

            def compile_entry(sig: dict[str, Any] = sig, key: str = key) -> bytes:
                return _entries.build_entry(cache, compiler, key, sig, fp, producer)

            entry, where = cache.get_or_compile(key, compile_entry)
            _entries.check(entry)  # a refusal is cached too (strict consumers then run the op on the host)
            answer["status"] = "compiled" if where == "compiled" else "present"
        except CompileRefused as e:
            answer.update(status="refused", reason=str(e))
        except Exception as e:  # noqa: BLE001 - reported per signature; the worker keeps going
            answer.update(status="failed", reason=f"{type(e).__name__}: {e}")
        answer["seconds"] = round(time.perf_counter() - t0, 3)
        proto.write(json.dumps(answer) + "\n")
        proto.flush()
    cache.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

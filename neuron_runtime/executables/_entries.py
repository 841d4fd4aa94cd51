"""What a compile puts in the cache: the artifact, or the compiler's refusal.

A refusal is cached like an artifact (an envelope whose header carries `refused` and whose payload is
empty), so a fleet asks the compiler about an op it cannot compile once, not once per host and run, and a
strict-mode job finds the answer in the cache (the op runs on the host, as everywhere else) instead of
failing on a miss. A refusal names the neuron-runtime version that made it: another version may compile
the op (refusals are often our own gaps, fixed later), so it asks the compiler again (`stale_refusal`,
`must_recompile`; `get_or_compile` is where every compile that stores an entry applies that).

Only a verdict about the op is cached. A failure that says something about this host or this moment (a
full disk, memory, a compiler killed or timed out, a CPU below the target: `transient`) is a
`HostRefused`: the op runs on the host in this process, and no tier learns anything from it."""

from __future__ import annotations

import errno
import subprocess
from collections.abc import Callable
from typing import Any

from .. import _profiling, _version
from ..compiler import Compiled, Compiler, CompileRefused
from ..signatures import kind_of

REFUSED = "refused"
RECOMPILED = "recompiled"  # `get_or_compile`'s "where" for a stale refusal it compiled again and replaced


class HostRefused(CompileRefused):
    """This host cannot compile or load the key's executable now (see `transient`): the op runs on the
    host in this process; nothing is cached, and no tier's entry is deleted or replaced."""


_TRANSIENT_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.ENOMEM, errno.EMFILE, errno.ENFILE,
                               errno.EAGAIN, errno.ETIMEDOUT, errno.EIO})
# What a compiler's output says when the host, not the op, was the problem (g++ killed by the OOM killer,
# a full /tmp, ...): Inductor reports a failed C++ build as text.
_TRANSIENT_TEXT = ("no space left on device", "cannot allocate memory", "out of memory", "memory exhausted",
                   "killed signal terminated program", "too many open files", "disk quota exceeded",
                   "resource temporarily unavailable", "timed out")


def transient(e: BaseException) -> str | None:
    """Why `e` (or an exception in its cause chain) is about this host or moment rather than the op: a
    short reason, or None for a verdict on the op (cacheable)."""
    from ..compiler import ToolchainError

    seen: set[int] = set()
    x: BaseException | None = e
    while x is not None and id(x) not in seen and len(seen) < 32:
        seen.add(id(x))
        if isinstance(x, (MemoryError, TimeoutError, subprocess.TimeoutExpired)):
            return type(x).__name__
        if isinstance(x, ToolchainError):
            return "this host cannot build or run code for the target"
        if isinstance(x, OSError) and x.errno in _TRANSIENT_ERRNOS:
            return errno.errorcode.get(x.errno or 0, "OSError")
        if isinstance(x, subprocess.CalledProcessError) and (x.returncode < 0 or x.returncode in (137, 143)):
            return f"a compiler process was killed (status {x.returncode})"
        text = str(x).lower()
        hit = next((t for t in _TRANSIENT_TEXT if t in text), None)
        if hit is not None:
            return hit
        x = x.__cause__ or x.__context__
    return None


def compile_one(compiler: Compiler, sig: dict[str, Any], key: str) -> Compiled:
    """The compiler's result for one signature (never raises for the op: a failure is the result's
    `error`), inside the profiler's compile range for `key`.

    It draws nothing from the user's random generators: random ops never reach a compiler (they are host
    ops by design, `signatures._ops.RANDOM`), and the compilers draw their example values from a private
    `torch.Generator`. So it needs no saving and restoring of the RNG state around it (`fork_rng`), which
    on the background thread of an in-process compile would undo the user's draws made meanwhile."""
    with _profiling.compile_span(sig, key, kind_of(sig)):
        return compiler.compile_many([sig])[0]


def build_entry(cache: Any, compiler: Compiler, key: str, sig: dict[str, Any], fingerprint: dict[str, Any],
                producer: str | None = None, compiled: Compiled | None = None) -> bytes:
    """Compile `sig` (unless `compiled` is its result already, e.g. from a batch) and pack the envelope
    for `key`; a refusal becomes a refusal entry. The header keeps the compile's seconds per phase
    (`"compile"`: what `neuron-cache stats` reports)."""
    if compiled is None:
        compiled = compile_one(compiler, sig, key)
    header: dict[str, Any] = {"signature": sig, "fingerprint": fingerprint}
    if producer:
        header["producer"] = producer
    if compiled.phases:
        header["compile"] = {k: round(v, 4) for k, v in compiled.phases.items()}
    e = compiled.error
    if e is not None and not isinstance(e, HostRefused):
        why = transient(e)
        if why is not None:
            raise HostRefused(f"{sig.get('op')}: compile failed on this host ({why}; not cached): "
                              f"{str(e)[:300]}") from e
    if isinstance(e, CompileRefused) and not isinstance(e, HostRefused):
        header[REFUSED] = str(e)
        header["runtime"] = _version.__version__  # read at call time (a test stands in an older one)
        payload = b""
    else:
        payload = compiled.unwrap()
    return bytes(cache.pack(key, header, payload))


def check(entry: Any) -> None:
    """Raise CompileRefused if `entry` records a refusal."""
    why = entry.header.get(REFUSED)
    if why:
        raise CompileRefused(str(why))


def stale_refusal(entry: Any) -> bool:
    """`entry` is a refusal made by another neuron-runtime version (so worth asking the compiler again)."""
    return bool(entry.header.get(REFUSED)) and entry.header.get("runtime") != _version.__version__


def must_recompile(entry: Any, cache_mode: str) -> bool:
    """A found `entry` (None: nothing found) the compiler must be asked about again: a stale refusal,
    except in strict mode, which never compiles (the old refusal stands: the op runs on the host)."""
    return entry is not None and cache_mode != "strict" and stale_refusal(entry)


def get_or_compile(cache: Any, key: str, compile_entry: Callable[[], bytes], cache_mode: str) -> tuple[Any, str]:
    """`cache.get_or_compile(key, compile_entry)` (single-flight; CacheMissError in strict mode), with a
    stale refusal it finds compiled again and put in its place (`must_recompile`, `replace`): then the
    "where" is `RECOMPILED` (the tiers did not count that compile; the caller does if it counts)."""
    entry, where = cache.get_or_compile(key, compile_entry)
    if where != "compiled" and must_recompile(entry, cache_mode):
        return replace(cache, key, compile_entry), RECOMPILED
    return entry, where


def replace(cache: Any, key: str, compile_entry: Any) -> Any:
    """Compile `key` again and store the result in place of a stale refusal (tiers keep the first writer,
    so the old entry goes first). The compile comes first: if it fails (or fails on this host only), the
    cached entry stays as it is. Returns the verified new entry."""
    data = compile_entry()
    new = cache.verify(key, data)
    if cache.writable:
        for _, backend in cache.tiers:
            backend.delete(key)
    cache.put(key, data)
    return new

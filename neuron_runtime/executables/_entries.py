"""What a compile puts in the cache: the artifact, or the compiler's refusal.

A refusal is cached like an artifact (an envelope whose header carries `refused` and whose payload is
empty), so a fleet asks the compiler about an op it cannot compile once, not once per host and run, and a
strict-mode job finds the answer in the cache (the op runs on the host, as everywhere else) instead of
failing on a miss. A refusal names the neuron-runtime version that made it: another version may compile
the op (refusals are often our own gaps, fixed later), so it asks the compiler again (`stale_refusal`)."""

from __future__ import annotations

from typing import Any

from .. import _profiling
from ..compiler import Compiler, CompileRefused

REFUSED = "refused"


def build_entry(cache: Any, compiler: Compiler, key: str, sig: dict[str, Any], fingerprint: dict[str, Any],
                producer: str | None = None) -> bytes:
    """Compile `sig` and pack the envelope for `key`; a refusal becomes a refusal entry."""
    from .. import __version__  # read at call time (not bound at import)

    header: dict[str, Any] = {"signature": sig, "fingerprint": fingerprint}
    if producer:
        header["producer"] = producer
    try:
        with _profiling.compile_span(sig, key):
            payload = compiler.compile(sig)
    except CompileRefused as e:
        header[REFUSED] = str(e)
        header["runtime"] = __version__
        payload = b""
    return bytes(cache.pack(key, header, payload))


def check(entry: Any) -> None:
    """Raise CompileRefused if `entry` records a refusal."""
    why = entry.header.get(REFUSED)
    if why:
        raise CompileRefused(str(why))


def stale_refusal(entry: Any) -> bool:
    """`entry` is a refusal made by another neuron-runtime version (so worth asking the compiler again)."""
    from .. import __version__

    return bool(entry.header.get(REFUSED)) and entry.header.get("runtime") != __version__


def replace(cache: Any, key: str, compile_entry: Any) -> Any:
    """Compile `key` again and store the result in place of the cached entry (tiers keep the first writer,
    so the old entry goes first). Returns the verified new entry."""
    if cache.writable:
        for _, backend in cache.tiers:
            backend.delete(key)
    data = compile_entry()
    cache.put(key, data)
    return cache.verify(key, data)

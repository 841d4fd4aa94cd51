"""What a compile puts in the cache: the artifact, or the compiler's refusal.

A refusal is cached like an artifact (an envelope whose header carries `refused` and whose payload is
empty), so a fleet asks the compiler about an op it cannot compile once, not once per host and run, and a
strict-mode job finds the answer in the cache (the op runs on the host, as everywhere else) instead of
failing on a miss."""

from __future__ import annotations

from typing import Any

from .compiler import CompileRefused, Compiler

REFUSED = "refused"


def build_entry(cache: Any, compiler: Compiler, key: str, sig: dict[str, Any], fingerprint: dict[str, Any],
                producer: str | None = None) -> bytes:
    """Compile `sig` and pack the envelope for `key`; a refusal becomes a refusal entry."""
    header: dict[str, Any] = {"signature": sig, "fingerprint": fingerprint}
    if producer:
        header["producer"] = producer
    try:
        payload = compiler.compile(sig)
    except CompileRefused as e:
        header[REFUSED] = str(e)
        payload = b""
    return bytes(cache.pack(key, header, payload))


def check(entry: Any) -> None:
    """Raise CompileRefused if `entry` records a refusal."""
    why = entry.header.get(REFUSED)
    if why:
        raise CompileRefused(str(why))

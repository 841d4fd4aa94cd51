"""TORCH_NEURONX_RECORD_FILE: append every new op signature of this process to a record file.

A record file is JSON lines, one signature record `{"op": ..., "signature": {...}}` per distinct
signature, written as they are first seen (a job that crashes midway leaves what it recorded).
`neuron-cache warm` and `neuron-cache compile` read it with `scan_records`, which keeps going past a bad
line and reports it by line number, so one damaged line never costs the other signatures their compile.
(The CLI calls this file a "manifest" (`--manifest`, NEURON_CACHE_MANIFEST), the name users know; in the
code a manifest is only a job's manifest of executables, `_manifest.py`.)
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ..signatures import build_signature, canonical, canonical_signature, has_nodes


class RecordError(ValueError):
    """A record file's line that is not a signature record; `line` is its 1-based line number."""

    def __init__(self, path: str, line: int, reason: str) -> None:
        self.path = path
        self.line = line
        self.reason = reason
        # (users know the file as `--manifest`: the message keeps their word)
        super().__init__(f"{path}:{line}: not a manifest line ({reason}); expected "
                         '{"op": ..., "signature": {"op": ..., "schema": ..., "args": [...]}}')


class Recorder:
    def __init__(self, path: str) -> None:
        self.path = path
        self._seen: set[str] = set()
        self._lock = threading.Lock()
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)

    def __call__(self, signature: dict[str, Any], digest: str) -> None:
        line = canonical({"op": signature["op"], "signature": signature}).decode()
        with self._lock:
            if line in self._seen:
                return
            self._seen.add(line)
            # O_APPEND and one write per line: several processes of one job (data-parallel ranks) may
            # record into the same file without interleaving inside a line.
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, (line + "\n").encode())
            finally:
                os.close(fd)


def check_signature(sig: Any) -> dict[str, Any]:
    """`sig` if it has the shape `build_signature` produces; ValueError naming what is wrong otherwise.

    Structural only: whether the op exists and compiles is the compiler's business (a refusal there is
    reported per signature, not as a bad record)."""
    if not isinstance(sig, dict):
        raise ValueError(f"signature must be a JSON object, not {type(sig).__name__}")
    if not isinstance(sig.get("op"), str) or not sig["op"]:
        raise ValueError("signature has no 'op' string")
    if has_nodes(sig):  # a torch.compile graph or a fused group: a list of op signatures and their wiring
        nodes, outputs = sig["graph"], sig.get("outputs")
        if not isinstance(nodes, list) or not nodes or not isinstance(outputs, list):
            raise ValueError("a graph signature needs a non-empty 'graph' list and an 'outputs' list")
        for i, node in enumerate(nodes):
            if not isinstance(node, dict) or not isinstance(node.get("in"), list):
                raise ValueError(f"graph[{i}] must be {{\"sig\": ..., \"in\": [...]}}")
            try:
                check_signature(node.get("sig"))
            except ValueError as e:
                raise ValueError(f"graph[{i}]: {e}") from None
        return sig
    if not isinstance(sig.get("schema"), str):
        raise ValueError("signature has no 'schema' string")
    args = sig.get("args")
    if not isinstance(args, list):
        raise ValueError("signature has no 'args' list")
    for i, a in enumerate(args):
        if not (isinstance(a, list) and len(a) == 3 and isinstance(a[0], str) and isinstance(a[1], str)):
            raise ValueError(f"args[{i}] must be [name, kind, descriptor]")
    if "shapes" in sig:  # a shape class (docs/dispatch.md) carries the exact signature it was made from
        if not isinstance(sig.get("example"), dict):
            raise ValueError("a shape-class signature ('shapes') has no 'example' signature")
        try:
            check_signature(sig["example"])
        except ValueError as e:
            raise ValueError(f"its example: {e}") from None
    return sig


def parse_line(text: str) -> dict[str, Any]:
    """The signature of one signature record (a line). Also accepts a bare signature object (what strict-mode errors
    and `neuron-cache explain` print). Strides come back canonical (`canonical_signature`: a record of an older
    runtime keys as this runtime's calls do). Raises ValueError with the reason."""
    try:
        rec = json.loads(text)
    except ValueError as e:
        raise ValueError(f"invalid JSON: {e}") from None
    if isinstance(rec, dict) and "signature" in rec:
        sig = check_signature(rec["signature"])
        if "op" in rec and rec["op"] != sig["op"]:
            raise ValueError(f"'op' {rec['op']!r} does not match the signature's op {sig['op']!r}")
        return canonical_signature(sig)
    return canonical_signature(check_signature(rec))


@dataclass(frozen=True)
class RecordLine:
    line: int
    signature: dict[str, Any] | None  # None when the line is bad
    error: RecordError | None = None


def scan_records(path: str) -> Iterator[RecordLine]:
    """Every non-empty line of a record file, parsed, duplicates dropped; bad lines come back with `error`
    set instead of stopping the scan."""
    seen: set[str] = set()
    with open(path, encoding="utf-8", errors="replace") as f:
        for n, text in enumerate(f, 1):
            text = text.strip()
            if not text:
                continue
            try:
                sig = parse_line(text)
            except ValueError as e:
                yield RecordLine(n, None, RecordError(path, n, str(e)))
                continue
            key = canonical(sig).decode()
            if key not in seen:
                seen.add(key)
                yield RecordLine(n, sig)


def read_records(path: str) -> list[dict[str, Any]]:
    """The signatures of a record file (duplicates removed). Raises `RecordError` (a ValueError) naming
    the first bad line; use `scan_records` to keep going past bad lines."""
    out: list[dict[str, Any]] = []
    for rec in scan_records(path):
        if rec.error is not None:
            raise rec.error
        assert rec.signature is not None
        out.append(rec.signature)
    return out

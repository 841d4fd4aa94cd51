"""TORCH_NEURONX_RECORD_FILE: append every new op signature of this process to a manifest.

The manifest is JSON lines, one `{"op": ..., "signature": {...}}` per distinct signature, written as
they are first seen (a job that crashes midway leaves what it recorded). `neuron-cache warm` and
`neuron-cache compile` read it."""

from __future__ import annotations

import json
import os
import threading
from typing import Any

from . import _signature


class Recorder:
    def __init__(self, path: str) -> None:
        self.path = path
        self._seen: set[str] = set()
        self._lock = threading.Lock()
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)

    def __call__(self, signature: dict[str, Any], digest: str) -> None:
        line = _signature.canonical({"op": signature["op"], "signature": signature}).decode()
        with self._lock:
            if line in self._seen:
                return
            self._seen.add(line)
            # O_APPEND: several processes of one job may record into the same manifest.
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, (line + "\n").encode())
            finally:
                os.close(fd)


def read_manifest(path: str) -> list[dict[str, Any]]:
    """The signatures of a manifest (duplicates removed). Raises ValueError naming the bad line."""
    out: list[dict[str, Any]] = []
    seen: set[str] = set()
    with open(path) as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                rec = json.loads(line)
                sig = rec["signature"]
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{n}: not a manifest line ({e})") from e
            key = _signature.canonical(sig).decode()
            if key not in seen:
                seen.add(key)
                out.append(sig)
    return out

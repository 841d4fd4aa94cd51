"""Executable runs made from Python, recorded on the profiler's device track (`trace.h`) while a profile
with device activity runs; the native paths record their own. One call and a flag read otherwise."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from . import _hostmem

OPS, FUSED, GRAPHS = 0, 1, 2  # trace.h's tracks
_UNNAMED = ("executable", "", "op", "exact")


def run(exe: Callable[..., Any], tensors: Any, scalars: Any, track: int = OPS) -> Any:
    """`exe(tensors, scalars)`, as a run on `track` when the device track records."""
    native = _hostmem.NATIVE
    if native is None or not native.tracing():
        return exe(tensors, scalars)
    t0 = native.trace_now()
    outs = exe(tensors, scalars)
    label = getattr(exe, "__neuron_trace__", None)  # set by the resolver: (op, key, kind, shape class)
    native.trace_run(label if isinstance(label, tuple) else _UNNAMED, track, t0)
    return outs

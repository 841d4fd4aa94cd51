"""Profiler ranges for the runtime's own work (README "Profiling").

`torch.profiler` sees aten ops; what the runtime does inside one is named here, so a trace says where
an op's time went: `neuron::compile[op|class|fused|graph] <op> <key>`, `neuron::load <op> <key>`,
`neuron::cache.get[local|fleet]`, `neuron::cache.put[local|fleet]`, `neuron::wait[thread|host|lease]`
(single-flight: another thread, process or host compiles the key), `neuron::miss <op>` (the first call
of a key: signature, lookup, compile or load, first run), `neuron::host_run <op>` (on the host while
its executable compiles), `neuron::fallback <op>` (on the host: no executable), `neuron::prefetch <job>`.
Executable runs themselves are device activity (the native layer's Kineto profiler, `_native/trace.h`).

`span(name, **meta)` is a range while a profiler records on this thread, and one call that returns a
shared null context otherwise: nothing here is on the hit path, and the slow path pays ~0.1 us per
range. The metadata (the full key, ...) shows in a trace with `record_shapes=True` (PyTorch keeps
keyword inputs only then). Never imports torch: the cache layer runs without it, and a process without
torch has no profiler to record for.
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["NULL", "active", "span", "compile_span", "kind_of"]


class _Null:
    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


NULL = _Null()
_enabled: Any = None  # torch's "is a profiler recording on this thread", bound once torch is imported
_range: Any = None    # what makes a range (torch's private fast record_function, which takes metadata)


def _bind() -> bool:
    global _enabled, _range
    torch = sys.modules.get("torch")
    if torch is None or not hasattr(torch, "_C"):
        return False
    try:
        _range = torch._C._profiler._RecordFunctionFast
    except AttributeError:  # another torch: the public record_function, without metadata
        record_function = torch.autograd.profiler.record_function
        _range = lambda name, _inputs, _meta: record_function(name)  # noqa: E731
    _enabled = torch._C._autograd._profiler_enabled
    return True


def active() -> bool:
    """Whether a profiler records this thread's ranges now."""
    if _enabled is None and not _bind():
        return False
    return bool(_enabled())


def span(name: str, **meta: Any) -> Any:
    """A context manager: a profiler range named `name` (with `meta` as its keyword inputs, strings), or
    nothing when no profiler records on this thread."""
    if _enabled is None and not _bind():
        return NULL
    if not _enabled():
        return NULL
    return _range(name, (), {k: str(v) for k, v in meta.items()})


def kind_of(sig: dict[str, Any]) -> str:
    """op, class (a shape class's generic executable), fused (a fused group) or graph (torch.compile)."""
    op = str(sig.get("op", ""))
    if op.startswith("graph:"):
        return "graph"
    if op.startswith("fused:"):
        return "fused"
    if "shapes" in sig:  # signatures/_shapes.is_class (not imported: signatures/ sits above this module)
        return "class"
    return "op"


def compile_span(sig: dict[str, Any], key: str, what: str = "compile") -> Any:
    """`neuron::compile[<kind>] <op> <key prefix>` (or `neuron::load ...`) for signature `sig`."""
    if _enabled is None and not _bind():
        return NULL
    if not _enabled():
        return NULL
    op = str(sig.get("op", "?"))
    name = f"neuron::{what}[{kind_of(sig)}] {op} {key[:12]}" if what == "compile" else f"neuron::{what} {op} {key[:12]}"
    return _range(name, (), {"key": key, "kind": kind_of(sig), "op": op})

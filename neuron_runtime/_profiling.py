"""Profiler ranges for the runtime's own work (README "Profiling").

`torch.profiler` sees aten ops; what the runtime does inside one is named here, so a trace says where
an op's time went: `neuron::compile[op|class|fused|graph] <op> <key>`, `neuron::load <op> <key>`,
`neuron::cache.get[local|fleet]`, `neuron::cache.put[local|fleet]`, `neuron::wait[thread|host|lease]`
(single-flight: another thread, process or host compiles the key), `neuron::miss <op>` (the first call
of a key: signature, lookup, compile or load, first run), `neuron::host_run <op>` (on the host while
its executable compiles), `neuron::fallback <op>` (on the host: no executable), `neuron::prefetch <job>`.
Executable runs themselves are device activity (the native layer's Kineto profiler, `_native/trace.h`;
runs made from Python are recorded through `_native/_trace.py`).

`span(name, **meta)` is a range while a profiler runs, and one flag read that returns a shared null
context otherwise: nothing here is on the hit path, and the slow path pays ~0.2 us per range. The
metadata (the full key, ...) shows in a trace with `record_shapes=True` (PyTorch keeps keyword inputs
only then). Never imports torch: the cache layer runs without it, and a process without torch has no
profiler to record for.
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["NULL", "active", "span", "compile_span"]


class _Null:
    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


NULL = _Null()
_profiler: Any = None  # torch.autograd.profiler: its `_is_profiler_enabled`, once torch is imported
_range: Any = None     # what makes a range (torch's private fast record_function, which takes metadata)


def _bind() -> bool:
    global _profiler, _range
    torch = sys.modules.get("torch")
    try:
        profiler = torch.autograd.profiler  # type: ignore[union-attr]
    except AttributeError:  # no torch, or torch still importing
        return False
    try:
        _range = torch._C._profiler._RecordFunctionFast  # type: ignore[union-attr]
    except AttributeError:  # another torch: the public record_function, without metadata
        _range = lambda name, _inputs, _meta: profiler.record_function(name)  # noqa: E731
    _profiler = profiler
    return True


def active() -> bool:
    """Whether a profiler runs in this process (PyTorch's flag "for fast python checks"). A range made
    on a thread the profiler does not follow records nothing: background threads' ranges are recorded
    with `experimental_config=torch._C._profiler._ExperimentalConfig(profile_all_threads=True)`."""
    if _profiler is None and not _bind():
        return False
    return bool(_profiler._is_profiler_enabled)


def span(name: str, **meta: Any) -> Any:
    """A context manager: a profiler range named `name` (with `meta` as its keyword inputs, strings), or
    nothing when no profiler runs."""
    if not active():
        return NULL
    return _range(name, (), {k: str(v) for k, v in meta.items()})


def compile_span(sig: dict[str, Any], key: str, kind: str, what: str = "compile") -> Any:
    """`neuron::compile[<kind>] <op> <key prefix>` (or `neuron::load ...`) for signature `sig`, whose kind
    (`signatures.kind_of`: this module sits below the signatures) the caller names."""
    if not active():
        return NULL
    op = str(sig.get("op", "?"))
    name = f"neuron::{what}[{kind}] {op} {key[:12]}" if what == "compile" else f"neuron::{what} {op} {key[:12]}"
    return _range(name, (), {"key": key, "kind": kind, "op": op})

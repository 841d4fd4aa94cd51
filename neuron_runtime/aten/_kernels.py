"""Registers one PrivateUse1 kernel per aten op: its own (`SPECIAL`) or the one of its kind (`_generic`)."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch

from .. import _profiling
from .._native import NATIVE
from ..signatures import (GENERATOR, OPT_TENSOR, OPT_TENSORS, RANDOM, SCALAR, SCALARS, TENSOR, TENSORS, VALUE, OpInfo,
                          classify, cpu_ops, resolve_op)
from . import _decomp, _fusion, _generic, _quantized, _special
from ._host import DEVICE
from ._runtime import runtime
from ._writes import full_overlap_ok

#: Ops with a kernel of their own: allocation, copies, resizes (`_special`), and ops computed from other
#: ops (`_decomp`). Every other op gets the kernel of its kind (`_generic`).
SPECIAL: dict[str, Callable[..., Any]] = {**_special.KERNELS, **_decomp.KERNELS, **_quantized.KERNELS}
_kernels: dict[str, Callable[..., Any]] = {}
_library: torch.library.Library | None = None
_fallbacks: torch.library.Library | None = None


#: Index arguments CUDA's kernel accepts as CPU tensors (any size) for a device `self`; here they move to
#: neuron first (index tensors are small). Every other CPU tensor but a 0-dim scalar is an error, as on CUDA.
CPU_INDEX_ARGS: dict[str, tuple[str, str]] = {
    f"aten::{op}": ("index", "CUDA's index_fill_ accepts a CPU index tensor (PyTorch's stable-sort test uses one)")
    for op in ("index_fill_.int_Scalar", "index_fill_.int_Tensor", "index_fill.int_Scalar", "index_fill.int_Tensor")
}


def _moving_cpu_index(kernel: Callable[..., Any], qualname: str) -> Callable[..., Any]:
    """`kernel` with the CPU index argument of `CPU_INDEX_ARGS[qualname]` moved to neuron."""
    name = CPU_INDEX_ARGS[qualname][0]
    pos = [a.name for a in classify(qualname).args].index(name)

    def moving_kernel(*args: Any, **kwargs: Any) -> Any:
        if len(args) > pos:
            v = args[pos]
            if isinstance(v, torch.Tensor) and v.device.type == "cpu":
                args = (*args[:pos], v.to(DEVICE), *args[pos + 1:])
        elif isinstance(kwargs.get(name), torch.Tensor) and kwargs[name].device.type == "cpu":
            kwargs[name] = kwargs[name].to(DEVICE)
        return kernel(*args, **kwargs)

    return moving_kernel


def kernel_for(qualname: str) -> Callable[..., Any]:
    k = _kernels.get(qualname)
    if k is None:
        k = SPECIAL.get(qualname) or _generic.kernel_for(qualname)
        if qualname in CPU_INDEX_ARGS:
            k = _moving_cpu_index(k, qualname)  # (a Python kernel: the native hit path never sees a CPU index)
        if runtime().fusion is not None and not hasattr(k, "__neuron_source__"):
            k = _flushing(k, qualname)
        _kernels[qualname] = k
    return k


def _flushing(kernel: Callable[..., Any], qualname: str) -> Callable[..., Any]:
    """With fusion on: run queued ops before an op that may read them (views, host ops, copies)."""
    pending, flush, reason = _fusion.PENDING, _fusion.flush, f"op:{qualname}"

    def flushing_kernel(*args: Any, **kwargs: Any) -> Any:
        if pending:
            flush(reason)
        return kernel(*args, **kwargs)

    return flushing_kernel


def register_all() -> int:
    """Register a PrivateUse1 kernel for every aten op with a CPU kernel (+ the special ones)."""
    global _library
    if _library is not None:
        return len(_kernels)
    lib = torch.library.Library("aten", "IMPL")
    names = set(cpu_ops()) | set(SPECIAL)
    for qualname in sorted(names):
        lib.impl(qualname.removeprefix("aten::"), _lazy(qualname), "PrivateUse1")
    # copy_ between neuron tensors goes through `_copy_from`, which PyTorch's conjugate/negative-bit
    # fallback does not know: it would materialise the conj view with clone -> copy_ -> _copy_from ->
    # fallback -> clone ... until the C stack overflows. Our `_copy_from` copies between CPU views that
    # keep both bits, so CPU's math-bit-aware copy_ does the resolving: let those keys fall through.
    for op in ("_copy_from", "_copy_from_and_resize"):
        for key in ("Conjugate", "Negative"):
            lib.impl(op, torch.library.fallthrough_kernel, key)
    for op, kernel in _decomp.COMPOSITE_WIDEN.items():
        lib.impl(op, kernel, "AutogradPrivateUse1")
    global _fallbacks
    _fallbacks = torch.library.Library("_", "IMPL")
    _fallbacks.fallback(_quantized.fallback, "QuantizedPrivateUse1")  # one error for quantized tensors
    _library = lib
    return len(names)


def _lazy(qualname: str) -> Callable[..., Any]:
    """Registered at import: builds the real kernel on first call and registers it in its place.

    Building all ~1,100 kernels up front costs seconds of import time for ops a program never uses;
    calling through a trampoline would cost every later call a Python frame."""

    def first(*args: Any, **kwargs: Any) -> Any:
        with _profiling.span(f"neuron::kernel_setup {qualname}"):  # README "Profiling"
            kernel = kernel_for(qualname)
            if _library is not None and qualname not in _installed:
                _installed.add(qualname)
                if not _install_native(qualname, kernel):
                    with warnings.catch_warnings():
                        # PyTorch warns (once) that a kernel is overridden: that is the point here.
                        warnings.simplefilter("ignore")
                        _library.impl(qualname.removeprefix("aten::"), kernel, "PrivateUse1")
        return kernel(*args, **kwargs)

    return first


_installed: set[str] = set()

# Special kernels with a native fast path (`fastpath.cpp`'s Special), falling back to ours.
_NATIVE_SPECIAL = {"aten::empty.memory_format": 0, "aten::empty_strided": 1, "aten::_copy_from": 2,
                   "aten::_local_scalar_dense": 3, "aten::_to_copy": 4, "aten::clone": 6,
                   "aten::slice_backward": 7, "aten::select_backward": 8,
                   **{f"aten::{op}": 5 for op in ("arange", "arange.start", "arange.start_step", "full",
                                                  "scalar_tensor")}}

# Argument kinds the native hit path serves (`fastpath.cpp`'s Kind), and nothing else.
_NATIVE_KINDS = {TENSOR: 0, OPT_TENSOR: 1, SCALAR: 2, VALUE: 3, TENSORS: 4,
                 SCALARS: 5, OPT_TENSORS: 7}
_NATIVE_OUT = 6  # an out= op's `out` (not keyed, not an input; the result is copied into it)


def _install_native(qualname: str, kernel: Callable[..., Any]) -> bool:
    """Register the native kernel of `qualname` in place of `kernel` if it can serve the op's hit path
    (`_native`); it calls `kernel` for everything else. With fusion on, the calls fusion queues go to
    `kernel` too (its lookup says which), and native kernels run the queue before anything else."""
    native = NATIVE
    if native is None:
        return False
    if qualname in _NATIVE_SPECIAL:
        args = resolve_op(qualname)._schema.arguments
        native.register_special(qualname, _NATIVE_SPECIAL[qualname], [a.kwarg_only for a in args],
                                [a.name for a in args], kernel)
        return True
    if qualname in SPECIAL:
        return False
    info = classify(qualname)
    if info.kind == "view":
        native.register_view(qualname)
        return True
    if info.kind == "host" and info.reason == RANDOM and _native_host_eligible(info):
        native.register_host(qualname, [a.kwarg_only for a in info.args], [a.name for a in info.args], kernel)
        return True
    lookup = getattr(kernel, "__neuron_lookup__", None)
    if lookup is None or not _native_eligible(info):
        return False
    mutated = info.args.index(next(a for a in info.args if a.name == info.mutable[0])) if info.mutable else -1
    kinds = [_NATIVE_OUT if i == mutated and a.kwarg_only else _NATIVE_KINDS[a.kind] for i, a in enumerate(info.args)]
    native.register_compute(qualname, kinds,
                            [a.kwarg_only for a in info.args], [a.name for a in info.args], mutated,
                            info.n_returns, info.returns_list, kernel, lookup,
                            [i for i, a in enumerate(info.args) if a.mutable and a.kind == TENSORS],
                            full_overlap_ok(info))
    return True


def _native_host_eligible(info: OpInfo) -> bool:
    """A random op the native host kernel serves (`HostKernel`): functional, tensors in (one at least),
    structural values, Scalars and a generator, tensors out; no device argument (a factory)."""
    if any(a.mutable for a in info.args) or any(a.name == "device" for a in info.args):
        return False
    if not any(a.kind == TENSOR for a in info.args):
        return False
    if any(a.kind not in (TENSOR, OPT_TENSOR, SCALAR, VALUE, GENERATOR) for a in info.args):
        return False
    returns = [str(r.type) for r in info.op._schema.returns]
    return bool(returns) and all(r == "Tensor" for r in returns)


def _native_eligible(info: OpInfo) -> bool:
    """Ops whose arguments are tensors, tensor lists, Scalars and structural values, returning tensors
    (or one list): a functional op, or an in-place one writing one tensor (returned) or one list."""
    if any(a.kind not in _NATIVE_KINDS for a in info.args):
        return False
    if info.kind != "compute" and any(a.kind == OPT_TENSORS for a in info.args):
        return False  # `index_put_`: the native in-place paths know lists of tensors only
    returns = [str(r.type) for r in info.op._schema.returns]
    if info.kind == "compute":
        return returns == ["List[Tensor]"] if info.returns_list else bool(returns) and \
            all(r == "Tensor" for r in returns)
    if info.kind != "mutating" or info.functional is None or \
            len(info.functional.args) != len(info.args) - sum(a.kwarg_only and a.mutable for a in info.args):
        return False
    if len(info.mutable) > 1:
        # Several lists written (`_fused_adamw_`): the native path serves only in-place executables'
        # entries (nothing to copy back); the others it hands to the Python kernel (`several_mutated`).
        return info.writes_lists and not returns
    if len(info.mutable) != 1:
        return False
    m = next(a for a in info.args if a.name == info.mutable[0])
    if m.kwarg_only:
        # out= (`mul.out`: DDP's reducer divides each gradient into its bucket with it): the functional
        # variant's executable on the other arguments, its result copied into `out` when dtype and sizes fit.
        return m.kind == TENSOR and returns == ["Tensor"] and info.returns_args == [m.name] and \
            [a.name for a in info.functional.args] == [a.name for a in info.args if a is not m]
    if m.kind == TENSOR:
        return returns == ["Tensor"] and info.returns_args == [m.name]
    return m.kind == TENSORS and not returns and info.functional.returns_list

"""Host views of neuron tensors: the CPU tensor over a neuron tensor's memory (`alias`), a neuron tensor
over a fresh CPU result (`wrap`), and the copies and regroupings between them that both paths share.

The bottom of the dispatch path (`_runtime` and `_codegen` build on it): a generated kernel's hit path
calls `alias`, `alias_slow`, `wrap` and `copy_back_out` directly, and reads `_aliases` through `_alias_get`.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch

from .._native import to_cpu, to_neuron
from ..signatures import OpInfo, SCALAR, SCALARS, tensors_in
from ._writes import DEVICE, _dtype_name, device_error, out_device_error

#: Python numbers a Tensor slot may hold (a "wrapped number", `x * 2`).
NUMBERS = frozenset({bool, int, float, complex})


# --------------------------------------------------------------------------------------------------
# CPU aliases of neuron tensors.
#
# `_aliases[id(t)] = (cpu_view, data_ptr, meta, weakref)` for neuron tensors this runtime created (op
# outputs, allocations) and for any neuron tensor once seen as an input. The entry is dropped when the
# tensor dies (weakref callback), and validated on use against the data pointer and the (dtype, sizes,
# strides) the kernel computed for its key anyway, so `t.data = ...`, in-place metadata ops and
# `swap_tensors` can never hand an executable a stale view.
# --------------------------------------------------------------------------------------------------
_aliases: dict[int, tuple[torch.Tensor, int, tuple[Any, ...], Any]] = {}
_alias_get = _aliases.get
_ref = weakref.ref
_alias_op = torch.ops.aten.alias.default


def _dropper(i: int) -> Callable[[Any], None]:
    # `pop` bound now: at interpreter exit the module's globals may be gone before the last tensors die.
    def drop(_: Any, i: int = i, pop: Callable[..., Any] = _aliases.pop) -> None:
        pop(i, None)

    return drop


def wrap(o: torch.Tensor) -> torch.Tensor:
    """A neuron tensor over the memory of fresh CPU tensor `o`, remembering `o` as its CPU view."""
    n = to_neuron(o)
    i = id(n)
    _aliases[i] = (o, o.data_ptr(), (o.dtype, o.shape, o.stride()), _ref(n, _dropper(i)))
    return n


def alias_mutated(t: torch.Tensor, meta: tuple[Any, ...] | None = None) -> torch.Tensor:
    """The CPU view of a tensor an op writes into: a CPU tensor there (even a 0-dim one, which may be
    read as a scalar) is an error, as on CUDA; nothing is written across devices."""
    if t.device.type != DEVICE:
        raise device_error(t)
    return alias_slow(t, meta)


def alias_slow(t: torch.Tensor, meta: tuple[Any, ...] | None = None) -> torch.Tensor:
    """The CPU view of `t` when the cached one is missing or stale (or `t` is a CPU scalar)."""
    if t.device.type == DEVICE:
        if t.is_conj() or t.is_neg():
            return _alias_with_bits(t)
        # Relabel a fresh alias, not `t` itself: the capsule keeps its source alive, and holding `t`'s own
        # TensorImpl would keep the Python tensor from ever dying (PyTorch preserves the PyObject).
        c = to_cpu(_alias_op(t))
        i = id(t)
        _aliases[i] = (c, t.data_ptr(), meta if meta is not None else (t.dtype, t.shape, t.stride()),
                       _ref(t, _dropper(i)))
        return c
    if t.dim() == 0 and t.device.type == "cpu":
        return t  # CPU scalars mix with device tensors, as on CUDA
    raise device_error(t)


def _alias_with_bits(t: torch.Tensor) -> torch.Tensor:
    """The CPU view of a lazily conjugated or negated tensor (`x.conj()`, `x.conj().imag`).

    DLPack carries neither bit: view the raw memory, then set the bits again on the CPU side, so reads
    and writes through the view see what PyTorch would. Not cached (the key does not hold the bits)."""
    raw = t.conj() if t.is_conj() else t  # flips the bit off: a view of the stored values
    if raw.is_neg():
        raw = raw._neg_view()
    c = to_cpu(_alias_op(raw))
    if t.is_neg():
        c = c._neg_view()
    return c.conj() if t.is_conj() else c


def alias(t: torch.Tensor) -> torch.Tensor:
    meta = (t.dtype, t.shape, t.stride())
    e = _alias_get(id(t))
    if e is not None and e[2] == meta and e[1] == t.data_ptr():
        return e[0]
    return alias_slow(t, meta)


def forget(t: torch.Tensor) -> None:
    """Drop the cached CPU view of `t` (after an op changed its storage or metadata)."""
    _aliases.pop(id(t), None)


def to_host(v: Any, strict: bool = False) -> Any:
    """Replace neuron tensors in an argument (lists too) by their CPU views.

    `strict`: a CPU tensor (other than a 0-dim scalar) is an error, as on CUDA for compute ops."""
    if isinstance(v, torch.Tensor):
        if v.device.type == DEVICE:
            return alias(v)
        if strict and v.dim() != 0:
            raise device_error(v)
        return v
    if isinstance(v, (list, tuple)):
        return type(v)(to_host(x, strict) for x in v)
    if isinstance(v, torch.device) and v.type == DEVICE:
        return torch.device("cpu")
    return v


# --------------------------------------------------------------------------------------------------
# Host results back to neuron, and functional results into the tensors an op mutates.
# --------------------------------------------------------------------------------------------------
def rewrap(out: Any, values: tuple[Any, ...], host_values: tuple[Any, ...], to_cpu_result: bool = False) -> Any:
    """Map host results back: an input's CPU view becomes that input; a fresh CPU tensor becomes neuron."""
    if isinstance(out, torch.Tensor):
        for v, h in zip(values, host_values):
            if h is out:
                return v
            if isinstance(h, (list, tuple)):
                for vv, hh in zip(v, h):
                    if hh is out:
                        return vv
        if to_cpu_result or out.device.type != "cpu":
            return out
        return wrap(out)
    if isinstance(out, (list, tuple)):
        return type(out)(rewrap(o, values, host_values, to_cpu_result) for o in out)
    return out


def regroup(info: OpInfo, values: tuple[Any, ...], outs: list[Any]) -> list[Any]:
    """A mutating op's functional results, one entry per mutated argument.

    A single `Tensor[]` return comes back as the list itself (`_foreach_add_`); several `Tensor[]`
    returns (`_fused_adamw_`) may come back flat, and are split by the lengths of the mutated lists."""
    f = info.functional or info
    if f.returns_list:
        return [outs]
    names = [a.name for a in info.args]
    lists = [values[names.index(m)] for m in info.mutable]
    if not any(isinstance(v, (list, tuple)) for v in lists) or not outs or \
            not isinstance(outs[0], torch.Tensor) or len(outs) == len(lists):
        return outs
    grouped, i = [], 0
    for v in lists:
        n = len(v) if isinstance(v, (list, tuple)) else 1
        grouped.append(outs[i:i + n] if isinstance(v, (list, tuple)) else outs[i])
        i += n
    return grouped


def mutated_views(info: OpInfo, host_values: tuple[Any, ...]) -> list[torch.Tensor]:
    """The CPU views of the tensors a mutating op writes, flattened."""
    out: list[torch.Tensor] = []
    for a, h in zip(info.args, host_values):
        if a.name in info.mutable:
            out.extend(h if isinstance(h, (list, tuple)) else [h])
    return out


def copy_back_all(info: OpInfo, values: tuple[Any, ...], outs: list[Any]) -> None:
    """The hit path's copy-back for ops that mutate lists of tensors."""
    names = [a.name for a in info.args]
    for name, out in zip(info.mutable, regroup(info, values, outs)):
        target = values[names.index(name)]
        if isinstance(target, (list, tuple)):
            dst = [alias(t) for t in target]
            if dst:
                torch._foreach_copy_(dst, list(out))
        else:
            copy_back_out(target, out)


def copy_back(target: torch.Tensor, host: torch.Tensor, result: torch.Tensor, info: OpInfo) -> None:
    """Write a functional result into the tensor an in-place or out= op mutates."""
    if target.shape != result.shape:
        if info.mutable and info.args[[a.name for a in info.args].index(info.mutable[0])].kwarg_only:
            target.resize_(result.shape)  # out=: resized like PyTorch does (our resize_ kernel)
            host = alias(target)
        else:
            raise RuntimeError(f"{info.qualname}: output with shape {list(target.shape)} doesn't match the "
                               f"broadcast shape {list(result.shape)}")
    if result.dtype != host.dtype and not torch.can_cast(result.dtype, host.dtype):
        raise RuntimeError(f"{info.qualname}: result type {result.dtype} can't be cast to the desired output "
                           f"type {host.dtype}")
    host.copy_(result)


def copy_back_out(target: torch.Tensor, result: torch.Tensor) -> None:
    """Write a result into an out= tensor (the hit path's copy-back): resized to the result's shape, cast
    where PyTorch casts, never across devices."""
    if target.device.type != DEVICE:
        raise out_device_error(target)  # never write across devices
    if target.dtype != result.dtype and not torch.can_cast(result.dtype, target.dtype):
        raise RuntimeError(f"result type {_dtype_name(result.dtype)} can't be cast to the desired output type "
                           f"{_dtype_name(target.dtype)}")
    host = alias(target)
    if host.shape != result.shape:
        target.resize_(result.shape)
        host = alias(target)
    host.copy_(result)


def flatten(info: OpInfo, host_values: tuple[Any, ...]) -> tuple[list[torch.Tensor], list[Any]]:
    """The executable's (tensors, scalars) for one call, in the order of `compiler._base`'s contract."""
    tensors: list[torch.Tensor] = []
    scalars: list[Any] = []
    for a, v in zip(info.args, host_values):
        k = a.kind
        if k == SCALAR:
            if v is not None:
                scalars.append(v)
        elif k == SCALARS:
            if v is not None:
                scalars.extend(v)
        else:
            tensors += tensors_in(k, v)
    return tensors, scalars

"""Writes an op makes into its arguments (in-place, out=): the device and dtype rules CUDA applies.

An op never writes across devices: a CPU tensor an op on `neuron` would write into raises before anything
runs (CUDA's messages). An out= tensor of another dtype than the result follows PyTorch's rules for that
op, which its meta kernel states (see docs/dispatch.md, "Writes across devices and dtypes")."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from ..signatures import _ops
from . import _widen

DEVICE = "neuron"


def device_error(t: torch.Tensor) -> RuntimeError:
    return RuntimeError(
        f"Expected all tensors to be on the same device, but found at least two devices, {DEVICE}:0 and "
        f"{t.device}!"
    )


def out_device_error(t: torch.Tensor) -> RuntimeError:
    """An out= tensor on another device. CUDA words this by kernel: TensorIterator ops "Expected all tensors
    to be on the same device, ...", structured kernels "Expected out tensor to have device cuda:0, but got
    cpu instead", `nonzero` "expected self and out to be on the same device". Both of CUDA's sentences, so
    code (and PyTorch's own tests) matching either one works on neuron."""
    return RuntimeError(
        f"Expected all tensors to be on the same device, but found at least two devices, {DEVICE}:0 and "
        f"{t.device}! Expected out tensor to have device {DEVICE}:0, but got {t.device} instead")


def check_mutated(info: _ops.OpInfo, values: tuple[Any, ...]) -> bool:
    """Before an op writes: every tensor it mutates is a neuron tensor (out= tensors get CUDA's out= message),
    and out= tensors follow PyTorch's dtype rules (`check_out_dtype`). True: an out= tensor has another
    dtype than the result and the op accepts it (then its CPU out= kernel runs, which casts as PyTorch
    does: `sum(x, out=int64)` sums in int64)."""
    has_out = False
    for a, v in zip(info.args, values):
        if not a.mutable:
            continue
        for t in (v if isinstance(v, (list, tuple)) else (v,)):
            if isinstance(t, torch.Tensor) and t.device.type != DEVICE:
                raise out_device_error(t) if a.kwarg_only else device_error(t)
        has_out = has_out or a.kwarg_only
    return has_out and check_out_dtype(info, values)


def _metas(v: Any) -> Any:
    return [_widen._meta(x) for x in v] if isinstance(v, (list, tuple)) else _widen._meta(v)


def check_out_dtype(info: _ops.OpInfo, values: tuple[Any, ...]) -> bool:
    """out= of another dtype than the result's: refused as PyTorch refuses it (the op's meta kernel decides:
    elementwise ops cast when `can_cast` allows, structured ops like mm want the exact dtype, reductions
    compute in it), with CPU's and CUDA's message. True when accepted with another dtype."""
    f = info.functional or info
    outs = [v for a, v in zip(info.args, values) if a.kwarg_only and a.mutable and isinstance(v, torch.Tensor)]
    try:
        res = [t.dtype for t in tree_leaves(f.op(*[_metas(v) for a, v in zip(info.args, values)
                                                      if not (a.mutable and a.kwarg_only) and not a.kwarg_only],
                                                   **{a.name: _metas(v) for a, v in zip(info.args, values)
                                                      if a.kwarg_only and not a.mutable}))
               if isinstance(t, torch.Tensor)]
    except Exception:  # noqa: BLE001 - no meta kernel: the copy-back applies can_cast
        return False
    if all(o.dtype == r for o, r in zip(outs, res)):
        return False
    try:
        info.op(*[_metas(v) for a, v in zip(info.args, values) if not a.kwarg_only],
                **{a.name: _metas(v) for a, v in zip(info.args, values) if a.kwarg_only})
    except RuntimeError as e:
        if "dtype" not in str(e) and "cast" not in str(e):
            return False  # the meta kernel refuses something else (data-dependent shapes): the op decides
        # The message CPU and CUDA give where meta words it differently: CPU's own out= kernel, whose
        # structured meta function CUDA shares (`isposinf`: "does not support non-boolean outputs"), else
        # TensorIterator's for a result that cannot be cast, else the meta kernel's.
        cpu_error = _cpu_out_error(info, values)
        if cpu_error is not None:
            raise RuntimeError(cpu_error) from None
        for o, r in zip(outs, res):
            if not torch.can_cast(r, o.dtype):
                raise RuntimeError(f"result type {_dtype_name(r)} can't be cast to the desired output type "
                                   f"{_dtype_name(o.dtype)}") from None
        raise RuntimeError(str(e)) from None
    except Exception:  # noqa: BLE001
        return False
    return True


def _cpu_out_error(info: _ops.OpInfo, values: tuple[Any, ...]) -> str | None:
    """The message of the op's CPU out= kernel for these arguments' metadata (zeros of the same sizes,
    strides and dtypes: only ever on the way to an error), or None if CPU accepts them."""
    def zeros(v: Any) -> Any:
        if isinstance(v, (list, tuple)):
            return type(v)(zeros(x) for x in v)
        if isinstance(v, torch.Tensor):
            return torch.empty_strided(v.shape, v.stride(), dtype=v.dtype).zero_()
        return v

    try:
        info.op(*[zeros(v) for a, v in zip(info.args, values) if not a.kwarg_only],
                **{a.name: zeros(v) for a, v in zip(info.args, values) if a.kwarg_only})
    except RuntimeError as e:
        return str(e)
    except Exception:  # noqa: BLE001 - anything else: the meta kernel's message stands
        return None
    return None


def _dtype_name(d: torch.dtype) -> str:
    """PyTorch's name of a dtype in its messages (`Float`, `Long`)."""
    return torch.empty(0, dtype=d).type().removeprefix("torch.").removesuffix("Tensor")

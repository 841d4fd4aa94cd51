"""Kernels that compute an op from other ops (registered through `_special.KERNELS`).

  * `_efficientzerotensor`: CPU's result is a ZeroTensor with no memory behind it (a null data pointer);
    relabelled to neuron it loses the ZeroTensor key and the first read dereferences null. Here: real zeros.
  * out= ops with no CPU kernel whose CompositeExplicitAutograd kernel refuses any device but CPU/CUDA/XPU
    (`mode.values`): the generic out= kernel (functional executable, then copy into `out`).
  * Ops that mutate arguments and also return fresh tensors (training batch norm: `_native_batch_norm_legit`,
    `_batch_norm_with_update`), which `_ops.classify` can only run on the host: their `*_functional` twin
    compiles, and the new running statistics are copied back.
  * Factories with out= (`_ops.FACTORY_OUT`: arange/linspace/logspace/eye reach these on every device): the
    functional factory compiles (its Scalars keyed by value), and its result is copied into `out`.
  * `equal`: eq(a, b).all() through executables, then one value read back (CUDA computes it the same way);
    `_local_scalar_dense` (`.item()`): a one-value device-to-host read.
  * Accelerator-only dtypes (`_ops.UPCAST`): CUDA kernels accept float16/bfloat16 where the host CPU kernel
    does not. The inputs are cast to float32, the op runs as usual (compiled), and the outputs are cast back,
    as a device without a native half kernel would compute it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from . import _dispatch, _ops
from ._dispatch import _copy_back_out, alias, wrap

_LOW = (torch.float16, torch.bfloat16)


def efficientzerotensor(size: list[int], *, dtype: Any = None, layout: Any = None, device: Any = None,
                        pin_memory: Any = None) -> torch.Tensor:
    from ._special import check_device

    check_device(device)
    return wrap(torch.zeros(size, dtype=dtype, layout=layout))


def _generic(qualname: str) -> Callable[..., Any]:
    """The kernel `_kernels` would build for `qualname` from its kind, ignoring the special tables."""
    from . import _kernels

    info = _ops.classify(qualname, special=False)
    if info.kind == "view":
        return _kernels._view_kernel(info)
    if info.kind == "host":
        return _kernels._host_kernel(info)
    return _dispatch._codegen(info)


def _lazy_generic(qualname: str) -> Callable[..., Any]:
    cell: list[Callable[..., Any]] = []

    def kernel(*args: Any, **kwargs: Any) -> Any:
        if not cell:
            cell.append(_generic(qualname))
        return cell[0](*args, **kwargs)

    return kernel


def _upcast(qualname: str) -> Callable[..., Any]:
    """float16/bfloat16 tensors in, float32 computation, the low dtype out (mutated args written back)."""
    info = _ops.classify(qualname)
    mutable = {i for i, a in enumerate(info.args) if a.mutable}
    names = [a.name for a in info.args]
    cell: list[Callable[..., Any]] = []

    def kernel(*args: Any, **kwargs: Any) -> Any:
        if not cell:
            cell.append(_generic(qualname))
        inner = cell[0]
        low = next((t.dtype for t in [*args, *kwargs.values()] if isinstance(t, torch.Tensor)
                    and t.dtype in _LOW), None)
        if low is None:
            return inner(*args, **kwargs)
        # 1. Cast the low-precision tensors up (fresh neuron tensors).
        up_args = [a.float() if isinstance(a, torch.Tensor) and a.dtype == low else a for a in args]
        up_kwargs = {k: (v.float() if isinstance(v, torch.Tensor) and v.dtype == low else v)
                     for k, v in kwargs.items()}
        # 2. Run the op in float32.
        out = inner(*up_args, **up_kwargs)
        # 3. Write mutated arguments back, cast the float32 outputs down.
        for i in mutable:
            if i < len(args) and up_args[i] is not args[i]:
                args[i].copy_(up_args[i])
            elif names[i] in kwargs and up_kwargs[names[i]] is not kwargs[names[i]]:
                kwargs[names[i]].copy_(up_kwargs[names[i]])

        def down(o: Any) -> Any:
            if isinstance(o, torch.Tensor) and o.dtype == torch.float32:
                return o.to(low)
            return o

        if isinstance(out, (tuple, list)):
            return type(out)(down(o) for o in out)
        return down(out)

    return kernel


def _via_functional(qualname: str, functional: str) -> Callable[..., Any]:
    """An op that mutates some arguments *and* returns fresh tensors (training batch norm updates the running
    stats): run its `*_functional` twin, which returns the fresh tensors followed by the new values of the
    mutated arguments, through the generic compiled kernel; then copy those values into the arguments."""
    schema = _ops._resolve(qualname)._schema
    mutated = [i for i, a in enumerate(schema.arguments) if a.alias_info is not None and a.alias_info.is_write]
    n_fresh = len(schema.returns)
    cell: list[Callable[..., Any]] = []

    def kernel(*args: Any, **kwargs: Any) -> Any:
        if not cell:
            cell.append(_generic(functional))
        outs = cell[0](*args, **kwargs)
        for j, i in enumerate(mutated):
            target = args[i] if i < len(args) else kwargs[schema.arguments[i].name]
            target.copy_(outs[n_fresh + j])
        return tuple(outs[:n_fresh])

    return kernel


def _factory_out(functional: str) -> Callable[..., Any]:
    """`arange.out(end, *, out)` and friends: the functional factory (`arange(end, *, dtype, ...)`) as a
    compiled op on the host, then `out` resized and filled, as `*.out` does."""
    cell: list[Callable[..., Any]] = []

    def kernel(*args: Any, out: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        if not cell:
            info = _ops.classify(f"aten::{functional}", special=False)
            info.kind, info.reason = "compute", ""  # classify() calls a device factory "host"
            cell.append(_dispatch._codegen(info))
        _copy_back_out(out, alias(cell[0](*args, dtype=out.dtype, **kwargs)))
        return out

    return kernel


def local_scalar_dense(self: torch.Tensor) -> Any:
    return alias(self).item()


def equal(self: torch.Tensor, other: torch.Tensor) -> bool:
    if self.device != other.device:
        raise RuntimeError(f"Expected all tensors to be on the same device, but found {self.device} and "
                           f"{other.device}")
    if self.shape != other.shape:
        return False
    return bool(torch.eq(self, other).all().item())


KERNELS: dict[str, Callable[..., Any]] = {
    **{f"aten::{op}": _factory_out(f) for op, f in _ops.FACTORY_OUT.items()},
    "aten::_local_scalar_dense": local_scalar_dense,
    "aten::equal": equal,
    "aten::_native_batch_norm_legit": _via_functional("aten::_native_batch_norm_legit",
                                                      "aten::_native_batch_norm_legit_functional"),
    "aten::_batch_norm_with_update": _via_functional("aten::_batch_norm_with_update",
                                                     "aten::_batch_norm_with_update_functional"),
    "aten::_efficientzerotensor": efficientzerotensor,
    "aten::mode.values": _lazy_generic("aten::mode.values"),
    **{q: _upcast(q) for q in _ops.UPCAST},
}

"""Kernels that compute an op from other ops (registered through `_kernels.SPECIAL`).

  * `_efficientzerotensor`: CPU's result is a ZeroTensor with no memory behind it (a null data pointer);
    relabelled to neuron it loses the ZeroTensor key and the first read dereferences null. Here: real zeros.
  * out= ops with no CPU kernel whose CompositeExplicitAutograd kernel refuses any device but CPU/CUDA/XPU
    (`mode.values`): the generic out= kernel (functional executable, then copy into `out`).
  * Ops that mutate arguments and also return fresh tensors (training batch norm: `_native_batch_norm_legit`,
    `_batch_norm_with_update`), which `classify` can only run on the host: their `*_functional` twin
    compiles, and the new running statistics are copied back.
  * Factories with out= (`FACTORY_OUT`: arange/linspace/logspace/eye reach these on every device): the
    functional factory compiles (its Scalars keyed by value), and its result is copied into `out`.
  * `narrow_copy`: a narrow view and a copy, as on CUDA (CPU's kernel words its argument errors otherwise).
  * `equal`: eq(a, b).all() through executables, then one value read back (CUDA computes it the same way);
    `_local_scalar_dense` (`.item()`): a one-value device-to-host read.
  * Dtypes the host kernel lacks are widened by one rule for every op (`_widen`); two exceptions live here,
    each where that rule cannot reach:
      - `nansum` on complex inputs: the CPU kernel refuses complex outright ("nansum on CPU does not support
        complex inputs"), so no wider dtype helps; computed as CUDA defines it, sum(where(isnan(x), 0, x))
        (a complex element with a NaN real or imaginary part counts as zero).
      - the `fft_*` composites (`COMPOSITE_WIDEN`): ATen's `promote_type_fft` accepts float16 only on CUDA
        and meta devices and raises "Unsupported dtype Half" before any neuron kernel runs; registered at
        AutogradPrivateUse1, they widen float16 inputs to float32 (the ops underneath then compute through
        executables) and return the dtype CUDA returns; every other dtype runs the composite unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..signatures import FACTORY_OUT, classify, resolve_op
from . import _codegen, _generic, _widen
from ._host import alias, copy_back_out, wrap
from ._runtime import runtime

def efficientzerotensor(size: list[int], *, dtype: Any = None, layout: Any = None, device: Any = None,
                        pin_memory: Any = None) -> torch.Tensor:
    _generic.check_device(device)
    return wrap(torch.zeros(size, dtype=dtype, layout=layout))


def _generic_kernel(qualname: str) -> Callable[..., Any]:
    """The kernel `_kernels` would build for `qualname` from its kind, ignoring the special tables."""
    return _generic.kernel(classify(qualname, special=False))


def _lazy_generic(qualname: str) -> Callable[..., Any]:
    cell: list[Callable[..., Any]] = []

    def kernel(*args: Any, **kwargs: Any) -> Any:
        if not cell:
            cell.append(_generic_kernel(qualname))
        return cell[0](*args, **kwargs)

    return kernel


def _via_functional(qualname: str, functional: str) -> Callable[..., Any]:
    """An op that mutates some arguments *and* returns fresh tensors (training batch norm updates the running
    stats): run its `*_functional` twin, which returns the fresh tensors followed by the new values of the
    mutated arguments, through the generic compiled kernel; then copy those values into the arguments."""
    schema = resolve_op(qualname)._schema
    mutated = [i for i, a in enumerate(schema.arguments) if a.alias_info is not None and a.alias_info.is_write]
    n_fresh = len(schema.returns)
    cell: list[Callable[..., Any]] = []

    def kernel(*args: Any, **kwargs: Any) -> Any:
        if not cell:
            cell.append(_generic_kernel(functional))
        outs = cell[0](*args, **kwargs)
        for j, i in enumerate(mutated):
            target = args[i] if i < len(args) else kwargs[schema.arguments[i].name]
            target.copy_(outs[n_fresh + j])
        return tuple(outs[:n_fresh])

    return kernel


# Factories filled on the host, not compiled: their output size is their arguments' values, so each new
# length was a new key (a decode loop's `arange(past, past + n)`: one compile per token, issue 43) that no
# shape class can cover. Filling a range on the host costs less than one compile, and equals CPU's.
_HOST_FACTORIES = frozenset({"arange", "arange.start_step"})


def _host_factory(name: str) -> Callable[..., Any]:
    """`torch.arange(..., device="neuron")` (`arange`, `arange.start`, `arange.start_step`), `torch.full` and
    `torch.scalar_tensor` on neuron: CPU's factory relabelled, one call (fastpath.cpp's HOST_FACTORY does
    the same natively). Without it `arange` allocates an empty neuron tensor and calls `arange.out`, whose
    out= path resizes it and copies the range in (three runtime calls; a decode step makes three aranges:
    ~20 % of its Python time on `aoti`, issue 43); `full` and `scalar_tensor` (`where(c, x, 0.0)`) allocate
    and launch `fill_`, which reads its value back through `item` (four a decode token)."""
    factory = getattr(torch, name)

    def kernel(*args: Any, dtype: Any = None, layout: Any = None, device: Any = None,
               pin_memory: Any = None) -> torch.Tensor:
        _generic.check_device(device)
        return wrap(factory(*args, dtype=dtype, layout=layout))

    return kernel


def _factory_out(functional: str) -> Callable[..., Any]:
    """`arange.out(end, *, out)` and friends: the functional factory (`arange(end, *, dtype, ...)`) as a
    compiled op on the host, then `out` resized and filled, as `*.out` does."""
    cell: list[Callable[..., Any]] = []

    def kernel(*args: Any, out: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        if functional in _HOST_FACTORIES:  # filled on the host: see _HOST_FACTORIES
            copy_back_out(out, torch.arange(*args, dtype=out.dtype, **kwargs))
            return out
        if not cell:
            info = classify(f"aten::{functional}", special=False)
            info.kind, info.reason = "compute", ""  # classify() calls a device factory "host"
            cell.append(_codegen.generate(info))
        copy_back_out(out, alias(cell[0](*args, dtype=out.dtype, **kwargs)))
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


def _nansum(qualname: str) -> Callable[..., Any]:
    """nansum; complex inputs as CUDA defines them (see the module docstring)."""
    cell: list[Callable[..., Any]] = []

    def kernel(self: torch.Tensor, dim: Any = None, keepdim: bool = False, *, dtype: Any = None) -> torch.Tensor:
        if self.is_complex():
            return torch.sum(torch.where(torch.isnan(self), torch.zeros_like(self), self), dim, keepdim, dtype=dtype)
        if not cell:
            cell.append(_generic_kernel(qualname))
        return cell[0](self, dim, keepdim, dtype=dtype)

    return kernel


FFT_OPS = ("fft", "ifft", "fft2", "ifft2", "fftn", "ifftn", "rfft", "irfft", "rfft2", "irfft2", "rfftn", "irfftn",
           "hfft", "ihfft", "hfft2", "ihfft2", "hfftn", "ihfftn")


def _composite_widen(name: str) -> Callable[..., Any]:
    """A CompositeImplicitAutograd op that refuses float16 off CUDA: float16 tensors in, float32 through the
    composite (differentiable: `.to` is), the dtype CUDA returns out (from the meta kernel)."""
    op = getattr(torch.ops.aten, name).default

    def kernel(*args: Any, **kwargs: Any) -> Any:
        if not any(isinstance(a, torch.Tensor) and a.dtype == torch.float16 for a in args):
            return op.decompose(*args, **kwargs)
        up = [a.to(torch.float32) if isinstance(a, torch.Tensor) and a.dtype == torch.float16 else a for a in args]
        want = _widen.result_dtypes(op, list(args), kwargs)
        runtime().note_widened(f"aten::{name}", "float16 -> float32")
        out = op(*up, **kwargs)
        return out.to(want[0]) if want and out.dtype != want[0] else out

    return kernel


# Registered at AutogradPrivateUse1 (`_kernels.register_all`): composites that refuse a dtype before any
# neuron kernel runs.
COMPOSITE_WIDEN: dict[str, Callable[..., Any]] = {f"fft_{n}": _composite_widen(f"fft_{n}") for n in FFT_OPS}


def narrow_copy(self: torch.Tensor, dim: int, start: int, length: int) -> torch.Tensor:
    """As CUDA computes it (a narrow view, then a contiguous copy): CPU's own kernel checks its arguments
    with other messages ("Expected dim < ... to be true") than the ones CUDA users and PyTorch's error
    inputs expect ("Dimension out of range", "narrow(): length must be non-negative.")."""
    return self.narrow(dim, start, length).clone(memory_format=torch.contiguous_format)


KERNELS: dict[str, Callable[..., Any]] = {
    **{f"aten::{op}": _factory_out(f) for op, f in FACTORY_OUT.items()},
    **{f"aten::{op}": _host_factory("arange") for op in ("arange", "arange.start", "arange.start_step")},
    "aten::full": _host_factory("full"),
    "aten::scalar_tensor": _host_factory("scalar_tensor"),
    "aten::_local_scalar_dense": local_scalar_dense,
    "aten::equal": equal,
    "aten::_native_batch_norm_legit": _via_functional("aten::_native_batch_norm_legit",
                                                      "aten::_native_batch_norm_legit_functional"),
    "aten::_batch_norm_with_update": _via_functional("aten::_batch_norm_with_update",
                                                     "aten::_batch_norm_with_update_functional"),
    "aten::_efficientzerotensor": efficientzerotensor,
    "aten::mode.values": _lazy_generic("aten::mode.values"),
    "aten::nansum": _nansum("aten::nansum"),
    "aten::narrow_copy": narrow_copy,
}

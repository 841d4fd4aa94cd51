"""Kernels of their own, for the ops in `_ops.SPECIAL` (allocation, cross-device copies, resizes)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from . import _generic
from ._host import DEVICE, alias, forget, wrap
from ._generic import check_device
from ._writes import assert_no_partial_overlap

_CPU_KEYS = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)


def _host(t: torch.Tensor) -> torch.Tensor:
    """CPU view of a neuron tensor, or a CPU tensor itself (copies may cross devices)."""
    return alias(t) if t.device.type == DEVICE else t


def empty_memory_format(size: list[int], *, dtype: Any = None, layout: Any = None, device: Any = None,
                        pin_memory: Any = None, memory_format: Any = None) -> torch.Tensor:
    check_device(device)
    return wrap(torch.empty(size, dtype=dtype, layout=layout,
                            memory_format=memory_format or torch.contiguous_format))


def empty_strided(size: list[int], stride: list[int], *, dtype: Any = None, layout: Any = None,
                  device: Any = None, pin_memory: Any = None) -> torch.Tensor:
    check_device(device)
    return wrap(torch.empty_strided(size, stride, dtype=dtype, layout=layout))


def copy_from(self: torch.Tensor, dst: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
    """`dst.copy_(self)` (PyTorch's `copy_` reaches it once the tensors are not the very same elements).
    The CPU views copied between have storages of their own, so CPU's copy cannot see that the tensors
    share memory: the overlap is judged here on the tensors themselves, as CPU's copy judges it (only
    neuron tensors share neuron memory; a copy from another device may have no data pointer to compare)."""
    if self.device.type == DEVICE and dst.device.type == DEVICE:
        assert_no_partial_overlap(dst, self)
    _host(dst).copy_(_host(self))
    return dst


def copy_from_and_resize(self: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    if dst.shape != self.shape:
        dst.resize_(self.shape)
    if self.device.type == DEVICE and dst.device.type == DEVICE:
        assert_no_partial_overlap(dst, self)
    _host(dst).copy_(_host(self))
    return dst


def _contiguous_strides(size: list[int], memory_format: Any) -> list[int]:
    if memory_format in (torch.channels_last, torch.channels_last_3d):
        return list(torch.empty(size, device="meta", memory_format=memory_format).stride())
    strides, acc = [], 1
    for s in reversed(size):
        strides.append(acc)
        acc *= max(s, 1)
    return strides[::-1]


def resize_(self: torch.Tensor, size: list[int], *, memory_format: Any = None) -> torch.Tensor:
    """Resize in place; grow through a new host buffer (neuron storages are not reallocatable). The same
    sizes and no memory format change nothing, as on CPU (an expanded `out=` keeps its strides, so the
    op's own checks still see that its elements share memory)."""
    size = list(size)
    if memory_format is None and size == list(self.shape):
        return self
    strides = _contiguous_strides(size, memory_format)
    numel = 1
    for s in size:
        numel *= s
    item = self.element_size()
    offset = self.storage_offset()
    need = (offset + numel) * item if numel else 0
    storage = self.untyped_storage()
    if need > storage.nbytes():
        # 1. New buffer, 2. keep the old bytes (resize_ preserves contents), 3. rebind the storage.
        buf = torch.empty(need, dtype=torch.uint8)
        old = storage.nbytes()
        if old:
            buf[:old].copy_(alias(torch.empty(0, dtype=torch.uint8, device=DEVICE).set_(storage, 0, [old], [1])))
        storage = wrap(buf).untyped_storage()
    torch.ops.aten.set_.source_Storage_storage_offset(self, storage, offset, size, strides)
    forget(self)
    return self


def _set_kernel(op: Any) -> Callable[..., Any]:
    handle = op._handle

    def kernel(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        out = handle.redispatch_boxed(_CPU_KEYS, self, *args, **kwargs)
        forget(self)
        return out  # type: ignore[no-any-return]

    return kernel


def set_empty(self: torch.Tensor) -> torch.Tensor:
    storage = wrap(torch.empty(0, dtype=self.dtype)).untyped_storage()
    torch.ops.aten.set_.source_Storage_storage_offset(self, storage, 0, [0], [1])
    forget(self)
    return self


def convolution_overrideable(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                             stride: list[int], padding: list[int], dilation: list[int], transposed: bool,
                             output_padding: list[int], groups: int) -> torch.Tensor:
    return _dispatch_kernel("aten::convolution")(input, weight, bias, stride, padding, dilation, transposed,
                                                 output_padding, groups)


def convolution_backward_overrideable(grad_output: torch.Tensor, input: torch.Tensor, weight: torch.Tensor,
                                      stride: list[int], padding: list[int], dilation: list[int],
                                      transposed: bool, output_padding: list[int], groups: int,
                                      output_mask: list[bool]) -> Any:
    bias_sizes = [weight.shape[1] * groups if transposed else weight.shape[0]]
    return _dispatch_kernel("aten::convolution_backward")(
        grad_output, input, weight, bias_sizes, stride, padding, dilation, transposed, output_padding, groups,
        output_mask)


def _dispatch_kernel(qualname: str) -> Callable[..., Any]:
    return _generic.kernel_for(qualname)


def to_copy(self: torch.Tensor, *, dtype: Any = None, layout: Any = None, device: Any = None,
            pin_memory: Any = None, non_blocking: bool = False, memory_format: Any = None) -> torch.Tensor:
    """`.to()` / `.cpu()` of a neuron tensor. PyTorch's composite kernel would ask the accelerator for a
    pinned-memory allocator on `non_blocking=True` copies to the CPU (a Python backend has none); neuron
    memory is host memory, so every copy is a plain host copy and is complete on return."""
    target = torch.device(device) if device is not None else self.device
    check_device(target)
    out = torch.ops.aten._to_copy.default(_host(self), dtype=dtype, layout=layout, device="cpu",
                                          memory_format=memory_format)
    return out if target.type == "cpu" else wrap(out)


def clone(self: torch.Tensor, *, memory_format: Any = None) -> torch.Tensor:
    """A copy into new memory, as PyTorch's composite makes it (`empty_like` + `copy_`): the native
    kernel serves the common case as one host clone of the CPU view (~2-3 us less than the composite's
    three dispatches and two CPU views, measured in a decode token)."""
    return torch.empty_like(self, memory_format=memory_format or torch.preserve_format).copy_(self)


KERNELS: dict[str, Callable[..., Any]] = {
    "aten::clone": clone,
    "aten::_to_copy": to_copy,
    "aten::empty.memory_format": empty_memory_format,
    "aten::empty_strided": empty_strided,
    "aten::_copy_from": copy_from,
    "aten::_copy_from_and_resize": copy_from_and_resize,
    "aten::resize_": resize_,
    "aten::set_.source_Storage": _set_kernel(torch.ops.aten.set_.source_Storage),
    "aten::set_.source_Storage_storage_offset": _set_kernel(torch.ops.aten.set_.source_Storage_storage_offset),
    "aten::set_.source_Tensor": _set_kernel(torch.ops.aten.set_.source_Tensor),
    "aten::set_": set_empty,
    "aten::convolution_overrideable": convolution_overrideable,
    "aten::convolution_backward_overrideable": convolution_backward_overrideable,
}

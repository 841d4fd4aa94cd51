"""Zero-copy relabelling between CPU tensors and `neuron` tensors (host memory on both sides).

Every private torch API and memory layout the runtime relies on lives here, checked at import by
`smoke_test()`; torch is pinned exactly in pyproject.toml for the same reason.

How it works: DLPack maps device type 12 (kDLExtDev) to PrivateUse1. `torch._C._to_dlpack` gives a
capsule over a tensor's memory whose deleter keeps the source alive; we overwrite the `DLDevice.device_type`
field (right after the `data` pointer of the `DLTensor` at the head of the managed tensor) and import the
capsule back, which yields a tensor of the other device over the same memory. (`Tensor.__dlpack__` refuses
renamed backends, hence the private functions.)
"""

from __future__ import annotations

import ctypes

import torch

from ._build import load as _load_native

_KDL_CPU = 1
_KDL_EXT_DEV = 12  # PrivateUse1

_to_dlpack = torch._C._to_dlpack
_from_dlpack = torch._C._from_dlpack
_void_p_at = ctypes.c_void_p.from_address
_int32_at = ctypes.c_int32.from_address
# A PyCapsule is PyObject_HEAD (refcount, type) followed by its pointer: read it without a C call.
_CAPSULE_PTR_OFFSET = 2 * ctypes.sizeof(ctypes.c_void_p)
# DLTensor: void* data, then DLDevice {int32 device_type; int32 device_id}.
_DEVICE_OFFSET = ctypes.sizeof(ctypes.c_void_p)


def _relabel(t: torch.Tensor, device_type: int) -> torch.Tensor:
    cap = _to_dlpack(t)
    _int32_at(_void_p_at(id(cap) + _CAPSULE_PTR_OFFSET).value + _DEVICE_OFFSET).value = device_type  # type: ignore[operator]
    return _from_dlpack(cap)


def to_neuron(t: torch.Tensor) -> torch.Tensor:
    """A `neuron` tensor over the memory of CPU tensor `t` (same sizes, strides, offset)."""
    return _relabel(t, _KDL_EXT_DEV)


def to_cpu(t: torch.Tensor) -> torch.Tensor:
    """A CPU tensor over the memory of `neuron` tensor `t`."""
    return _relabel(t, _KDL_CPU)


# The native layer relabels in one C++ call (a third of the DLPack round trip), when it is available.
NATIVE = _load_native()
if NATIVE is not None:
    to_neuron = NATIVE.to_neuron  # noqa: F811
    to_cpu = NATIVE.to_cpu  # noqa: F811


class HostMemoryError(RuntimeError):
    """The private torch APIs this module relies on do not behave as this torch version should."""


def smoke_test() -> None:
    """Check the relabelling round trip on this torch build; raise HostMemoryError if it is broken."""
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)[:, 1:]
    n = to_neuron(base)
    back = to_cpu(n)
    ok = (
        n.device.type == torch._C._get_privateuse1_backend_name()
        and back.device.type == "cpu"
        and n.data_ptr() == base.data_ptr() == back.data_ptr()
        and n.shape == base.shape
        and n.stride() == base.stride()
        and torch.equal(back, base)
    )
    if not ok:
        raise HostMemoryError(
            f"zero-copy host memory relabelling failed on torch {torch.__version__}; "
            "neuron-runtime needs torch==2.13.0 (see pyproject.toml)"
        )

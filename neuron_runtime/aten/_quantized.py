"""Quantized tensors on `neuron`: refused, with one error, wherever one would come into being.

Why refused rather than served for the ops that only touch metadata (views, flatten, flip as a copy):
PyTorch's quantized tensors carry their own quantizer (per-tensor or per-channel scale and zero point) and
run on QuantizedCPU/QuantizedCUDA kernels. A quantized neuron tensor that could be viewed and copied but not
added, matmul'ed or dequantized by any compiled op would fail later, deep in some other op, with PyTorch's
"Could not run ... 'Quantizedneuron' backend". Trainium's own eager stack (TorchNeuron) leaves PyTorch's
quantized tensors out as well (per-channel quantization included). So every way in raises this one error:
`.to("neuron")` of a quantized tensor, `torch.quantize_per_tensor`/`_per_channel` of a neuron tensor, and
any factory with a quantized dtype on neuron (the `QuantizedPrivateUse1` fallback)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

DEVICE = "neuron"


_QUANTIZED = frozenset({torch.quint8, torch.qint8, torch.qint32, torch.quint4x2, torch.quint2x4})


class QuantizedTensorError(RuntimeError):
    """A quantized tensor would be made on `neuron`, which does not support them."""


def error(what: str, dtype: Any = None) -> QuantizedTensorError:
    d = f" ({dtype})" if dtype is not None else ""
    return QuantizedTensorError(
        f"{what}: {DEVICE} does not support quantized tensors{d}. PyTorch's quantized tensors (torch.quint8, "
        f"qint8, qint32, ...) run only on its QuantizedCPU/QuantizedCUDA kernels; dequantize on the host first "
        f"(`q.dequantize().to('{DEVICE}')`) or keep the quantized part of the model on CPU.")


def _dtype_in(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    for v in (*args, *kwargs.values()):
        if isinstance(v, torch.Tensor) and v.is_quantized:
            return v.dtype
        if isinstance(v, torch.dtype) and v in _QUANTIZED:
            return v
    return None


def fallback(op: Any, *args: Any, **kwargs: Any) -> Any:
    """Every op that reaches the QuantizedPrivateUse1 key: `.to('neuron')` of a quantized tensor (it
    allocates with `empty_quantized` there), `torch.empty(..., dtype=torch.quint8, device='neuron')`, ..."""
    name = getattr(op, "__name__", None) or str(op)
    raise error(f"{name} on {DEVICE} (a quantized tensor: `.to('{DEVICE}')` of one comes here)", _dtype_in(args, kwargs))


def _refusing(qualname: str) -> Callable[..., Any]:
    def kernel(*args: Any, **kwargs: Any) -> Any:
        raise error(f"{qualname} of a {DEVICE} tensor", _dtype_in(args, kwargs))

    return kernel


# Ops that make a quantized tensor from a neuron one (the PrivateUse1 key sees these; what they would
# return is a quantized neuron tensor).
KERNELS: dict[str, Callable[..., Any]] = {q: _refusing(q) for q in (
    "aten::quantize_per_tensor", "aten::quantize_per_tensor.tensor_qparams", "aten::quantize_per_tensor.tensors",
    "aten::quantize_per_tensor_dynamic", "aten::quantize_per_channel", "aten::_make_per_tensor_quantized_tensor",
    "aten::_make_per_channel_quantized_tensor", "aten::_empty_affine_quantized",
    "aten::_empty_per_channel_affine_quantized",
)}

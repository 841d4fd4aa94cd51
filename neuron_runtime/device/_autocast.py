"""`torch.autocast(device_type="neuron")`.

PyTorch registers no autocast kernels for PrivateUse1, so every op would fail at the AutocastPrivateUse1
key. We register a fallthrough for all ops, plus kernels for the ops CUDA's autocast also casts:
matmul-class ops run in the autocast dtype (bf16 by default), precision-sensitive ops in float32.
The lists are a subset of PyTorch's CUDA policy (aten/src/ATen/autocast_mode.cpp).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

_KEY = "AutocastPrivateUse1"
_EXCLUDE = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastPrivateUse1)

# (op, reason) — run in the autocast (lower precision) dtype: matmul-class, where bf16 pays off.
LOWER = [
    "mm", "bmm", "addmm", "addbmm", "baddbmm", "matmul", "linear", "conv1d", "conv2d", "conv3d",
    "conv_transpose1d", "conv_transpose2d.input", "conv_transpose3d.input", "_convolution", "convolution",
    "prelu", "scaled_dot_product_attention", "chain_matmul", "linalg_multi_dot", "addmv", "addr", "mv",
]
# Run in float32: reductions and losses that lose too much in bf16.
FP32 = [
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal",
    "rsqrt", "sinh", "tan", "pow.Tensor_Scalar", "pow.Tensor_Tensor", "pow.Scalar", "softplus",
    "layer_norm", "group_norm", "norm.Scalar", "frobenius_norm.dim", "nuclear_norm", "cosine_similarity",
    "poisson_nll_loss", "cosine_embedding_loss", "nll_loss", "nll_loss2d", "hinge_embedding_loss",
    "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss", "margin_ranking_loss",
    "multilabel_margin_loss", "soft_margin_loss", "triplet_margin_loss", "multi_margin_loss",
    "binary_cross_entropy_with_logits", "dist", "pdist", "cdist", "renorm", "logsumexp",
    "softmax.int", "log_softmax.int", "cross_entropy_loss", "cumsum", "cumprod", "prod", "sum",
]

_library: torch.library.Library | None = None
_libraries: list[torch.library.Library] = []  # keeps registrations alive


def _cast(v: Any, dtype: torch.dtype) -> Any:
    if isinstance(v, torch.Tensor) and v.is_floating_point() and v.device.type != "cpu" and v.dtype != dtype:
        return v.to(dtype)
    if isinstance(v, (list, tuple)):
        return type(v)(_cast(x, dtype) for x in v)
    return v


def _kernel(op: Any, target: Callable[[], torch.dtype]) -> Callable[..., Any]:
    def kernel(*args: Any, **kwargs: Any) -> Any:
        dtype = target()
        args = tuple(_cast(a, dtype) for a in args)
        kwargs = {k: _cast(v, dtype) for k, v in kwargs.items()}
        with torch._C._ExcludeDispatchKeyGuard(_EXCLUDE):
            return op(*args, **kwargs)

    return kernel


def _resolve(name: str) -> Any:
    base, _, overload = name.partition(".")
    packet = getattr(torch.ops.aten, base, None)
    if packet is None:
        return None
    return getattr(packet, overload or "default", None)


def install(device: str) -> None:
    global _library
    if _library is not None:
        return
    fallback = torch.library.Library("_", "IMPL")
    fallback.fallback(torch.library.fallthrough_kernel, _KEY)
    lib = torch.library.Library("aten", "IMPL")
    lower = lambda: torch.get_autocast_dtype(device)  # noqa: E731
    fp32 = lambda: torch.float32  # noqa: E731
    for names, target in ((LOWER, lower), (FP32, fp32)):
        for name in names:
            op = _resolve(name)
            if op is None:
                continue
            lib.impl(name, _kernel(op, target), _KEY)
    _library = lib
    _libraries.append(fallback)

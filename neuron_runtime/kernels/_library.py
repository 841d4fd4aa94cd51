"""The kernels shipped with the runtime, each one executable per call on neuron (docs/kernels.md), and
`use_in_llama`, which puts them in a Hugging Face Llama without editing its source.

Each body is the eager composition a Hugging Face Llama computes (`LlamaRMSNorm.forward`,
`apply_rotary_pos_emb`, `LlamaMLP`'s `act_fn(gate) * up`), so on every device but neuron a kernel
computes exactly what the model did, and its backward is the body's own VJP.
"""

from __future__ import annotations

import sys
import types
from typing import Any

import torch

from ._kernel import kernel

__all__ = ["rms_norm", "rotary", "swiglu", "use_in_llama"]


@kernel("neuron_kernels::rms_norm")
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`weight * x / sqrt(mean(x², -1) + eps)`, in float32 and back to x's dtype (LlamaRMSNorm)."""
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


@kernel("neuron_kernels::rotary")
def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
           unsqueeze_dim: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary position embedding of q and k (Hugging Face's `apply_rotary_pos_emb`): both rotated in one
    launch."""
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


@kernel("neuron_kernels::swiglu")
def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up`, the gated activation of a Llama MLP."""
    return torch.nn.functional.silu(gate) * up


# swiglu's eager autograd: the body's VJP would recompute sigmoid(gate), the one costly op of either
# pass (an exp per element; the multiplies are nearly free), so the forward returns it too and the
# backward reads it: two launches, one exp.
@kernel("neuron_kernels::swiglu_saving")
def _swiglu_saving(gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`(silu(gate) * up, sigmoid(gate))`."""
    sig = torch.sigmoid(gate)
    return gate * sig * up, sig


@kernel("neuron_kernels::swiglu_grad")
def _swiglu_grad(grad: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
                 sig: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """swiglu's gradients (gate, up) from the forward's `sigmoid(gate)`."""
    return grad * up * (sig * (1 + gate * (1 - sig))), grad * (gate * sig)


swiglu.saving_backward(_swiglu_saving, _swiglu_grad)


def _rms_forward(self: Any, hidden_states: torch.Tensor) -> torch.Tensor:
    return rms_norm(hidden_states, self.weight, float(self.variance_epsilon))


def _mlp_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
    return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


def _rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            unsqueeze_dim: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    return rotary(q, k, cos, sin, unsqueeze_dim)


def use_in_llama(model: torch.nn.Module, *, rotary_embedding: bool = True) -> dict[str, int]:
    """Run `model`'s (a Hugging Face Llama's) RMSNorms and SwiGLU MLPs through this library's kernels,
    without editing its source: each `LlamaRMSNorm` and each `LlamaMLP` whose activation is SiLU gets an
    instance `forward` calling the kernel (the module, its parameters and its state dict are unchanged;
    `del module.forward` undoes it). With `rotary_embedding`, the Llama modeling module's
    `apply_rotary_pos_emb` (called by name from `LlamaAttention.forward`) becomes the `rotary` kernel: that
    swap is process-wide, and harmless to other models since off neuron the kernel computes the same
    function. Returns how many modules of each kind were swapped."""
    counts = {"rms_norm": 0, "swiglu": 0, "rotary": 0}
    modeling = None
    for m in model.modules():
        name = type(m).__name__
        if name.endswith("RMSNorm") and hasattr(m, "variance_epsilon") and hasattr(m, "weight"):
            m.forward = types.MethodType(_rms_forward, m)  # type: ignore[method-assign]
            counts["rms_norm"] += 1
        elif name.endswith("MLP") and _is_silu(getattr(m, "act_fn", None)) and hasattr(m, "gate_proj"):
            m.forward = types.MethodType(_mlp_forward, m)  # type: ignore[method-assign]
            counts["swiglu"] += 1
        if name.endswith("Attention"):
            modeling = sys.modules.get(type(m).__module__)
    if rotary_embedding and modeling is not None and hasattr(modeling, "apply_rotary_pos_emb"):
        modeling.apply_rotary_pos_emb = _rotary
        counts["rotary"] = 1
    return counts


def _is_silu(act: Any) -> bool:
    return isinstance(act, torch.nn.SiLU) or getattr(act, "__name__", "") == "silu" or \
        type(act).__name__ in ("SiLUActivation", "SiLU")

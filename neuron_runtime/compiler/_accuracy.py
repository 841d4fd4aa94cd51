"""The self-check's tolerance: when a compiled output counts as equal to eager's (docs/compile.md:
"The self-check").

The rule is Inductor's own accuracy rule against eager (`torch._dynamo.utils.same`, what its benchmarks
and the accuracy minifier hold a compiled model to):

  1. `allclose(compiled, eager, rtol=1e-2, atol=1e-2)` (NaN equal to NaN) passes; otherwise
  2. the same computation in float64 on the same values is the referee: the compiled output passes when
     its root-mean-square error against it is at most `multiplier` times eager's own float32 error plus
     `TOL / 10`, where `multiplier` is 2 (3 for outputs under 1,000 elements or of a half dtype: noise
     dominates small tensors). Positions where any of the three is not finite are compared by pattern
     (the same NaNs and infinities), the rest by error.

Step 2 is what makes a graph's check fair on values it was not written for: a backward graph fed made-up
activations grows to 1e23 and loses digits to cancellation in eager as much as in the compiled code; an
output that is as wrong as float32 itself is not the compiler's fault. A refusal states both errors.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

TOL = 1e-2
_HALF = (torch.float16, torch.bfloat16)
_FLOATS = {"float32", "float16", "bfloat16"}


def upcast_signature(sig: Any) -> Any:
    """A signature (op, fused group or graph) with every float32/float16/bfloat16 dtype, of a tensor
    argument or of a dtype value (`_to_copy(dtype=...)`), made float64: the float64 referee's."""
    if isinstance(sig, dict):
        if set(sig) == {"dtype"} and sig["dtype"] in _FLOATS:
            return {"dtype": "float64"}
        return {k: ("float64" if k == "dtype" and v in _FLOATS else upcast_signature(v)) for k, v in sig.items()}
    if isinstance(sig, list):
        return [upcast_signature(v) for v in sig]
    return sig


def upcast_tensor(t: Any) -> Any:
    """`t` in float64 with the same sizes, strides and storage offset (an `as_strided` in the op reads
    the same elements), its storage copied whole (expanded inputs stay expanded)."""
    if not isinstance(t, torch.Tensor) or t.dtype not in (torch.float32, *_HALF):
        return t
    base = torch.empty(0, dtype=t.dtype).set_(t.untyped_storage()).to(torch.float64)
    return base.as_strided(t.shape, t.stride(), t.storage_offset())


def float64_reference(make_run: Callable[[], Any], tensors: list[Any], scalars: list[Any],
                      into: list[int]) -> tuple[list[Any] | None, str]:
    """Eager in float64 on `tensors` upcast (`make_run()`: the float64 signature's call): its outputs then
    the inputs it wrote, or None and why there is none (an op that takes no float64, a graph whose ops
    mix dtypes the upcast cannot follow)."""
    try:
        ins = [upcast_tensor(t.clone() if i in into and isinstance(t, torch.Tensor) else t)
               for i, t in enumerate(tensors)]
        out = list(make_run()(ins, scalars)) + [ins[i] for i in into]
    except Exception as e:  # noqa: BLE001 - no referee: the plain tolerance decides alone
        return None, f"no float64 run to judge by: {type(e).__name__}: {str(e).strip()[:120]}"
    return out, ""


def _rmse(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.sqrt(torch.mean(torch.square(a - b)))) if a.numel() else 0.0


def judge(got: torch.Tensor, want: torch.Tensor, ref: Any) -> str | None:
    """None when floating `got` (compiled) counts as equal to `want` (eager float32) under the rule above,
    with `ref` the float64 output (or None); otherwise why not, with the numbers."""
    g64 = got.to(torch.complex128 if got.is_complex() else torch.float64)
    w64 = want.to(torch.complex128 if want.is_complex() else torch.float64)
    if torch.allclose(g64, w64, rtol=TOL, atol=TOL, equal_nan=True):
        return None
    diff = (g64 - w64).abs().nan_to_num(nan=math.inf)
    at = [int(i) for i in torch.unravel_index(diff.argmax(), got.shape)] if got.ndim else []
    worst = f"largest |compiled - eager| {float(diff.max()):.3g} at {at} (eager {w64[tuple(at)].item():.4})"
    if not isinstance(ref, torch.Tensor) or ref.shape != got.shape or not (ref.is_floating_point() or ref.is_complex()):
        return f"{worst}, beyond rtol=atol={TOL:g}"
    r64 = ref.to(torch.complex128 if ref.is_complex() else torch.float64)
    # where compiled or eager is not finite, both must give the same NaN or infinity
    odd = ~(g64.isfinite() & w64.isfinite())
    if not torch.equal(g64[odd].nan_to_num(nan=0.0, posinf=1.0, neginf=-1.0),
                       w64[odd].nan_to_num(nan=0.0, posinf=1.0, neginf=-1.0)):
        return f"{worst}; NaN or infinity where eager has another value"
    finite = ~odd & r64.isfinite()
    res_err, ref_err = _rmse(g64[finite], r64[finite]), _rmse(w64[finite], r64[finite])
    multiplier = 3.0 if got.numel() < 1000 or got.dtype in _HALF else 2.0
    limit = multiplier * ref_err + TOL / 10
    if res_err <= limit:
        return None
    return (f"{worst}; error against float64 {res_err:.3g}, eager's own {ref_err:.3g} "
            f"(limit {multiplier:g} x eager's + {TOL / 10:g}: Inductor's accuracy rule)")

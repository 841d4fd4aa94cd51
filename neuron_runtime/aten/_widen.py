"""Dtypes the host kernel lacks: compute in the nearest wider dtype it has, return what CUDA returns.

Code written for CUDA calls ops with dtypes CUDA's kernels accept and the host CPU kernel does not
(`histc` on int32 in a router, `abs` on a bool mask, complex32 arithmetic, half-precision pooling). The
rule, one for every op:

  1. The op runs as usual (compiled, or on the host). If the host kernel raises that it is not
     implemented for a dtype (`not implemented for 'Int'`, `Unsupported dtype Half`, ...), the tensors
     of the dtype(s) the error names are widened one rung of `LADDER` (fresh neuron tensors), and the op
     runs again -- through its own executable for the wider dtype -- until the host accepts it.
  2. The result gets the dtype CUDA returns, which is what the op's meta kernel says for the original
     inputs (dtype rules are device-independent; the meta kernel never checks dtype support). Mutated
     arguments (in-place, out=) are written back in their own dtype.
  3. The widening found for a key is remembered: later calls with that key widen straight away, and
     `stats()["widened"]` lists each op with the dtypes it computes in.

Where widening changes the result, and what CUDA does (see docs/dispatch.md, "Dtypes the host lacks"):
  * integers computed in int64 and cast back wrap modulo 2**bits, as CUDA's narrower arithmetic does;
  * integers computed in float64 (`histc`) are exact up to 2**53: an int64 input beyond that is
    detected and warned about, since CUDA would compare the integers themselves;
  * half types computed in float32 round once at the end; CUDA's kernels also accumulate half in
    float32 (`acc_type`), so results agree to half precision, not always bit for bit.
"""

from __future__ import annotations

import re
import warnings
from typing import Any

import torch
from torch.utils import _pytree as pytree

# One rung up for each dtype a host kernel may lack (the rule's step 1). Not here, so never widened: the
# dtypes CUDA's kernels lack as broadly as CPU's (float8 types, uint16/uint32/uint64): the error stays
# the one CUDA gives.
LADDER: dict[torch.dtype, torch.dtype] = {
    torch.float16: torch.float32,
    torch.bfloat16: torch.float32,
    torch.complex32: torch.complex64,
    torch.bool: torch.int64,
    torch.uint8: torch.int64,
    torch.int8: torch.int64,
    torch.int16: torch.int64,
    torch.int32: torch.int64,
    torch.int64: torch.float64,
    torch.float32: torch.float64,
    torch.complex64: torch.complex128,
}

# ATen's names of scalar types in its errors -> the dtypes they can mean (a complex kernel names its real
# component type: "MKL FFT doesn't support tensors of type: Half" for a complex32 input).
_NAMES: dict[str, tuple[torch.dtype, ...]] = {
    "Half": (torch.float16, torch.complex32), "BFloat16": (torch.bfloat16,), "ComplexHalf": (torch.complex32,),
    "Bool": (torch.bool,), "Byte": (torch.uint8,), "Char": (torch.int8,), "Short": (torch.int16,),
    "Int": (torch.int32,), "Long": (torch.int64,),
    "Float": (torch.float32, torch.complex64), "Double": (torch.float64, torch.complex128),
    "ComplexFloat": (torch.complex64,), "ComplexDouble": (torch.complex128,),
}
_UNSUPPORTED = re.compile(r"not implemented for '(\w+)'|[Uu]nsupported dtype (\w+)|"
                          r"doesn't support tensors of type: (\w+)|does not support (?:the )?dtype (\w+)")

# 2**53: the largest integer up to which every int64 is exact in float64.
_EXACT_IN_FLOAT64 = 2 ** 53


def named_dtypes(err: BaseException) -> set[torch.dtype]:
    """The dtypes a host kernel's error says it lacks (empty: not a missing-dtype error)."""
    if not isinstance(err, (RuntimeError, NotImplementedError, TypeError)):
        return set()
    out: set[torch.dtype] = set()
    for m in _UNSUPPORTED.finditer(str(err)):
        name = next(g for g in m.groups() if g)
        out.update(_NAMES.get(name, ()))
    return out


def _tensors(values: Any) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(list(values)) if isinstance(t, torch.Tensor)]


def _meta(t: Any) -> Any:
    if isinstance(t, torch.Tensor):
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
    if isinstance(t, torch.device):
        return torch.device("meta")
    return t


def result_dtypes(op: Any, args: list[Any], kwargs: dict[str, Any]) -> list[torch.dtype] | None:
    """The dtypes of the op's tensor results for these inputs, from its meta kernel (None: no meta kernel)."""
    try:
        m_args, m_kwargs = pytree.tree_map(_meta, (list(args), dict(kwargs)))
        out = op(*m_args, **m_kwargs)
    except Exception:  # noqa: BLE001 - no meta kernel, or it needs data (then the rung's inverse is used)
        return None
    return [o.dtype for o in pytree.tree_leaves(out) if isinstance(o, torch.Tensor)]


class Plan:
    """How one key widens: `{dtype: the dtype it computes in}` and the op's result dtypes."""

    def __init__(self, widen: dict[torch.dtype, torch.dtype], results: list[torch.dtype] | None) -> None:
        self.widen = widen
        self.results = results

    def describe(self) -> str:
        return ", ".join(f"{_short(a)} -> {_short(b)}" for a, b in self.widen.items())


def _short(d: torch.dtype) -> str:
    return str(d).removeprefix("torch.")


def _apply(widen: dict[torch.dtype, torch.dtype], args: list[Any], kwargs: dict[str, Any]
           ) -> tuple[list[Any], dict[str, Any], list[tuple[torch.Tensor, torch.Tensor]]]:
    """Widened copies of the tensors of `widen`'s dtypes; returns them with (original, copy) pairs."""
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []

    def up(t: Any) -> Any:
        if isinstance(t, torch.Tensor) and t.dtype in widen:
            w = t.detach().to(widen[t.dtype]) if not t.requires_grad else t.to(widen[t.dtype])
            pairs.append((t, w))
            return w
        return t

    a, k = pytree.tree_map(up, (list(args), dict(kwargs)))
    return a, k, pairs


def _check_exact(widen: dict[torch.dtype, torch.dtype], pairs: list[tuple[torch.Tensor, torch.Tensor]],
                 name: str) -> None:
    for orig, _ in pairs:
        if orig.dtype == torch.int64 and widen.get(torch.int64) == torch.float64 and orig.numel():
            big = int(orig.detach().abs().max().item())
            if big > _EXACT_IN_FLOAT64:
                warnings.warn(f"neuron: {name} has no int64 kernel on the host and computes in float64; "
                              f"|values| up to {big} exceed 2**53 and are rounded", UserWarning, stacklevel=5)


def run(name: str, op: Any, args: list[Any], kwargs: dict[str, Any], err: BaseException | None,
        plan: Plan | None = None) -> tuple[Any, Plan]:
    """Run `op` widened. `err`: the host kernel's missing-dtype error that started it (re-raised when no
    rung helps); `plan`: a widening found before for this key. Returns (result, plan)."""
    if plan is None:
        widen: dict[torch.dtype, torch.dtype] = {}
        present = {t.dtype for t in _tensors([*args, *kwargs.values()])}
        named = named_dtypes(err) if err is not None else set()
        for _ in range(4):  # at most: bool -> int64 -> float64, plus one dtype named later
            # Compose: a dtype whose current rung is named moves up one more.
            grow = {d for d in present if widen.get(d, d) in named and widen.get(d, d) in LADDER}
            if not grow:
                break
            for d in grow:
                widen[d] = LADDER[widen.get(d, d)]
            try:
                result = _call(name, op, args, kwargs, Plan(widen, None))
            except Exception as e:  # noqa: BLE001 - the next rung, or the original error
                named = named_dtypes(e)
                continue
            plan = Plan(dict(widen), None)
            plan.results = result_dtypes(op, args, kwargs)
            return _cast(result[0], result[1], plan), plan
        assert err is not None
        raise err
    result = _call(name, op, args, kwargs, plan)
    return _cast(result[0], result[1], plan), plan


def _call(name: str, op: Any, args: list[Any], kwargs: dict[str, Any], plan: Plan
          ) -> tuple[Any, list[tuple[torch.Tensor, torch.Tensor]]]:
    w_args, w_kwargs, pairs = _apply(plan.widen, args, kwargs)
    _check_exact(plan.widen, pairs, name)
    out = op(*w_args, **w_kwargs)
    # Mutated arguments (in-place, out=): write the widened copy back into the original, in its dtype.
    schema = op._schema
    mutable = {a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write}
    if mutable:
        by_copy = {id(w): o for o, w in pairs}
        for a, v in zip(schema.arguments, [*w_args, *[w_kwargs.get(a.name) for a in schema.arguments[len(w_args):]]]):
            if a.name in mutable and isinstance(v, torch.Tensor) and id(v) in by_copy:
                orig = by_copy[id(v)]
                if orig.shape != v.shape:
                    orig.resize_(v.shape)
                with torch.no_grad():
                    orig.copy_(v)
    return out, pairs


def _cast(out: Any, pairs: list[tuple[torch.Tensor, torch.Tensor]], plan: Plan) -> Any:
    """Results in the dtypes CUDA returns; a returned widened copy of a mutated argument is the argument."""
    originals = {id(w): o for o, w in pairs}
    back = {w: n for n, w in plan.widen.items()}
    i = [0]

    def down(o: Any) -> Any:
        if not isinstance(o, torch.Tensor):
            return o
        j = i[0]
        i[0] += 1
        if id(o) in originals:
            return originals[id(o)]
        want = plan.results[j] if plan.results is not None and j < len(plan.results) else _inverse(o.dtype, back)
        return o if o.dtype == want else o.to(want)

    return pytree.tree_map(down, out)


def _inverse(d: torch.dtype, back: dict[torch.dtype, torch.dtype]) -> torch.dtype:
    """Without a meta kernel: a result in a widened dtype goes back to the dtype it was widened from."""
    if d in back:
        return back[d]
    if d == torch.float32 and torch.complex64 in back and back[torch.complex64] == torch.complex32:
        return torch.float16  # the real part of complex32
    return d


__all__ = ["LADDER", "Plan", "named_dtypes", "result_dtypes", "run"]

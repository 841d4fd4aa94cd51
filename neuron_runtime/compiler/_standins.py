"""What the `aoti` tier traces in an op's place where Inductor needs another spelling of the same op:
a `_foreach_*` op as a loop over its per-tensor op (`per_element`), a graph's `view` as `reshape`
(`VIEWS`); `for_node` chooses for a node of a fused group or graph. Each table says why."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..signatures import SCALAR, SCALARS


def for_node(sig: dict[str, Any], op: Any) -> Any:
    """What a fused group's or graph's node (`sig`, its op `op`) is traced as: `build_graph`'s `choose`."""
    return for_op(sig["op"], op, sig) or VIEWS.get(sig["op"], op)


def for_op(qualname: str, op: Any, signature: dict[str, Any]) -> Any | None:
    """What an op's call (`signature`) is traced as instead of `op` itself, or None: `per_element` for a
    `_foreach_*` op, `_RUNTIME_SCALAR` for an op whose lowering cannot take one of its run-time scalars."""
    found = per_element(qualname, op, signature)
    if found is None and qualname in _RUNTIME_SCALAR:
        name, stand_in = _RUNTIME_SCALAR[qualname]
        if _has_runtime_scalar(signature, name):
            found = stand_in(op)
    return found


def _has_runtime_scalar(signature: dict[str, Any], name: str) -> bool:
    return any(n == name and kind == SCALAR and desc is not None for n, kind, desc in signature["args"])


def per_element(qualname: str, op: Any, signature: dict[str, Any]) -> Any | None:
    """For a `_foreach_*` op, a stand-in that calls the per-tensor op in a loop, when Inductor needs it.

    Inductor has no lowering for many foreach ops (all ScalarList overloads, exp, log, lgamma, ...) and
    calls them through AOTInductor's proxy executor: one dispatcher call per execution and, for run-time
    scalars, a load-time failure (it cannot take symbolic scalars). The per-tensor ops lower to one fused
    kernel and keep the scalars as inputs. It is also how the CPU kernels of these ops compute (a loop
    over the per-tensor op), so results match eager."""
    if not qualname.startswith("aten::_foreach_"):
        return None
    from torch._inductor.lowering import lowerings

    has_scalars = any(kind in (SCALAR, SCALARS) for _, kind, _ in signature["args"])
    if not has_scalars and op in lowerings:
        return None
    base = qualname.removeprefix("aten::_foreach_").partition(".")[0]
    target_name, scalar_kw = _FOREACH_ELEMENT.get(base, (base, None))
    target = getattr(torch.ops.aten, target_name, None)
    if target is None:
        return None
    return _PerElement(op, target, scalar_kw)


class _Reshape:
    """`view(self, size)` in a compiled graph, traced as `reshape`. A graph AOTAutograd recorded views
    tensors with the strides eager kernels gave them; Inductor's decompositions may lay an intermediate
    out otherwise (a CPU attention's `k` transposed in another order), and a `view` of it then fails the
    whole compile ("Cannot view a tensor with shape ..."). `reshape` views when it can and copies when it
    must; the self-check still compares every output's strides with eager's."""

    def __init__(self, op: Any) -> None:
        self._schema = op._schema

    def __call__(self, x: torch.Tensor, size: Sequence[int]) -> torch.Tensor:
        return torch.reshape(x, size)


VIEWS: dict[str, Any] = {"aten::view": _Reshape(torch.ops.aten.view.default),
                         "aten::_unsafe_view": _Reshape(torch.ops.aten._unsafe_view.default)}


# foreach base name -> (per-tensor op, keyword its list-wise scalar goes to when not positional); both as
# the CPU kernels of the foreach ops call them (ForeachOpsKernels.cpp).
_FOREACH_ELEMENT: dict[str, tuple[str, str | None]] = {
    "maximum": ("clamp_min", None),
    "minimum": ("clamp_max", None),
    "addcmul": ("addcmul", "value"),
    "addcdiv": ("addcdiv", "value"),
    "norm": ("linalg_vector_norm", None),
}


class _PerElement:
    """Callable with a foreach op's schema (what `build_call` needs) that loops over the per-tensor op."""

    def __init__(self, op: Any, target: Any, scalar_kw: str | None) -> None:
        self._schema = op._schema
        self.target = target
        self.scalar_kw = scalar_kw
        self.n_positional = sum(1 for a in op._schema.arguments if not a.kwarg_only)

    def __call__(self, *args: Any, **kwargs: Any) -> list[torch.Tensor]:
        n = next(len(a) for a in args if isinstance(a, (list, tuple)))
        outs = []
        for i in range(n):
            pos = [a[i] if isinstance(a, (list, tuple)) else a for a in args]
            kw = {k: v[i] if isinstance(v, (list, tuple)) else v for k, v in kwargs.items()}
            if self.scalar_kw is not None and len(pos) == 4:
                kw[self.scalar_kw] = pos.pop()
            outs.append(self.target(*pos, **kw))
        return outs


# Ops whose trace or lowering cannot take one of their run-time scalars, each traced as the same computation
# spelt so it can (`_RUNTIME_SCALAR`). `sub` and `index_add`: the decomposition asks `alpha != 1` (to skip
# a multiply), which a run-time alpha cannot answer at trace time ("Could not guard on data-dependent
# expression Ne(zuf0, 1.0)"); the multiply is always done (exact for alpha = 1: x * 1 is x).
class _SubAsAdd:
    """`sub(a, b, alpha)` as `add(a, b, alpha=-alpha)`: what ATen's CPU kernel computes (`sub_out` calls
    the add kernel with -alpha), and `add`'s lowering takes a symbolic alpha. Bool inputs, which `sub`
    refuses and `add` would not, go to `sub` itself."""

    def __init__(self, op: Any) -> None:
        self._schema = op._schema
        self._aten = op

    def __call__(self, a: Any, b: Any, alpha: Any = 1) -> torch.Tensor:
        if any(isinstance(t, torch.Tensor) and t.dtype == torch.bool for t in (a, b)):
            return self._aten(a, b, alpha=alpha)
        return torch.ops.aten.add.Tensor(a, b, alpha=-alpha)


class _IndexAddScaled:
    """`index_add(self, dim, index, source, alpha)` as `index_add(self, dim, index, source * alpha)`: the
    decomposition's own computation for alpha != 1 (`tensor = tensor * alpha`)."""

    def __init__(self, op: Any) -> None:
        self._schema = op._schema
        self._aten = op

    def __call__(self, x: torch.Tensor, dim: int, index: torch.Tensor, source: torch.Tensor,
                 alpha: Any = 1) -> torch.Tensor:
        if x.dtype == torch.bool:
            return self._aten(x, dim, index, source, alpha=alpha)
        return self._aten(x, dim, index, source * alpha)


class _FillFromTensor:
    """`fill(self, value)` of a complex tensor as `fill(self, <value as a 0-d tensor>)`: Inductor lowers a
    complex `full` only from a constant (an AssertionError for a symbolic value); `fill.Tensor` converts
    the 0-d tensor's value to self's dtype as `fill.Scalar` converts the Scalar. Other dtypes lower as
    they are."""

    def __init__(self, op: Any) -> None:
        self._schema = op._schema
        self._aten = op

    def __call__(self, x: torch.Tensor, value: Any) -> torch.Tensor:
        if not x.is_complex():
            return self._aten(x, value)
        dtype = (torch.bool if isinstance(value, (bool, torch.SymBool)) else
                 torch.float64 if isinstance(value, (float, torch.SymFloat)) else torch.int64)
        return torch.ops.aten.fill.Tensor(x, torch.scalar_tensor(value, dtype=dtype))


# op -> (the run-time scalar argument it cannot take as it is, the stand-in used when it is run-time)
_RUNTIME_SCALAR: dict[str, tuple[str, Any]] = {
    "aten::sub.Tensor": ("alpha", _SubAsAdd),
    "aten::index_add": ("alpha", _IndexAddScaled),
    "aten::fill.Scalar": ("value", _FillFromTensor),
}

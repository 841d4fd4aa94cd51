"""Shape classes: one executable for every shape a kernel's code does not depend on (docs/dispatch.md).

A signature's *class* is the signature with its tensor sizes made symbolic, except what the code of a
kernel depends on:
  1. sizes 0 and 1 stay literal (empty tensors, broadcasting: a size-1 dim is a different kernel);
  2. equal sizes share one symbol (`mm`'s inner dims, an elementwise op's operands): a shape where two
     sizes happen to become equal is another class, never a kernel that assumed them different;
  3. a size equal to an integer the op takes as a size argument (schema type `SymInt`: a `view`'s target
     sizes, `normalized_shape`, `num_weights`) stays literal: the kernel is specialised on it anyway;
  4. the sizes inside a slice's row (dims whose strides come before a stride no product of inner sizes
     explains, e.g. the head dim of `qkv[..., :64]`) stay literal: export bounds them by that stride;
  5. strides are kept as expressions of the sizes (`1`, `s1`, `96*s0`): found as torch's own stride
     inference does, innermost dim first, each stride matched against the products of the sizes and
     strides already seen, else kept as a literal; a size-1 dim's stride is `*` (never read). Memory
     format, contiguity, transposes and slices of a larger tensor are therefore part of the class;
  6. everything else (dtypes, ranks, structural arguments by value, run-time scalars by type) as in the
     exact signature.
An elementwise op whose tensors all share one dense layout gets a *flat* class before that one (the
rank-collapse rule, `flat_class`): its rank and layout do not matter to a kernel over memory positions.
The class is itself a signature (`"shapes": CLASS_VERSION`) that carries the exact signature it was made
from as its `"example"` (left out of the cache key): a compiler compiles the class from it. The resolver
tries the classes' executables first (flat, ranked) and the exact signature's last (`Resolver.candidates`);
since a signature maps to exactly one class of each kind, an executable can only ever serve shapes of the
class it was compiled and checked for.
"""

from __future__ import annotations

import functools
import json
import math
import re
from typing import Any

CLASS_VERSION = 1
ANY = "*"  # the stride of a size-1 dim: never used to address memory


def is_class(sig: dict[str, Any]) -> bool:
    return "shapes" in sig


def _is_tensor(d: Any) -> bool:
    return isinstance(d, dict) and "dtype" in d and "sizes" in d


@functools.lru_cache(maxsize=None)
def _size_args(qualname: str) -> frozenset[str]:
    """Names of the op's arguments the schema types as sizes (SymInt, SymInt[], SymInt?)."""
    from ._ops import _resolve

    try:
        op = _resolve(qualname)
    except Exception:  # noqa: BLE001 - an op we cannot look up: no size arguments known
        return frozenset()
    # The Python types of the schema say `int` for SymInt; its text keeps the distinction.
    return frozenset(re.findall(r"SymInt(?:\[\d*\])?\??\s+(\w+)", str(op._schema)))


def _ints(v: Any, out: set[int]) -> None:
    if isinstance(v, bool):
        return
    if isinstance(v, int):
        out.add(v)
    elif isinstance(v, list):
        for x in v:
            _ints(x, out)


def _ops_of(sig: dict[str, Any]) -> list[dict[str, Any]]:
    """The op signatures inside `sig`: itself, or a fused group's nodes."""
    return [n["sig"] for n in sig["graph"]] if "graph" in sig else [sig]


def _tensors(sig: dict[str, Any]) -> list[dict[str, Any]]:
    """Every tensor description of `sig`, in a fixed order (args, then a fused group's nodes')."""
    out: list[dict[str, Any]] = []
    for op in _ops_of(sig):
        for _, _, desc in op["args"]:
            for d in desc if isinstance(desc, list) else [desc]:
                if _is_tensor(d):
                    out.append(d)
    return out


def _static_sizes(sig: dict[str, Any]) -> set[int]:
    fixed: set[int] = set()
    for op in _ops_of(sig):
        names = _size_args(op["op"])
        for name, kind, desc in op["args"]:
            if kind == "value" and name in names:
                _ints(desc, fixed)
    return fixed


def _inside_gaps(values: list[int], strides: list[int]) -> set[int]:
    """Sizes of the dims inside a stride gap (a slice's row: the dims whose strides come before a stride
    that no product of inner sizes explains). They bound each other (export guards `s <= stride - 1` so
    rows cannot overlap), so they stay static; the dims outside the gap stay free."""
    fixed: set[int] = set()
    known = {1}
    inner: list[int] = []
    for i in sorted(range(len(strides)), key=lambda i: (strides[i], -i)):
        if values[i] == 1:
            continue
        if strides[i] not in known:
            fixed.update(inner)
        inner.append(values[i])
        known.add(strides[i] * values[i])
    return fixed


def _stride_exprs(sizes: list[Any], values: list[int], strides: list[int]) -> list[Any]:
    """Each stride as an expression of the (symbolic) sizes: a literal int, a product "c*sA*sB", or ANY."""
    exprs: list[Any] = [None] * len(strides)
    known: dict[int, tuple[int, tuple[str, ...]]] = {1: (1, ())}
    for i in sorted(range(len(strides)), key=lambda i: (strides[i], -i)):
        if values[i] == 1:
            exprs[i] = ANY
            continue
        st = strides[i]
        coef, syms = known.get(st, (st, ()))
        exprs[i] = _render(coef, syms)
        size = sizes[i]
        nxt = (coef * size, syms) if isinstance(size, int) else (coef, tuple(sorted(syms + (size,))))
        known.setdefault(st * values[i], nxt)
    return exprs


def _render(coef: int, syms: tuple[str, ...]) -> Any:
    if not syms:
        return coef
    return "*".join(([str(coef)] if coef != 1 else []) + list(syms))


def _evaluate(expr: Any, env: dict[str, int], fill: int) -> int:
    if isinstance(expr, int):
        return expr
    if expr == ANY:
        return fill
    value = 1
    for part in str(expr).split("*"):
        value *= int(part) if part.isdigit() else env[part]
    return value


def _copy(sig: dict[str, Any]) -> dict[str, Any]:
    """A copy sharing nothing: a fused group's nodes may share one op signature object, and
    `copy.deepcopy` would keep them shared (each would then be rewritten twice)."""
    out: dict[str, Any] = json.loads(json.dumps(sig))
    return out


def shape_class(sig: dict[str, Any]) -> dict[str, Any] | None:
    """The class signature of `sig`, or None if no size of it can be symbolic (the class would be `sig`):
    its flat class where the rank-collapse rule applies (`flat_class`), else its ranked class."""
    return flat_class(sig) or ranked_class(sig)


def classes(sig: dict[str, Any]) -> list[dict[str, Any]]:
    """Every class signature that may serve `sig`, most general first: its flat class (if any), then its
    ranked class (if any; a refused flat class falls back to it, and a runtime that had no flat classes
    left its entries under it)."""
    return [c for c in (flat_class(sig), ranked_class(sig)) if c is not None]


def ranked_class(sig: dict[str, Any]) -> dict[str, Any] | None:
    """The class of rules 1-6: ranks, layouts and size coincidences kept, the other sizes symbolic."""
    cls = _symbolic(sig)
    if cls is not None:
        cls["example"] = sig
    return cls


def _symbolic(sig: dict[str, Any]) -> dict[str, Any] | None:
    fixed = _static_sizes(sig)
    for d in _tensors(sig):
        fixed |= _inside_gaps(list(d["sizes"]), list(d["strides"]))
    symbol: dict[int, str] = {}
    cls = _copy({k: v for k, v in sig.items() if k != "example"})
    for d in _tensors(cls):
        values = list(d["sizes"])
        sizes: list[Any] = []
        for n in values:
            if n < 2 or n in fixed:
                sizes.append(n)
            else:
                sizes.append(symbol.setdefault(n, f"s{len(symbol)}"))
        d["sizes"] = sizes
        d["strides"] = _stride_exprs(sizes, values, list(d["strides"]))
    if not symbol:
        return None
    cls["shapes"] = CLASS_VERSION
    return cls


# -- the rank-collapse rule -------------------------------------------------------------------------
# A pointwise op computes each output element from the input elements at the same index, so when all its
# tensors have the same sizes and the same dense layout, the index may as well be the position in memory:
# one 1-D kernel over `numel` elements serves every rank and every such layout. Its class is the 1-D
# class of the signature with each tensor flattened (`flatten`), marked `"flat": FLAT_VERSION`; callers
# pass flat views of the inputs (`t.as_strided([numel], [1])`, over the same memory) and view each output
# back with the sizes and strides of the first input (what eager's TensorIterator gives such inputs).
FLAT_VERSION = 1

# Ops the rule serves besides the overloads torch tags `pointwise`, with the reason.
FLAT_OPS: dict[str, str] = {
    "aten::zero": "zero_'s functional variant: every element 0, whatever the shape",
    "aten::fill.Scalar": "fill_'s functional variant: every element the same run-time value",
}


@functools.lru_cache(maxsize=None)
def elementwise(qualname: str) -> bool:
    """Whether the op computes each output element from its inputs' elements at the same index only:
    `FLAT_OPS`, or an overload torch tags `pointwise` (`torch.Tag.pointwise`, 536 overloads in torch
    2.13)."""
    if qualname in FLAT_OPS:
        return True
    from ._ops import _resolve

    try:
        op = _resolve(qualname)
    except Exception:  # noqa: BLE001 - an op we cannot look up: not known to be elementwise
        return False
    import torch

    return torch.Tag.pointwise in op.tags


def _dense(sizes: list[int], strides: list[int]) -> bool:
    """Non-overlapping and dense: the elements fill `numel` consecutive positions of memory."""
    expected = 1
    for i in sorted((i for i in range(len(sizes)) if sizes[i] != 1), key=lambda i: strides[i]):
        if strides[i] != expected:
            return False
        expected *= sizes[i]
    return True


def flat_layout(sig: dict[str, Any]) -> tuple[list[int], list[int]] | None:
    """(sizes, strides) every tensor of `sig` has, if the rank-collapse rule applies to it: an elementwise
    op (`elementwise`), or a fused group of them (every node's tensors, the intermediates' included);
    tensor arguments only as single tensors (no lists), all of the same sizes and strides (no
    broadcasting), dense, at least 2 elements (0 and 1 stay static as in rule 1); a `memory_format`
    argument, if any, None or `preserve_format` (else the output's layout is not the input's). Numbers in
    tensor slots (`x * 2`) are not tensors here."""
    ops = _ops_of(sig)
    if not all(elementwise(str(op.get("op", ""))) for op in ops):
        return None
    from ._ops import OPT_TENSOR, TENSOR, TENSORS, OPT_TENSORS, VALUE

    layout: tuple[list[int], list[int]] | None = None
    for name, kind, desc in (a for op in ops for a in op["args"]):
        if kind in (TENSORS, OPT_TENSORS):
            return None
        if kind == VALUE and name == "memory_format" and desc not in (None, {"memory_format": "preserve_format"}):
            return None
        if kind in (TENSOR, OPT_TENSOR) and _is_tensor(desc):
            mine = (list(desc["sizes"]), list(desc["strides"]))
            if layout is None:
                layout = mine
            elif mine != layout:
                return None
    if layout is None or not _dense(*layout):
        return None
    return layout if math.prod(layout[0]) >= 2 else None


def flatten(sig: dict[str, Any]) -> dict[str, Any]:
    """`sig` with every tensor a 1-D contiguous tensor of its number of elements (`flat_layout` applies)."""
    out = _copy({k: v for k, v in sig.items() if k != "example"})
    for d in _tensors(out):
        d["sizes"], d["strides"] = [math.prod(d["sizes"])], [1]
    return out


def flat_class(sig: dict[str, Any]) -> dict[str, Any] | None:
    """The rank-collapsed class of `sig`, or None if the rule does not apply (`flat_layout`)."""
    if is_flat(sig) or flat_layout(sig) is None:
        return None
    cls = _symbolic(flatten(sig))
    if cls is None:
        return None
    cls["flat"] = FLAT_VERSION
    cls["example"] = sig
    return cls


def is_flat(sig: dict[str, Any]) -> bool:
    return "flat" in sig


def example(cls: dict[str, Any]) -> dict[str, Any]:
    """The exact signature a class compiles from: its example, flattened for a flat class."""
    ex: dict[str, Any] = cls["example"]
    return flatten(ex) if is_flat(cls) else ex


def symbols(cls: dict[str, Any]) -> dict[str, int]:
    """Each symbol of a class and its value in the class's example."""
    env: dict[str, int] = {}
    for c, e in zip(_tensors(cls), _tensors(example(cls))):
        for s, n in zip(c["sizes"], e["sizes"]):
            if isinstance(s, str):
                env[s] = n
    return env


def instance(cls: dict[str, Any], env: dict[str, int]) -> dict[str, Any]:
    """The exact signature of the class for symbol values `env` (a size-1 dim gets a contiguous stride);
    for a flat class, the flat (1-D) signature its kernel is called with."""
    sig = _copy({k: v for k, v in cls.items() if k not in ("shapes", "example", "flat")})
    for d in _tensors(sig):
        sizes = [env[s] if isinstance(s, str) else s for s in d["sizes"]]
        strides = [_evaluate(e, env, 1) for e in d["strides"]]
        d["sizes"], d["strides"] = sizes, strides
    return sig


def other_instance(cls: dict[str, Any]) -> dict[str, Any]:
    """A second exact signature of the class, every symbol one larger than in its example (distinct
    symbols stay distinct, none becomes 0 or 1): what a compiler's self-check runs besides the example."""
    return instance(cls, {s: n + 1 for s, n in symbols(cls).items()})


def describe(sig: dict[str, Any]) -> str:
    """The shapes of a signature's tensors, e.g. `[s0,s1,32] [32]` (for `neuron-cache ls/explain`)."""
    return " ".join("[" + ",".join(str(n) for n in d["sizes"]) + "]" for d in _tensors(sig))


def policy_allows(policy: str, sig: dict[str, Any]) -> bool:
    """Whether `TORCH_NEURONX_SHAPES=policy` compiles `sig`'s class before its exact shape."""
    if policy == "static":
        return False
    if policy == "generic":
        return True
    # auto: generic, except where a generic kernel is measurably slower (docs/dispatch.md: shape classes).
    return sig.get("op") not in STATIC_OPS


# Ops `auto` compiles per shape, with the reason (measured; docs/dispatch.md).
STATIC_OPS: dict[str, str] = {}


__all__ = ["CLASS_VERSION", "FLAT_OPS", "FLAT_VERSION", "classes", "describe", "elementwise", "example",
           "flat_class", "flat_layout", "flatten", "instance", "is_class", "is_flat", "other_instance",
           "policy_allows", "ranked_class", "shape_class", "symbols"]

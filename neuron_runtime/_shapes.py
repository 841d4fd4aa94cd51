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
The class is itself a signature (`"shapes": CLASS_VERSION`) that carries the exact signature it was made
from as its `"example"` (left out of the cache key): a compiler compiles the class from it. The resolver
tries the class's executable first and the exact signature's second (`Resolver.candidates`); since a
signature maps to exactly one class, an executable can only ever serve shapes of the class it was
compiled and checked for.
"""

from __future__ import annotations

import functools
import json
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
    """The class signature of `sig`, or None if no size of it can be symbolic (the class would be `sig`)."""
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
    cls["example"] = sig
    return cls


def symbols(cls: dict[str, Any]) -> dict[str, int]:
    """Each symbol of a class and its value in the class's example."""
    env: dict[str, int] = {}
    for c, e in zip(_tensors(cls), _tensors(cls["example"])):
        for s, n in zip(c["sizes"], e["sizes"]):
            if isinstance(s, str):
                env[s] = n
    return env


def instance(cls: dict[str, Any], env: dict[str, int]) -> dict[str, Any]:
    """The exact signature of the class for symbol values `env` (a size-1 dim gets a contiguous stride)."""
    sig = _copy({k: v for k, v in cls.items() if k not in ("shapes", "example")})
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


__all__ = ["CLASS_VERSION", "describe", "instance", "is_class", "other_instance", "policy_allows",
           "shape_class", "symbols"]

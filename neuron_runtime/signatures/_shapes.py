"""Shape classes: one executable for every shape a kernel's code does not depend on (docs/dispatch.md).

A signature's *class* is the signature with its tensor sizes made symbolic, except what the code of a
kernel depends on:
  1. sizes 0 and 1 stay literal (empty tensors, broadcasting: a size-1 dim is a different kernel);
  2. sizes share one symbol where the op needs them equal (`mm`'s inner dims, an elementwise op's aligned
     operand dims, `cat`'s other dims), found from the op's own shape rules (`_needed`): each group of
     equal sizes is split into the sets that can change together and still be a valid call of the op on
     `meta` tensors. Sizes that are merely equal (a sequence length that happens to equal the head dim)
     get symbols of their own, so such a coincidence is never another class. A fused group (its ops'
     rules interact) and an op without meta kernels keep the older rule: all equal sizes share a symbol;
  3. a size the op ties to an integer it takes as a size argument (schema type `SymInt`: a `view`'s
     target sizes, `normalized_shape`, `num_weights`) stays literal: the kernel is specialised on it
     anyway (found the same way: no set of sizes including it can change; for a fused group, any size
     equal to such an integer); so do adaptive pooling's input spatial sizes (`_INNER_STATIC`);
  4. the sizes inside a slice's row (dims whose strides come before a stride no product of inner sizes
     explains, e.g. the head dim of `qkv[..., :64]`) stay literal: export bounds them by that stride;
  5. strides are kept as expressions of the sizes (`1`, `s1`, `96*s0`): found as torch's own stride
     inference does, innermost dim first, each stride matched against the products of the sizes and
     strides already seen, else kept as a literal; a size-1 dim's stride is `*` (never read). Memory
     format, contiguity, transposes and slices of a larger tensor are therefore part of the class;
  6. everything else (dtypes, ranks, structural arguments by value, run-time scalars by type) as in the
     exact signature;
  7. a symbol ranges over sizes >= 2, or >= its minimum where the op rejects smaller ones (a 3x3 pool's
     height: `MINIMUMS`, found on `meta` tensors); the minimums are part of the class, and a signature
     maps to a class only if its sizes reach them (`admits`).
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
import itertools
import json
import math
import re
from typing import Any

from ._packed import PACKED_VERSION, dense, is_packed, pack

CLASS_VERSION = 1
ANY = "*"  # the stride of a size-1 dim: never used to address memory


def is_class(sig: dict[str, Any]) -> bool:
    return "shapes" in sig


def kind_of(sig: dict[str, Any]) -> str:
    """What a signature is: `graph` (a torch.compile graph), `fused` (a fused group), `class` (a shape
    class's generic executable) or `op` (one op, exact shapes). Decided here alone, by the op's prefix."""
    op = str(sig.get("op", ""))
    if op.startswith("graph:"):
        return "graph"
    if op.startswith("fused:"):
        return "fused"
    return "class" if is_class(sig) else "op"


def has_nodes(sig: dict[str, Any]) -> bool:
    """A signature made of op signatures (a graph or a fused group, or a class of one): see `nodes_of`."""
    return "graph" in sig


def nodes_of(sig: dict[str, Any]) -> list[dict[str, Any]]:
    """The op signatures inside `sig`: a graph's or fused group's nodes, else `sig` itself."""
    return [n["sig"] for n in sig["graph"]] if has_nodes(sig) else [sig]


def _is_tensor(d: Any) -> bool:
    return isinstance(d, dict) and "dtype" in d and "sizes" in d


@functools.lru_cache(maxsize=None)
def _size_args(qualname: str) -> frozenset[str]:
    """Names of the op's arguments the schema types as sizes (SymInt, SymInt[], SymInt?)."""
    from ._ops import resolve_op

    try:
        op = resolve_op(qualname)
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


def tensor_descs(sig: dict[str, Any]) -> list[dict[str, Any]]:
    """Every tensor description of `sig`, in a fixed order (args, then a fused group's nodes')."""
    out: list[dict[str, Any]] = []
    for op in nodes_of(sig):
        for _, _, desc in op["args"]:
            for d in desc if isinstance(desc, list) else [desc]:
                if _is_tensor(d):
                    out.append(d)
    return out


def _static_sizes(sig: dict[str, Any]) -> set[int]:
    fixed: set[int] = set()
    for op in nodes_of(sig):
        names = _size_args(op["op"])
        for name, kind, desc in op["args"]:
            if kind == "value" and name in names:
                _ints(desc, fixed)
    return fixed


def _inside_gaps(values: list[int], strides: list[int]) -> set[int]:
    """Sizes of the dims inside a stride gap (a slice's row: the dims whose strides come before a stride
    that no product of inner sizes explains). They bound each other (export guards `s <= stride - 1` so
    rows cannot overlap), so they stay static; the dims outside the gap stay free."""
    return {values[i] for i in _gap_dims(values, strides)}


def _gap_dims(values: list[int], strides: list[int]) -> set[int]:
    """The dims `_inside_gaps` names, by index."""
    fixed: set[int] = set()
    known = {1}
    inner: list[int] = []
    for i in sorted(range(len(strides)), key=lambda i: (strides[i], -i)):
        if values[i] == 1:
            continue
        if strides[i] not in known:
            fixed.update(inner)
        inner.append(i)
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
    """Every class signature that may serve `sig`, most general first: its flat class (if any), its packed
    class (if any: small row slices of any row stride, `_packed`), then its ranked class (if any; a refused flat class falls back to it, and a runtime that had no flat classes
    left its entries under it)."""
    return [c for c in (flat_class(sig), packed_class(sig), ranked_class(sig)) if c is not None]


def packed_class(sig: dict[str, Any]) -> dict[str, Any] | None:
    """The packed class of `sig` (the packed-slice rule, `_packed`: small row slices described contiguous,
    then made symbolic as any class; the packed signature itself where no size can be), or None where the
    rule does not apply."""
    if is_class(sig):
        return None
    packed = pack(sig)
    if packed is None:
        return None
    cls = _symbolic(packed) or {**packed, "shapes": CLASS_VERSION}
    cls["packed"] = PACKED_VERSION
    cls["example"] = sig
    return cls


def ranked_class(sig: dict[str, Any]) -> dict[str, Any] | None:
    """The class of rules 1-6: ranks, layouts and size coincidences kept, the other sizes symbolic, each
    symbol at least its minimum (rule 7, `MINIMUMS`)."""
    cls = _symbolic(sig)
    if cls is None:
        return None
    cls["example"] = sig
    low = _minimums(cls)
    if low:
        cls[MINIMUMS] = low
    return cls if admits(cls, sig) else None


# -- rule 7: the smallest size each symbol may take ---------------------------------------------------
# A class's symbols range over sizes >= 2 unless the class says more: `"minimums": {"s1": 3}` where the
# op rejects smaller sizes for the arguments the class keeps (a 3x3 pool's height, `topk`'s dim of k=3,
# a reflection pad's dim). Without it export refuses the class (its guard `s1 >= 3` narrows a symbol that
# was declared >= 2) and the op compiles once per shape. The minimums are part of the class's signature,
# hence its key: its executable is exported and checked for sizes >= them only, and a call maps to it
# only when its sizes are (`admits`), so a smaller shape gets another class or its exact executable.
MINIMUMS = "minimums"
_MIN_CACHE: dict[str, dict[str, int]] = {}


def _minimums(cls: dict[str, Any]) -> dict[str, int]:
    """Each symbol whose smallest size the op accepts (on `meta` tensors, the other symbols at the
    example's sizes) is above 2, with that size: found by bisection between 2 and the example's size
    (validity grows with the size for the ops this serves; an op where it does not gets a minimum export
    cannot prove, and its class is refused as before). Ops whose shape rule is broadcasting alone, fused
    groups and ops without meta kernels have none. Cached per class (the sizes abstracted: a probe costs
    0.1-0.3 ms, a new length must cost a lookup), found again for an example below a cached minimum."""
    qualname = str(cls.get("op", ""))
    if has_nodes(cls) or elementwise(qualname) or qualname.startswith("aten::_foreach_"):
        return {}
    values = symbols(cls)
    key = json.dumps({k: v for k, v in cls.items() if k != "example"}, sort_keys=True, default=str)
    found = _MIN_CACHE.get(key)  # one lookup: another thread may clear the dict meanwhile
    if found is not None and all(values[s] >= n for s, n in found.items()):
        return dict(found)
    from ._ops import resolve_op

    try:
        op = resolve_op(qualname)
    except Exception:  # noqa: BLE001 - an op we cannot look up: no minimums known
        return {}

    def accepts(sym: str, size: int) -> bool:
        return _runs_on_meta(op, cls, {**values, sym: size})

    low: dict[str, int] = {}
    if all(v <= 2 for v in values.values()) or not _runs_on_meta(op, cls, values):
        pass  # nothing to bound, or the op cannot be probed
    else:
        for sym, v in sorted(values.items()):
            if v <= 2 or accepts(sym, 2):
                continue
            lo, hi = 2, v  # rejected at lo, accepted at hi
            while hi - lo > 1:
                mid = (lo + hi) // 2
                lo, hi = (lo, mid) if accepts(sym, mid) else (mid, hi)
            low[sym] = hi
    if len(_MIN_CACHE) >= _NEEDED_CACHE_MAX:
        _MIN_CACHE.clear()
    _MIN_CACHE[key] = low
    return dict(low)


def minimums(cls: dict[str, Any]) -> dict[str, int]:
    """The smallest size of each symbol of a class: its `MINIMUMS` entry, else 2 (rule 1)."""
    low: dict[str, int] = cls.get(MINIMUMS) or {}
    return {s: max(2, low.get(s, 2)) for s in symbols(cls)}


def admits(cls: dict[str, Any], sig: dict[str, Any]) -> bool:
    """Whether the exact signature `sig` is a shape the class serves, as far as its minimums go: every
    symbol's size in `sig` at least the symbol's minimum (the rest of the mapping is `ranked_class`'s
    construction)."""
    low = cls.get(MINIMUMS)
    if not low:
        return True
    for c, e in zip(tensor_descs(cls), tensor_descs(sig)):
        for s, n in zip(c["sizes"], e["sizes"]):
            if isinstance(s, str) and n < low.get(s, 2):
                return False
    return True


def _symbolic(sig: dict[str, Any]) -> dict[str, Any] | None:
    if str(sig.get("op", "")) in _TIED_DIMS:
        # Sizes inside a slice's row stay literal by position, with every size the op ties to them: a
        # sequence length equal to the head dim of `qkv[..., :64]` is still a length (rule 4 by value
        # would keep it literal, one class per such coincidence).
        gap_dims = {(t, i) for t, d in enumerate(tensor_descs(sig))
                    for i in _gap_dims(list(d["sizes"]), list(d["strides"]))}
        every = [(t, i) for t, d in enumerate(tensor_descs(sig)) for i, n in enumerate(d["sizes"]) if n >= 2]
        return _with_symbols(sig, [g for g in _tied_groups(sig, every) or [] if not gap_dims & set(g)])
    gaps: set[int] = set()
    for d in tensor_descs(sig):
        gaps |= _inside_gaps(list(d["sizes"]), list(d["strides"]))
    # Positions (tensor, dim) that may be symbolic: sizes 0 and 1 and sizes inside a slice's row stay.
    inner = _INNER_STATIC.get(str(sig.get("op", "")), 0)
    positions = [(t, i) for t, d in enumerate(tensor_descs(sig)) for i, n in enumerate(d["sizes"])
                 if n >= 2 and n not in gaps and not (t == 0 and (inner is None or i >= len(d["sizes"]) - inner))]
    groups = _needed(sig, positions) if not has_nodes(sig) else None
    if groups is None:  # the older rule: equal sizes share a symbol; sizes equal to size arguments stay
        fixed = _static_sizes(sig)
        tensors = tensor_descs(sig)
        by_value: dict[int, list[tuple[int, int]]] = {}
        tied: dict[int, list[tuple[int, int]]] = {}
        for p in positions:
            n = tensors[p[0]]["sizes"][p[1]]
            (tied if n in fixed else by_value).setdefault(n, []).append(p)
        if kind_of(sig) == "graph":  # rule 3b: only a free size is a symbol, its size arguments with it
            by_value = {n: ps for n, ps in {**by_value, **tied}.items() if _free_in_graph(sig, n, ps)}
        groups = sorted(by_value.values())
    else:
        groups = _conv_tied(sig, groups)
    return _with_symbols(sig, groups)


def _conv_tied(sig: dict[str, Any], groups: list[list[tuple[int, int]]]) -> list[list[tuple[int, int]]]:
    """`convolution`'s channel ties its meta kernel does not check, so probing cannot find them (the
    self-check's second shape then drew them apart: "expected bias to be 1-dimensional with 3 elements,
    but got bias of size [4]"): the bias with the weight's output channels, and for a transposed one the
    input's channels with the weight's first dim. Transposed with groups > 1 (bias = `weight.size(1) *
    groups`) is left as found: no one symbol is both."""
    if sig.get("op") != "aten::convolution":
        return groups
    args = {name: desc for name, _, desc in sig["args"]}
    if not (_is_tensor(args.get("input")) and _is_tensor(args.get("weight"))):
        return groups
    transposed = bool(args.get("transposed"))
    if transposed and args.get("groups") != 1:
        return groups
    ties = [((0, 1), (1, 0))] if transposed else []
    if _is_tensor(args.get("bias")):
        ties.append(((1, 1 if transposed else 0), (2, 0)))
    tensors = tensor_descs(sig)
    for p, q in ties:
        if tensors[p[0]]["sizes"][p[1]] != tensors[q[0]]["sizes"][q[1]]:
            continue  # not a valid call: nothing to tie
        a = next((g for g in groups if p in g), None)
        b = next((g for g in groups if q in g), None)
        if a is not None and b is not None and a is not b:
            groups = sorted([g for g in groups if g is not a and g is not b] + [sorted(a + b)])
    return groups


# Ops whose kernel's code depends on the input's innermost sizes (how many stay literal, as rule 3 keeps a
# size argument): adaptive pooling's window bounds are loop bounds, and Inductor's lowering reads those
# sizes as ints (`guard_int(h_in)`), a guard AOTInductor drops, so a class generic over them was wrong at
# its second shape (the self-check refused it: one compile per shape). The batch and channels stay free.
# None: every dim of the first tensor, which rule 3 would keep but probing cannot find (the meta kernel
# does not check it): `unfold_backward`'s gradient is `input_sizes` (a SymInt[]) with the unfolded dim
# made `(input_sizes[dim] - size) // step + 1` and `size` appended, so no size of it is free.
_INNER_STATIC: dict[str, int | None] = {
    "aten::_adaptive_avg_pool2d": 2, "aten::adaptive_max_pool2d": 2,
    "aten::_adaptive_avg_pool3d": 3, "aten::adaptive_max_pool3d": 3,
    "aten::unfold_backward": None,
}


def _with_symbols(sig: dict[str, Any], groups: list[list[tuple[int, int]]]) -> dict[str, Any] | None:
    """The class of `sig` whose symbol `s{k}` stands for the sizes at the positions of `groups[k]`."""
    symbol_of = {p: f"s{k}" for k, group in enumerate(groups) for p in group}
    if not symbol_of:
        return None
    cls = _copy({k: v for k, v in sig.items() if k != "example"})
    symbol_at: dict[int, str] = {}
    for t, d in enumerate(tensor_descs(cls)):
        values = list(d["sizes"])
        sizes: list[Any] = [symbol_of.get((t, i), n) for i, n in enumerate(values)]
        symbol_at.update({n: s for n, s in zip(values, sizes) if isinstance(s, str)})
        d["sizes"] = sizes
        d["strides"] = _stride_exprs(sizes, values, list(d["strides"]))
    if kind_of(cls) == "graph":  # rule 3b: each size argument equal to a symbol's size becomes the symbol
        for op in nodes_of(cls):
            names = _size_args(op["op"])
            op["args"] = [[name, kind, _tie(desc, symbol_at) if kind == "value" and name in names else desc]
                          for name, kind, desc in op["args"]]
    cls["shapes"] = CLASS_VERSION
    return cls


# -- rule 3b: a torch.compile graph's size arguments ----------------------------------------------------
# A graph keeps the sizes it was traced with as arguments (`expand(k, [1, 2, 2, 15, 16])`,
# `_unsafe_view(k, [1, 4, 15, 16])` for a static KV cache of length 15), so rule 3 kept every size of it
# literal: Hugging Face's static cache compiled its decode graph again for each new cache length (issue
# 43). In a graph class a size argument equal to a symbol's size is that symbol (`{"sym": "s0"}`), computed
# from the inputs' sizes when the executable runs (`bind_symbols`). A graph's size is a symbol only where
# the whole graph stays a valid call with that size changed everywhere, its size arguments with it
# (`_free_in_graph`, on `meta` tensors): a hidden size that a head count times a head dim must equal stays
# literal (the older rule made it a symbol whenever no size argument held it, and export refused the
# class). Sound as every class is: a signature maps to the class only if its own sizes and arguments give
# the same class, and the self-check runs a second shape.
SYM = "sym"
_FREE_CACHE: dict[str, bool] = {}


def _tie(desc: Any, symbol_at: dict[int, str]) -> Any:
    if isinstance(desc, bool) or not isinstance(desc, (int, list)):
        return desc
    if isinstance(desc, list):
        return [_tie(x, symbol_at) for x in desc]
    return {SYM: symbol_at[desc]} if desc in symbol_at else desc


def has_symbols(desc: Any) -> bool:
    """Whether a value argument holds a class symbol (rule 3b)."""
    if isinstance(desc, list):
        return any(has_symbols(x) for x in desc)
    return isinstance(desc, dict) and SYM in desc


def graph_has_symbols(sig: dict[str, Any]) -> bool:
    """Whether a graph class has size arguments that follow its symbols (rule 3b): its executable is built
    from the class itself, the arguments bound from the inputs' sizes."""
    return any(has_symbols(desc) for node in sig["graph"] for _, kind, desc in node["sig"]["args"] if kind == "value")


def bind_symbols(desc: Any, env: dict[str, Any]) -> Any:
    """A value argument with its class symbols replaced by their sizes in `env` (ints, or SymInts while
    an executable is traced)."""
    if isinstance(desc, list):
        return [bind_symbols(x, env) for x in desc]
    if isinstance(desc, dict) and SYM in desc:
        return env[desc[SYM]]
    return desc


def _free_in_graph(sig: dict[str, Any], value: int, positions: list[tuple[int, int]]) -> bool:
    """Whether graph `sig` is still a valid call with `value` changed to another size at `positions` and
    in the size arguments equal to it: every node runs on `meta` tensors and returns the sizes its
    consumers were traced with. Cached per class structure (a new length costs a lookup)."""
    trial = _with_symbols(sig, [positions])
    if trial is None:
        return False
    key = json.dumps(trial, sort_keys=True)
    found = _FREE_CACHE.get(key)
    if found is None:
        taken: set[int] = set()
        for d in tensor_descs(sig):
            taken.update(d["sizes"])
        other = value + 1
        while other in taken:
            other += 1
        found = _graph_runs_on_meta(instance(trial, {"s0": other}))
        if len(_FREE_CACHE) >= _NEEDED_CACHE_MAX:
            _FREE_CACHE.clear()
        _FREE_CACHE[key] = found
    return found


def _graph_runs_on_meta(sig: dict[str, Any]) -> bool:
    import torch

    from ._ops import resolve_op, tensors_in
    from ._signature import meta_call

    results: list[list[Any]] = []
    for node in sig["graph"]:
        op_sig = node["sig"]
        slots = [d for _, kind, desc in op_sig["args"] for d in tensors_in(kind, desc)]
        for w, d in zip(node["in"], slots):
            if w[0] == "n":
                out = results[int(w[1])]
                k = int(w[2]) if len(w) > 2 else 0
                if k >= len(out) or not isinstance(out[k], torch.Tensor) or list(out[k].shape) != d["sizes"]:
                    return False
        try:
            res = meta_call(resolve_op(op_sig["op"]), op_sig, lambda d: (d["sizes"], d["strides"]))
        except Exception:  # noqa: BLE001 - no meta kernel, or the op rejects the sizes: not free
            return False
        results.append(list(res) if isinstance(res, (tuple, list)) else [res])
    return True


# -- rule 2: the equalities an op needs ---------------------------------------------------------------
_NEEDED_CACHE: dict[str, list[list[int]] | None] = {}
_NEEDED_CACHE_MAX = 4096
_UNKNOWN: Any = object()


def _needed(sig: dict[str, Any], positions: list[tuple[int, int]]) -> list[list[tuple[int, int]]] | None:
    """The positions grouped by the op's needs (rule 2), in first-position order; positions in no group
    stay literal (rule 3). None when the op cannot run on `meta` tensors (then the older rule applies).

    Each group of equal sizes is split by probing: a set of positions is *free* when the op still accepts
    its arguments with those sizes (and nothing else) changed to one new size. The sizes an op ties
    together form the smallest free set holding any one of them (sets of up to `_SEARCH` are tried, larger
    ones grown greedily, which at worst ties more sizes than needed: a narrower class, never a wrong one);
    what no set can free is tied to a constant. A probe is one call of the op's meta kernel (tens of microseconds); results are kept per
    structure (the signature with its sizes abstracted, and which sizes were equal), so a new sequence
    length with the same coincidences costs a dictionary lookup."""
    analytic = _broadcast_groups(sig, positions)
    if analytic is not None:
        return analytic
    # Per signature first (an op running on the host while it compiles asks on every call), then per
    # structure (a new length with the same coincidences).
    exact = json.dumps([sig, positions], sort_keys=True, default=str)
    found = _NEEDED_CACHE.get(exact, _UNKNOWN)  # one lookup: another thread may clear the dict meanwhile
    if found is not _UNKNOWN:
        return None if found is None else [[positions[k] for k in g] for g in found]  # type: ignore[union-attr]
    tensors = tensor_descs(sig)
    value = [tensors[t]["sizes"][i] for t, i in positions]
    split = _copy(sig)
    for k, (t, i) in enumerate(positions):
        tensor_descs(split)[t]["sizes"][i] = f"p{k}"
    for t, d in enumerate(tensor_descs(split)):
        d["strides"] = _stride_exprs(d["sizes"], tensors[t]["sizes"], list(tensors[t]["strides"]))
    partition = sorted(sorted(k for k, v in enumerate(value) if v == x) for x in set(value))
    ckey = json.dumps([split, partition], sort_keys=True, default=str)
    if len(_NEEDED_CACHE) >= _NEEDED_CACHE_MAX:
        _NEEDED_CACHE.clear()
    found = _NEEDED_CACHE.get(ckey, _UNKNOWN)
    if found is _UNKNOWN:
        found = _NEEDED_CACHE[ckey] = _probe_groups(split, value, partition)
    _NEEDED_CACHE[exact] = found
    if found is None:
        return None
    return [[positions[k] for k in g] for g in found]


# Ops whose meta kernel (and CPU kernel) accepts sizes the op cannot compute with, so probing finds no
# equality: their size relations, written as einsum-like letters per tensor argument (from the left; a
# mask's from the right, it broadcasts). Positions with the same letter and the same size share a symbol;
# a letter seen once is a size of its own. CPU's flash attention: q, out and grad_out [B, H, L, E], k and v
# [B, H, S, E] (one head size), logsumexp [B, H, L]. Its kernels read k and v with q's batch and heads
# whatever their sizes say, so probing found no relation, the second-shape check drew every size on its
# own and compared garbage (issue 40: the backward's class refused, one compile per sequence length).
# The head counts and the head size (`_LITERAL` letters) stay literal; a model never changes them, and a
# class generic over them was refused: over the head size it compiled and returned inf and NaN where eager
# has values at its second shape; over the heads, grouped-query attention (4 query heads over 2 KV heads,
# two symbols) got a second shape of 5 over 3, which eager computes garbage for (NaN at random), so the
# self-check refused the class now and then. Both measured on a static KV cache's prefill, whose query is
# transposed and whose key is a packed slice of the cache: one compile per cache length while refused.
_ATTENTION = {"query": "BHLE", "key": "BHSE", "value": "BHSE", "out": "BHLE", "grad_out": "BHLE",
              "logsumexp": "BHL", "attn_mask": "-LS"}
_LITERAL = frozenset("HE")
_TIED_DIMS: dict[str, dict[str, str]] = {
    "aten::_scaled_dot_product_flash_attention_for_cpu": _ATTENTION,
    "aten::_scaled_dot_product_flash_attention_for_cpu_backward": _ATTENTION,
}


def _tied_groups(sig: dict[str, Any], positions: list[tuple[int, int]]) -> list[list[tuple[int, int]]] | None:
    """Rule 2 from `_TIED_DIMS` for the ops listed there (`_symbolic`; None for others); positions of a
    `_LITERAL` letter are in no group (they stay literal)."""
    letters = _TIED_DIMS.get(str(sig.get("op", "")))
    if letters is None:
        return None
    from ._ops import OPT_TENSOR, TENSOR

    names = [name for name, kind, desc in sig["args"] if kind in (TENSOR, OPT_TENSOR) and _is_tensor(desc)]
    tensors = tensor_descs(sig)
    if len(names) != len(tensors):
        return None
    groups: dict[Any, list[tuple[int, int]]] = {}
    for t, i in positions:
        pattern, rank = letters.get(names[t], ""), len(tensors[t]["sizes"])
        k = i - (rank - len(pattern)) if pattern.startswith("-") else i  # a mask aligns from the right
        letter = pattern[k] if 0 <= k < len(pattern) and pattern[k] != "-" else None
        if letter in _LITERAL:
            continue
        key = (letter, tensors[t]["sizes"][i]) if letter is not None else (t, i)
        groups.setdefault(key, []).append((t, i))
    return sorted(groups.values())


def _broadcast_groups(sig: dict[str, Any], positions: list[tuple[int, int]]) -> list[list[tuple[int, int]]] | None:
    """Rule 2 without probing, for the ops whose shape rule is broadcasting alone: an elementwise op
    (`elementwise`) ties the dims its tensors align on (from the right); a `_foreach_` op does so per list
    element (element i of every list, with any single tensor argument). Sizes 0 and 1 are not positions
    (they broadcast, or stay literal), so every aligned pair of positions must be equal. None for others."""
    qualname = str(sig.get("op", ""))
    foreach = qualname.startswith("aten::_foreach_")
    if not foreach and not elementwise(qualname):
        return None
    from ._ops import OPT_TENSOR, OPT_TENSORS, TENSOR, TENSORS

    # Each tensor's (list element index or None, rank), in `tensor_descs` order.
    where: list[tuple[int | None, int]] = []
    for _, kind, desc in sig["args"]:
        if kind in (TENSOR, OPT_TENSOR) and _is_tensor(desc):
            where.append((None, len(desc["sizes"])))
        elif kind in (TENSORS, OPT_TENSORS):
            if not foreach:
                return None
            where.extend((i, len(d["sizes"])) for i, d in enumerate(desc) if _is_tensor(d))
    if len(where) != len(tensor_descs(sig)):
        return None
    parent = {p: p for p in positions}

    def find(p: tuple[int, int]) -> tuple[int, int]:
        while parent[p] != p:
            parent[p] = parent[parent[p]]
            p = parent[p]
        return p

    by_slot: dict[tuple[Any, int], tuple[int, int]] = {}
    singles: dict[int, tuple[int, int]] = {}
    for t, i in positions:
        element, rank = where[t]
        aligned = rank - i  # 1 = innermost
        slot_key = (element, aligned)
        if element is None:
            first = singles.setdefault(aligned, (t, i))
            parent[find((t, i))] = find(first)
        else:
            first = by_slot.setdefault(slot_key, (t, i))
            parent[find((t, i))] = find(first)
    for (element, aligned), p in by_slot.items():  # a single tensor broadcasts against every element
        if aligned in singles:
            parent[find(p)] = find(singles[aligned])
    groups: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for p in positions:
        groups.setdefault(find(p), []).append(p)
    return sorted(groups.values())


def _probe_groups(split: dict[str, Any], value: list[int], partition: list[list[int]]) -> list[list[int]] | None:
    from ._ops import resolve_op

    try:
        op = resolve_op(str(split["op"]))
    except Exception:  # noqa: BLE001 - an op we cannot look up: the older rule
        return None
    base = {f"p{k}": v for k, v in enumerate(value)}
    spare = max(value, default=1) + 1  # a size no position has: a changed size coincides with nothing

    def accepts(changed: list[int]) -> bool:
        env = dict(base)
        for k in changed:
            env[f"p{k}"] = spare + value[k]
        return _runs_on_meta(op, split, env)

    if not accepts([]):
        return None
    groups: list[list[int]] = []
    for members in partition:
        open_ = list(members)
        while open_:
            p, rest = open_[0], open_[1:]
            chosen = _smallest_free(p, rest, accepts)
            if chosen is None:  # no set of up to _SEARCH positions with p can change: grow one greedily
                chosen = [p]
                while not accepts(chosen) and rest:
                    chosen.append(rest.pop(0))
                if not accepts(chosen):
                    open_ = open_[1:]  # tied to a constant (a size argument): stays literal
                    continue
            groups.append(sorted(chosen))
            open_ = [k for k in open_ if k not in chosen]
    return sorted(groups)


_SEARCH = 4  # the largest set of equal sizes searched exhaustively for the one an op ties together


def _smallest_free(p: int, rest: list[int], accepts: Any) -> list[int] | None:
    """The smallest set of positions holding `p` (the others from `rest`) that can change together:
    exactly the sizes the op ties to p's (changing part of them, or them and others, fails or is larger)."""
    for k in range(min(_SEARCH, len(rest) + 1)):
        for others in itertools.combinations(rest, k):
            if accepts([p, *others]):
                return [p, *others]
    return None


def _runs_on_meta(op: Any, split: dict[str, Any], env: dict[str, int]) -> bool:
    """Whether the op accepts the signature's arguments with sizes `env`, as `meta` tensors."""
    from ._signature import meta_call

    def layout(d: dict[str, Any]) -> tuple[list[int], list[int]]:
        return ([env[n] if isinstance(n, str) else n for n in d["sizes"]],
                [_evaluate(e, env, 1) for e in d["strides"]])

    try:
        meta_call(op, split, layout)
    except Exception:  # noqa: BLE001 - the op rejects these sizes (or cannot run on meta at all)
        return False
    return True


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
    from ._ops import resolve_op

    try:
        op = resolve_op(qualname)
    except Exception:  # noqa: BLE001 - an op we cannot look up: not known to be elementwise
        return False
    import torch

    return torch.Tag.pointwise in op.tags


def flat_layout(sig: dict[str, Any]) -> tuple[list[int], list[int]] | None:
    """(sizes, strides) every tensor of `sig` has, if the rank-collapse rule applies to it: an elementwise
    op (`elementwise`), or a fused group of them (every node's tensors, the intermediates' included);
    tensor arguments only as single tensors (no lists), all of the same sizes and strides (no
    broadcasting), dense, at least 2 elements (0 and 1 stay static as in rule 1); a `memory_format`
    argument, if any, None or `preserve_format` (else the output's layout is not the input's). Numbers in
    tensor slots (`x * 2`) are not tensors here."""
    ops = nodes_of(sig)
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
    if layout is None or not dense(*layout):
        return None
    return layout if math.prod(layout[0]) >= 2 else None


def flatten(sig: dict[str, Any]) -> dict[str, Any]:
    """`sig` with every tensor a 1-D contiguous tensor of its number of elements (`flat_layout` applies)."""
    out = _copy({k: v for k, v in sig.items() if k != "example"})
    for d in tensor_descs(out):
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
    if is_packed(cls):  # the packed-slice rule (_packed): its slices described contiguous
        packed = pack(ex)
        assert packed is not None, "a packed class is only made where its example packs"
        return packed
    return flatten(ex) if is_flat(cls) else ex


def symbols(cls: dict[str, Any]) -> dict[str, int]:
    """Each symbol of a class and its value in the class's example."""
    env: dict[str, int] = {}
    for c, e in zip(tensor_descs(cls), tensor_descs(example(cls))):
        for s, n in zip(c["sizes"], e["sizes"]):
            if isinstance(s, str):
                env[s] = n
    return env


def instance(cls: dict[str, Any], env: dict[str, int]) -> dict[str, Any]:
    """The exact signature of the class for symbol values `env` (a size-1 dim gets a contiguous stride);
    for a flat class, the flat (1-D) signature its kernel is called with."""
    sig = _copy({k: v for k, v in cls.items() if k not in ("shapes", "example", "flat", "packed")})
    for d in tensor_descs(sig):
        sizes = [env[s] if isinstance(s, str) else s for s in d["sizes"]]
        strides = [_evaluate(e, env, 1) for e in d["strides"]]
        d["sizes"], d["strides"] = sizes, strides
    if kind_of(sig) == "graph":
        for op in nodes_of(sig):
            op["args"] = [[name, kind, bind_symbols(desc, env) if kind == "value" else desc]
                          for name, kind, desc in op["args"]]
    return sig


def other_instance(cls: dict[str, Any]) -> dict[str, Any]:
    """A second exact signature of the class, every symbol larger than in its example and no two symbols
    equal (symbols whose example sizes coincided become different sizes, none becomes 0 or 1): what a
    compiler's self-check runs besides the example, so a kernel that silently assumed two of them equal
    is caught."""
    env: dict[str, int] = {}
    used: set[int] = set()
    for s, n in sorted(symbols(cls).items(), key=lambda kv: (kv[1], kv[0])):
        v = n + 1
        while v in used:
            v += 1
        env[s] = v
        used.add(v)
    return instance(cls, env)


def describe(sig: dict[str, Any]) -> str:
    """The shapes of a signature's tensors, e.g. `[s0,s1,32] [32]` (for `neuron-cache ls/explain`)."""
    return " ".join("[" + ",".join(str(n) for n in d["sizes"]) + "]" for d in tensor_descs(sig))


def policy_allows(policy: str, sig: dict[str, Any]) -> bool:
    """Whether `TORCH_NEURONX_SHAPES=policy` compiles `sig`'s class before its exact shape."""
    if policy == "static":
        return False
    if policy == "generic":
        return True
    # auto: generic, except where a class costs more than it serves (docs/dispatch.md: shape classes).
    op = str(sig.get("op", ""))
    return op not in STATIC_OPS and not op.startswith(tuple(STATIC_PREFIXES))


# Ops `auto` compiles per shape, with the reason (measured; docs/dispatch.md).
STATIC_OPS: dict[str, str] = {}
# Op name prefixes `auto` compiles per shape, with the reason.
STATIC_PREFIXES: dict[str, str] = {
    "aten::_foreach_": "the lists hold a model's parameters, gradients and optimizer state, whose shapes do not "
                       "change between steps: a class serves no new shape, and its symbol per dim of every "
                       "tensor (88 for a 2-layer Llama's AdamW) made export and lowering 1.5-2.5x slower than "
                       "the exact shape's (aoti, issue 32)",
    "aten::_fused_": "the fused optimizers (_fused_adamw_, _fused_sgd_): the same lists as _foreach_",
}


__all__ = ["CLASS_VERSION", "FLAT_OPS", "FLAT_VERSION", "MINIMUMS", "SYM", "admits", "bind_symbols", "classes",
           "describe", "elementwise", "example", "flat_class", "flat_layout", "flatten", "graph_has_symbols",
           "has_symbols", "instance",
           "is_class", "is_flat", "minimums", "other_instance", "policy_allows", "ranked_class", "shape_class",
           "symbols"]

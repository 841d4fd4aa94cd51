"""Example inputs of the `aoti` tier: what a signature's executable takes, as tensors and 0-d scalar
tensors of the signature's exact dtypes, sizes and strides (for `torch.export`, for AOTInductor's
lowering, and with values for the self-check against eager); and the refusals decided from the
signature alone (a run-time scalar the schema cannot take symbolically, a device argument, float8).

    example_inputs   the tensors, then one 0-d tensor per run-time scalar
    wrapped_slots    the dtype each Python number in a Tensor slot is passed as
    graph_inputs     a fused group's or graph's inputs as one flat signature
    dynamic_dims     a shape class's sizes (symbol names where dynamic), in example_inputs' order
"""

from __future__ import annotations

from typing import Any

import torch

from ..signatures import (
    MINIMUMS,
    SCALAR,
    SCALARS,
    TENSOR,
    TENSOR_KINDS,
    VALUE,
    decode_dtype,
    decode_value,
    is_wrapped,
    tensors_in,
)
from ._base import CompileRefused
from ._reference import resolve

# Run-time scalar type (from the signature) -> dtype of the 0-d tensor that carries it into the executable.
# float64/int64 keep every Python float/int exact; the traced `.item()` gives the op the same Python type.
SCALAR_DTYPES = {"float": torch.float64, "int": torch.int64, "bool": torch.bool}
# A Python number in a Tensor slot (`x * 2`): its example value by type, and the dtypes its 0-d tensor may
# take (`wrapped_slots`), by name as artifacts record them.
_EXAMPLE_NUMBERS = {"float": 0.5, "int": 2, "bool": True}
WRAPPED_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16, torch.int8,
    torch.uint8, torch.bool)}


def example_inputs(signature: dict[str, Any], values: bool = False) -> tuple[list[torch.Tensor], list[str]]:
    """Tensors with the signature's exact dtype/sizes/strides, then one 0-d tensor per run-time scalar.

    With `values`, floating tensors hold random numbers (the self-check compares against eager); integer
    tensors hold zeros, which are valid indices for any op that takes indices. An op's inputs are
    uniform in [0.5, 1.5); a graph's (`graph_inputs`: its `"values"`) are centred, uniform in
    [-0.5, 0.5) and each of its own draw, as a model's weights, activations and gradients are (positive
    values through a backward graph's dozens of matmuls grow to 1e23 and cancel each other's digits),
    except those an op of the graph reads directly where only positive values are defined (`_POSITIVE`)."""
    tensors: list[torch.Tensor] = []
    scalar_types: list[str] = []
    wrapped = dict(wrapped_slots(signature))
    hints = signature.get("values") or {}
    positive = set(hints.get("positive", []))
    for name, kind, desc in signature["args"]:
        if kind in TENSOR_KINDS:
            for d in tensors_in(kind, desc):
                if is_wrapped(d):  # only ever in a Tensor slot (`signatures.build_signature`)
                    dtype = WRAPPED_DTYPES[wrapped[len(tensors)]]
                    tensors.append(torch.tensor(_EXAMPLE_NUMBERS[d["wrapped"]], dtype=dtype))
                elif hints.get("centred"):
                    k = len(tensors)
                    tensors.append(_example_tensor(d, values, centred=k not in positive, seed=k))
                else:
                    tensors.append(_example_tensor(d, values))
        elif kind in (SCALAR, SCALARS):
            types = [] if desc is None else [desc] if kind == SCALAR else list(desc)
            for t in types:
                if t not in SCALAR_DTYPES:
                    raise CompileRefused(f"{signature['op']}: argument {name} is a run-time {t} scalar; "
                                         f"executables take only float, int and bool scalars at run time")
                scalar_types.append(t)
        elif kind == VALUE:
            _check_value(signature["op"], name, decode_value(desc))
    scalars = [torch.tensor(0.5 if t == "float" else 2, dtype=SCALAR_DTYPES[t]) for t in scalar_types]
    return tensors + scalars, scalar_types


def wrapped_slots(signature: dict[str, Any]) -> list[tuple[int, str]]:
    """(position in the tensor list, dtype) of each Python number in a Tensor slot (`x * 2`).

    The executable takes it as a 0-d tensor whose dtype reproduces a wrapped number's type promotion: the
    widest input dtype of the number's category (float inputs for a float, integer inputs for an int), or
    the default dtype / int64 when there is none (an int tensor times 2.5 gives float32); a bool as bool."""
    slots: list[tuple[int, str]] = []
    position = 0
    floats: list[torch.dtype] = []
    ints: list[torch.dtype] = []
    for _, kind, desc in signature["args"]:
        for d in tensors_in(kind, desc):
            if is_wrapped(d):
                t = d["wrapped"]
                if t not in _EXAMPLE_NUMBERS:
                    raise CompileRefused(f"{signature['op']}: a {t} number in a tensor slot is not compiled")
                slots.append((position, t))
            else:
                dt = decode_dtype(d["dtype"])
                if dt.is_floating_point:
                    floats.append(dt)
                elif not dt.is_complex and dt != torch.bool:
                    ints.append(dt)
            position += 1

    if not slots:  # nothing to promote (float8 inputs cannot be: promote_types raises for them)
        return []

    def widest(dtypes: list[torch.dtype], default: torch.dtype) -> str:
        out = dtypes[0] if dtypes else default
        for dt in dtypes[1:]:
            out = torch.promote_types(out, dt)
        return str(out).removeprefix("torch.")

    # A 0-d tensor of the widest input dtype of its category never changes the result dtype, whether the
    # other inputs are dimensioned or 0-d (a wider one would: 0-d float32 + 0-d float64 is float64, while
    # 0-d float32 + 2.5 is float32).
    fdt, idt = widest(floats, torch.get_default_dtype()), widest(ints, torch.int64)
    return [(i, idt if t == "int" else "bool" if t == "bool" else fdt) for i, t in slots]


# Ops whose (named; None: every) tensor inputs are defined only for positive values, or, as a divisor,
# ill-conditioned near 0: a graph input read by one of them gets positive example values.
_POSITIVE: dict[str, tuple[str, ...] | None] = {
    **{f"aten::{op}": None for op in (
        "log", "log2", "log10", "log1p", "sqrt", "rsqrt", "reciprocal", "lgamma", "digamma", "polygamma",
        "mvlgamma", "_foreach_sqrt", "_foreach_log", "_foreach_reciprocal", "_foreach_div", "xlogy",
        "special_xlog1py", "special_entr", "logit", "acosh")},
    "aten::pow": ("self",), "aten::float_power": ("self",), "aten::div": ("other",), "aten::fmod": ("other",),
    "aten::remainder": ("other",), "aten::addcdiv": ("tensor2",), "aten::_foreach_addcdiv": ("tensor2",),
    "aten::atan2": ("other",), "aten::true_divide": ("other",), "aten::floor_divide": ("other",),
}


def graph_inputs(signature: dict[str, Any]) -> dict[str, Any]:
    """A fused group's inputs as one flat signature: its external tensors (`e0`, `e1`, ... described by
    the slot each feeds first), then every node's run-time scalars in node order; what `build_graph`'s
    executable takes. Each node's scalars are checked as a single op's are."""
    ext: dict[int, Any] = {}
    positive: set[int] = set()  # inputs an op reads where only positive values are defined
    scalars: list[list[Any]] = []
    for k, node in enumerate(signature["graph"]):
        sig = node["sig"]
        check_scalar_schema(sig["op"], resolve(sig["op"]), sig)
        # What feeds each of the node's inputs: its tensors in order, Nones left out (a compiled graph's
        # `index`: None is a dimension not indexed).
        slots = [d for _, kind, desc in sig["args"] for d in tensors_in(kind, desc)]
        if len(slots) != len(node["in"]):
            raise CompileRefused(f"{signature['op']}: node {k} ({sig['op']}) is not a fusible op")
        names = [name for name, kind, desc in sig["args"] for _ in tensors_in(kind, desc)]
        wants = _POSITIVE.get(sig["op"].split(".")[0], ())
        for w, desc, name in zip(node["in"], slots, names):
            if w[0] == "e":
                ext.setdefault(int(w[1]), desc)
                if wants is None or name in wants:
                    positive.add(int(w[1]))
        scalars += [[f"n{k}.{name}", kind, desc] for name, kind, desc in sig["args"]
                    if kind in (SCALAR, SCALARS) and desc is not None]
    if sorted(ext) != list(range(len(ext))):
        raise CompileRefused(f"{signature['op']}: external inputs {sorted(ext)} are not numbered 0..n-1")
    return {"op": signature["op"], "args": [[f"e{i}", TENSOR, ext[i]] for i in range(len(ext))] + scalars,
            "values": {"centred": True, "positive": sorted(positive)}}


def check_scalar_schema(qualname: str, op: Any, signature: dict[str, Any]) -> None:
    """Refuse run-time scalars the op's schema cannot take symbolically.

    Only `Scalar` (schema `number`) arguments accept the SymFloat/SymInt that carries a run-time value
    through export; an argument typed `float` (eps, momentum, dropout p, `_fused_adamw`'s lr) rejects it
    ("Expected a value of type 'float' ... found type 'SymFloat'"). Baking the value in would be wrong for
    the next call, since the key holds only its type: such arguments must be keyed by value to compile."""
    types = {a.name: str(a.type) for a in op._schema.arguments}
    for name, kind, desc in signature["args"]:
        if kind in (SCALAR, SCALARS) and desc is not None and "number" not in types.get(name, ""):
            raise CompileRefused(f"{qualname}: argument {name} is a `{types.get(name)}` in the schema, which "
                                 "cannot take a run-time value (only `Scalar` arguments can); it compiles once "
                                 "keyed by value")


class Symbol(str):
    """A class's symbol name with the smallest size it takes (`minimum`: 2, or the class's minimum)."""
    minimum: int = 2


def _symbol(name: str, minimum: int) -> Symbol:
    s = Symbol(name)
    s.minimum = minimum
    return s


def dynamic_dims(cls: dict[str, Any]) -> list[list[Any]]:
    """The sizes (ints, `Symbol`s) of each tensor input of a class, in `example_inputs` order."""
    low = cls.get(MINIMUMS) or {}
    out: list[list[Any]] = []
    for _, kind, desc in cls["args"]:
        out.extend([] if is_wrapped(d) else [_symbol(n, max(2, low.get(n, 2))) if isinstance(n, str) else n
                                             for n in d["sizes"]] for d in tensors_in(kind, desc))
    return out


def _example_tensor(desc: dict[str, Any], values: bool = False, centred: bool = False,
                    seed: int = 0) -> torch.Tensor:
    dtype = decode_dtype(desc["dtype"])
    if dtype.itemsize == 1 and dtype.is_floating_point:
        # Inductor's CPU backend has no float8 codegen; the host runs these exactly. (Complex tensors
        # compile: Inductor calls ATen's kernels for what it cannot generate, and the self-check compares.)
        raise CompileRefused(f"tensors of dtype {dtype} are not compiled by the aoti tier")
    sizes, strides = desc["sizes"], desc["strides"]
    # Fill the storage, then view it: an expanded input (stride 0) cannot be written through its view.
    n = 0 if 0 in sizes else 1 + sum((size - 1) * stride for size, stride in zip(sizes, strides))
    flat = torch.zeros(n, dtype=dtype)
    if values and (dtype.is_floating_point or dtype.is_complex):
        # Uniform in [0.5, 1.5): positive (log, sqrt, division stay finite), away from kinks at 0 and 1.
        # Centred (a graph's): uniform in [-0.5, 0.5).
        gen = torch.Generator().manual_seed(seed)
        real = torch.rand(n, generator=gen, dtype=torch.float32) + (-0.5 if centred else 0.5)
        flat.copy_(torch.complex(real, torch.rand(n, generator=gen) + 0.5) if dtype.is_complex else real)
    return flat.as_strided(sizes, strides)


def _check_value(qualname: str, name: str, value: Any) -> None:
    devices = value if isinstance(value, list) else [value]
    for v in devices:
        if isinstance(v, torch.device) and v.type != "cpu":
            raise CompileRefused(f"{qualname}: argument {name}={v} names a device; executables compute on host "
                                 "memory and cannot place results")

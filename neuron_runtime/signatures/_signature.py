"""Op signatures and cache keys (DESIGN §4).

Two forms of the same fact:
  * the in-process key: a tuple built by the per-op kernel on every call (cheap, hashable, never persisted);
  * the signature: canonical JSON built once per new in-process key, whose sha256 (together with the
    compiler's fingerprint) is the persistent cache key. Never Python `hash()`.

Tensors enter by dtype, sizes and strides (`tensor_meta`). Not keyed, on purpose (each leaves out
something that cannot change what an executable computes; docs/dispatch.md "What a key leaves out"):
  * the stride of a size-1 dimension, and every stride of an empty tensor: no element is ever addressed
    through them (PyTorch's own contiguity tests skip them). They enter as canonical values
    (`canonical_strides`), so a slice `ids[:, -1:]` of a buffer that grows by a column per token keys
    the same at every position;
  * storage offset: executables read through the data pointer, so an offset cannot change what they
    compute; keying it would compile one executable per slice position (KV caches, row slices).
  * grad mode and requires_grad: the kernels run below autograd, where neither changes what an aten op
    computes; keying them would only multiply compiles.
  * aliasing between inputs: executables are functional (fresh outputs; in-place ops copy back after),
    so inputs that share memory compute the same result as copies would.
Run-time scalars (arguments the schema types `Scalar`) are keyed by type; their values are fed to the
executable. Arguments typed `float` (eps, momentum, dropout p) are hyperparameters, keyed by value,
except the few that change every step (`_ops.RUNTIME_FLOATS`: the fused optimizers' learning rate).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch

from . import _ops

FORMAT_VERSION = 1

_DTYPE_NAMES = {d: str(d).removeprefix("torch.") for d in vars(torch).values() if isinstance(d, torch.dtype)}
_DTYPES = {v: k for k, v in _DTYPE_NAMES.items()}
_MEMORY_FORMATS = {
    torch.contiguous_format: "contiguous_format",
    torch.channels_last: "channels_last",
    torch.channels_last_3d: "channels_last_3d",
    torch.preserve_format: "preserve_format",
}
_LAYOUTS = {torch.strided: "strided", torch.sparse_coo: "sparse_coo", torch.sparse_csr: "sparse_csr"}
_TYPE_NAMES = {bool: "bool", int: "int", float: "float", complex: "complex", type(None): None}


class SignatureError(ValueError):
    """A value that cannot be part of a signature (the op then runs on the host)."""


def is_wrapped(desc: Any) -> bool:
    """A `tensor` argument that arrived as a Python number (its value travels in the tensor list)."""
    return isinstance(desc, dict) and "wrapped" in desc


def tensor_meta(t: torch.Tensor) -> dict[str, Any]:
    """A tensor's description in a signature: dtype, sizes, canonical strides (`canonical_strides`)."""
    sizes = list(t.shape)
    return {"dtype": _DTYPE_NAMES[t.dtype], "sizes": sizes, "strides": canonical_strides(sizes, list(t.stride()))}


def canonical_strides(sizes: list[int], strides: list[int]) -> list[int]:
    """`strides` with what cannot change a result replaced by canonical values; equal for any two layouts
    that address the same elements the same way.

    1. An empty tensor addresses nothing: its strides are the contiguous ones.
    2. A size-1 dimension is only ever indexed with 0: its stride becomes the contiguous value over the
       dimensions inside it (`stride[i+1] * size[i+1]`, 1 for the last), which is what a fresh tensor has,
       so a contiguous tensor's strides are already canonical and its signature (and key) is unchanged.
    3. Except where PyTorch's memory-format guess would change: eager's `suggest_memory_format` reads
       size-1 strides (an [N, C, 1, 1] tensor with strides [C, 1, C, C] counts as channels_last, and a
       convolution then returns channels_last). A 4-D or 5-D tensor keeps that guess: its size-1 strides
       are then the channels_last values instead, or, if neither keeps it, its own.
    """
    if 1 not in sizes and 0 not in sizes:  # the common case: nothing to replace
        return strides
    out = list(strides)
    if 0 in sizes:
        expected = 1
        for i in reversed(range(len(sizes))):
            out[i] = expected
            expected *= max(sizes[i], 1)
        return out
    for i in reversed(range(len(sizes))):
        if sizes[i] == 1:
            out[i] = out[i + 1] * sizes[i + 1] if i + 1 < len(sizes) else 1
    order = _CHANNELS_LAST_ORDER.get(len(sizes))
    if order is None or out == strides:
        return out
    guess = _strides_like_channels_last(sizes, strides, order)
    if _strides_like_channels_last(sizes, out, order) == guess:
        return out
    last = list(strides)
    inner = 1
    for d in order:  # innermost first, in channels_last's order
        if sizes[d] == 1:
            last[d] = inner
        else:
            inner = strides[d] * sizes[d]
    return last if _strides_like_channels_last(sizes, last, order) == guess else list(strides)


# Rank -> the dims from innermost to outermost of its channels_last format (c10/core/MemoryFormat.h).
_CHANNELS_LAST_ORDER = {4: (1, 3, 2, 0), 5: (1, 4, 3, 2, 0)}


def _strides_like_channels_last(sizes: list[int], strides: list[int], order: tuple[int, ...]) -> bool:
    """c10's `is_channels_last_strides_2d_s4` / `_3d_s5`, which `suggest_memory_format` asks."""
    if strides[1] == 0:
        return False
    low = 0
    for d in order:
        if sizes[d] == 0 or strides[d] < low or (d == 0 and low == strides[1]):
            return False
        low = strides[d] * sizes[d] if sizes[d] > 1 else strides[d]
    return True


def canonical_signature(sig: dict[str, Any]) -> dict[str, Any]:
    """`sig` with every exact tensor description's strides canonical (`canonical_strides`), for signatures
    that come from elsewhere (a record file written by an older runtime): the signature this runtime's
    calls of the same shapes build. Symbolic (shape-class) descriptions are left as they are."""
    def fix(d: Any) -> Any:
        if isinstance(d, list):
            return [fix(x) for x in d]
        if isinstance(d, dict) and "sizes" in d and "strides" in d:
            sizes, strides = d["sizes"], d["strides"]
            if all(type(n) is int for n in (*sizes, *strides)) and len(sizes) == len(strides):
                return {**d, "strides": canonical_strides(list(sizes), list(strides))}
        return d

    out = dict(sig)
    if isinstance(sig.get("args"), list):
        out["args"] = [[a[0], a[1], fix(a[2])] if isinstance(a, list) and len(a) == 3 else a for a in sig["args"]]
    if isinstance(sig.get("graph"), list):
        out["graph"] = [{**n, "sig": canonical_signature(n["sig"])} if isinstance(n, dict) and
                        isinstance(n.get("sig"), dict) else n for n in sig["graph"]]
    if isinstance(sig.get("example"), dict):
        out["example"] = canonical_signature(sig["example"])
    return out


def encode_value(v: Any) -> Any:
    """A structural argument as JSON that keeps its type (1, 1.0 and True stay distinct)."""
    if v is None or isinstance(v, (bool, int, str)):
        return v
    if isinstance(v, float):
        if v != v or v in (float("inf"), float("-inf")):
            return {"float": repr(v)}
        return v
    if isinstance(v, (list, tuple)):
        return [encode_value(x) for x in v]
    if isinstance(v, torch.dtype):
        return {"dtype": _DTYPE_NAMES[v]}
    if isinstance(v, torch.memory_format):
        return {"memory_format": _MEMORY_FORMATS[v]}
    if isinstance(v, torch.layout):
        return {"layout": _LAYOUTS[v]}
    if isinstance(v, torch.device):
        return {"device": str(v)}
    raise SignatureError(f"cannot key a value of type {type(v).__name__}: {v!r}")


def decode_value(v: Any) -> Any:
    if isinstance(v, list):
        return [decode_value(x) for x in v]
    if isinstance(v, dict):
        (kind, text), = v.items()
        if kind == "dtype":
            return _DTYPES[text]
        if kind == "memory_format":
            return {n: f for f, n in _MEMORY_FORMATS.items()}[text]
        if kind == "layout":
            return {n: f for f, n in _LAYOUTS.items()}[text]
        if kind == "device":
            return torch.device(text)
        if kind == "float":
            return float(text)
        raise SignatureError(f"unknown encoded value {v!r}")
    return v


def decode_dtype(name: str) -> torch.dtype:
    return _DTYPES[name]


def _scalar_type(v: Any) -> str | None:
    try:
        return _TYPE_NAMES[type(v)]
    except KeyError:
        raise SignatureError(f"unsupported scalar {v!r}") from None


def build(info: _ops.OpInfo, values: tuple[Any, ...]) -> dict[str, Any]:
    """The signature of one call: `values` are the op's arguments in schema order (CPU or neuron tensors)."""
    args: list[list[Any]] = []
    for a, v in zip(info.args, values):
        k = a.kind
        if k == _ops.TENSOR:
            # A number in a Tensor slot is a wrapped number (`x * 2`): it stays a number at run time.
            d: Any = {"wrapped": _scalar_type(v)} if type(v) in _TYPE_NAMES else tensor_meta(v)
        elif k == _ops.OPT_TENSOR:
            d = None if v is None else tensor_meta(v)
        elif k == _ops.TENSORS:
            d = [tensor_meta(t) for t in v]
        elif k == _ops.OPT_TENSORS:
            d = [None if t is None else tensor_meta(t) for t in v]
        elif k == _ops.SCALAR:
            d = _scalar_type(v)
        elif k == _ops.SCALARS:
            d = None if v is None else [_scalar_type(x) for x in v]
        elif k == _ops.VALUE:
            d = encode_value(v)
        else:
            raise SignatureError(f"{info.qualname}: argument {a.name} of kind {k} cannot be compiled")
        args.append([a.name, k, d])
    return {"op": info.qualname, "schema": str(info.op._schema), "args": args}


def canonical(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def cache_key(signature: dict[str, Any], fingerprint: dict[str, Any]) -> str:
    """sha256 of the canonical JSON of signature + compiler fingerprint + format version.

    A shape class's `example` (the exact signature it was first made from, `_shapes`) is not part of its
    key: every shape of the class finds the same entry."""
    if "example" in signature:
        signature = {k: v for k, v in signature.items() if k != "example"}
    return hashlib.sha256(canonical({"v": FORMAT_VERSION, "sig": signature, "fp": fingerprint})).hexdigest()


def meta_call(op: Any, sig: dict[str, Any], layout: Any) -> Any:
    """`op` called on `meta` tensors for `sig`'s arguments: `layout(desc)` gives a tensor description's
    (sizes, strides); run-time scalars are stand-in numbers of their type, wrapped numbers likewise.
    Returns the op's result; raises whatever the op raises (no meta kernel, or it rejects the call), and
    ValueError for an argument it cannot stand in for. Shared by the shape-class probes (`_shapes`) and
    the packed-slice rule (`_packed`)."""
    def meta(d: Any) -> Any:
        if d is None:
            return None
        if is_wrapped(d):
            return {"float": 0.5, "int": 2, "bool": True}.get(d["wrapped"], 2)
        sizes, strides = layout(d)
        return torch.empty_strided(sizes, strides, dtype=decode_dtype(d["dtype"]), device="meta")

    schema = {a.name: a for a in op._schema.arguments}
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    for name, kind, desc in sig["args"]:
        if kind in (_ops.TENSOR, _ops.OPT_TENSOR):
            v = meta(desc)
        elif kind in (_ops.TENSORS, _ops.OPT_TENSORS):
            v = [meta(d) for d in desc]
        elif kind == _ops.SCALAR:
            v = None if desc is None else (0.5 if desc == "float" else True if desc == "bool" else 2)
        elif kind == _ops.SCALARS:
            v = None if desc is None else [0.5 if t == "float" else 2 for t in desc]
        elif kind == _ops.VALUE:
            v = decode_value(desc)
        else:
            raise ValueError(f"{sig.get('op')}: argument {name} ({kind}) has no meta stand-in")
        a = schema.get(name)
        if a is None:
            raise ValueError(f"{sig.get('op')}: schema has no argument {name}")
        if a.kwarg_only:
            kwargs[name] = v
        else:
            args.append(v)
    with torch.no_grad():
        return op(*args, **kwargs)

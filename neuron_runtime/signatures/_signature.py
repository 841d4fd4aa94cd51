"""Op signatures and cache keys (DESIGN §4).

Two forms of the same fact:
  * the in-process key: a tuple built by the per-op kernel on every call (cheap, hashable, never persisted);
  * the signature: canonical JSON built once per new in-process key, whose sha256 (together with the
    compiler's fingerprint) is the persistent cache key. Never Python `hash()`.

Tensors enter by dtype, sizes and strides. Not keyed, on purpose:
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
    return {"dtype": _DTYPE_NAMES[t.dtype], "sizes": list(t.shape), "strides": list(t.stride())}


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

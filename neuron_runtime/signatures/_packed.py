"""The packed-slice rule (issue 43): one class for small row slices whatever their row stride.

A slice of a larger buffer (`ids[:, -1:]` of a `[4, T]` token buffer, a KV cache's first rows) has a row
stride that is the buffer's width. Shape classes keep such a stride literal (`_shapes` rules 4-5: no
product of sizes explains it), so a buffer that grows by a column per token made a new class, and a new
compile, every token. For a *small* slice it is cheaper to copy it than to compile for its layout: the
packed class of a signature is its ranked class with every such tensor described contiguous, marked
`"packed": PACKED_VERSION`, and its executable is handed contiguous copies of those inputs
(`compiler/_runner.packed_executable`; the reference tier's aten op reads any layout).

A signature gets a packed class only where that copy provably changes nothing the op returns:
  * a single op (not a fused group or graph) that writes none of its arguments and returns no view of one
    (a view of a copy would not alias the caller's tensor);
  * every tensor is dense (contiguous, or a permutation of it, such as the transposed query a prefill
    hands attention beside a KV cache's slice: passed as it is, and described as it is), or is a
    *packable slice*: not dense, at most `PACK_MAX_NUMEL` elements, its dims of size >= 2 in row-major
    order (strides strictly decreasing): a row-major tensor with gaps, whose contiguous copy has the same
    element order. Only the slices are copied (an input that is not dense), so the runners tell them
    apart without the signature;
  * the op's outputs on `meta` tensors have the same sizes and strides for the slices as for their
    contiguous copies (a kernel whose output layout follows its inputs' would differ: then no class).
The compiler's self-check runs the class's example as the caller passes it (the slices themselves)
besides the packed example and `other_instance`.

`PACK_MAX_NUMEL` = 4096 elements (32 KiB at 8 bytes): a copy that size takes about a microsecond, less
than one launch's dispatch; a compile takes seconds. Above it a slice keeps its literal-stride class
(rules 4-5), which compiles once per stride but then runs without a copy on every call.
"""

from __future__ import annotations

import json
import math
from typing import Any

PACKED_VERSION = 1
PACK_MAX_NUMEL = 4096


def is_packed(sig: dict[str, Any]) -> bool:
    return "packed" in sig


def _contiguous(sizes: list[int]) -> list[int]:
    out, expected = [0] * len(sizes), 1
    for i in reversed(range(len(sizes))):
        out[i] = expected
        expected *= max(sizes[i], 1)
    return out


def dense(sizes: list[int], strides: list[int]) -> bool:
    """Non-overlapping and dense: the elements fill `numel` consecutive positions of memory."""
    expected = 1
    for i in sorted((i for i in range(len(sizes)) if sizes[i] != 1), key=lambda i: strides[i]):
        if strides[i] != expected:
            return False
        expected *= sizes[i]
    return True


def _packable_slice(sizes: list[int], strides: list[int]) -> bool:
    if not all(type(n) is int for n in (*sizes, *strides)) or 0 in sizes or math.prod(sizes) > PACK_MAX_NUMEL:
        return False
    if dense(sizes, strides):
        return False
    big = [strides[i] for i in range(len(sizes)) if sizes[i] != 1]
    return all(s > 0 for s in big) and all(a > b for a, b in zip(big, big[1:]))


def _plain_op(qualname: str) -> Any:
    """The op if it writes no argument and returns no alias of one, else None."""
    from ._ops import resolve_op

    try:
        op = resolve_op(qualname)
    except Exception:  # noqa: BLE001 - an op we cannot look up: no packed class
        return None
    schema = op._schema
    if any(a.alias_info is not None for a in (*schema.arguments, *schema.returns)):
        return None
    return op


def pack(sig: dict[str, Any]) -> dict[str, Any] | None:
    """`sig` with each packable slice described contiguous, or None if the rule does not apply (see the
    module docstring: not a plain op, a tensor neither dense nor a packable slice, no slice at all,
    or the op's output layout on `meta` depends on the slices' strides)."""
    if "graph" in sig or sig.get("writes") or _plain_op(str(sig.get("op", ""))) is None:
        return None
    out = json.loads(json.dumps({k: v for k, v in sig.items() if k != "example"}))
    found = False
    for d in (d for _, _, desc in out["args"] for d in (desc if isinstance(desc, list) else [desc])
              if isinstance(d, dict) and "sizes" in d):
        sizes, strides = list(d["sizes"]), list(d["strides"])
        if _packable_slice(sizes, strides):
            d["strides"], found = _contiguous(sizes), True
        elif not all(type(n) is int for n in (*sizes, *strides)) or not dense(sizes, strides):
            return None
    if not found or _meta_layouts(sig) != _meta_layouts(out) or _meta_layouts(out) is None:
        return None
    return out


def _meta_layouts(sig: dict[str, Any]) -> list[tuple[list[int], list[int]]] | None:
    """The sizes and strides of the op's tensor outputs on `meta` tensors of `sig`'s layouts, or None if
    it does not run on meta."""
    import torch

    from ._ops import resolve_op
    from ._signature import meta_call

    try:
        res = meta_call(resolve_op(sig["op"]), sig, lambda d: (d["sizes"], d["strides"]))
    except Exception:  # noqa: BLE001 - no meta kernel, or it rejects the call: no packed class
        return None
    outs = res if isinstance(res, (tuple, list)) else [res]
    return [(list(o.shape), list(o.stride())) for o in outs if isinstance(o, torch.Tensor)]

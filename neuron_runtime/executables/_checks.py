"""What a signature that came from outside this process must be before anything acts on it.

A manifest's signatures (written by another job), a compile request (from another process) and a
recorded signature file are input, not truth (STYLE 20). `_record.check_signature` checks the shape of
one; here:

  `check_bounds(sig)`  its tensors are plausible: known dtypes, integer sizes and strides of the same rank
                       (at most `MAX_RANK`), and all of them together at most `max_example_bytes()`: a
                       compiler allocates example inputs of these sizes, so an absurd size is refused
                       before a worker tries to allocate it;
  `check_known(sig)`   its op exists in this torch and the signature names the op's own schema and
                       argument names (so a hint cannot make a worker compile, and cache a refusal for,
                       an op that does not exist);
  `check_hint(sig)`    all of the above, plus: an exact signature (a shape class is never a hint; the
                       reader derives classes itself).

Each raises `ValueError` naming what is wrong; none of them runs or compiles anything.
"""

from __future__ import annotations

import functools
import math
import os
import re
from typing import Any

from ..signatures import LIST_KINDS, SCALAR, SCALARS, TENSOR_KINDS, VALUE, is_class, nodes_of, resolve_op
from ._record import check_signature

MAX_RANK = 64
_OP_NAME = re.compile(r"aten::[a-z_][a-z0-9_]*(\.[A-Za-z0-9_]+)?")
_KINDS = TENSOR_KINDS | {SCALAR, SCALARS, VALUE}  # every argument kind a signature may name


@functools.lru_cache(maxsize=1)
def max_example_bytes() -> int:
    """Half this host's memory: the most the tensors of one signature may describe (a real call's
    tensors exist in the calling process already; a signature over this is nobody's real op here)."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")) // 2
    except (ValueError, OSError, AttributeError):
        return 1 << 34


@functools.lru_cache(maxsize=None)
def _itemsize(dtype: str) -> int:
    from ..signatures import decode_dtype

    return int(decode_dtype(dtype).itemsize)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _ops_to_check(sig: dict[str, Any]) -> list[tuple[dict[str, Any], bool]]:
    """`nodes_of(sig)`, and of a shape class's example too, each with whether its sizes may be symbols
    (a shape class's own, never an exact signature's)."""
    parts = [(sig, is_class(sig))]
    if isinstance(sig.get("example"), dict):
        parts.append((sig["example"], False))
    return [(op, symbolic) for s, symbolic in parts for op in nodes_of(s)]


def check_bounds(sig: dict[str, Any], max_bytes: int | None = None) -> dict[str, Any]:
    """`sig` (structurally checked) if its tensors are plausible and their bytes within `max_bytes`."""
    check_signature(sig)
    limit = max_example_bytes() if max_bytes is None else max_bytes
    total = 0
    for op, symbolic in _ops_to_check(sig):
        for name, kind, desc in op["args"]:
            # (not `tensors_in`: whatever claims sizes is bounded, under any kind, and a list kind's
            # non-list value too)
            for d in desc if kind in LIST_KINDS and isinstance(desc, list) else [desc]:
                if not (isinstance(d, dict) and "sizes" in d):
                    continue
                sizes, strides, dtype = d.get("sizes"), d.get("strides"), d.get("dtype")
                if not (isinstance(sizes, list) and isinstance(strides, list) and len(sizes) == len(strides)
                        and len(sizes) <= MAX_RANK):
                    raise ValueError(f"{op['op']} argument {name}: sizes and strides must be lists of one "
                                     f"rank (at most {MAX_RANK})")
                # A shape class's sizes may be symbols ("s0"); its strides expressions of them.
                if not all(_is_int(n) and 0 <= n < 1 << 62 or symbolic and isinstance(n, str) and len(n) < 64
                           for n in sizes) \
                        or not all(_is_int(s) and abs(s) < 1 << 62 or symbolic and isinstance(s, str) and len(s) < 256
                                   for s in strides):
                    raise ValueError(f"{op['op']} argument {name}: sizes and strides must be integers")
                try:
                    item = _itemsize(str(dtype))
                except (KeyError, TypeError):
                    raise ValueError(f"{op['op']} argument {name}: unknown dtype {str(dtype)[:40]!r}") from None
                total += math.prod(n for n in sizes if _is_int(n)) * item
                if total > limit:
                    raise ValueError(f"{op['op']}: its tensors would take more than {limit} bytes (the most a "
                                     "signature may describe on this host)")
    return sig


@functools.lru_cache(maxsize=4096)
def _schema(qualname: str) -> tuple[str, tuple[str, ...]] | None:
    if not _OP_NAME.fullmatch(qualname):
        return None
    try:
        op = resolve_op(qualname)
        return str(op._schema), tuple(a.name for a in op._schema.arguments)
    except Exception:  # noqa: BLE001 - an op this torch does not have
        return None


def check_known(sig: dict[str, Any]) -> dict[str, Any]:
    """`sig` (structurally checked) if every op in it is one of this torch's, named with its own schema."""
    check_signature(sig)
    for op, _ in _ops_to_check(sig):
        name = op["op"]
        known = _schema(name) if isinstance(name, str) else None
        if known is None:
            raise ValueError(f"unknown op {str(name)[:80]!r}")
        schema, names = known
        if op.get("schema") != schema:
            raise ValueError(f"{name}: the signature's schema is not this torch's")
        if tuple(a[0] for a in op["args"]) != names or any(a[1] not in _KINDS for a in op["args"]):
            raise ValueError(f"{name}: the signature's arguments are not the schema's")
    return sig


def check_hint(sig: Any, max_bytes: int | None = None) -> dict[str, Any]:
    """An exact signature that is known and bounded (`check_known`, `check_bounds`)."""
    if isinstance(sig, dict) and (is_class(sig) or "example" in sig or "flat" in sig):
        raise ValueError("a shape class, not an exact signature")
    return check_bounds(check_known(sig), max_bytes)

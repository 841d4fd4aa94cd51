"""In-place executables of the `aoti` tier (`writes_inputs`, compiler._base): the call that is traced
for an in-place signature (the functional op, its results stored into the inputs it updates), and the
executable around the compiled kernel, which runs the in-place aten op on the host whenever a written
tensor overlaps another argument (`writes_overlap`: the rule the native layer applies too)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..signatures import classify, tensors_in
from ._base import CompileRefused, Executable
from ._examples import check_scalar_schema
from ._reference import build_call, resolve
from ._standins import for_op


def in_place_call(signature: dict[str, Any]) -> tuple[Executable, list[int]]:
    """The executable `_lowering.export` traces for an in-place signature (`"writes"`: the mutated arguments): the
    op's functional variant, then each result stored into the list element it updates; and the indices,
    in the tensor inputs, of the elements it stores into."""
    qualname = signature["op"]
    functional = classify(qualname, special=False).functional
    if functional is None:
        raise CompileRefused(f"{qualname}: no functional variant to compile in place")
    fop = resolve(functional.qualname)
    fsig = {k: v for k, v in signature.items() if k != "writes"}
    fsig["op"] = functional.qualname
    check_scalar_schema(functional.qualname, fop, fsig)
    call = build_call(fsig, for_op(functional.qualname, fop, fsig) or fop, wrapped_as_tensors=True)
    # Where each written argument's tensors sit among the tensor inputs (build_call's numbering).
    at: dict[str, list[int]] = {}
    ti = 0
    for name, kind, desc in signature["args"]:
        n = len(tensors_in(kind, desc))
        at[name] = list(range(ti, ti + n))
        ti += n
    groups = [at[name] for name in signature["writes"]]
    if any(not g for g in groups):
        raise CompileRefused(f"{qualname}: a written argument holds no tensor")
    several = len(groups) > 1

    def run(T: Any, S: Any) -> list[Any]:
        res = call(T, S)
        for k, idx in enumerate(groups):
            outs = res[k] if several else res
            if len(outs) != len(idx):
                raise CompileRefused(f"{qualname}: the functional variant returns {len(outs)} results "
                                     f"for {len(idx)} written tensors")
            for i, o in zip(idx, outs):
                T[i].copy_(o)
        return []

    return run, [i for g in groups for i in g]


def _span(t: torch.Tensor) -> tuple[int, int] | None:
    """The bytes a strided tensor may touch: [first, last + 1), or None for an empty one."""
    if t.numel() == 0:
        return None
    lo = hi = 0
    for n, st in zip(t.shape, t.stride()):
        if st < 0:
            lo += (n - 1) * st
        else:
            hi += (n - 1) * st
    p, e = t.data_ptr(), t.element_size()
    return p + lo * e, p + (hi + 1) * e


def writes_overlap(tensors: Sequence[Any], written: Sequence[int]) -> bool:
    """Whether a tensor the call writes shares a byte with any other tensor argument (or one written twice:
    the same tensor twice in a list). The native layer applies the same rule (`AotiCall::overlaps`)."""
    w = set(written)
    spans = sorted((*sp, i in w) for i, t in enumerate(tensors)
                   if isinstance(t, torch.Tensor) and (sp := _span(t)) is not None)
    end_any = end_written = -1
    for a, b, is_written in spans:
        if a < end_written or (is_written and a < end_any):
            return True
        end_any = max(end_any, b)
        if is_written:
            end_written = max(end_written, b)
    return False


class InPlace:
    """An in-place kernel's executable: returns [] having written its inputs (`compiler._base`). The kernel
    was compiled for inputs that do not overlap; a call whose written tensors overlap another argument
    (`_foreach_add_(xs, xs)`, the same tensor twice in a list) is the in-place aten op on the host, which
    gives eager's answer for any aliasing."""

    __neuron_inplace__ = True

    def __init__(self, inner: Executable, written: list[int], signature: dict[str, Any]) -> None:
        self.inner = inner
        self.written = written
        self.loader = getattr(inner, "loader", None)  # keeps the .so alive with the executable
        self.host = build_call(signature, resolve(signature["op"]))

    def __call__(self, tensors: Sequence[Any], scalars: Sequence[Any]) -> list[torch.Tensor]:
        if writes_overlap(tensors, self.written):
            return list(self.host(list(tensors), scalars))
        self.inner(tensors, scalars)
        return []

"""Writes that overlap what they read judge the overlap as CPU does (issue 41): copies, index writes and
every in-place / out= op of a slice of PyTorch's OpInfo database raise exactly when CPU raises, and
otherwise leave CPU's values. The whole matrix is a script (`python -m neuron_runtime.conformance._overlap`,
docs/coverage/overlap.md); here a part of it runs on the `reference` tier."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from neuron_runtime._native import NATIVE

# Public-API writes, each evaluated with `x = arange(6.)`, `y = arange(9.).reshape(3, 3)`, `dev`; the outcome
# is `x`'s and `y`'s values, or CPU's error.
CASES = {
    "copy_ forward": "x[2:6].copy_(x[0:4])",
    "copy_ backward": "x[0:4].copy_(x[2:6])",
    "setitem slice": "x[:-1] = x[1:]",
    "copy_ transposed": "y.t().copy_(y)",
    "copy_ itself": "x.copy_(x)",
    "copy_ same elements": "x[:].copy_(x)",
    "copy_ disjoint": "x[0:3].copy_(x[3:6])",
    "copy_ strided": "x[0::2].copy_(x[1::2])",
    "copy_ into expanded from cpu": "x[:3].expand(2, 3).copy_(torch.zeros(2, 3))",
    "copy_ into a view from cpu": "x[2:5].copy_(torch.ones(3))",
    "copy_ other dtype same memory": "x.view(torch.int32).copy_(x)",
    # A negative view's copy runs the Python kernel (the native one serves plain views): the same rule.
    "copy_ forward from a negative view": "x[2:6].copy_(x[0:4]._neg_view())",
    "copy_ transposed from a negative view": "y.t().copy_(y._neg_view())",
    "copy_ itself from a negative view": "x.copy_(x._neg_view())",
    "copy_ disjoint from a negative view": "x[0:3].copy_(x[3:6]._neg_view())",
    "_foreach_copy_": "torch._foreach_copy_([x[0:4]], [x[2:6]])",
    "masked_scatter_": "x[0:4].masked_scatter_(torch.tensor([True, False, True, True], device=dev), x[2:6])",
    "masked_scatter_ itself": "x.masked_scatter_(x > 2, x)",
    "index_put_": "x[0:4].index_put_((torch.tensor([0, 1, 2, 3], device=dev),), x[2:6])",
    "setitem index": "x[torch.tensor([0, 1, 2, 3], device=dev)] = x[2:6]",
    "index_copy_ itself": "x.index_copy_(0, torch.tensor([5, 4, 3, 2, 1, 0], device=dev), x)",
    "addmm_ itself": "y.addmm_(y, y)",
}
# Cases the native layer once let through (its `_copy_from` and the in-place test that let the very same
# tensor pass) now raise there too; kept as a set so a future gap is named, not hidden.
NATIVE_GAPS: set[str] = set()


def test_overlapping_writes_raise_as_on_cpu(fresh_runtime: Any) -> None:
    """CPU's error where CPU raises (`x[2:6].copy_(x[0:4])` used to give [0, 1, 0, 1, 0, 1]), CPU's values
    otherwise, twice (the second call a hit): every case outside `NATIVE_GAPS`; those too where the native
    layer is not loaded (TORCH_NEURONX_NATIVE=0)."""
    scope = {"torch": torch}

    def outcome(code: str, dev: str) -> list[Any]:
        x = torch.arange(6.0, device=dev)
        y = torch.arange(9.0, device=dev).reshape(3, 3)
        try:
            exec(code, {**scope, "x": x, "y": y, "dev": dev})  # noqa: S102 - the test's own statements
        except RuntimeError as e:
            return ["raises", str(e)]
        return ["ok", x.cpu().tolist(), y.cpu().tolist()]

    wrong = []
    for name, code in CASES.items():
        want = outcome(code, "cpu")
        if any(outcome(code, "neuron") != want for _ in range(2)):
            wrong.append(name)
    assert set(wrong) <= (NATIVE_GAPS if NATIVE is not None else set()), wrong
    assert sum(outcome(code, "cpu")[0] == "raises" for code in CASES.values()) >= 10


# A slice of the matrix: pointwise, reductions, BLAS, indexing, scatter, sorting, random and composite
# ops, in-place and out=.
MATRIX_OPS = ["add", "addcmul", "addmm", "cumsum", "index_put", "index_copy", "masked_scatter", "scatter_add",
              "gather", "sort", "bernoulli", "softmax"]


def test_overlap_matrix_from_op_db_matches_cpu(fresh_runtime: Any) -> None:
    """Each op's first sample in every layout of `_overlap.LAYOUTS`: 0 disagreements with CPU, and enough
    cases where CPU raises that the check can fail."""
    from neuron_runtime.conformance import _overlap

    ops = _overlap.ops_with_writes(MATRIX_OPS)
    assert len(ops) == len(MATRIX_OPS)
    cases = [c for op in ops for c in _overlap.check(op, 1)]
    s = _overlap.summary(cases)
    bad = [c for c in cases if c.outcome == "disagree"]
    assert not bad, [(c.op, c.variant, c.reader, c.layout, c.detail) for c in bad]
    assert s["cases"] >= 150 and s["cpu_raises"] >= 40, s

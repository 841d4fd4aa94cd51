"""Rule 7 of shape classes (neuron_runtime/signatures/_shapes.py, `MINIMUMS`): a symbol the op bounds from
below (a 3x3 pool's height, `topk`'s dim) carries its minimum in the class, the class's key and its export;
a shape below it is not the class's. Export only (no lowering): the refusal this rule removes was export's."""

from __future__ import annotations

from typing import Any

import torch

from neuron_runtime.compiler import _examples, _lowering
from neuron_runtime.compiler._reference import build_call, resolve
from neuron_runtime.signatures import _ops, _shapes, _signature


def sig_of(qualname: str, *values: Any) -> dict[str, Any]:
    return _signature.build(_ops.classify(qualname), values)


def test_a_class_keeps_the_minimum_sizes_the_op_needs_and_admits_nothing_below() -> None:
    pool = _shapes.ranked_class(sig_of("aten::max_pool2d_with_indices", torch.randn(1, 3, 7, 9),
                                       [3, 3], [2, 2], [0, 0], [1, 1], False))
    assert pool is not None and _shapes.describe(pool) == "[1,s0,s1,s2]"
    assert pool[_shapes.MINIMUMS] == {"s1": 3, "s2": 3}  # a 3x3 window; the channels are free
    assert _shapes.minimums(pool) == {"s0": 2, "s1": 3, "s2": 3}
    # the minimum is part of the class: another kernel size is another class, another key
    wide = _shapes.ranked_class(sig_of("aten::max_pool2d_with_indices", torch.randn(1, 3, 7, 9),
                                       [5, 5], [2, 2], [0, 0], [1, 1], False))
    assert wide is not None and wide[_shapes.MINIMUMS] == {"s1": 5, "s2": 5}
    assert _signature.cache_key(pool, {}) != _signature.cache_key(wide, {})
    # a shape below a minimum is not the class's; the second shape the self-check runs is
    assert not _shapes.admits(pool, _shapes.instance(pool, {"s0": 3, "s1": 2, "s2": 9}))
    assert _shapes.admits(pool, _shapes.other_instance(pool))
    # ops with no lower bound keep classes without the entry (their keys unchanged)
    mm = _shapes.ranked_class(sig_of("aten::mm", torch.randn(3, 9), torch.randn(9, 4)))
    assert mm is not None and _shapes.MINIMUMS not in mm
    # adaptive pooling keeps its input's spatial sizes (its kernel's loop bounds), batch and channels free
    pool = _shapes.ranked_class(sig_of("aten::adaptive_max_pool2d", torch.randn(3, 4, 7, 9), [2, 3]))
    assert pool is not None and _shapes.describe(pool) == "[s0,s1,7,9]"
    # unfold_backward's gradient is fixed by its input_sizes argument: no class (rule 3)
    grad = torch.randn(3, 4, 2)  # x of [3, 9] unfolded along dim 1 by size 2, step 2
    assert _shapes.ranked_class(sig_of("aten::unfold_backward", grad, [3, 9], 1, 2, 2)) is None


def test_a_class_with_a_minimum_exports_generic() -> None:
    """`topk` with k=3: export refuses a dim declared >= 2 (its guard `s1 >= 3`); with the class's
    minimum it exports with the dim symbolic, and the program runs at the class's second shape."""
    cls = _shapes.ranked_class(sig_of("aten::topk", torch.randn(4, 9), 3, -1, True, True))
    assert cls is not None and cls[_shapes.MINIMUMS] == {"s1": 3}
    exact = _shapes.example(cls)
    run = build_call(exact, resolve("aten::topk"), wrapped_as_tensors=True)
    inputs, scalars = _examples.example_inputs(exact)
    ep = _lowering.export("aten::topk", run, len(inputs) - len(scalars), inputs, _examples.dynamic_dims(cls))
    other = _shapes.other_instance(cls)
    x = torch.randn(other["args"][0][2]["sizes"])
    values, indices = ep.module()(x)
    want = torch.topk(x, 3)
    assert torch.equal(values, want.values) and torch.equal(indices, want.indices)

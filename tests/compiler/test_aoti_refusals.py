"""Refusals the `aoti` tier no longer makes (issues 40 and 44): None outputs, a class whose plain export
pins a derived size, run-time scalars an op's lowering cannot take as they are. One batch, one C++ build."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from neuron_runtime.compiler._aoti import AotiCompiler
from neuron_runtime.signatures import _ops, _shapes, _signature

pytestmark = pytest.mark.aoti


def _sig(qualname: str, *values: Any) -> dict[str, Any]:
    return _signature.build(_ops.classify(qualname), values)


@pytest.fixture(scope="module")
def executables(aoti_compiler: AotiCompiler) -> dict[str, Any]:
    x = torch.randn(2, 5, 8)
    mean, rstd = x.mean(-1, keepdim=True), torch.rsqrt(x.var(-1, keepdim=True, unbiased=False) + 1e-5)
    sigs = {
        # the input of a LayerNorm needs no gradient: output_mask[0] is False, output 0 is None
        "ln_backward": _sig("aten::native_layer_norm_backward", torch.randn(2, 5, 8), x, [8], mean, rstd,
                            torch.randn(8), torch.randn(8), [False, True, True]),
        # a first convolution: its input needs no gradient (a library call)
        "conv_backward": _sig("aten::convolution_backward", torch.randn(2, 4, 6, 6), torch.randn(2, 3, 8, 8),
                              torch.randn(4, 3, 3, 3), [4], [1, 1], [0, 0], [1, 1], False, [0, 0], 1,
                              [False, True, True]),
        # export pins H // 2 != 1 on the plain trace (tensor metadata only): the class compiles
        "max_pool": _shapes.shape_class(_sig("aten::max_pool2d_with_indices", torch.randn(8, 8, 14, 14),
                                             [2, 2], [2, 2], [0, 0], [1, 1], False)),
        "fill_bool": _sig("aten::fill.Scalar", torch.randn(4, 3), True),  # a run-time bool
        "fill_complex": _sig("aten::fill.Scalar", torch.zeros(4, 3, dtype=torch.complex64), 2.5),
        "sub_alpha": _sig("aten::sub.Tensor", torch.randn(5, 3), torch.randn(5, 3), 1.5),  # asks alpha != 1
    }
    results = aoti_compiler.compile_many(list(sigs.values()))
    return {name: aoti_compiler.load(r.unwrap()) for name, r in zip(sigs, results)}


def test_optional_outputs_that_are_none_compile_and_come_back_none(executables: dict[str, Any]) -> None:
    x = torch.randn(2, 5, 8)  # the signature's shape, new values
    mean, rstd = x.mean(-1, keepdim=True), torch.rsqrt(x.var(-1, keepdim=True, unbiased=False) + 1e-5)
    g, w, b = torch.randn(2, 5, 8), torch.randn(8), torch.randn(8)
    got = executables["ln_backward"]([g, x, mean, rstd, w, b], [])
    want = torch.ops.aten.native_layer_norm_backward(g, x, [8], mean, rstd, w, b, [False, True, True])
    assert got[0] is None and want[0] is None
    for a, e in zip(got[1:], want[1:]):
        torch.testing.assert_close(a, e)
    go, inp, wt = torch.randn(2, 4, 6, 6), torch.randn(2, 3, 8, 8), torch.randn(4, 3, 3, 3)
    got = executables["conv_backward"]([go, inp, wt], [])
    assert got[0] is None
    want = torch.ops.aten.convolution_backward(go, inp, wt, [4], [1, 1], [0, 0], [1, 1], False, [0, 0], 1,
                                               [False, True, True])
    torch.testing.assert_close(got[1], want[1])


def test_max_pool_class_serves_every_batch_size(executables: dict[str, Any]) -> None:
    for shape in [(2, 2, 2, 2), (3, 8, 9, 7), (32, 8, 14, 14)]:  # 2x2 pools to a 1x1 output
        x = torch.randn(*shape)
        got = executables["max_pool"]([x], [])
        want = torch.ops.aten.max_pool2d_with_indices(x, [2, 2], [2, 2], [0, 0], [1, 1], False)
        for a, e in zip(got, want):
            assert torch.equal(a, e) and a.stride() == e.stride()


def test_run_time_scalars_the_lowering_cannot_take_as_they_are(executables: dict[str, Any]) -> None:
    x = torch.randn(4, 3)
    for v in (True, False):
        assert torch.equal(executables["fill_bool"]([x], [v])[0], torch.full_like(x, float(v)))
    z = torch.zeros(4, 3, dtype=torch.complex64)
    for v in (2.5, -1.0):
        assert torch.equal(executables["fill_complex"]([z], [v])[0], torch.full_like(z, v))
    a, b = torch.randn(5, 3), torch.randn(5, 3)
    for alpha in (1.0, 2.5, -3.0):
        torch.testing.assert_close(executables["sub_alpha"]([a, b], [alpha])[0], torch.sub(a, b, alpha=alpha))

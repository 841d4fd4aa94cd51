"""The self-check's verdict on graphs (`compiler._aoti._compare`, `_accuracy`, `_examples`), without a
compile: eager's float64 result of a real backward graph, rounded to float32, stands for the most exact
executable a compiler could build; it must be accepted, and an output moved by 5 % refused with a reason."""

from __future__ import annotations

import pytest
import torch

from neuron_runtime.compiler import CompileRefused
from neuron_runtime.compiler import _examples
from selfcheck_helpers import check, graph_signatures


class Block(torch.nn.Module):
    """A small Llama-like decoder: two layers of RMS norm, causal-free attention and a gated MLP."""

    def __init__(self, d: int = 64, f: int = 176) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(torch.nn.ModuleDict(
            {"qkv": torch.nn.Linear(d, 3 * d, bias=False), "o": torch.nn.Linear(d, d, bias=False),
             "gate": torch.nn.Linear(d, f, bias=False), "up": torch.nn.Linear(d, f, bias=False),
             "down": torch.nn.Linear(f, d, bias=False)}) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
            q, k, v = layer["qkv"](h).chunk(3, -1)
            x = x + layer["o"](torch.softmax(q @ k.transpose(-1, -2) / 8, -1) @ v)
            h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
            x = x + layer["down"](torch.nn.functional.silu(layer["gate"](h)) * layer["up"](h))
        return x


def test_a_backward_graph_as_exact_as_float64_is_accepted_and_a_wrong_one_refused_with_reason() -> None:
    sigs = graph_signatures(Block(), torch.randn(2, 32, 64, requires_grad=True))
    assert [s["op"] for s in sigs] == ["graph:forward", "graph:backward"]
    for sig in sigs:
        check(sig)  # never refused: no compiler can do better than float64 rounded once
    backward = sigs[1]
    # On an op's positive values the backward's outputs reach 1e15 and eager itself loses digits to
    # cancellation (rtol 1e-2 alone refused even this exact result): the float64 referee still accepts.
    check(backward, centred=False)
    with pytest.raises(CompileRefused) as e:
        check(backward, wrong=0)
    # the refusal names the output, the node that computes it and the errors it was judged by
    assert "output 0 (node" in str(e.value) and "error against float64" in str(e.value), e.value


def test_graph_example_values_are_centred_except_where_an_op_needs_them_positive() -> None:
    class Logs(torch.nn.Module):
        def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return torch.log(a) + b * 2

    sig = graph_signatures(Logs(), torch.rand(8) + 1, torch.randn(8, requires_grad=True))[0]
    flat = _examples.graph_inputs(sig)
    tensors, _ = _examples.example_inputs(flat, values=True)
    by_name = dict(zip([name for name, _, _ in flat["args"]], tensors))
    a, b = by_name["e0"], by_name["e1"]  # e0 feeds log, e1 the product
    assert a.min() >= 0.5 and b.min() < 0 < b.max(), (a, b)

"""`torch.compile(backend="neuron")` on a Hugging Face causal LM (the tiny GPT-2 config of hf_helpers,
random weights, nothing downloaded): forward and backward equal eager `neuron`, and the `aoti` tier's
self-check judges its graphs fairly (docs/compile.md: "The self-check")."""

from __future__ import annotations

import copy
import gc

import pytest
import torch

import neuron_runtime
from neuron_runtime.graphs._compile import CompiledGraph
from hf_helpers import VOCAB, tiny_model
from selfcheck_helpers import check


def test_compiled_gpt2_forward_and_backward_equal_eager_neuron() -> None:
    torch._dynamo.reset()
    eager = tiny_model(dropout=0.0).to("neuron")
    model = copy.deepcopy(eager)
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1)).to("neuron")
    want = eager(input_ids=ids, labels=ids).loss
    want.backward()
    before = neuron_runtime.stats()["graphs"]
    compiled = torch.compile(model, backend="neuron")
    got = compiled(input_ids=ids, labels=ids).loss
    got.backward()
    assert got.device.type == "neuron"
    torch.testing.assert_close(got.cpu(), want.cpu(), rtol=1e-5, atol=1e-5)
    grads = 0
    for (name, pe), pc in zip(eager.named_parameters(), model.parameters()):
        if pe.grad is not None:
            torch.testing.assert_close(pc.grad.cpu(), pe.grad.cpu(), rtol=1e-4, atol=1e-5, msg=name)
            grads += 1
    assert grads > 10
    g = neuron_runtime.stats()["graphs"]
    # a forward and a backward graph at least, every graph compiled (none run op by op)
    assert g["graph_executions"] - before["graph_executions"] >= 2, g
    assert g["graphs_refused"] == before["graphs_refused"] and g["graph_eager_runs"] == before["graph_eager_runs"], g
    # The self-check of the `aoti` tier on these graphs (no compile: eager's float64 result rounded to
    # float32 stands for the most exact executable there can be): accepted; an output moved by 5 % refused,
    # with the node and the errors it was judged by.

    sigs = [o.plan.signature for o in gc.get_objects() if type(o) is CompiledGraph and o.plan is not None
            and o.plan.n_ops]
    assert {"graph:forward", "graph:backward"} <= {s["op"] for s in sigs}
    for sig in sigs:
        check(sig)
        if sig["op"] == "graph:backward":
            with pytest.raises(Exception, match=r"output 0 \(node .* error against float64"):
                check(sig, wrong=0)
    torch._dynamo.reset()

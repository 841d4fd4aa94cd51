"""The self-check's verdict on a graph without a compile (tests/compiler/test_selfcheck.py, tests/hf)."""

from __future__ import annotations

from typing import Any

import torch
from functorch.compile import aot_module, make_boxed_func

from neuron_runtime.compiler import _accuracy, _aoti, _examples
from neuron_runtime.graphs import _graph


def graph_signatures(model: torch.nn.Module, *inputs: Any) -> list[dict[str, Any]]:
    """The forward and backward graph signatures of `model` on `inputs`, as AOTAutograd hands them to
    `torch.compile(backend="neuron")` (without Dynamo: the graphs are the same for a module without
    Python control flow, and tracing costs a fraction)."""
    sigs: list[dict[str, Any]] = []

    def grab(kind: str) -> Any:
        def compile_graph(gm: torch.fx.GraphModule, _example: Any) -> Any:
            sigs.append(_graph.signature(gm, kind).signature)
            return make_boxed_func(gm)
        return compile_graph

    compiled = aot_module(model, fw_compiler=grab("forward"), bw_compiler=grab("backward"))
    compiled(*inputs).sum().backward()
    return sigs


def check(sig: dict[str, Any], wrong: int | None = None, centred: bool = True) -> None:
    """The self-check's comparison of `sig` on its example values, with eager's float64 result (rounded
    to float32, in eager's layout) as the compiled artifact's; output `wrong` moved by 5 % of
    its largest value (+ 0.05: an output of zeros moves too). Not
    `centred`: the values an op gets (all in [0.5, 1.5), which drive a backward graph's values to 1e15)."""
    job = _aoti._Job(sig)
    _aoti._plan(job)
    flat = job.flat if centred else {k: v for k, v in job.flat.items() if k != "values"}
    inputs, scalar_types = _examples.example_inputs(flat, values=True)
    tensors = inputs[:len(inputs) - len(scalar_types)]
    scalars = [0.5 if t == "float" else 2 for t in scalar_types]
    pristine = [t.clone() for t in tensors]
    want = list(job.run(tensors, scalars)) + [tensors[i] for i in job.into]
    ref, why = _accuracy.float64_reference(lambda: _aoti._float64_run(job), pristine, scalars, job.into)
    assert ref is not None, why
    got = [w.clone() if not w.is_floating_point() else
           torch.empty_strided(w.shape, w.stride(), dtype=w.dtype).copy_(r) if w.stride() and 0 not in w.stride()
           else w.clone() for w, r in zip(want, ref)]
    if wrong is not None:
        got[wrong] = got[wrong] + 0.05 * (got[wrong].abs().max() + 1)
    _aoti._compare(job, got, want, set(), lambda: (ref, why))

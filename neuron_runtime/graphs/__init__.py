"""`torch.compile(backend="neuron")`: each captured graph is one cached executable (docs/compile.md).

    _compile.py   the Dynamo backend (AOTAutograd), a compiled graph's call, its fallback to eager
    _graph.py     a graph's signature and run plan (inputs, constants, writes, outputs)
    _split.py     a graph calling ops no executable holds (source kernels): split into compiled partitions

Sits beside `device/` above `aten/`: a graph that cannot run compiled runs op by op through the eager
kernels, and its executables come from the same resolver and cache as ops. `backend` is registered
through the `torch_dynamo_backends` entry point.
"""

from ._compile import CompiledGraph, backend, decompose
from ._split import call_between

__all__ = ["CompiledGraph", "backend", "call_between", "decompose"]

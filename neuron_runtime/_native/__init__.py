"""The native hit path (`fastpath.cpp`): built once per torch install with the host C++ compiler.

The Python kernels of `aten/` are the whole runtime; this extension serves their hit path without
entering Python (view ops, and compute ops whose executable the Python slow path already made), and
relabels host memory between `cpu` and `neuron` without a DLPack round trip. Without it (no C++ compiler,
or TORCH_NEURONX_NATIVE=0) every op runs the same Python kernels, slower.

The shared object is built with `g++` straight into a temporary file and renamed into
`$XDG_CACHE_HOME/neuron-runtime/native/<tag>/` (tag: source, torch, Python and compiler identity), so
concurrent first imports never wait on a lock a killed process left behind: each builds, the last rename
wins, every result is the same. `python -m neuron_runtime._native` builds it ahead of time.
"""

from ._build import build, enabled, load, status
from ._hostmem import NATIVE, smoke_test, to_cpu, to_neuron
from ._trace import FUSED, GRAPHS, run as trace_run

__all__ = ["FUSED", "GRAPHS", "NATIVE", "build", "enabled", "load", "smoke_test", "status", "to_cpu", "to_neuron",
           "trace_run"]

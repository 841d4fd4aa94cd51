"""Custom kernels as PyTorch operators (docs/kernels.md).

    _kernel.py    `kernel(name)`: a typed function of torch ops → `torch.ops.<ns>.<name>`, one executable
                  per call on neuron (a graph signature with the kernel's name), its VJP another
    _source.py    `kernel(name, source=CPP)`: kernel source (C++ over data, sizes, strides) compiled by the
                  tier's host compiler (a `source:` signature), checked against its reference body
    _library.py   the kernels shipped: RMSNorm, rotary embedding, SwiGLU, and `use_in_llama(model)`

Sits above `graphs/` (a kernel's executable is a `graphs.CompiledGraph`). The library's operators are
registered on first use of one of its names (`import torch` stays as fast as without it).
"""

from __future__ import annotations

from typing import Any

from ._kernel import Kernel, KernelError
from ._source import SourceKernel, kernel

__all__ = ["Kernel", "KernelError", "SourceKernel", "kernel", "rms_norm", "rotary", "swiglu", "use_in_llama"]
_LIBRARY = frozenset({"rms_norm", "rotary", "swiglu", "use_in_llama"})


def __getattr__(name: str) -> Any:
    """The library's kernels, registered on first use."""
    if name in _LIBRARY:
        from . import _library

        value = getattr(_library, name)
        globals()[name] = value  # found directly from now on
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

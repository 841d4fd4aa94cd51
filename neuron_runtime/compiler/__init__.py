"""Compiler tiers behind one interface (see `_base.Compiler`), chosen by TORCH_NEURONX_COMPILER.

    _base.py           the interface: a signature to bytes, bytes to an executable; its errors and phases
    _reference.py      the `reference` tier (the aten op on host memory); an op's call built from a signature
    _toolchain.py      host facts of the `aoti` tier: target pins, fingerprint, scratch directories
    _aoti.py           the `aoti` tier: a batch of signatures compiled, packaged, self-checked; load
    _examples.py       example inputs of a signature (exact dtypes, sizes, strides) and what they refuse
    _standins.py       what is traced in an op's place where Inductor needs another spelling of it
    _lowering.py       torch.export and AOTInductor's lowering, inside the tier's private scratch
    _units.py          an op's C++ unit: AOTInductor's generated code without its runtime
    _aoti_runtime.py   the AOTInductor runtime every op links (built once per host); a batch's g++ build
    _package.py        the artifact: a .pt2 zip written member by member, and read back
    _runner.py         what `load` returns: AOTInductor's runner called with as little Python as can be
    _inplace.py        in-place kernels: the traced call, and the host op when written tensors overlap
    _source.py         kernel source (`source:` signatures): C++ built by the host compiler, loaded by ctypes
    __main__.py        `python -m neuron_runtime.compiler`: build the shared runtime now (make install)

What the other packages use is named here.
"""

from __future__ import annotations

from .. import _config
from ._base import PHASES, CompileRefused, Compiled, Compiler, Executable, PhaseTimes
from ._toolchain import ToolchainError

__all__ = ["PHASES", "CompileRefused", "Compiled", "Compiler", "Executable", "PhaseTimes", "ToolchainError",
           "get_compiler", "make_compiler"]


def get_compiler(name: str) -> Compiler:
    if name == "reference":
        from ._reference import ReferenceCompiler

        return ReferenceCompiler()
    if name == "aoti":
        from ._aoti import AotiCompiler

        return AotiCompiler()
    raise ValueError(f"unknown compiler tier {name!r}: choose 'aoti' or 'reference' (TORCH_NEURONX_COMPILER)")


def make_compiler(cfg: _config.Config) -> Compiler:
    """The target tier's compiler, configured from `cfg` rather than the process environment."""
    if cfg.compiler == "aoti":
        from ._aoti import AotiCompiler

        return AotiCompiler(march=cfg.aoti_march, simdlen=cfg.aoti_simdlen, local_cache_dir=cfg.local_cache_dir,
                            runtime_dir=cfg.aoti_runtime_dir)
    return get_compiler(cfg.compiler)

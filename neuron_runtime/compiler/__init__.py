"""Compiler tiers behind one interface (see `_base.Compiler`), chosen by TORCH_NEURONX_COMPILER."""

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

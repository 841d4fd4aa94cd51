"""Compiler tiers behind one interface (see `_base.Compiler`), chosen by TORCH_NEURONX_COMPILER."""

from __future__ import annotations

from ._base import CompileRefused, Compiler, Executable

__all__ = ["CompileRefused", "Compiler", "Executable", "get_compiler"]


def get_compiler(name: str) -> Compiler:
    if name == "reference":
        from ._reference import ReferenceCompiler

        return ReferenceCompiler()
    if name == "aoti":
        from ._aoti import AotiCompiler

        return AotiCompiler()
    raise ValueError(f"unknown compiler tier {name!r}: choose 'aoti' or 'reference' (TORCH_NEURONX_COMPILER)")

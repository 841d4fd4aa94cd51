"""The compiler interface: a tier turns one op signature into bytes, and bytes into an executable.

Contract:
  * `compile(signature) -> bytes` is pure: the same signature and fingerprint give an equivalent artifact
    on any compatible host. It raises `CompileRefused` for an op it cannot compile (the op then runs on the
    host with a warning) and may raise anything else for a failed compile (treated the same way).
  * `load(payload) -> Executable` never compiles. The payload was verified (digest, signature) before.
  * An `Executable` is called as `exe(tensors, scalars)`: `tensors` is the flat list of tensor arguments
    in schema order (lists flattened, absent optional tensors skipped), as CPU tensors over the neuron
    memory; `scalars` the run-time scalar values in schema order (Scalar[] lists flattened). It returns
    the op's outputs as a list of fresh CPU tensors (a `Tensor[]` return is the list itself).
  * `fingerprint()` names everything that decides whether an artifact can run here; it is part of the key,
    so a host with another ISA or torch never even looks up the other host's entries.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from typing import Any

import torch

Executable = Callable[[Sequence[torch.Tensor], Sequence[Any]], Sequence[torch.Tensor]]


class CompileRefused(Exception):
    """This compiler cannot compile the op; say why in the message."""


class Compiler(abc.ABC):
    name: str = ""
    format_version: int = 1

    @abc.abstractmethod
    def fingerprint(self) -> dict[str, Any]: ...

    @abc.abstractmethod
    def compile(self, signature: dict[str, Any]) -> bytes: ...

    @abc.abstractmethod
    def load(self, payload: bytes) -> Executable: ...

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
  * In-place executables (only from a compiler whose `writes_inputs` is true, and only for signatures
    that carry `"writes"`: the names of the arguments the op mutates, all of them tensor lists or tensors
    passed positionally, e.g. `_foreach_mul_`, `_fused_adamw_`): the signature's op is the mutating op
    itself; the executable writes the results into the CPU views it is given for those arguments (they
    are the neuron tensors' own memory, so their views and aliases see the update) and returns `[]`.
    The key holds no aliasing between arguments, so an in-place executable must be correct for any
    aliasing (the reference tier's is the CPU op itself, which is); and it should check its inputs before
    it writes anything: an executable that raises makes the runtime restore what it wrote only on the
    first call of a key (the runtime snapshots the mutated tensors then), not on later calls.
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
    #: Whether `compile` accepts signatures with `"writes"` (in-place executables, see above). A tier
    #: without it gets the functional variant's signature and the runtime copies the results back.
    writes_inputs: bool = False

    @abc.abstractmethod
    def fingerprint(self) -> dict[str, Any]: ...

    @abc.abstractmethod
    def compile(self, signature: dict[str, Any]) -> bytes: ...

    @abc.abstractmethod
    def load(self, payload: bytes) -> Executable: ...

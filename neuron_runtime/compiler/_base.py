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
  * `compile_many(signatures)` compiles several signatures at once (a tier may share one compiler
    invocation between them: `aoti` compiles a batch in one C++ translation unit). One result per
    signature, in order: its bytes or its own exception (a signature that fails costs only itself), and
    the seconds of each phase spent on it (`PHASES`; a batch's shared phases split evenly).
  * `fingerprint()` names everything that decides whether an artifact can run here; it is part of the key,
    so a host with another ISA or torch never even looks up the other host's entries.
  * Kernels (`neuron_runtime.kernel`, docs/kernels.md) reach a tier as graph signatures named
    `graph:kernel:<ns>::<name>`: nothing new to compile. Kernel *source* reaches it as
    `{"op": "source:<ns>::<name>", "args": [], "language": ..., "source": <text>, "inputs": [[dtype, rank]],
    "outputs": [[dtype, rank]], "scalars": <count>}` (`_source.py`): the host tiers compile `"c++"` with
    the host compiler (`aoti` for its `-march`) into a shared object over each tensor's data pointer,
    sizes and strides, whose executable takes the inputs then the outputs (written, returns `[]`). A
    Neuron compiler would take `"language": "nki"`: compile the NKI source with `neuronx-cc` for the
    fingerprint's target (`trn2`/`trn3`) into a NEFF whose inputs and outputs are the signature's tensors
    in order (NKI traces per shape, so it would need the sizes the host ABI passes at run time: a field
    the kernel layer would add for such a tier), and refuse (`CompileRefused`) any other language.
"""

from __future__ import annotations

import abc
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

Executable = Callable[[Sequence[torch.Tensor], Sequence[Any]], Sequence[torch.Tensor]]


class CompileRefused(Exception):
    """This compiler cannot compile the op; say why in the message."""


#: The phases of a compile whose seconds a tier reports (`Compiled.phases`, `stats()`, `neuron-cache
#: stats`): tracing the op (export), Inductor's lowering to C++, the C++ compile, the link, running the
#: fresh executable against eager (self_check), and the artifact's packaging; `setup` is what a compile
#: spent building what every later compile on the host reuses (a tier's shared runtime); `compile` is the
#: whole of it for a tier that does not break it down.
PHASES = ("export", "lowering", "cxx", "link", "self_check", "packaging", "setup", "compile")


@dataclass
class Compiled:
    """One signature's result of `Compiler.compile_many`: `payload`, or the `error` it alone raised."""

    payload: bytes | None = None
    error: BaseException | None = None
    phases: dict[str, float] = field(default_factory=dict)

    def unwrap(self) -> bytes:
        if self.error is not None:
            raise self.error
        assert self.payload is not None
        return self.payload


class PhaseTimes:
    """Seconds per compile phase over many compiles (`stats()["compile_phases"]`, `neuron-cache stats`):
    per phase p50, p95, total and count. Thread-safe; keeps the last `keep` values of each phase."""

    def __init__(self, keep: int = 4096) -> None:
        import threading

        self.keep = keep
        self.values: dict[str, list[float]] = {}
        self.lock = threading.Lock()

    def add(self, phases: dict[str, Any] | None) -> None:
        if not isinstance(phases, dict):
            return
        with self.lock:
            for name, v in phases.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0:
                    vals = self.values.setdefault(str(name)[:32], [])
                    vals.append(float(v))
                    if len(vals) > self.keep:
                        del vals[: len(vals) - self.keep]

    def summary(self) -> dict[str, dict[str, float]]:
        with self.lock:
            items = {k: sorted(v) for k, v in self.values.items() if v}
        return {k: {"p50": round(v[len(v) // 2], 3), "p95": round(v[min(len(v) - 1, int(0.95 * len(v)))], 3),
                    "total": round(sum(v), 3), "n": len(v)}
                for k, v in sorted(items.items(), key=lambda kv: _phase_order(kv[0]))}


def _phase_order(name: str) -> tuple[int, str]:
    return (PHASES.index(name) if name in PHASES else len(PHASES), name)


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

    def payload_signature(self, payload: bytes) -> dict[str, Any] | None:
        """The signature an artifact records inside itself (what it was compiled for), read without
        loading it; None for a tier whose artifacts record none. An entry's header names a signature too,
        but the header is only the envelope's word: the resolver loads a payload only when its own record
        gives the entry's key (`Resolver.load_entry`), so a header cannot vouch for bytes that compute
        another op. A Neuron compiler returns what its NEFF's metadata records. Raises ValueError for a
        payload that is not one of this tier's artifacts."""
        return None

    def compile_many(self, signatures: Sequence[dict[str, Any]]) -> list[Compiled]:
        """One `Compiled` per signature (see the module docstring); this default compiles one by one."""
        out = []
        for sig in signatures:
            t0 = time.perf_counter()
            try:
                out.append(Compiled(payload=self.compile(sig), phases={"compile": time.perf_counter() - t0}))
            except Exception as e:  # noqa: BLE001 - reported per signature
                out.append(Compiled(error=e, phases={"compile": time.perf_counter() - t0}))
        return out

"""What `AotiCompiler.load` returns: AOTInductor's container runner over an artifact's `.so`, called as
`exe(tensors, scalars)` with as little Python as a call can have (`make_executable`), and a flat class's
executable around it (`flat_executable`), and a packed class's (`packed_executable`)."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Sequence
from typing import Any

import torch

from .._native import NATIVE
from ..signatures import dense
from . import _toolchain
from ._base import Executable
from ._examples import SCALAR_DTYPES, WRAPPED_DTYPES
from ._package import ARTIFACT_FORMAT, ArtifactMismatch


def load_runner(members: dict[str, bytes | memoryview], scratch: _toolchain.Scratch) -> Any:
    """AOTInductor's container runner over the artifact's .so (and its proxy-executor JSON, if any).

    Not the .pt2 package loader: that one takes a path, unzips everything into $TMPDIR and leaves the
    directory behind until the loader is freed; writing the two members out of our (uncompressed) zip
    and handing the .so to the runner costs a third of the time (~1 ms vs ~3 ms). Once dlopen()ed the
    files are never read again, so the per-load directory goes right away."""
    so = [n for n in members if n.endswith(".so")]
    if len(so) != 1:
        raise ArtifactMismatch(f"an {ARTIFACT_FORMAT} artifact holds one .so, this one {len(so)}")
    stem = so[0][: -len(".so")]
    files = {os.path.basename(n): members[n] for n in (so[0], stem + ".json") if n in members}
    work = tempfile.mkdtemp(prefix="load-", dir=scratch.load)
    try:
        for base, data in files.items():
            with open(os.path.join(work, base), "wb") as f:
                f.write(data)
        # One model instance, run by one thread at a time (`run_of`).
        return torch._C._aoti.AOTIModelContainerRunnerCpu(os.path.join(work, os.path.basename(so[0])), 1)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def run_of(loader: Any) -> Any:
    """`loader.run`, or with the native extension its replacement: every run of the container through its
    single-threaded entry under one lock, the native hit path's too (fastpath.cpp, `RunLock`). The
    container's own `run` hands its model instance around under two mutexes, a shared lock and a condition
    variable (~0.35 us a launch), and must not be mixed with the single-threaded entry."""
    native = NATIVE.aoti_runner(loader) if NATIVE is not None else None
    return loader.run if native is None else native


def make_executable(loader: Any, qualname: str, scalar_types: Sequence[str],
                    wrapped: Sequence[tuple[int, str]] = ()) -> Executable:
    """`exe(tensors, scalars)` over `run_of(loader)(list)`; generated per arity so a call is one C++ call.

    Each scalar slot keeps the 0-d tensor of the last value *object* it saw: `alpha=1` and an unchanged
    learning rate are the same Python object call after call, so the hit path allocates nothing. Numbers
    in tensor slots (`wrapped`) become 0-d tensors the same way."""
    if wrapped:
        return _with_wrapped(make_executable(loader, qualname, scalar_types), loader, wrapped)
    run = run_of(loader)
    if not scalar_types:
        def exe(tensors: Sequence[torch.Tensor], scalars: Sequence[Any]) -> list[torch.Tensor]:
            return run(tensors if isinstance(tensors, list) else list(tensors))  # type: ignore[no-any-return]
        exe.loader = loader  # type: ignore[attr-defined]  # keeps the .so alive with the function
        return exe
    dtypes = [SCALAR_DTYPES[t] for t in scalar_types]
    last: list[tuple[Any, torch.Tensor]] = [(object(), torch.empty(0)) for _ in dtypes]
    tensor = torch.tensor

    def scalar_tensor(i: int, v: Any) -> torch.Tensor:
        held = last[i]
        if held[0] is v:
            return held[1]
        t = tensor(v, dtype=dtypes[i])
        last[i] = (v, t)  # one tuple store: a racing thread sees the old or the new pair, both consistent
        return t

    if len(dtypes) == 1:
        def exe1(tensors: Sequence[torch.Tensor], scalars: Sequence[Any]) -> list[torch.Tensor]:
            return run([*tensors, scalar_tensor(0, scalars[0])])  # type: ignore[no-any-return]
        exe1.loader = loader  # type: ignore[attr-defined]
        return exe1

    def exen(tensors: Sequence[torch.Tensor], scalars: Sequence[Any]) -> list[torch.Tensor]:
        return run([*tensors, *[scalar_tensor(i, v) for i, v in enumerate(scalars)]])  # type: ignore[no-any-return]
    exen.loader = loader  # type: ignore[attr-defined]
    return exen


def _with_wrapped(inner: Executable, loader: Any, wrapped: Sequence[tuple[int, str]]) -> Executable:
    """`inner` with each Python number in a tensor slot (`wrapped`: position, dtype name) passed as a 0-d
    tensor of its dtype, kept per slot as `make_executable` keeps its scalars'."""
    slots = [(i, WRAPPED_DTYPES[d]) for i, d in wrapped]
    seen: list[tuple[Any, torch.Tensor]] = [(object(), torch.empty(0)) for _ in slots]

    def exe_wrapped(tensors: Sequence[Any], scalars: Sequence[Any]) -> list[torch.Tensor]:
        ts = list(tensors)
        for k, (i, dtype) in enumerate(slots):
            v, held = ts[i], seen[k]
            if held[0] is not v:
                held = (v, torch.tensor(v, dtype=dtype))
                seen[k] = held  # one store: a racing thread sees a consistent pair
            ts[i] = held[1]
        return inner(ts, scalars)
    exe_wrapped.loader = loader  # type: ignore[attr-defined]
    return exe_wrapped


def flat_executable(inner: Executable) -> Executable:
    """A flat class's executable (`flat_class`): its 1-D kernel on 1-D views of the inputs' memory
    (all inputs have the same sizes and dense strides, so position k of each is the same element), each
    output viewed back with the first input's sizes and strides. Inputs already 1-D pass as they are."""
    def exe_flat(tensors: Sequence[Any], scalars: Sequence[Any]) -> Sequence[torch.Tensor]:
        first = next((t for t in tensors if isinstance(t, torch.Tensor) and t.dim() != 0), None)
        if first is None or (first.dim() == 1 and first.stride(0) == 1):
            return inner(tensors, scalars)
        sizes, strides, n = first.shape, first.stride(), first.numel()
        flat = [t.as_strided((n,), (1,)) if isinstance(t, torch.Tensor) and t.dim() != 0 else t for t in tensors]
        return [o.as_strided(sizes, strides) if o is not None else o for o in inner(flat, scalars)]
    exe_flat.loader = getattr(inner, "loader", None)  # type: ignore[attr-defined]
    return exe_flat


def packed_executable(inner: Executable) -> Executable:
    """A packed class's executable (signatures' packed-slice rule): its kernel was compiled for its slices
    described contiguous, and the class serves small row slices of any row stride, so each input that is
    not dense (a slice) is handed over as a contiguous copy (at most `PACK_MAX_NUMEL` elements: cheaper
    than a compile); a dense one (contiguous, or a transposed query) is the layout the kernel was made for."""
    def exe_packed(tensors: Sequence[Any], scalars: Sequence[Any]) -> Sequence[torch.Tensor]:
        return inner([t.contiguous() if isinstance(t, torch.Tensor) and not t.is_contiguous() and
                      not dense(list(t.shape), list(t.stride())) else t for t in tensors], scalars)
    exe_packed.loader = getattr(inner, "loader", None)  # type: ignore[attr-defined]
    return exe_packed

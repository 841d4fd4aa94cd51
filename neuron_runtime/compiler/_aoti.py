"""The `aoti` tier: one AOTInductor `.pt2` package (a real `.so`) per op signature.

compile(signature), on the tier's own thread, one at a time:
  1. Build the op's call from the signature (`_reference.build_call`; foreach ops Inductor cannot lower
     become a loop over the per-tensor op). Run-time scalars become 0-d float64/int64 tensor inputs read
     with `.item()` inside the traced function, so a new learning rate or alpha is a new input value,
     never a new compile; scalars the schema types `float` (not `Scalar`) cannot be, and are refused.
  2. `torch.export` it with example inputs of the signature's exact dtypes, sizes and strides.
  3. Refuse what an executable cannot be: outputs whose shape depends on data, non-tensor outputs.
  4. AOTInductor-compile it under the pinned target (`_toolchain.pins`) in a private scratch directory.
  5. Package it as a `.pt2` zip in memory, keep only the allow-listed files (the `.so` and JSON metadata:
     no pickle, no sources), and add `extra/neuron_runtime.json` (format, fingerprint, signature).
  6. Load and run it once against eager on example values; refuse it if it cannot run or disagrees.
load(bytes):
  checks the fingerprint stored in the artifact against this host, hands the `.so` to AOTInductor's C++
  container runner (dlopen, no compiler involved) and returns a function that calls the runner's
  `run(list)` directly (not the package's `__call__`, which flattens pytrees: ~17 µs more per call).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import io
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import warnings
import zipfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .. import _config
from ..signatures import (
    OPT_TENSOR,
    OPT_TENSORS,
    SCALAR,
    SCALARS,
    TENSOR,
    TENSORS,
    VALUE,
    build_signature,
    canonical,
    class_example,
    classify,
    decode_dtype,
    decode_value,
    flat_class,
    is_class,
    is_flat,
    is_wrapped,
    other_instance,
)
from . import _aoti_runtime, _toolchain, _units
from ._base import CompileRefused, Compiled, Compiler, Executable
from ._reference import aten_executable, build_call, build_graph, resolve as _resolve

log = logging.getLogger(__name__)

ARTIFACT_FORMAT = "neuron-aoti-v2"
META_PATH = "extra/neuron_runtime.json"  # the .pt2 archive's place for extra files; the loader ignores it

# Run-time scalar type (from the signature) -> dtype of the 0-d tensor that carries it into the executable.
# float64/int64 keep every Python float/int exact; the traced `.item()` gives the op the same Python type.
_SCALAR_DTYPES = {"float": torch.float64, "int": torch.int64}

# Files an artifact may hold, by suffix: the .so, JSON metadata, and for ops AOTInductor calls through its
# proxy executor (no C shim) the JSON description of that call. An allow-list, so nothing pickled (weights saved
# with torch.save, exported programs) can ever ride along; sources are dropped because nothing loads them.
_KEEP_SUFFIXES = (".so", ".json", "archive_format", "archive_version", "byteorder", ".data/version",
                  "serialization_id")
_DROP_SUFFIXES = (".cpp", ".h")

# Ops whose outputs hold no defined values, so the self-check compares only their shape, dtype and strides.
_UNDEFINED_VALUES = {
    "aten::empty_like": "uninitialised memory",
    "aten::new_empty": "uninitialised memory",
    "aten::new_empty_strided": "uninitialised memory",
}

# Inductor's configuration and scratch paths are process globals: one compile at a time per process, on a
# thread with torch's default thread-local state (see `AotiCompiler.compile`). Made per process: a forked
# child inherits the executor but not its thread, and would wait forever on a queued compile.
_WORKER: tuple[int, concurrent.futures.ThreadPoolExecutor] | None = None
_WORKER_LOCK = threading.Lock()


def _worker() -> concurrent.futures.ThreadPoolExecutor:
    global _WORKER
    with _WORKER_LOCK:
        if _WORKER is None or _WORKER[0] != os.getpid():
            _WORKER = (os.getpid(), concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="neuron-aoti-compile"))
        return _WORKER[1]


class _LayoutMismatch(CompileRefused):
    """The compiled executable's output has eager's shape and dtype but not its strides."""


class ArtifactMismatch(RuntimeError):
    """An artifact built for another host, toolchain or format was offered to `load`; it is never loaded.

    The fingerprint is part of every cache key, so this means a corrupt or misplaced entry: treat it like
    an integrity failure (recompile), never as an op error."""


# Ops whose executable is the library call itself (what Inductor lowers them to: an extern kernel, MKL or
# oneDNN), with the reason: no trace, no C++; the executable calls the op on host memory as eager does,
# and the native hit path calls it without Python (docs/compilers.md: "Library calls").
LIBRARY_OPS: dict[str, str] = {
    "aten::mm": "Inductor calls at::mm_out (extern_kernels.mm)",
    "aten::addmm": "Inductor calls at::addmm_out (extern_kernels.addmm)",
    "aten::bmm": "Inductor calls at::bmm_out (extern_kernels.bmm)",
    "aten::baddbmm": "Inductor calls at::baddbmm_out (extern_kernels.baddbmm)",
    "aten::convolution": "Inductor calls the oneDNN convolution, around it only layout copies for a lone op",
    "aten::convolution_backward": "Inductor calls the op's own kernel (a fallback)",
}


@dataclass
class _Job:
    """One signature on its way through `_compile_many`."""

    signature: dict[str, Any]
    phases: dict[str, float] = field(default_factory=dict)
    error: BaseException | None = None
    cls: dict[str, Any] | None = None
    exact: dict[str, Any] = field(default_factory=dict)
    run: Any = None
    flat: dict[str, Any] = field(default_factory=dict)
    others: list[dict[str, Any]] = field(default_factory=list)
    into: list[int] = field(default_factory=list)
    n_tensors: int = 0
    scalar_types: list[str] = field(default_factory=list)
    library: bool = False
    restride: bool = False  # outputs copied into eager's layout (after a layout mismatch: `_export`)
    unit: _units.Unit | None = None  # the op's C++ unit, built with the batch (`_aoti_runtime`)
    raw: bytes | None = None  # or a .pt2 AOTInductor built whole (a unit the rewrite does not know)
    so: bytes | None = None
    payload: bytes = b""

    @property
    def qualname(self) -> str:
        return str(self.signature.get("op", "?"))

    def add(self, phase: str, seconds: float) -> None:
        self.phases[phase] = self.phases.get(phase, 0.0) + seconds


class AotiCompiler(Compiler):
    name = "aoti"
    # 2: an op's .so is its own unit linked with the shared runtime (or a library call); part of every
    # key, so entries of format 1 are never looked up (they are recompiled, and pruned like any other).
    format_version = 2
    # In-place executables (`writes_inputs`, compiler._base) for ops that write tensor lists (`_foreach_*_`):
    # the functional op followed by a `copy_` into each mutated input is exported, as a fused group's
    # `into`, and AOTInductor stores the results into those inputs' buffers: no fresh results, no copy
    # back. The kernel assumes its inputs do not overlap; a call whose written tensors overlap another
    # argument runs the in-place aten op on the host instead (`_InPlace`).
    writes_inputs = True

    def __init__(self, march: str | None = None, simdlen: int | None = None,
                 local_cache_dir: str | None = None, runtime_dir: str | None = None) -> None:
        """Target, scratch and shared-runtime locations default to the configuration
        (TORCH_NEURONX_AOTI_MARCH, TORCH_NEURONX_AOTI_SIMDLEN, TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR,
        TORCH_NEURONX_AOTI_RUNTIME_DIR)."""
        cfg = _config.get()
        self.runtime_dir = runtime_dir or cfg.aoti_runtime_dir or _config.default_aoti_runtime_dir()
        self.march = march or cfg.aoti_march
        self.simdlen = _toolchain.simdlen_for(self.march, simdlen if simdlen is not None else cfg.aoti_simdlen)
        self.local_cache_dir = local_cache_dir or cfg.local_cache_dir
        self._scratch: _toolchain.Scratch | None = None
        self._host: _aoti_runtime.HostRuntime | None = None

    # -- fingerprint --------------------------------------------------------------------------------
    def fingerprint(self) -> dict[str, Any]:
        return _toolchain.fingerprint(self.name, self.format_version, self.march, self.simdlen)

    def scratch(self) -> _toolchain.Scratch:
        if self._scratch is None:
            self._scratch = _toolchain.Scratch(self.local_cache_dir, self.fingerprint())
        return self._scratch

    # -- compile ------------------------------------------------------------------------------------
    def compile(self, signature: dict[str, Any]) -> bytes:
        return self.compile_many([signature])[0].unwrap()

    def compile_many(self, signatures: Sequence[dict[str, Any]]) -> list[Compiled]:
        """Compiles on the tier's own thread, one batch at a time per process (see the module docstring).

        Inductor's configuration and scratch paths are process globals, so compiles cannot overlap. The
        caller is usually inside a `neuron` kernel, under whatever thread-local state the user's code set
        (inference mode, autocast, a default device, dispatch keys excluded below autograd); a thread of
        our own exports and checks the op under torch's defaults instead."""
        return _worker().submit(self._compile_many, list(signatures)).result()

    def prepare(self) -> float:
        """Do now what the first compile of a process would pay for: build (or verify) what every compile
        on this host shares, and lower one tiny op (Inductor's first lowering in a process imports and
        initialises seconds of code). Returns the seconds it took; a compile worker calls it before it
        says it is ready, so none of it delays a signature."""
        t0 = time.perf_counter()
        _worker().submit(self._prepare).result()
        return time.perf_counter() - t0

    def _prepare(self) -> None:
        self.host_runtime().ensure()
        x = torch.zeros(4)
        warm = _Job(build_signature(classify("aten::add.Tensor"), (x, x, 1)))
        try:
            self._lower(warm)
        except Exception as e:  # noqa: BLE001 - a warm-up only: the real compile reports its own error
            log.debug("aoti: warm-up lowering failed: %s", e)

    def host_runtime(self) -> _aoti_runtime.HostRuntime:
        """The shared runtime under `runtime_dir` (per user and host, like the native layer: a new local
        tier does not build it again), or beside the scratch when that directory cannot be written and
        holds no usable build (a read-only image layer that does is used as it is)."""
        if self._host is None:
            scratch = self.scratch()
            pinned = _toolchain.pins(self.march, self.simdlen)
            host = _aoti_runtime.HostRuntime(Path(self.runtime_dir), scratch.tmp, pinned)
            if not host.usable():
                log.info("aoti: %s is not writable; the shared runtime goes to %s", self.runtime_dir, scratch.root)
                host = _aoti_runtime.HostRuntime(scratch.root, scratch.tmp, pinned)
            self._host = host
        return self._host

    def _compile_many(self, signatures: list[dict[str, Any]]) -> list[Compiled]:
        jobs = [_Job(sig) for sig in signatures]
        self._run(jobs)
        # Outputs Inductor laid out otherwise than eager: once more, writing them in eager's layout.
        again = [j for j in jobs if isinstance(j.error, _LayoutMismatch)]
        for j in again:
            log.debug("aoti: %s: %s; compiling it again with eager's output layout", j.qualname, j.error)
            j.__init__(j.signature, phases=j.phases, restride=True)  # type: ignore[misc]
        if again:
            self._run(again)
        return [Compiled(payload=j.payload if j.error is None else None, error=j.error, phases=j.phases) for j in jobs]

    def _run(self, jobs: list[_Job]) -> None:
        # 1. Per signature: trace it and lower it to C++ (or find it needs no C++: a library call).
        for job in jobs:
            try:
                self._lower(job)
            except Exception as e:  # noqa: BLE001 - costs only this signature
                job.error = e
        # 2. One C++ compile for every unit of the batch, one link per unit.
        units = [j for j in jobs if j.error is None and j.unit is not None]
        if units:
            self._build(units)
        # 3. Per signature: the artifact, then its self-check against eager.
        for job in jobs:
            if job.error is None:
                try:
                    self._finish(job)
                except Exception as e:  # noqa: BLE001 - costs only this signature
                    job.error = e

    def _lower(self, job: _Job) -> None:
        signature = job.signature
        qualname = job.qualname
        try:
            _toolchain.check_host(self.march)
        except _toolchain.ToolchainError as e:
            raise CompileRefused(f"{qualname}: {e}") from e
        # A shape class (`_shapes`) compiles from its example, the exact signature it was made from, with
        # its symbolic sizes as dynamic dims; the self-check then runs a second shape of the class too.
        # A flat class (the rank-collapse rule) compiles a 1-D kernel from its flattened example, and its
        # executable views the inputs flat and the outputs back (`_flat_executable`).
        cls = job.cls = signature if is_class(signature) else None
        exact = job.exact = class_example(cls) if cls is not None else signature
        job.into = [int(i) for _, i in exact.get("into", [])]  # inputs a fused group writes in place
        if "graph" in exact:  # a fused group (neuron_runtime.aten._fusion) or a torch.compile graph
            job.run = build_graph(exact, wrapped_as_tensors=True,
                                  choose=lambda sig, op: _per_element(sig["op"], op, sig) or _VIEWS.get(sig["op"], op))
            job.flat = graph_inputs(exact)
            job.others = [graph_inputs(other_instance(cls))] if cls is not None else []
            dynamic = _dynamic_dims(graph_inputs(cls)) if cls is not None else None
        elif exact.get("writes"):  # in place: the functional op, its results stored into the inputs
            job.run, job.into = _in_place_call(exact)
            job.flat = exact
            job.others = [other_instance(cls)] if cls is not None else []
            dynamic = _dynamic_dims(cls) if cls is not None else None
        else:
            op = _resolve(qualname)
            _check_scalar_schema(qualname, op, exact)
            job.run = build_call(exact, _per_element(qualname, op, exact) or op, wrapped_as_tensors=True)
            job.flat = exact
            job.others = [other_instance(cls)] if cls is not None else []
            dynamic = _dynamic_dims(cls) if cls is not None else None
            if qualname in LIBRARY_OPS:
                # The op is one library call: its executable is that call (no C++ of its own).
                job.library = True
                inputs, job.scalar_types = _example_inputs(exact)
                job.n_tensors = len(inputs) - len(job.scalar_types)
                return
        inputs, job.scalar_types = _example_inputs(job.flat)
        job.n_tensors = len(inputs) - len(job.scalar_types)
        scratch = self.scratch()
        # Inductor's deprecation and future warnings are about Inductor, not the user's program.
        with _redirected(scratch), warnings.catch_warnings(record=True) as caught:
            t0 = time.perf_counter()
            ep = _export(qualname, job.run, job.n_tensors, inputs, dynamic, restride=job.restride)
            _check_outputs(qualname, ep)
            t1 = time.perf_counter()
            job.add("export", t1 - t0)
            # A fresh build directory, not Inductor's cache, which would keep every .so forever.
            build = tempfile.mkdtemp(prefix="build-", dir=scratch.build)
            try:
                job.unit, job.raw, classic_s = _aot_lower(qualname, ep, inputs,
                                                          _toolchain.pins(self.march, self.simdlen), build)
            finally:
                shutil.rmtree(build, ignore_errors=True)
            job.add("lowering", time.perf_counter() - t1 - classic_s)
            if classic_s:
                job.add("cxx", classic_s)
        for w in caught:
            log.debug("aoti: while compiling %s: %s", qualname, w.message)

    def _build(self, jobs: list[_Job]) -> None:
        """One translation unit for the batch's units; each job gets its .so or its own error."""
        host = self.host_runtime()
        setup_before = host.setup_seconds
        work = Path(tempfile.mkdtemp(prefix="units-", dir=self.scratch().build))
        try:
            try:
                results = host.build([j.unit for j in jobs if j.unit is not None], work)
            except _aoti_runtime.BuildError as e:  # the shared runtime itself cannot be built here
                for j in jobs:
                    j.error = CompileRefused(f"{j.qualname}: {e}")
                return
        finally:
            shutil.rmtree(work, ignore_errors=True)
        share = host.last_compile_s / len(jobs)
        for k, (job, res) in enumerate(zip(jobs, results)):
            job.add("cxx", share)
            job.add("link", host.last_link_s[k])
            if isinstance(res, bytes):
                job.so = res
            else:
                job.error = CompileRefused(f"{job.qualname}: C++ build failed ({res})")
        if host.setup_seconds > setup_before:
            jobs[0].add("setup", host.setup_seconds - setup_before)

    def _finish(self, job: _Job) -> None:
        """Package the artifact and check it against eager (every shape the self-check knows)."""
        t0 = time.perf_counter()
        meta: dict[str, Any] = {"format": ARTIFACT_FORMAT, "fingerprint": self.fingerprint(),
                                "signature": job.signature, "n_tensors": job.n_tensors,
                                "scalar_types": job.scalar_types, "wrapped": wrapped_slots(job.flat)}
        if job.exact.get("writes"):
            meta["writes_at"] = job.into  # the tensor inputs the kernel stores into (`_InPlace`)
        if job.library:
            meta["kind"] = "library"
            payload = _package(job.qualname, None, meta)
        elif job.so is not None:
            payload = _package(job.qualname, job.so, meta)
        else:
            assert job.raw is not None
            payload = _repackage(job.qualname, job.raw, meta, str(self.scratch().tmp))
        t1 = time.perf_counter()
        job.add("packaging", t1 - t0)
        others = list(job.others)
        if job.cls is not None and is_flat(job.cls):
            # the shape it was made from: the flat views and the views back
            others.append(graph_inputs(job.cls["example"]) if "graph" in job.exact else job.cls["example"])
        for shape in [job.flat, *others]:
            self._self_check(job.qualname, payload, job.run, job.n_tensors, job.scalar_types, shape, job.into)
        job.add("self_check", time.perf_counter() - t1)
        job.payload = payload
        log.info("aoti: compiled %s (%s, %d bytes)", job.qualname,
                 ", ".join(f"{k} {v:.2f}s" for k, v in job.phases.items()), len(payload))

    def _self_check(self, qualname: str, payload: bytes, run: Executable, n_tensors: int,
                    scalar_types: list[str], signature: dict[str, Any], into: Sequence[int] = ()) -> None:
        """Load the fresh artifact and run it once against eager on example values (a few ms).

        Catches what compiles but cannot run (AOTInductor's proxy executor rejects symbolic scalars only
        at load) or returns other shapes, dtypes or strides than the op, before anything is cached."""
        inputs, _ = _example_inputs(signature, values=True)
        tensors, scalars = inputs[:n_tensors], [0.5 if t == "float" else 2 for t in scalar_types]
        for i, _dtype in wrapped_slots(signature):
            tensors[i] = tensors[i].item()  # the dispatcher passes these as Python numbers
        # A fused group writing results into its inputs (`into`): each side runs on its own copies, and
        # what it wrote is compared as its other outputs are.
        mine = [t.clone() if i in into else t for i, t in enumerate(tensors)]
        try:
            exe = self.load(payload)
        except Exception as e:  # noqa: BLE001 - an artifact that cannot load is refused, never cached
            raise CompileRefused(f"{qualname}: compiled artifact fails to load ({type(e).__name__}: "
                                 f"{str(e).strip()[:300]})") from e
        try:
            want = run(tensors, scalars)
            want = list(want) + [tensors[i] for i in into]
        except Exception:  # noqa: BLE001 - eager rejects the example values (a matrix that is not
            # positive-definite for cholesky, pivots for lu_unpack, a class's other shape whose sizes break
            # the op's own checks): nothing to compare with, and the artifact is not run on values the op
            # refuses (its library calls would print their refusal)
            log.debug("aoti: eager reference of %s rejects the example values; values not compared", qualname)
            return
        try:
            got = exe(mine, scalars)
            got = list(got) + [mine[i] for i in into]
        except Exception as e:  # noqa: BLE001 - an artifact that cannot run is refused, never cached
            raise CompileRefused(f"{qualname}: compiled artifact fails to run ({type(e).__name__}: "
                                 f"{str(e).strip()[:300]})") from e
        if len(got) != len(want):
            raise CompileRefused(f"{qualname}: compiled artifact returns {len(got)} outputs, the op {len(want)}")
        held = {t.untyped_storage().data_ptr() for t in mine if isinstance(t, torch.Tensor)}
        for i, (g, w) in enumerate(zip(got, want)):
            # A compiled graph (torch.compile) may return views of its inputs (a transposed weight saved
            # for backward): its caller relabels them over the same memory, as the view would be.
            if i < len(got) - len(into) and g.numel() and g.untyped_storage().data_ptr() in held and \
                    not qualname.startswith("graph:"):
                raise CompileRefused(f"{qualname}: compiled artifact returns an input's memory as output {i}")
            # Strides of size-1 dimensions are arbitrary; every other stride is the op's layout contract.
            # An empty output has no layout to honour.
            strides_differ = g.numel() > 0 and any(n > 1 and a != b
                                                   for n, a, b in zip(g.shape, g.stride(), w.stride()))
            if (g.shape, g.dtype) != (w.shape, w.dtype) or strides_differ:
                cls = _LayoutMismatch if (g.shape, g.dtype) == (w.shape, w.dtype) else CompileRefused
                raise cls(f"{qualname}: output {i} is {list(g.shape)}/{g.stride()}/{g.dtype}, eager "
                                     f"gives {list(w.shape)}/{w.stride()}/{w.dtype}")
            if qualname in _UNDEFINED_VALUES:
                continue
            inexact = g.is_floating_point() or g.is_complex()
            if inexact and not torch.allclose(g.to(torch.complex128 if g.is_complex() else torch.float64),
                                              w.to(torch.complex128 if w.is_complex() else torch.float64),
                                              rtol=1e-2, atol=1e-2, equal_nan=True) or \
                    not inexact and not torch.equal(g, w):
                raise CompileRefused(f"{qualname}: output {i} differs from eager on example values")

    # -- load ---------------------------------------------------------------------------------------
    def load(self, payload: bytes) -> Executable:
        meta, members = _read(payload)
        if meta.get("format") != ARTIFACT_FORMAT:
            raise ArtifactMismatch(f"not an {ARTIFACT_FORMAT} artifact (format {meta.get('format')!r})")
        theirs, ours = meta.get("fingerprint"), self.fingerprint()
        if theirs != ours:
            diff = sorted(k for k in set(ours) | set(theirs or {}) if (theirs or {}).get(k) != ours.get(k))
            raise ArtifactMismatch(f"{meta.get('signature', {}).get('op', '?')}: artifact was built for another "
                                   f"host or toolchain (differs in {', '.join(diff)}); refusing to load it")
        try:
            # The fingerprint names the target, not this CPU: a host below the fleet baseline would SIGILL.
            _toolchain.check_host(self.march)
        except _toolchain.ToolchainError as e:
            raise ArtifactMismatch(f"{meta['signature']['op']}: {e}") from e
        if meta.get("kind") == "library":
            return aten_executable(meta["signature"])
        loader = _load_package(members, self.scratch())
        wrapped = [(int(i), str(d)) for i, d in meta.get("wrapped", [])]
        exe = _make_executable(loader, meta["signature"]["op"], meta["scalar_types"], wrapped)
        flat = is_flat(meta["signature"])
        if flat:
            exe = _flat_executable(exe)
        writes_at = [int(i) for i in meta.get("writes_at", [])]
        if writes_at:
            exe = _InPlace(exe, writes_at, meta["signature"])
        # How the native hit path calls the runner itself: tensors, then each run-time Scalar as a 0-d
        # tensor of these dtypes; numbers in tensor slots (by index) as 0-d tensors of theirs; and whether
        # the kernel is a flat class's (inputs viewed 1-D, outputs viewed back).
        # And for an in-place kernel, the inputs it stores into (the native path checks they overlap
        # nothing else before it calls the runner, as `_InPlace` does).
        exe.__neuron_aoti__ = (loader, [_SCALAR_DTYPES[t] for t in meta["scalar_types"]],  # type: ignore[attr-defined]
                               [(i, _WRAPPED_DTYPES[d]) for i, d in wrapped], flat, writes_at)
        return exe


# -- in-place executables --------------------------------------------------------------------------
def _in_place_call(signature: dict[str, Any]) -> tuple[Executable, list[int]]:
    """The executable `_export` traces for an in-place signature (`"writes"`: the mutated arguments): the
    op's functional variant, then each result stored into the list element it updates; and the indices,
    in the tensor inputs, of the elements it stores into."""
    qualname = signature["op"]
    functional = classify(qualname, special=False).functional
    if functional is None:
        raise CompileRefused(f"{qualname}: no functional variant to compile in place")
    fop = _resolve(functional.qualname)
    fsig = {k: v for k, v in signature.items() if k != "writes"}
    fsig["op"] = functional.qualname
    _check_scalar_schema(functional.qualname, fop, fsig)
    call = build_call(fsig, _per_element(functional.qualname, fop, fsig) or fop, wrapped_as_tensors=True)
    # Where each written argument's tensors sit among the tensor inputs (build_call's numbering).
    at: dict[str, list[int]] = {}
    ti = 0
    for name, kind, desc in signature["args"]:
        n = 1 if kind == TENSOR or (kind == OPT_TENSOR and desc is not None) else \
            sum(d is not None for d in desc) if kind in (TENSORS, OPT_TENSORS) else 0
        at[name] = list(range(ti, ti + n))
        ti += n
    groups = [at[name] for name in signature["writes"]]
    if any(not g for g in groups):
        raise CompileRefused(f"{qualname}: a written argument holds no tensor")
    several = len(groups) > 1

    def run(T: Any, S: Any) -> list[Any]:
        res = call(T, S)
        for k, idx in enumerate(groups):
            outs = res[k] if several else res
            if len(outs) != len(idx):
                raise CompileRefused(f"{qualname}: the functional variant returns {len(outs)} results "
                                     f"for {len(idx)} written tensors")
            for i, o in zip(idx, outs):
                T[i].copy_(o)
        return []

    return run, [i for g in groups for i in g]


def _span(t: torch.Tensor) -> tuple[int, int] | None:
    """The bytes a strided tensor may touch: [first, last + 1), or None for an empty one."""
    if t.numel() == 0:
        return None
    lo = hi = 0
    for n, st in zip(t.shape, t.stride()):
        if st < 0:
            lo += (n - 1) * st
        else:
            hi += (n - 1) * st
    p, e = t.data_ptr(), t.element_size()
    return p + lo * e, p + (hi + 1) * e


def writes_overlap(tensors: Sequence[Any], written: Sequence[int]) -> bool:
    """Whether a tensor the call writes shares a byte with any other tensor argument (or one written twice:
    the same tensor twice in a list). The native layer applies the same rule (`AotiCall::overlaps`)."""
    w = set(written)
    spans = sorted((*sp, i in w) for i, t in enumerate(tensors)
                   if isinstance(t, torch.Tensor) and (sp := _span(t)) is not None)
    end_any = end_written = -1
    for a, b, is_written in spans:
        if a < end_written or (is_written and a < end_any):
            return True
        end_any = max(end_any, b)
        if is_written:
            end_written = max(end_written, b)
    return False


class _InPlace:
    """An in-place kernel's executable: returns [] having written its inputs (`compiler._base`). The kernel
    was compiled for inputs that do not overlap; a call whose written tensors overlap another argument
    (`_foreach_add_(xs, xs)`, the same tensor twice in a list) is the in-place aten op on the host, which
    gives eager's answer for any aliasing."""

    __neuron_inplace__ = True

    def __init__(self, inner: Executable, written: list[int], signature: dict[str, Any]) -> None:
        self.inner = inner
        self.written = written
        self.loader = getattr(inner, "loader", None)  # keeps the .so alive with the executable
        self.host = build_call(signature, _resolve(signature["op"]))

    def __call__(self, tensors: Sequence[Any], scalars: Sequence[Any]) -> list[torch.Tensor]:
        if writes_overlap(tensors, self.written):
            return list(self.host(list(tensors), scalars))
        self.inner(tensors, scalars)
        return []


# -- compile steps ----------------------------------------------------------------------------------
def _per_element(qualname: str, op: Any, signature: dict[str, Any]) -> Any | None:
    """For a `_foreach_*` op, a stand-in that calls the per-tensor op in a loop, when Inductor needs it.

    Inductor has no lowering for many foreach ops (all ScalarList overloads, exp, log, lgamma, ...) and
    calls them through AOTInductor's proxy executor: one dispatcher call per execution and, for run-time
    scalars, a load-time failure (it cannot take symbolic scalars). The per-tensor ops lower to one fused
    kernel and keep the scalars as inputs. It is also how the CPU kernels of these ops compute (a loop
    over the per-tensor op), so results match eager."""
    if not qualname.startswith("aten::_foreach_"):
        return None
    from torch._inductor.lowering import lowerings

    has_scalars = any(kind in (SCALAR, SCALARS) for _, kind, _ in signature["args"])
    if not has_scalars and op in lowerings:
        return None
    base = qualname.removeprefix("aten::_foreach_").partition(".")[0]
    target_name, scalar_kw = _FOREACH_ELEMENT.get(base, (base, None))
    target = getattr(torch.ops.aten, target_name, None)
    if target is None:
        return None
    return _PerElement(op, target, scalar_kw)


class _Reshape:
    """`view(self, size)` in a compiled graph, traced as `reshape`. A graph AOTAutograd recorded views
    tensors with the strides eager kernels gave them; Inductor's decompositions may lay an intermediate
    out otherwise (a CPU attention's `k` transposed in another order), and a `view` of it then fails the
    whole compile ("Cannot view a tensor with shape ..."). `reshape` views when it can and copies when it
    must; the self-check still compares every output's strides with eager's."""

    def __init__(self, op: Any) -> None:
        self._schema = op._schema

    def __call__(self, x: torch.Tensor, size: Sequence[int]) -> torch.Tensor:
        return torch.reshape(x, size)


_VIEWS: dict[str, Any] = {"aten::view": _Reshape(torch.ops.aten.view.default),
                          "aten::_unsafe_view": _Reshape(torch.ops.aten._unsafe_view.default)}


# foreach base name -> (per-tensor op, keyword its list-wise scalar goes to when not positional); both as
# the CPU kernels of the foreach ops call them (ForeachOpsKernels.cpp).
_FOREACH_ELEMENT: dict[str, tuple[str, str | None]] = {
    "maximum": ("clamp_min", None),
    "minimum": ("clamp_max", None),
    "addcmul": ("addcmul", "value"),
    "addcdiv": ("addcdiv", "value"),
    "norm": ("linalg_vector_norm", None),
}


class _PerElement:
    """Callable with a foreach op's schema (what `build_call` needs) that loops over the per-tensor op."""

    def __init__(self, op: Any, target: Any, scalar_kw: str | None) -> None:
        self._schema = op._schema
        self.target = target
        self.scalar_kw = scalar_kw
        self.n_positional = sum(1 for a in op._schema.arguments if not a.kwarg_only)

    def __call__(self, *args: Any, **kwargs: Any) -> list[torch.Tensor]:
        n = next(len(a) for a in args if isinstance(a, (list, tuple)))
        outs = []
        for i in range(n):
            pos = [a[i] if isinstance(a, (list, tuple)) else a for a in args]
            kw = {k: v[i] if isinstance(v, (list, tuple)) else v for k, v in kwargs.items()}
            if self.scalar_kw is not None and len(pos) == 4:
                kw[self.scalar_kw] = pos.pop()
            outs.append(self.target(*pos, **kw))
        return outs


def _example_inputs(signature: dict[str, Any], values: bool = False) -> tuple[list[torch.Tensor], list[str]]:
    """Tensors with the signature's exact dtype/sizes/strides, then one 0-d tensor per run-time scalar.

    With `values`, floating tensors hold random numbers (the self-check compares against eager); integer
    tensors hold zeros, which are valid indices for any op that takes indices."""
    tensors: list[torch.Tensor] = []
    scalar_types: list[str] = []
    wrapped = dict(wrapped_slots(signature))
    for name, kind, desc in signature["args"]:
        if kind in (TENSOR, OPT_TENSOR):
            if is_wrapped(desc):
                dtype = _WRAPPED_DTYPES[wrapped[len(tensors)]]
                tensors.append(torch.tensor(_EXAMPLE_NUMBERS[desc["wrapped"]], dtype=dtype))
            elif desc is not None:
                tensors.append(_example_tensor(desc, values))
        elif kind in (TENSORS, OPT_TENSORS):
            tensors.extend(_example_tensor(d, values) for d in desc if d is not None)
        elif kind in (SCALAR, SCALARS):
            types = [] if desc is None else [desc] if kind == SCALAR else list(desc)
            for t in types:
                if t not in _SCALAR_DTYPES:
                    raise CompileRefused(f"{signature['op']}: argument {name} is a run-time {t} scalar; "
                                         f"executables take only float and int scalars at run time")
                scalar_types.append(t)
        elif kind == VALUE:
            _check_value(signature["op"], name, decode_value(desc))
    scalars = [torch.tensor(0.5 if t == "float" else 2, dtype=_SCALAR_DTYPES[t]) for t in scalar_types]
    return tensors + scalars, scalar_types


_EXAMPLE_NUMBERS = {"float": 0.5, "int": 2, "bool": True}
_WRAPPED_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16, torch.int8,
    torch.uint8, torch.bool)}


def wrapped_slots(signature: dict[str, Any]) -> list[tuple[int, str]]:
    """(position in the tensor list, dtype) of each Python number in a Tensor slot (`x * 2`).

    The executable takes it as a 0-d tensor whose dtype reproduces a wrapped number's type promotion: the
    widest input dtype of the number's category (float inputs for a float, integer inputs for an int), or
    the default dtype / int64 when there is none (an int tensor times 2.5 gives float32); a bool as bool."""
    slots: list[tuple[int, str]] = []
    position = 0
    floats: list[torch.dtype] = []
    ints: list[torch.dtype] = []
    for _, kind, desc in signature["args"]:
        descs = [desc] if kind in (TENSOR, OPT_TENSOR) else \
            list(desc) if kind in (TENSORS, OPT_TENSORS) else []
        for d in descs:
            if d is None:
                continue
            if is_wrapped(d):
                t = d["wrapped"]
                if t not in _EXAMPLE_NUMBERS:
                    raise CompileRefused(f"{signature['op']}: a {t} number in a tensor slot is not compiled")
                slots.append((position, t))
            else:
                dt = decode_dtype(d["dtype"])
                if dt.is_floating_point:
                    floats.append(dt)
                elif not dt.is_complex and dt != torch.bool:
                    ints.append(dt)
            position += 1

    def widest(dtypes: list[torch.dtype], default: torch.dtype) -> str:
        out = dtypes[0] if dtypes else default
        for dt in dtypes[1:]:
            out = torch.promote_types(out, dt)
        return str(out).removeprefix("torch.")

    # A 0-d tensor of the widest input dtype of its category never changes the result dtype, whether the
    # other inputs are dimensioned or 0-d (a wider one would: 0-d float32 + 0-d float64 is float64, while
    # 0-d float32 + 2.5 is float32).
    fdt, idt = widest(floats, torch.get_default_dtype()), widest(ints, torch.int64)
    return [(i, idt if t == "int" else "bool" if t == "bool" else fdt) for i, t in slots]


def graph_inputs(signature: dict[str, Any]) -> dict[str, Any]:
    """A fused group's inputs as one flat signature: its external tensors (`e0`, `e1`, ... described by
    the slot each feeds first), then every node's run-time scalars in node order; what `build_graph`'s
    executable takes. Each node's scalars are checked as a single op's are."""
    ext: dict[int, Any] = {}
    scalars: list[list[Any]] = []
    for k, node in enumerate(signature["graph"]):
        sig = node["sig"]
        _check_scalar_schema(sig["op"], _resolve(sig["op"]), sig)
        slots: list[Any] = []
        for _, kind, desc in sig["args"]:
            if kind in (TENSOR, OPT_TENSOR) and desc is not None:
                slots.append(desc)
            elif kind == TENSORS:
                slots += desc
            elif kind == OPT_TENSORS:  # a compiled graph's `index` (None: a dimension not indexed)
                slots += [d for d in desc if d is not None]
        if len(slots) != len(node["in"]):
            raise CompileRefused(f"{signature['op']}: node {k} ({sig['op']}) is not a fusible op")
        for w, desc in zip(node["in"], slots):
            if w[0] == "e":
                ext.setdefault(int(w[1]), desc)
        scalars += [[f"n{k}.{name}", kind, desc] for name, kind, desc in sig["args"]
                    if kind in (SCALAR, SCALARS) and desc is not None]
    if sorted(ext) != list(range(len(ext))):
        raise CompileRefused(f"{signature['op']}: external inputs {sorted(ext)} are not numbered 0..n-1")
    return {"op": signature["op"], "args": [[f"e{i}", TENSOR, ext[i]] for i in range(len(ext))] + scalars}


def _check_scalar_schema(qualname: str, op: Any, signature: dict[str, Any]) -> None:
    """Refuse run-time scalars the op's schema cannot take symbolically.

    Only `Scalar` (schema `number`) arguments accept the SymFloat/SymInt that carries a run-time value
    through export; an argument typed `float` (eps, momentum, dropout p, `_fused_adamw`'s lr) rejects it
    ("Expected a value of type 'float' ... found type 'SymFloat'"). Baking the value in would be wrong for
    the next call, since the key holds only its type: such arguments must be keyed by value to compile."""
    types = {a.name: str(a.type) for a in op._schema.arguments}
    for name, kind, desc in signature["args"]:
        if kind in (SCALAR, SCALARS) and desc is not None and "number" not in types.get(name, ""):
            raise CompileRefused(f"{qualname}: argument {name} is a `{types.get(name)}` in the schema, which "
                                 "cannot take a run-time value (only `Scalar` arguments can); it compiles once "
                                 "keyed by value")


def _example_tensor(desc: dict[str, Any], values: bool = False) -> torch.Tensor:
    dtype = decode_dtype(desc["dtype"])
    if dtype.itemsize == 1 and dtype.is_floating_point:
        # Inductor's CPU backend has no float8 codegen; the host runs these exactly. (Complex tensors
        # compile: Inductor calls ATen's kernels for what it cannot generate, and the self-check compares.)
        raise CompileRefused(f"tensors of dtype {dtype} are not compiled by the aoti tier")
    sizes, strides = desc["sizes"], desc["strides"]
    # Fill the storage, then view it: an expanded input (stride 0) cannot be written through its view.
    n = 0 if 0 in sizes else 1 + sum((size - 1) * stride for size, stride in zip(sizes, strides))
    flat = torch.zeros(n, dtype=dtype)
    if values and (dtype.is_floating_point or dtype.is_complex):
        # Uniform in [0.5, 1.5): positive (log, sqrt, division stay finite), away from kinks at 0 and 1.
        gen = torch.Generator().manual_seed(0)
        real = torch.rand(n, generator=gen, dtype=torch.float32) + 0.5
        flat.copy_(torch.complex(real, torch.rand(n, generator=gen) + 0.5) if dtype.is_complex else real)
    return flat.as_strided(sizes, strides)


def _check_value(qualname: str, name: str, value: Any) -> None:
    devices = value if isinstance(value, list) else [value]
    for v in devices:
        if isinstance(v, torch.device) and v.type != "cpu":
            raise CompileRefused(f"{qualname}: argument {name}={v} names a device; executables compute on host "
                                 "memory and cannot place results")


def _export(qualname: str, run: Executable, n_tensors: int, inputs: list[torch.Tensor],
            dynamic: list[list[Any]] | None = None, restride: bool = False) -> Any:
    """`torch.export` of the op's call; `dynamic`: per tensor input its sizes, a symbol name where the
    dim is dynamic (a shape class). Each symbol is a `Dim` with min=2: export refuses (constraint
    violation) rather than narrow it, so a class it cannot keep generic is refused, never half-generic.
    `restride`: each output is written into a buffer of eager's strides (the traced meta strides), for an
    op whose Inductor lowering picks another layout (`cat` of permuted inputs keeps their order, eager's
    is contiguous)."""
    class _Op(torch.nn.Module):
        def forward(self, *args: torch.Tensor) -> tuple[torch.Tensor, ...]:
            # `.item()` on an input keeps the scalar symbolic (an unbacked SymFloat/SymInt): the value is
            # read when the executable runs instead of being baked into the code.
            outs = tuple(run(args[:n_tensors], [s.item() for s in args[n_tensors:]]))
            if not restride:
                return outs
            return tuple(torch.empty_strided(o.shape, o.stride(), dtype=o.dtype).copy_(o)
                         if isinstance(o, torch.Tensor) else o for o in outs)

    shapes: Any = None
    if dynamic is not None:
        dims: dict[str, Any] = {}
        specs: list[Any] = [{i: dims.setdefault(n, torch.export.Dim(n, min=2)) for i, n in enumerate(sizes)
                             if isinstance(n, str)} or None for sizes in dynamic]
        specs += [None] * (len(inputs) - len(specs))
        shapes = (tuple(specs),)
    try:
        return torch.export.export(_Op(), tuple(inputs), dynamic_shapes=shapes, strict=False)
    except CompileRefused:
        raise
    except Exception as e:  # noqa: BLE001 - anything export rejects is an op we cannot compile
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        what = "export with dynamic dims" if dynamic is not None else "export"
        raise CompileRefused(f"{qualname}: {what} failed ({type(e).__name__}: {first[:300]})") from e


def _dynamic_dims(cls: dict[str, Any]) -> list[list[Any]]:
    """The sizes (ints, symbol names) of each tensor input of a class, in `_example_inputs` order."""
    out: list[list[Any]] = []
    for _, kind, desc in cls["args"]:
        descs = [desc] if kind in (TENSOR, OPT_TENSOR) else \
            list(desc) if kind in (TENSORS, OPT_TENSORS) else []
        out.extend([] if is_wrapped(d) else list(d["sizes"]) for d in descs if d is not None)
    return out


def _check_outputs(qualname: str, ep: Any) -> None:
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    out = next(iter(ep.graph.find_nodes(op="output")))
    for i, node in enumerate(out.args[0]):
        val = getattr(node, "meta", {}).get("val") if node is not None else None
        if not isinstance(val, torch.Tensor):
            raise CompileRefused(f"{qualname}: output {i} is not a tensor ({type(val).__name__})")
        if free_unbacked_symbols(val):  # sizes of a shape class's dynamic dims are fine
            raise CompileRefused(f"{qualname}: output {i} has a shape that depends on the data "
                                 f"({list(val.shape)}); it runs on the host")


def _aot_lower(qualname: str, ep: Any, inputs: list[torch.Tensor], pinned: dict[str, Any],
               build: str) -> tuple[_units.Unit | None, bytes | None, float]:
    """AOTInductor's lowering of `ep`, stopped before its C++ build: (the op's unit, None, 0.0). Generated
    code of a shape the rewrite does not know (`_units.Unsupported`) is built by AOTInductor itself into
    `build` and packaged as a .pt2 zip in memory: (None, the zip, the seconds that build took)."""
    from torch._inductor import aot_compile
    from torch._inductor.package import package_aoti

    options = dict(pinned)
    options["aot_inductor.package"] = True
    options["aot_inductor.output_path"] = build
    classic: dict[str, float] = {}
    try:
        with _units.capturing(classic):
            files = aot_compile(ep.module(check_guards=False), tuple(inputs), options=options)
    except BaseException as e:  # noqa: BLE001 - `capturing` raises a BaseException to carry the code out
        got = _units.captured(e)
        if got is not None:
            return got, None, 0.0
        if not isinstance(e, Exception):
            raise
        # a failed lowering or C++ build is a refusal with its reason
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise CompileRefused(f"{qualname}: AOTInductor failed ({type(e).__name__}: {first[:300]})") from e
    log.debug("aoti: %s built by AOTInductor whole (%s)", qualname, classic.get("why"))
    if not isinstance(files, list) or not all(isinstance(f, str) for f in files):
        raise CompileRefused(f"{qualname}: AOTInductor produced weights outside the .so; not supported")
    raw = io.BytesIO()
    package_aoti(raw, files)
    return None, raw.getvalue(), classic.get("seconds", 0.0)


def _package(qualname: str, so: bytes | None, meta: dict[str, Any]) -> bytes:
    """A .pt2 zip as AOTInductor's packager lays one out: the op's .so (none for a library call), its
    metadata, the archive markers, and our metadata (`META_PATH`)."""
    from torch._inductor.codecache import get_device_information

    info = {"AOTI_DEVICE_KEY": "cpu", **get_device_information("cpu")}
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_STORED) as z:
        z.writestr("archive/archive_format", "pt2")
        z.writestr("archive/archive_version", "0")
        z.writestr("archive/byteorder", sys.byteorder)
        z.writestr("archive/.data/version", "6\n")
        if so is not None:
            z.writestr("archive/data/aotinductor/model/model.so", so)
            z.writestr("archive/data/aotinductor/model/model_metadata.json", json.dumps(info))
        z.writestr("archive/" + META_PATH, canonical(meta))
    return out.getvalue()


def _repackage(qualname: str, raw: bytes, meta: dict[str, Any], tmp: str) -> bytes:
    """The .pt2 zip rebuilt with only allow-listed files, plus our metadata."""
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(raw)) as src, zipfile.ZipFile(out, "w", compression=zipfile.ZIP_STORED) as dst:
        prefix = ""
        for info in src.infolist():
            name = info.filename
            if name.endswith("/archive_format"):
                prefix = name[: -len("archive_format")]
            if name.endswith(_DROP_SUFFIXES):
                continue
            if not name.endswith(_KEEP_SUFFIXES):
                raise CompileRefused(f"{qualname}: AOTInductor package holds an unexpected file {name!r}; "
                                     "refusing it (artifacts carry only the .so and JSON metadata)")
            data = src.read(name)
            dst.writestr(info, _strip(data, tmp) if name.endswith(".so") else data)
        dst.writestr(prefix + META_PATH, canonical(meta))
    return out.getvalue()


def _strip(so: bytes, tmp: str) -> bytes:
    """The .so without its static symbol table (~20 % of it): nothing resolves those symbols; the dynamic
    ones the runner looks up (`AOTInductorModelContainer*`) stay. Unchanged if binutils' strip is absent."""
    tool = shutil.which("strip")
    if tool is None:
        return so
    with tempfile.TemporaryDirectory(prefix="strip-", dir=tmp) as d:
        path = os.path.join(d, "model.so")
        with open(path, "wb") as f:
            f.write(so)
        done = subprocess.run([tool, "--strip-unneeded", path], capture_output=True, timeout=60, check=False)
        if done.returncode != 0:
            log.debug("aoti: strip failed (%s); keeping symbols", done.stderr.decode(errors="replace")[:200])
            return so
        with open(path, "rb") as f:
            return f.read()


# -- load steps -------------------------------------------------------------------------------------
def _members(payload: bytes, wanted: Any) -> dict[str, bytes | memoryview]:
    """The archive members whose names satisfy `wanted`, read in one pass over the central directory.

    Stored (uncompressed) members are sliced out of the payload without a copy or a CRC pass: the entry's
    sha256 was verified before `load`, and this is the hit path's load."""
    view = memoryview(payload)
    out: dict[str, bytes | memoryview] = {}
    with zipfile.ZipFile(io.BytesIO(payload)) as z:
        for info in z.infolist():
            if not wanted(info.filename):
                continue
            local = payload[info.header_offset: info.header_offset + 30]
            if info.compress_type == zipfile.ZIP_STORED and local[:4] == b"PK\x03\x04":
                start = info.header_offset + 30 + int.from_bytes(local[26:28], "little") + \
                    int.from_bytes(local[28:30], "little")
                out[info.filename] = view[start: start + info.file_size]
            else:
                out[info.filename] = z.read(info)
    return out


def read_meta(payload: bytes) -> dict[str, Any]:
    """The `extra/neuron_runtime.json` of an artifact (raises `ArtifactMismatch` if it has none)."""
    return _read(payload)[0]


def _read(payload: bytes) -> tuple[dict[str, Any], dict[str, bytes | memoryview]]:
    """(our metadata, the .so and proxy-executor JSON members) of an artifact."""
    try:
        members = _members(payload, lambda n: n.endswith(("/" + META_PATH, ".so", ".wrapper.json")))
        meta_name = next((n for n in members if n.endswith("/" + META_PATH)), None)
        if meta_name is None:
            raise ArtifactMismatch(f"not an {ARTIFACT_FORMAT} artifact: no {META_PATH}")
        meta: dict[str, Any] = json.loads(bytes(members.pop(meta_name)))
        return meta, members
    except (zipfile.BadZipFile, ValueError, KeyError) as e:
        raise ArtifactMismatch(f"not an {ARTIFACT_FORMAT} artifact: {e}") from e


def _load_package(members: dict[str, bytes | memoryview], scratch: _toolchain.Scratch) -> Any:
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
        # One model instance; the runner's own lock makes concurrent calls from Python threads safe.
        return torch._C._aoti.AOTIModelContainerRunnerCpu(os.path.join(work, os.path.basename(so[0])), 1)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _make_executable(loader: Any, qualname: str, scalar_types: Sequence[str],
                     wrapped: Sequence[tuple[int, str]] = ()) -> Executable:
    """`exe(tensors, scalars)` over `loader.run(list)`; generated per arity so a call is one C++ call.

    Each scalar slot keeps the 0-d tensor of the last value *object* it saw: `alpha=1` and an unchanged
    learning rate are the same Python object call after call, so the hit path allocates nothing. Numbers
    in tensor slots (`wrapped`) become 0-d tensors the same way."""
    if wrapped:
        inner = _make_executable(loader, qualname, scalar_types)
        slots = [(i, _WRAPPED_DTYPES[d]) for i, d in wrapped]
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
    run = loader.run
    if not scalar_types:
        def exe(tensors: Sequence[torch.Tensor], scalars: Sequence[Any]) -> list[torch.Tensor]:
            return run(tensors if isinstance(tensors, list) else list(tensors))  # type: ignore[no-any-return]
        exe.loader = loader  # type: ignore[attr-defined]  # keeps the .so alive with the function
        return exe
    dtypes = [_SCALAR_DTYPES[t] for t in scalar_types]
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


def _flat_executable(inner: Executable) -> Executable:
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


# -- scratch redirection ----------------------------------------------------------------------------
@contextlib.contextmanager
def _env(**values: str) -> Iterator[None]:
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def _redirected(scratch: _toolchain.Scratch) -> Iterator[None]:
    """Inductor's scratch into our private directories for the duration of one compile.

    Three knobs, because Inductor reads them at different times: TORCHINDUCTOR_CACHE_DIR is read on every
    use; the precompiled-header directory was fixed at import of `torch._inductor.codecache` from
    tempfile.gettempdir() (so setting TMPDIR now would not move it) and is a module global; TMPDIR in the
    environment reaches g++ and tempfile.tempdir reaches Python's own temporary files."""
    import torch._inductor.codecache as codecache

    old_header = codecache._HEADER_DIR, codecache._HEADER_LOCK_DIR
    old_tempdir = tempfile.tempdir
    codecache._HEADER_DIR = str(scratch.pch)
    codecache._HEADER_LOCK_DIR = str(scratch.pch / "locks")
    tempfile.tempdir = str(scratch.tmp)
    try:
        with _env(TORCHINDUCTOR_CACHE_DIR=str(scratch.cache), TMPDIR=str(scratch.tmp)):
            yield
    finally:
        codecache._HEADER_DIR, codecache._HEADER_LOCK_DIR = old_header
        tempfile.tempdir = old_tempdir

"""The `aoti` tier: one AOTInductor `.pt2` package (a real `.so`) per op signature.

compile(signature), on the tier's own thread, one at a time:
  1. Build the op's call from the signature (`_reference.build_call`; foreach ops Inductor cannot lower
     become a loop over the per-tensor op: `_standins`). Run-time scalars become 0-d float64/int64 tensor
     inputs read with `.item()` inside the traced function, so a new learning rate or alpha is a new input
     value, never a new compile; scalars the schema types `float` (not `Scalar`) cannot be, and are refused.
  2. `torch.export` it with example inputs of the signature's exact dtypes, sizes and strides
     (`_examples`, `_lowering.export`).
  3. Refuse what an executable cannot be: outputs whose shape depends on data, non-tensor outputs.
  4. AOTInductor-compile it under the pinned target (`_toolchain.pins`) in a private scratch directory
     (`_lowering.aot_lower`: the op's unit, built with its batch by `_aoti_runtime`).
  5. Package it as a `.pt2` zip in memory, keep only the allow-listed files (the `.so` and JSON metadata:
     no pickle, no sources), and add `extra/neuron_runtime.json` (format, fingerprint, signature:
     `_package`).
  6. Load and run it once against eager on example values; refuse it if it cannot run or disagrees.
load(bytes):
  checks the fingerprint stored in the artifact against this host, hands the `.so` to AOTInductor's C++
  container runner (dlopen, no compiler involved) and returns a function that calls the runner's
  `run(list)` directly (not the package's `__call__`, which flattens pytrees: ~17 µs more per call:
  `_runner`); an in-place kernel's is wrapped by `_inplace.InPlace`.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import shutil
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .. import _config
from ..signatures import (
    build_signature,
    class_example,
    classify,
    graph_has_symbols,
    has_nodes,
    is_class,
    is_flat,
    is_packed,
    kind_of,
    other_instance,
)
from . import (_accuracy, _aoti_runtime, _examples, _inplace, _lowering, _package, _runner, _source, _standins,
               _toolchain, _units)
from ._base import CompileRefused, Compiled, Compiler, Executable
from ._reference import aten_executable, build_call, build_graph, resolve

log = logging.getLogger(__name__)

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
    # No lowering, no C shim: Inductor calls these through AOTInductor's proxy executor, which cannot pass
    # segment_reduce's run-time `initial` ("Unexpected type in c_type_for_prim_type: type_=number") and
    # miscounts hash_tensor's int-list `dim` at run time ("Mismatch between ints consumed and num_ints").
    "aten::segment_reduce": "Inductor calls the op's own kernel (a fallback through the proxy executor)",
    "aten::hash_tensor": "Inductor calls the op's own kernel (a fallback through the proxy executor)",
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
    restride: bool = False  # outputs copied into eager's layout (after a layout mismatch: `_lowering.export`)
    unit: _units.Unit | None = None  # the op's C++ unit, built with the batch (`_aoti_runtime`)
    raw: bytes | None = None  # or a .pt2 AOTInductor built whole (a unit the rewrite does not know)
    so: bytes | None = None
    payload: bytes = b""

    @property
    def qualname(self) -> str:
        return str(self.signature.get("op", "?"))

    def add(self, phase: str, seconds: float) -> None:
        self.phases[phase] = self.phases.get(phase, 0.0) + seconds


def _plan(job: _Job) -> list[list[Any]] | None:
    """Step 1 for `job`: what is traced (`run`), its inputs as one flat signature (`flat`), the other
    shapes the self-check runs (`others`), the inputs written in place (`into`), whether it is a library
    call; returns the dynamic dims of a shape class's export (None for an exact signature).

    A shape class (`_shapes`) compiles from its example, the exact signature it was made from, with its
    symbolic sizes as dynamic dims; the self-check then runs a second shape of the class too. A flat class
    (the rank-collapse rule) compiles a 1-D kernel from its flattened example, and its executable views
    the inputs flat and the outputs back (`_runner.flat_executable`)."""
    signature = job.signature
    cls = job.cls = signature if is_class(signature) else None
    exact = job.exact = class_example(cls) if cls is not None else signature
    job.into = [int(i) for _, i in exact.get("into", [])]  # inputs a fused group writes in place
    if has_nodes(exact):  # a fused group (neuron_runtime.aten._fusion) or a torch.compile graph
        # A graph class whose size arguments follow its symbols (signatures rule 3b) is traced from the
        # class itself, so those arguments are the inputs' symbolic sizes, not the example's numbers.
        symbolic = cls is not None and graph_has_symbols(cls)
        job.run = build_graph(cls if symbolic else exact, wrapped_as_tensors=True, choose=_standins.for_node)
        job.flat = _examples.graph_inputs(exact)
        job.others = [_examples.graph_inputs(other_instance(cls))] if cls is not None else []
        return _examples.dynamic_dims(_examples.graph_inputs(cls)) if cls is not None else None
    if exact.get("writes"):  # in place: the functional op, its results stored into the inputs
        job.run, job.into = _inplace.in_place_call(exact)
    else:
        op = resolve(job.qualname)
        _examples.check_scalar_schema(job.qualname, op, exact)
        job.run = build_call(exact, _standins.for_op(job.qualname, op, exact) or op,
                             wrapped_as_tensors=True)
        job.library = job.qualname in LIBRARY_OPS
    job.flat = exact
    job.others = [other_instance(cls)] if cls is not None else []
    return _examples.dynamic_dims(cls) if cls is not None else None


def _compare(job: _Job, got: list[Any], want: list[Any], held: set[int],
             reference: Callable[[], tuple[list[Any] | None, str]] | None = None) -> None:
    """The self-check's verdict: each output of the artifact (`got`: its results, then the inputs it
    wrote) against eager's (`want`), by shape, dtype, strides and values; `held`: the inputs' memory;
    `reference()`: eager's outputs in float64 on the same values and why there are none (asked for only
    when an output is not within plain tolerance: `_accuracy`)."""
    qualname = job.qualname
    ref: tuple[list[Any] | None, str] | None = None
    for i, (g, w) in enumerate(zip(got, want)):
        if g is None or w is None:  # an optional output eager leaves out (an `output_mask` entry off)
            if g is not None or w is not None:
                raise CompileRefused(f"{qualname}: output {i} is {type(g).__name__}, eager gives {type(w).__name__}")
            continue
        # A compiled graph (torch.compile) may return views of its inputs (a transposed weight saved
        # for backward): its caller relabels them over the same memory, as the view would be.
        if i < len(got) - len(job.into) and g.numel() and g.untyped_storage().data_ptr() in held and \
                kind_of(job.signature) != "graph":
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
        if not (g.is_floating_point() or g.is_complex()):
            if not torch.equal(g, w):
                raise CompileRefused(f"{qualname}: output {i} ({_output_name(job, i)}, {w.dtype}) differs "
                                     "from eager on example values (an exact dtype)")
            continue
        if _accuracy.judge(g, w, None) is None:
            continue
        if ref is None:
            ref = reference() if reference is not None else (None, "no float64 run to judge by")
        refs, why_none = ref
        why = _accuracy.judge(g, w, refs[i] if refs is not None and i < len(refs) else None)
        if why is not None:
            raise CompileRefused(f"{qualname}: output {i} ({_output_name(job, i)}, {list(w.shape)} {w.dtype}) "
                                 f"differs from eager on example values: {why}"
                                 + (f"; {why_none}" if why_none else ""))


def _float64_run(job: _Job) -> Any:
    """`job.run` for its signature with every float32/half dtype made float64 (`_accuracy`'s referee)."""
    exact = _accuracy.upcast_signature(job.exact)
    if has_nodes(exact):
        return build_graph(exact, wrapped_as_tensors=True, choose=_standins.for_node)
    if exact.get("writes"):
        return _inplace.in_place_call(exact)[0]
    op = resolve(job.qualname)
    return build_call(exact, _standins.per_element(job.qualname, op, exact) or op, wrapped_as_tensors=True)


def _output_name(job: _Job, i: int) -> str:
    """What computes output `i`: a graph's node (`node 12 aten::mm`), an input it writes, or the op."""
    exact = job.exact
    if has_nodes(exact):
        outputs = list(exact.get("outputs", []))
        if i < len(outputs):
            o = outputs[i]
            j = int(o) if isinstance(o, int) else int(o[0])
            return f"node {j} {exact['graph'][j]['sig']['op']}"
        return f"written into input {job.into[i - len(outputs)]}" if i - len(outputs) < len(job.into) else "?"
    return job.qualname


class AotiCompiler(Compiler):
    name = "aoti"
    # 2: an op's .so is its own unit linked with the shared runtime (or a library call); part of every
    # key, so entries of format 1 are never looked up (they are recompiled, and pruned like any other).
    format_version = 2
    # In-place executables (`writes_inputs`, compiler._base) for ops that write tensor lists (`_foreach_*_`):
    # the functional op followed by a `copy_` into each mutated input is exported, as a fused group's
    # `into`, and AOTInductor stores the results into those inputs' buffers: no fresh results, no copy
    # back. The kernel assumes its inputs do not overlap; a call whose written tensors overlap another
    # argument runs the in-place aten op on the host instead (`_inplace.InPlace`).
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
        if any(_source.is_source(s) for s in signatures):  # kernel source: g++ alone, no Inductor
            sources = iter(self._compile_sources([s for s in signatures if _source.is_source(s)]))
            rest = [s for s in signatures if not _source.is_source(s)]
            ops = iter(self._compile_many(rest) if rest else [])
            return [next(sources) if _source.is_source(s) else next(ops) for s in signatures]
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

    def _compile_sources(self, signatures: list[dict[str, Any]]) -> list[Compiled]:
        """Kernel source, compiled for the tier's target (`-march`) in its scratch."""
        out = []
        for sig in signatures:
            t0 = time.perf_counter()
            try:
                payload = _source.compile_source(sig, self.fingerprint(), [f"-march={self.march}"],
                                                 str(self.scratch().tmp))
                out.append(Compiled(payload=payload, phases={"cxx": time.perf_counter() - t0}))
            except Exception as e:  # noqa: BLE001 - costs only this signature
                out.append(Compiled(error=e, phases={"cxx": time.perf_counter() - t0}))
        return out

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
        """Steps 1-4 of the module docstring for one signature: its call, exported and lowered by
        AOTInductor to the op's unit (or a .pt2 AOTInductor built whole); a library call stops after 1."""
        qualname = job.qualname
        try:
            _toolchain.check_host(self.march)
        except _toolchain.ToolchainError as e:
            raise CompileRefused(f"{qualname}: {e}") from e
        dynamic = _plan(job)
        inputs, job.scalar_types = _examples.example_inputs(job.flat)
        job.n_tensors = len(inputs) - len(job.scalar_types)
        if job.library:  # the op is one library call: its executable is that call (no C++ of its own)
            return
        scratch = self.scratch()
        # Inductor's deprecation and future warnings are about Inductor, not the user's program: recorded
        # whatever the caller's filters say (an "error" filter made them exceptions, and the compile a
        # refusal that the cache then kept for good).
        with _lowering.redirected(scratch), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            t0 = time.perf_counter()
            ep = _lowering.export(qualname, job.run, job.n_tensors, inputs, dynamic, restride=job.restride)
            _lowering.check_outputs(qualname, ep)
            t1 = time.perf_counter()
            job.add("export", t1 - t0)
            # A fresh build directory, not Inductor's cache, which would keep every .so forever.
            build = tempfile.mkdtemp(prefix="build-", dir=scratch.build)
            try:
                job.unit, job.raw, classic_s = _lowering.aot_lower(qualname, ep, inputs,
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
        meta: dict[str, Any] = {"format": _package.ARTIFACT_FORMAT, "fingerprint": self.fingerprint(),
                                "signature": job.signature, "n_tensors": job.n_tensors,
                                "scalar_types": job.scalar_types, "wrapped": _examples.wrapped_slots(job.flat)}
        if job.exact.get("writes"):
            meta["writes_at"] = job.into  # the tensor inputs the kernel stores into (`_inplace.InPlace`)
        if job.library:
            meta["kind"] = "library"
            payload = _package.package(job.qualname, None, meta)
        elif job.so is not None:
            payload = _package.package(job.qualname, job.so, meta)
        else:
            assert job.raw is not None
            payload = _package.repackage(job.qualname, job.raw, meta, str(self.scratch().tmp))
        t1 = time.perf_counter()
        job.add("packaging", t1 - t0)
        others = list(job.others)
        if job.cls is not None and (is_flat(job.cls) or is_packed(job.cls)):
            # the shape it was made from: the flat views and the views back, or the slices copied
            example = job.cls["example"]
            others.append(_examples.graph_inputs(example) if has_nodes(job.exact) else example)
        for shape in [job.flat, *others]:
            self._self_check(job, payload, shape)
        job.add("self_check", time.perf_counter() - t1)
        job.payload = payload
        log.info("aoti: compiled %s (%s, %d bytes)", job.qualname,
                 ", ".join(f"{k} {v:.2f}s" for k, v in job.phases.items()), len(payload))

    def _self_check(self, job: _Job, payload: bytes, signature: dict[str, Any]) -> None:
        """Load the fresh artifact and run it once against eager on example values of `signature` (one of
        the job's shapes; a few ms).

        Catches what compiles but cannot run (AOTInductor's proxy executor rejects symbolic scalars only
        at load) or returns other shapes, dtypes or strides than the op, before anything is cached."""
        qualname, into = job.qualname, job.into
        inputs, _ = _examples.example_inputs(signature, values=True)
        tensors = inputs[:job.n_tensors]
        scalars = [{"float": 0.5, "bool": True}.get(t, 2) for t in job.scalar_types]
        for i, _dtype in _examples.wrapped_slots(signature):
            tensors[i] = tensors[i].item()  # the dispatcher passes these as Python numbers
        # A fused group writing results into its inputs (`into`): each side runs on its own copies, and
        # what it wrote is compared as its other outputs are.
        mine = [t.clone() if i in into else t for i, t in enumerate(tensors)]
        try:
            exe = self.load(payload)
        except Exception as e:  # noqa: BLE001 - an artifact that cannot load is refused, never cached
            raise CompileRefused(f"{qualname}: compiled artifact fails to load ({type(e).__name__}: "
                                 f"{str(e).strip()[:300]})") from e
        pristine = [t.clone() if i in into else t for i, t in enumerate(tensors)]  # for the float64 run
        try:
            want = job.run(tensors, scalars)
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
        _compare(job, got, want, held,
                 lambda: _accuracy.float64_reference(lambda: _float64_run(job), pristine, scalars, into))

    # -- load ---------------------------------------------------------------------------------------
    def payload_signature(self, payload: bytes) -> dict[str, Any] | None:
        if _source.is_artifact(payload):
            return _source.read_meta(payload).get("signature")
        try:
            sig = _package.read_meta(payload).get("signature")
        except _package.ArtifactMismatch as e:
            raise ValueError(str(e)) from e
        return sig if isinstance(sig, dict) else None

    def load(self, payload: bytes) -> Executable:
        if _source.is_artifact(payload):
            _toolchain.check_host(self.march)
            return _source.load(payload, self.fingerprint(), str(self.scratch().load))
        meta, members = _package.read(payload)
        if meta.get("format") != _package.ARTIFACT_FORMAT:
            raise _package.ArtifactMismatch(f"not an {_package.ARTIFACT_FORMAT} artifact "
                                            f"(format {meta.get('format')!r})")
        theirs, ours = meta.get("fingerprint"), self.fingerprint()
        if theirs != ours:
            diff = sorted(k for k in set(ours) | set(theirs or {}) if (theirs or {}).get(k) != ours.get(k))
            raise _package.ArtifactMismatch(f"{meta.get('signature', {}).get('op', '?')}: artifact was built for "
                                            f"another host or toolchain (differs in {', '.join(diff)}); "
                                            "refusing to load it")
        try:
            # The fingerprint names the target, not this CPU: a host below the fleet baseline would SIGILL.
            _toolchain.check_host(self.march)
        except _toolchain.ToolchainError as e:
            raise _package.ArtifactMismatch(f"{meta['signature']['op']}: {e}") from e
        if meta.get("kind") == "library":
            return aten_executable(meta["signature"])
        loader = _runner.load_runner(members, self.scratch())
        wrapped = [(int(i), str(d)) for i, d in meta.get("wrapped", [])]
        exe = _runner.make_executable(loader, meta["signature"]["op"], meta["scalar_types"], wrapped)
        flat = is_flat(meta["signature"])
        if flat:
            exe = _runner.flat_executable(exe)
        packed = is_packed(meta["signature"])
        if packed:  # its kernel takes the slices contiguous: they are copied first (the native path too)
            exe = _runner.packed_executable(exe)
        writes_at = [int(i) for i in meta.get("writes_at", [])]
        if writes_at:
            exe = _inplace.InPlace(exe, writes_at, meta["signature"])
        # How the native hit path calls the runner itself: tensors, then each run-time Scalar as a 0-d
        # tensor of these dtypes; numbers in tensor slots (by index) as 0-d tensors of theirs; and whether
        # the kernel is a flat class's (inputs viewed 1-D, outputs viewed back).
        # And for an in-place kernel, the inputs it stores into (the native path checks they overlap
        # nothing else before it calls the runner, as `_inplace.InPlace` does); and whether it is a packed
        # class's (inputs that are not dense copied first, as `_runner.packed_executable` does).
        scalar_dtypes = [_examples.SCALAR_DTYPES[t] for t in meta["scalar_types"]]
        exe.__neuron_aoti__ = (loader, scalar_dtypes,  # type: ignore[attr-defined]
                               [(i, _examples.WRAPPED_DTYPES[d]) for i, d in wrapped], flat, writes_at, packed)
        return exe

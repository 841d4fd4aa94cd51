"""The runtime: one per process (`runtime()`), with the executable resolver, fallbacks, counters and fusion,
and the slow path of the generated kernels (`Runtime.slow_call`), which does the checks once per key.

Everything a generated kernel (`_codegen`) does not serve from its table goes to `slow_call`: devices
checked, the executable found or made, run, the result checked against the op's contract once, then the
key is a hit. Host runs (host ops, fallbacks, keys compiling in the background), dtypes the host kernel
lacks (`_widen`) and writes that overlap an input (`_writes`) are decided here too.

The generated kernels' tables of executables (`_EXES`, filled through `kernel_table`) live here, so that
reset and eviction empty them. The runtime (`_current`) and `_EXES` are rebound at run time (tests rebind
`_EXES`): both are read in this module alone, never imported by name.
"""

from __future__ import annotations

import logging
import sys
import threading
import warnings
from typing import Any

import torch

from .. import _config, _profiling
from .._native import NATIVE, trace_run
from ..executables import (CacheMissError, CompileRefused, Compiler, Executable, IntegrityError, Resolver, TieredCache,
                           megacache_stats, set_provider)
from ..signatures import OPT_TENSORS, OpInfo, SignatureError, TENSOR, build_signature, canonical, scalar_overload
from . import _fusion, _widen
from ._host import (DEVICE, NUMBERS, copy_back, copy_back_out, flatten, mutated_views, regroup, rewrap, to_host,
                    wrap)
from ._writes import adopt_geometry, check_mutated, overlapping, shared_views

log = logging.getLogger(__name__)


class NeuronRuntimeError(RuntimeError):
    """Base of the runtime's errors."""


class FallbackDisabledError(NeuronRuntimeError):
    """An op could not be compiled and TORCH_NEURONX_FALLBACK=0 forbids running it on the host."""


# Executions on the hit path: a list cell, the cheapest thing Python can bump (read by `stats()`).
FAST = [0]


class Runtime:
    """One process's runtime: the executable resolver, fallbacks, counters and fusion."""

    #: Fusion wraps a flushed group's fresh CPU results as neuron tensors through its runtime (so
    #: `_fusion` never imports this module, which imports it).
    wrap = staticmethod(wrap)

    def __init__(self, cfg: _config.Config) -> None:
        self.cfg = cfg
        self.lock = threading.RLock()
        self.fallback_keys: set[tuple[str, Any]] = set()
        self.fallback_ops: dict[str, str] = {}   # op name -> reason (first seen)
        self.host_ops: set[str] = set()
        # Keys whose host kernel lacks an input dtype: how they widen (`_widen`), and per op what for stats().
        self.widened: dict[tuple[str, Any], _widen.Plan] = {}
        self.widened_ops: dict[str, set[str]] = {}
        FAST[0] = 0
        if NATIVE is not None:
            NATIVE.reset_counters()
        # One dict of counters, shared with the resolver's TieredCache (which adds hits["local"/"fleet"],
        # misses, compiles, corrupt, fleet_errors, writes_skipped, lease_waits).
        self.counts: dict[str, Any] = {"executions": 0, "compiles": 0, "fallbacks": 0, "corrupt": 0,
                                       "misses": 0, "class_hits": 0, "host_ops": 0, "host_runs": 0, "loads": 0,
                                       "widened": 0,
                                       "hits": {"memory": 0}}
        # torch.compile graphs (`graphs._compile` counts here): compiled, calls on an executable and op by
        # op, refusals.
        self.graph_counts = {"graphs": 0, "graph_executions": 0, "graph_eager_runs": 0, "graphs_refused": 0}
        self.waiting: dict[tuple[str, Any], str] = {}  # (op, key) -> cache key compiling in the background
        self.resolver = Resolver(cfg, self.counts, self.lock, on_evict=self._evicted)
        self.fusion = _fusion.install(self)  # None unless TORCH_NEURONX_ENABLE_CONCATENATION=1

    @property
    def compiler(self) -> Compiler:
        return self.resolver.compiler

    @property
    def fingerprint(self) -> dict[str, Any]:
        return self.resolver.fingerprint

    @property
    def by_digest(self) -> dict[str, Executable]:
        """The memory tier: loaded executables by cache key."""
        return self.resolver.by_digest

    @property
    def cache(self) -> TieredCache | None:
        return self.resolver.cache

    def set_compiler(self, compiler: Compiler) -> None:
        """Use another compiler tier (its fingerprint keys everything from now on)."""
        self.resolver.set_compiler(compiler)

    # -- stats ------------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        with self.lock:
            s: dict[str, Any] = dict(self.counts)
            hits = dict(self.counts["hits"])
        fast = FAST[0] + (NATIVE.executions() if NATIVE is not None else 0)
        s["executions"] += fast
        if NATIVE is not None:  # random host ops the native layer ran (`HostKernel`)
            s["host_ops"] += NATIVE.host_runs()
        hits["memory"] += fast
        s["hits"] = hits
        s["fallback_ops"] = sorted(self.fallback_ops)
        s["widened_ops"] = {op: sorted(how) for op, how in sorted(self.widened_ops.items())}
        s["compiler"] = self.compiler.name
        s["compile_mode"] = self.cfg.compile_mode
        with self.resolver._kinds_lock:
            s["compiles_by_kind"] = dict(self.resolver.compile_kinds)
        s["compile_phases"] = self.resolver.phase_times.summary()
        s["graphs"] = dict(self.graph_counts, compiles=s["compiles_by_kind"]["graph"])
        if NATIVE is not None:  # graphs run by kernels' native autograd nodes (kernels/_kernel.py)
            s["graphs"]["graph_executions"] += NATIVE.graph_runs()
        bg = self.resolver._background
        if bg is not None:
            s["background"] = bg.stats()
        if self.fusion is not None:
            s["fusion"] = self.fusion.counters()
        s["megacache"] = megacache_stats()
        group = sys.modules.get("neuron_runtime.distributed._group")
        if group is not None:
            s["collectives"] = group.counts()
        return s

    # -- executables ------------------------------------------------------------------------------
    def executable_for(self, sig: dict[str, Any], wait: bool | None = None,
                       seen: bool = False) -> tuple[Executable | None, str]:
        """Find or make the executable of a signature (an op's, or a fused group's graph); in background
        mode (None, key) while it compiles (see `Resolver.resolve`, and its `seen`)."""
        return self.resolver.resolve(sig, wait, seen)

    def close(self) -> None:
        """Write the job's manifest and disconnect from the compile service (at exit, or on reset)."""
        self.resolver.close()

    def _evicted(self) -> None:
        """The resolver dropped executables: so do the kernels' per-key tables and the native layer."""
        live = self.resolver.live()
        for _, exes in _EXES.values():
            for k in [k for k, e in exes.items() if id(e) not in live]:
                del exes[k]
        _forget_native()

    # -- fallbacks --------------------------------------------------------------------------------
    def note_fallback(self, info: OpInfo, key: Any, sig: dict[str, Any] | None, why: str) -> None:
        name = info.qualname
        if not self.cfg.fallback:
            detail = "" if sig is None else f"; signature {canonical(sig).decode()}"
            raise FallbackDisabledError(
                f"{name} cannot run compiled ({why}) and TORCH_NEURONX_FALLBACK=0 forbids running it on "
                f"the host{detail}")
        with self.lock:
            self.fallback_keys.add((name, key))
            if name not in self.fallback_ops:
                self.fallback_ops[name] = why
                warnings.warn(f"neuron: {name} runs on the host ({why}); see neuron_runtime.fallback_ops()",
                              UserWarning, stacklevel=4)

    # -- the slow path of compute / mutating kernels ----------------------------------------------
    def slow_call(self, info: OpInfo, exes: dict[Any, Executable], key: Any,
                  values: tuple[Any, ...]) -> Any:
        """Everything but a hit: check devices, find or make the executable, run it, check the result
        against the op's contract once, then let the hit path serve this key. A profiler sees it as
        `neuron::miss <op>` (README "Profiling"), except a key known to run on the host: that is its
        `neuron::fallback` range alone, every call."""
        if not _profiling.active() or (info.qualname, key) in self.fallback_keys:
            return self._slow_call(info, exes, key, values)
        with _profiling.span(f"neuron::miss {info.qualname}"):
            return self._slow_call(info, exes, key, values)

    def _slow_call(self, info: OpInfo, exes: dict[Any, Executable], key: Any,
                   values: tuple[Any, ...]) -> Any:
        if self.fusion is not None:
            self.fusion.flush_for(info)  # ops run in stream order: queued ones first
        other_out = bool(info.mutable) and check_mutated(info, values)
        plan = self.widened.get((info.qualname, key))
        if plan is not None:  # the host kernel lacks one of these dtypes: computed wider
            return self.widen(info, key, values, plan=plan)
        inplace = self.writes_in_place(info)
        f = info if inplace else info.functional or info
        fvalues = values if f is info else info.functional_values(values)
        host_values = tuple(to_host(v, strict=a.kind != OPT_TENSORS) for a, v in zip(info.args, values))
        if info.mutable and overlapping(info, values):
            # A write that partially overlaps an input: CPU's kernel on views sharing one storage decides
            # (its "unsupported operation" error, or a run with the aliasing as on CPU), out= of another
            # dtype included.
            return self.host_shared(info, values, shared_views(values, host_values))
        if other_out:  # out= of another dtype: the CPU out= kernel applies PyTorch's rules for it
            return self.host_or_widen(info, key, values, host_values)[0]
        if (info.qualname, key) in self.fallback_keys:
            return self.host_or_widen(info, key, values, host_values, fallback=True)[0]
        # Background mode: a key whose executable is being compiled runs on the host meanwhile.
        waited = self.waiting.get((info.qualname, key))
        if waited is not None and not self.resolver.has(waited) and \
                self.resolver.background.lookup(waited)[0]:
            return self.host_or_widen(info, key, values, host_values, counter="host_runs")[0]
        try:
            sig = build_signature(f, fvalues)
            if inplace:
                sig["writes"] = list(info.mutable)
            exe, digest = self.resolver.resolve(sig)
        except (CompileRefused, SignatureError) as e:
            return self.refused(info, key, None, str(e), values, host_values)
        except (CacheMissError, IntegrityError):
            raise
        except Exception as e:  # noqa: BLE001 - a failed compile is a fallback, not a user error
            log.debug("compile of %s failed", info.qualname, exc_info=True)
            return self.refused(info, key, None, f"compile failed: {type(e).__name__}: {e}", values, host_values)
        if exe is None:
            self.waiting[(info.qualname, key)] = digest
            return self.host_or_widen(info, key, values, host_values, counter="host_runs")[0]
        tensors, scalars = flatten(f, host_values if f is info else info.functional_values(host_values))
        # An in-place executable writes the mutated tensors themselves: if it fails, what it wrote is
        # restored before the host runs the op (the first call of a key; see compiler._base).
        saved = [h.clone() for h in mutated_views(info, host_values)] if inplace else []
        try:
            outs = trace_run(exe, tensors, scalars)
        except Exception as e:  # noqa: BLE001
            for h, c in zip(mutated_views(info, host_values), saved):
                h.copy_(c)
            # Either the op is invalid for these inputs (the host raises the user's error), or the host
            # kernel lacks their dtype (computed wider from now on), or the executable is broken (the
            # host succeeds, and this key falls back from now on).
            result, widened = self.host_or_widen(info, key, values, host_values, fallback=True)
            if not widened:
                self.note_fallback(info, key, sig, f"executable failed: {type(e).__name__}: {e}")
            return result
        with self.lock:
            self.counts["executions"] += 1
        if self.fusion is not None:
            self.fusion.learn(info, key, sig, list(outs))
        result = self.mutating_result(info, values, [a.name for a in info.args]) if inplace else \
            self.finish(info, values, host_values, list(outs))
        exes[key] = exe  # undefined outputs (None) stay None on the hit path too
        if waited is not None:
            # Compiled in the background: the native layer learnt this key as "Python only" meanwhile.
            del self.waiting[(info.qualname, key)]
            _forget_native()
        return result

    def writes_in_place(self, info: OpInfo) -> bool:
        """Whether this op's executables write its mutated tensor lists in place (`compiler._base`)
        rather than return fresh results to copy back: the compiler tier can, and fusion is off (its
        groups learn from functional results)."""
        return info.writes_lists and self.fusion is None and self.compiler.writes_inputs

    def refused(self, info: OpInfo, key: Any, sig: dict[str, Any] | None, why: str,
                values: tuple[Any, ...], host_values: tuple[Any, ...]) -> Any:
        """The compiler refused the key: the host runs it (a fallback), or, if the host kernel lacks an
        input's dtype, the op computes wider through executables (not a fallback)."""
        if not self.cfg.fallback:
            self.note_fallback(info, key, sig, why)  # raises
        result, widened = self.host_or_widen(info, key, values, host_values, fallback=True)
        if not widened:
            self.note_fallback(info, key, sig, why)
        return result

    def host_or_widen(self, info: OpInfo, key: Any, values: tuple[Any, ...], host_values: tuple[Any, ...],
                      fallback: bool = False, counter: str | None = None) -> tuple[Any, bool]:
        """`host_call`, unless the host kernel lacks a dtype of the inputs: then the op computes in the
        nearest wider dtype the host has (`_widen`). Returns (result, widened)."""
        try:
            return self.host_call(info, values, host_values, fallback=fallback, counter=counter), False
        except Exception as e:
            if not _widen.named_dtypes(e):
                raise
            return self.widen(info, key, values, err=e), True

    def widen(self, info: OpInfo, key: Any, values: tuple[Any, ...], err: BaseException | None = None,
              plan: _widen.Plan | None = None) -> Any:
        args, kwargs = info.call_args(values)
        out, plan = _widen.run(info.qualname, info.op, args, kwargs, err, plan)
        if key is not None:
            self.widened[(info.qualname, key)] = plan
        self.note_widened(info.qualname, plan.describe())
        return out

    def note_widened(self, qualname: str, how: str) -> None:
        with self.lock:
            self.widened_ops.setdefault(qualname, set()).add(how)
            self.counts["widened"] += 1

    def finish(self, info: OpInfo, values: tuple[Any, ...], host_values: tuple[Any, ...],
               outs: list[torch.Tensor]) -> Any:
        if info.kind != "mutating":
            if info.returns_list:
                return [wrap(o) for o in outs]
            if info.n_returns == 1:
                return None if outs[0] is None else wrap(outs[0])
            return tuple(None if o is None else wrap(o) for o in outs)
        names = [a.name for a in info.args]
        for name, out in zip(info.mutable, regroup(info, values, outs)):
            i = names.index(name)
            target, host = values[i], host_values[i]
            if isinstance(target, (list, tuple)):
                for t, h, o in zip(target, host, out):
                    copy_back(t, h, o, info)
            else:
                copy_back(target, host, out, info)
        return self.mutating_result(info, values, names)

    @staticmethod
    def mutating_result(info: OpInfo, values: tuple[Any, ...], names: list[str]) -> Any:
        rets = [values[names.index(r)] for r in info.returns_args]
        if info.n_returns == 0:
            return None
        if info.n_returns == 1:
            return rets[0]
        return tuple(rets)

    def host_shared(self, info: OpInfo, values: tuple[Any, ...], host_values: tuple[Any, ...]) -> Any:
        """The op itself on CPU views that share storage as the neuron tensors do (`_writes.shared_views`),
        out= tensors included: CPU's kernel sees the aliasing and applies its own rules to it."""
        args, kwargs = info.call_args(host_values)
        op = _op_for_numbers(info, args, kwargs)
        grown = False
        try:
            out = op(*args, **kwargs)
        except RuntimeError as e:
            if "not resizable" not in str(e):
                raise
            grown = True  # (CPU's verdict below is raised outside this handler: no chained traceback)
        if grown:
            # An out= tensor CPU grows past its storage's end (neuron memory does not grow in place): CPU's
            # verdict on copies of the storages; where it allows the call, the host path's fresh out= tensors.
            plain = tuple(to_host(v) for v in values)
            copy_args, copy_kwargs = info.call_args(shared_views(values, plain, copies=True))
            op(*copy_args, **copy_kwargs)
            return self.host_call(info, values, plain)
        adopt_geometry(info, values, host_values)
        with self.lock:
            self.counts["host_ops"] += 1
        return rewrap(out, values, host_values, to_cpu_result=_wants_cpu(info, values))

    def host_call(self, info: OpInfo, values: tuple[Any, ...], host_values: tuple[Any, ...],
                  fallback: bool = False, counter: str | None = None) -> Any:
        """Run the op itself on CPU views; outputs that are an input's view come back as that input.

        out= arguments get fresh CPU tensors (the host kernel may need to resize them, which neuron
        memory cannot do in place), then the neuron out tensors are resized and filled."""
        call_values = list(host_values)
        outs: list[tuple[torch.Tensor, torch.Tensor]] = []
        for i, (a, v) in enumerate(zip(info.args, values)):
            if a.mutable and a.kwarg_only and isinstance(v, torch.Tensor) and v.device.type == DEVICE:
                call_values[i] = torch.empty(0, dtype=v.dtype)
                outs.append((v, call_values[i]))
        args, kwargs = info.call_args(call_values)
        counter = counter or ("fallbacks" if fallback else "host_ops")
        with _profiling.span(_HOST_SPANS[counter] + info.qualname) if counter in _HOST_SPANS else _profiling.NULL:
            out = _op_for_numbers(info, args, kwargs)(*args, **kwargs)
        with self.lock:
            self.counts[counter] += 1
        for target, h in outs:
            copy_back_out(target, h)
        if outs:
            host_values = tuple(next((h for t, h in outs if t is v), hv) for v, hv in zip(values, host_values))
        return rewrap(out, values, host_values, to_cpu_result=_wants_cpu(info, values))


# Host runs a profiler names (README "Profiling"): while the key's executable compiles, and fallbacks
# (no executable); an op that always runs on the host (`host_ops`) is its aten op's range alone.
_HOST_SPANS = {"host_runs": "neuron::host_run ", "fallbacks": "neuron::fallback "}


# Ops whose overload objects take a Python number in a Tensor slot themselves, as a wrapped number (what
# C++ passed): called as they are, they keep CPU's rules exactly, out= dtypes included (`mul.Scalar_out`
# refuses a float64 `out` for a float32 result that `mul.out` with a wrapped number writes).
_TAKE_NUMBERS = frozenset({"aten::add", "aten::sub", "aten::mul", "aten::div"})


def _op_for_numbers(info: OpInfo, args: list[Any], kwargs: dict[str, Any]) -> Any:
    """The overload to call on the host: a Python number in a Tensor slot needs the Scalar overload,
    except for the ops that take it as a wrapped number themselves."""
    numbers = {a.name for a, v in zip(info.args, [*args, *kwargs.values()])
               if a.kind == TENSOR and type(v) in NUMBERS}
    if numbers and info.op._schema.name in _TAKE_NUMBERS:
        return info.op
    return scalar_overload(info.op, numbers)


def _wants_cpu(info: OpInfo, values: tuple[Any, ...]) -> bool:
    for a, v in zip(info.args, values):
        if a.name == "device" and v is not None:
            return torch.device(v).type == "cpu"
    return False


#: The kernels' tables of executables, by op: what the hit path serves (`_codegen`).
_EXES: dict[str, tuple[OpInfo, dict[Any, Executable]]] = {}


def kernel_table(info: OpInfo) -> dict[Any, Executable]:
    """A new, empty table of executables for a kernel of `info`, registered so that the runtime's reset and
    eviction empty it (one per op: a new kernel of the op replaces the old one's)."""
    exes: dict[Any, Executable] = {}
    _EXES[info.qualname] = (info, exes)
    return exes


_current: Runtime | None = None
_runtime_lock = threading.Lock()
set_provider(lambda: runtime().resolver)  # Mega-Cache bundles load into this runtime's tiers


def runtime() -> Runtime:
    global _current
    if _current is None:
        with _runtime_lock:  # a named job's prefetch may make it on another thread at import
            if _current is None:
                _current = Runtime(_config.get())
    return _current


def made_runtime() -> Runtime | None:
    """The runtime if an op (or a prefetch) made it already, else None (nothing ran on the device)."""
    return _current


def reset_runtime(cfg: _config.Config | None = None) -> Runtime:
    """Start over with a fresh runtime (new config, empty in-memory caches). For tests and the CLI."""
    global _current
    if _current is not None:
        _current.close()
    _current = Runtime(cfg or _config.reload())
    for info, exes in _EXES.values():
        exes.clear()
    _forget_native()
    if NATIVE is not None:
        NATIVE.forget_kernels()  # kernels' native calls (kernels/_kernel.py) were made with the old one
    return _current


def _forget_native() -> None:
    """The native hit path keeps its own table of the executables in `_EXES`: empty it with them."""
    if NATIVE is not None:
        NATIVE.clear()

"""One dispatch path for every eager op on `neuron` (DESIGN §2).

Each aten op with a CPU kernel gets a Python kernel for PrivateUse1, chosen by its kind (`_ops.py`):

  view       the CPU kernel runs on the neuron tensor itself (metadata only)
  host       the op runs on CPU views of the neuron memory (random ops, data-dependent shapes, ...)
  special    its own kernel (`_special.py`)
  compute    generated per op (see `_codegen`): key tuple -> executable -> outputs relabelled to neuron
  mutating   the functional variant's executable, then a copy into the mutated arguments

The hit path of `compute`/`mutating` is the product's inner loop: the kernel is Python source generated
from the op's schema, so arguments bind natively, the key is one tuple and the executable one call.
Everything that is not a hit goes to `Runtime.slow_call`, which does the checks once per key.
"""

from __future__ import annotations

import logging
import sys
import threading
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch

from .. import _config, _profiling
from .._native import NATIVE, to_cpu, to_neuron, trace_run
from ..executables import (CacheMissError, CompileRefused, Compiler, Executable, IntegrityError, Resolver, TieredCache,
                           megacache_stats, set_provider)
from ..signatures import (
    OPT_TENSOR,
    OPT_TENSORS,
    OpInfo,
    SCALAR,
    SCALARS,
    SignatureError,
    TENSOR,
    TENSORS,
    VALUE,
    build_signature,
    canonical,
    scalar_overload,
)
from . import _fusion, _widen
from ._writes import (_dtype_name, check_mutated, device_error, out_device_error, overlapping, shared_views,
                      spans_meet, spans_meet_lists, spans_touch)

log = logging.getLogger(__name__)

DEVICE = "neuron"


class NeuronRuntimeError(RuntimeError):
    """Base of the runtime's errors."""


class FallbackDisabledError(NeuronRuntimeError):
    """An op could not be compiled and TORCH_NEURONX_FALLBACK=0 forbids running it on the host."""


# --------------------------------------------------------------------------------------------------
# CPU aliases of neuron tensors.
#
# `_aliases[id(t)] = (cpu_view, data_ptr, meta, weakref)` for neuron tensors this runtime created (op
# outputs, allocations) and for any neuron tensor once seen as an input. The entry is dropped when the
# tensor dies (weakref callback), and validated on use against the data pointer and the (dtype, sizes,
# strides) the kernel computed for its key anyway, so `t.data = ...`, in-place metadata ops and
# `swap_tensors` can never hand an executable a stale view.
# --------------------------------------------------------------------------------------------------
_aliases: dict[int, tuple[torch.Tensor, int, tuple[Any, ...], Any]] = {}
_alias_get = _aliases.get
_ref = weakref.ref
_alias_op = torch.ops.aten.alias.default


def _dropper(i: int) -> Callable[[Any], None]:
    # `pop` bound now: at interpreter exit the module's globals may be gone before the last tensors die.
    def drop(_: Any, i: int = i, pop: Callable[..., Any] = _aliases.pop) -> None:
        pop(i, None)

    return drop


def wrap(o: torch.Tensor) -> torch.Tensor:
    """A neuron tensor over the memory of fresh CPU tensor `o`, remembering `o` as its CPU view."""
    n = to_neuron(o)
    i = id(n)
    _aliases[i] = (o, o.data_ptr(), (o.dtype, o.shape, o.stride()), _ref(n, _dropper(i)))
    return n


def alias_mutated(t: torch.Tensor, meta: tuple[Any, ...] | None = None) -> torch.Tensor:
    """The CPU view of a tensor an op writes into: a CPU tensor there (even a 0-dim one, which may be
    read as a scalar) is an error, as on CUDA; nothing is written across devices."""
    if t.device.type != DEVICE:
        raise device_error(t)
    return alias_slow(t, meta)


def alias_slow(t: torch.Tensor, meta: tuple[Any, ...] | None = None) -> torch.Tensor:
    """The CPU view of `t` when the cached one is missing or stale (or `t` is a CPU scalar)."""
    if t.device.type == DEVICE:
        if t.is_conj() or t.is_neg():
            return _alias_with_bits(t)
        # Relabel a fresh alias, not `t` itself: the capsule keeps its source alive, and holding `t`'s own
        # TensorImpl would keep the Python tensor from ever dying (PyTorch preserves the PyObject).
        c = to_cpu(_alias_op(t))
        i = id(t)
        _aliases[i] = (c, t.data_ptr(), meta if meta is not None else (t.dtype, t.shape, t.stride()),
                       _ref(t, _dropper(i)))
        return c
    if t.dim() == 0 and t.device.type == "cpu":
        return t  # CPU scalars mix with device tensors, as on CUDA
    raise device_error(t)


def _alias_with_bits(t: torch.Tensor) -> torch.Tensor:
    """The CPU view of a lazily conjugated or negated tensor (`x.conj()`, `x.conj().imag`).

    DLPack carries neither bit: view the raw memory, then set the bits again on the CPU side, so reads
    and writes through the view see what PyTorch would. Not cached (the key does not hold the bits)."""
    raw = t.conj() if t.is_conj() else t  # flips the bit off: a view of the stored values
    if raw.is_neg():
        raw = raw._neg_view()
    c = to_cpu(_alias_op(raw))
    if t.is_neg():
        c = c._neg_view()
    return c.conj() if t.is_conj() else c


def alias(t: torch.Tensor) -> torch.Tensor:
    meta = (t.dtype, t.shape, t.stride())
    e = _alias_get(id(t))
    if e is not None and e[2] == meta and e[1] == t.data_ptr():
        return e[0]
    return alias_slow(t, meta)


def forget(t: torch.Tensor) -> None:
    """Drop the cached CPU view of `t` (after an op changed its storage or metadata)."""
    _aliases.pop(id(t), None)


def to_host(v: Any, strict: bool = False) -> Any:
    """Replace neuron tensors in an argument (lists too) by their CPU views.

    `strict`: a CPU tensor (other than a 0-dim scalar) is an error, as on CUDA for compute ops."""
    if isinstance(v, torch.Tensor):
        if v.device.type == DEVICE:
            return alias(v)
        if strict and v.dim() != 0:
            raise device_error(v)
        return v
    if isinstance(v, (list, tuple)):
        return type(v)(to_host(x, strict) for x in v)
    if isinstance(v, torch.device) and v.type == DEVICE:
        return torch.device("cpu")
    return v


# --------------------------------------------------------------------------------------------------
# The runtime: executables, fallbacks, counters.
# --------------------------------------------------------------------------------------------------
# Executions on the hit path: a list cell, the cheapest thing Python can bump (read by `stats()`).
FAST = [0]


class _Fallback:
    """Marks an in-process key whose op runs on the host (compile refused or executable failed)."""


FALLBACK = _Fallback()


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
    def executable_for(self, sig: dict[str, Any], wait: bool | None = None) -> tuple[Executable | None, str]:
        """Find or make the executable of a signature (an op's, or a fused group's graph); in background
        mode (None, key) while it compiles (see `Resolver.resolve`)."""
        return self.resolver.resolve(sig, wait)

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
        fvalues = values if f is info else tuple(v for a, v in zip(info.args, values)
                                                 if not (a.mutable and a.kwarg_only))
        host_values = tuple(to_host(v, strict=a.kind != OPT_TENSORS) for a, v in zip(info.args, values))
        if other_out:  # out= of another dtype: the CPU out= kernel applies PyTorch's rules for it
            return self.host_or_widen(info, key, values, host_values)[0]
        if info.mutable and overlapping(info, values):
            # A write that partially overlaps an input: CPU's kernel on views sharing one storage decides
            # (its "unsupported operation" error, or a run with the aliasing as on CPU).
            return self.host_shared(info, values, shared_views(values, host_values))
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
        tensors, scalars = flatten(f, host_values if f is info else
                                   tuple(v for a, v in zip(info.args, host_values)
                                         if not (a.mutable and a.kwarg_only)))
        # An in-place executable writes the mutated tensors themselves: if it fails, what it wrote is
        # restored before the host runs the op (the first call of a key; see compiler._base).
        saved = [h.clone() for h in _mutated_views(info, host_values)] if inplace else []
        try:
            outs = trace_run(exe, tensors, scalars)
        except Exception as e:  # noqa: BLE001
            for h, c in zip(_mutated_views(info, host_values), saved):
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
        args = [v for a, v in zip(info.args, values) if not a.kwarg_only]
        kwargs = {a.name: v for a, v in zip(info.args, values) if a.kwarg_only}
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
        args = [h for a, h in zip(info.args, host_values) if not a.kwarg_only]
        kwargs = {a.name: h for a, h in zip(info.args, host_values) if a.kwarg_only}
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
            copies = shared_views(values, plain, copies=True)
            op(*[h for a, h in zip(info.args, copies) if not a.kwarg_only],
               **{a.name: h for a, h in zip(info.args, copies) if a.kwarg_only})
            return self.host_call(info, values, plain)
        with self.lock:
            self.counts["host_ops"] += 1
        return rewrap(out, values, host_values, to_cpu_result=_wants_cpu(info, values))

    def host_call(self, info: OpInfo, values: tuple[Any, ...], host_values: tuple[Any, ...],
                  fallback: bool = False, counter: str | None = None) -> Any:
        """Run the op itself on CPU views; outputs that are an input's view come back as that input.

        out= arguments get fresh CPU tensors (the host kernel may need to resize them, which neuron
        memory cannot do in place), then the neuron out tensors are resized and filled."""
        args, kwargs = [], {}
        outs: list[tuple[torch.Tensor, torch.Tensor]] = []
        for a, v, h in zip(info.args, values, host_values):
            if a.mutable and a.kwarg_only and isinstance(v, torch.Tensor) and v.device.type == DEVICE:
                h = torch.empty(0, dtype=v.dtype)
                outs.append((v, h))
            if a.kwarg_only:
                kwargs[a.name] = h
            else:
                args.append(h)
        counter = counter or ("fallbacks" if fallback else "host_ops")
        with _profiling.span(_HOST_SPANS[counter] + info.qualname) if counter in _HOST_SPANS else _profiling.NULL:
            out = _op_for_numbers(info, args, kwargs)(*args, **kwargs)
        with self.lock:
            self.counts[counter] += 1
        for target, h in outs:
            _copy_back_out(target, h)
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


def rewrap(out: Any, values: tuple[Any, ...], host_values: tuple[Any, ...], to_cpu_result: bool = False) -> Any:
    """Map host results back: an input's CPU view becomes that input; a fresh CPU tensor becomes neuron."""
    if isinstance(out, torch.Tensor):
        for v, h in zip(values, host_values):
            if h is out:
                return v
            if isinstance(h, (list, tuple)):
                for vv, hh in zip(v, h):
                    if hh is out:
                        return vv
        if to_cpu_result or out.device.type != "cpu":
            return out
        return wrap(out)
    if isinstance(out, (list, tuple)):
        return type(out)(rewrap(o, values, host_values, to_cpu_result) for o in out)
    return out


def regroup(info: OpInfo, values: tuple[Any, ...], outs: list[Any]) -> list[Any]:
    """A mutating op's functional results, one entry per mutated argument.

    A single `Tensor[]` return comes back as the list itself (`_foreach_add_`); several `Tensor[]`
    returns (`_fused_adamw_`) may come back flat, and are split by the lengths of the mutated lists."""
    f = info.functional or info
    if f.returns_list:
        return [outs]
    names = [a.name for a in info.args]
    lists = [values[names.index(m)] for m in info.mutable]
    if not any(isinstance(v, (list, tuple)) for v in lists) or not outs or \
            not isinstance(outs[0], torch.Tensor) or len(outs) == len(lists):
        return outs
    grouped, i = [], 0
    for v in lists:
        n = len(v) if isinstance(v, (list, tuple)) else 1
        grouped.append(outs[i:i + n] if isinstance(v, (list, tuple)) else outs[i])
        i += n
    return grouped


def _mutated_views(info: OpInfo, host_values: tuple[Any, ...]) -> list[torch.Tensor]:
    """The CPU views of the tensors a mutating op writes, flattened."""
    out: list[torch.Tensor] = []
    for a, h in zip(info.args, host_values):
        if a.name in info.mutable:
            out.extend(h if isinstance(h, (list, tuple)) else [h])
    return out


def _copy_back_all(info: OpInfo, values: tuple[Any, ...], outs: list[Any]) -> None:
    """The hit path's copy-back for ops that mutate lists of tensors."""
    names = [a.name for a in info.args]
    for name, out in zip(info.mutable, regroup(info, values, outs)):
        target = values[names.index(name)]
        if isinstance(target, (list, tuple)):
            dst = [alias(t) for t in target]
            if dst:
                torch._foreach_copy_(dst, list(out))
        else:
            _copy_back_out(target, out)


def copy_back(target: torch.Tensor, host: torch.Tensor, result: torch.Tensor, info: OpInfo) -> None:
    """Write a functional result into the tensor an in-place or out= op mutates."""
    if target.shape != result.shape:
        if info.mutable and info.args[[a.name for a in info.args].index(info.mutable[0])].kwarg_only:
            target.resize_(result.shape)  # out=: resized like PyTorch does (our resize_ kernel)
            host = alias(target)
        else:
            raise RuntimeError(f"{info.qualname}: output with shape {list(target.shape)} doesn't match the "
                               f"broadcast shape {list(result.shape)}")
    if result.dtype != host.dtype and not torch.can_cast(result.dtype, host.dtype):
        raise RuntimeError(f"{info.qualname}: result type {result.dtype} can't be cast to the desired output "
                           f"type {host.dtype}")
    host.copy_(result)


def flatten(info: OpInfo, host_values: tuple[Any, ...]) -> tuple[list[torch.Tensor], list[Any]]:
    """The executable's (tensors, scalars) for one call, in the order of `compiler._base`'s contract."""
    tensors: list[torch.Tensor] = []
    scalars: list[Any] = []
    for a, v in zip(info.args, host_values):
        k = a.kind
        if k == TENSOR:
            tensors.append(v)
        elif k == OPT_TENSOR:
            if v is not None:
                tensors.append(v)
        elif k in (TENSORS, OPT_TENSORS):
            tensors.extend(t for t in v if t is not None)
        elif k == SCALAR:
            if v is not None:
                scalars.append(v)
        elif k == SCALARS:
            if v is not None:
                scalars.extend(v)
    return tensors, scalars


_runtime: Runtime | None = None
_runtime_lock = threading.Lock()
set_provider(lambda: runtime().resolver)  # Mega-Cache bundles load into this runtime's tiers


def runtime() -> Runtime:
    global _runtime
    if _runtime is None:
        with _runtime_lock:  # a named job's prefetch may make it on another thread at import
            if _runtime is None:
                _runtime = Runtime(_config.get())
    return _runtime


def made_runtime() -> Runtime | None:
    """The runtime if an op (or a prefetch) made it already, else None (nothing ran on the device)."""
    return _runtime


def reset_runtime(cfg: _config.Config | None = None) -> Runtime:
    """Start over with a fresh runtime (new config, empty in-memory caches). For tests and the CLI."""
    global _runtime
    if _runtime is not None:
        _runtime.close()
    _runtime = Runtime(cfg or _config.reload())
    for info, exes in _EXES.values():
        exes.clear()
    _forget_native()
    return _runtime


def _forget_native() -> None:
    """The native hit path keeps its own table of the executables in `_EXES`: empty it with them."""
    if NATIVE is not None:
        NATIVE.clear()


# --------------------------------------------------------------------------------------------------
# Kernel generation.
# --------------------------------------------------------------------------------------------------
_EXES: dict[str, tuple[OpInfo, dict[Any, Executable]]] = {}


NUMBERS = frozenset({bool, int, float, complex})


def _tensor_key(x: str) -> str:
    return f"({x}.dtype, {x}.shape, {x}.stride())"


def _codegen(info: OpInfo) -> Callable[..., Any]:
    """Generate the kernel of a compute or mutating op from its schema.

    Every name the generated code introduces starts with `_z` (no schema argument does), so an op's
    arguments (`N`, `key`, `out`, ...) never shadow them."""
    f = info.functional or info
    fnames = {a.name for a in f.args}
    fuse = runtime().fusion is not None  # decided when the kernel is built: flag off, nothing changes

    can_queue = fuse and _fusion.fusible(info)
    params: list[str] = []
    kwonly: list[str] = []
    defaults: list[Any] = []
    for a in info.args:
        if a.has_default:
            defaults.append(a.default)
            p = f"{a.name}=_zDF[{len(defaults) - 1}]"
        else:
            p = a.name
        (kwonly if a.kwarg_only else params).append(p)
    sig = ", ".join(params + (["*"] + kwonly if kwonly else []))
    key_lines: list[str] = []
    alias_lines: list[str] = []
    key_items: list[str] = []
    tens: list[str] = []   # expressions building the tensor list
    scal: list[str] = []   # expressions building the scalar list
    mutated: dict[str, str] = {}  # arg name -> expression of its CPU view(s)
    for j, a in enumerate(arg for arg in info.args if arg.name in fnames and not (arg.mutable and arg.kwarg_only)):
        n, k = a.name, a.kind
        if k == TENSOR:
            # A Python number here is a "wrapped number" (`x * 2`): keyed by type, passed as is.
            key_lines.append(f"_zk{j} = {n}.__class__ if {n}.__class__ in _zNUM else {_tensor_key(n)}")
            alias_lines += [
                f"if _zk{j}.__class__ is type: _zc{j} = {n}",
                "else:",
                f"    _ze = _zAG(id({n}))",
                f"    _zc{j} = _ze[0] if _ze is not None and _ze[2] == _zk{j} and _ze[1] == {n}.data_ptr() "
                f"else {'_zASM' if a.mutable else '_zAS'}({n}, _zk{j})",
            ]
            key_items.append(f"_zk{j}")
            tens.append(f"_zc{j}")
            mutated[n] = f"_zc{j}"
        elif k == OPT_TENSOR:
            key_items.append(f"(None if {n} is None else {_tensor_key(n)})")
            tens.append(f"*(() if {n} is None else (_zAL({n}),))")
        elif k == TENSORS:
            key_items.append(f"tuple([{_tensor_key('_zt')} for _zt in {n}])")
            alias_lines.append(f"_zl{j} = [_zAL(_zt) for _zt in {n}]")
            tens.append(f"*_zl{j}")
            mutated[n] = f"_zl{j}"
        elif k == OPT_TENSORS:
            key_items.append(f"tuple([None if _zt is None else {_tensor_key('_zt')} for _zt in {n}])")
            tens.append(f"*[_zAL(_zt) for _zt in {n} if _zt is not None]")
        elif k == SCALAR:
            key_items.append(f"{n}.__class__")
            scal.append(f"*(() if {n} is None else ({n},))" if a.optional else n)
        elif k == SCALARS:
            key_items.append(f"(None if {n} is None else tuple([_zs.__class__ for _zs in {n}]))")
            scal.append(f"*(() if {n} is None else {n})")
        elif k == VALUE:
            key_items.append(f"(tuple({n}) if {n}.__class__ is list else {n})")
        else:  # pragma: no cover - classify() never sends these here
            raise AssertionError(f"{info.qualname}: {n} of kind {k}")
    values = "(" + "".join(f"{a.name}, " for a in info.args) + ")"
    key = "(" + "".join(f"{x}, " for x in key_items) + ")"
    call_tensors = "[" + ", ".join(tens) + "]"
    call_scalars = "[" + ", ".join(scal) + "]"
    # 1. The key, cheap: a miss needs nothing else. 2. CPU views. 3. Run. 4. Outputs.
    lines = [f"def kernel({sig}):"]
    if fuse and not can_queue:
        lines.append(f"    if _zPENDING: _zFLUSH({('op:' + info.qualname)!r})")
    lines += ["    " + b for b in key_lines]
    lines.append(f"    _zkey = {key}")
    lines.append("    _zexe = _zEG(_zkey)")
    lines.append("    if _zexe is None:")
    lines.append(f"        return _zRT().slow_call(_zINFO, _zEXES, _zkey, {values})")
    overlap = _overlap_test(info)
    if overlap:  # a write that may partially overlap an input: the slow path applies CPU's rule
        lines.append(f"    if {overlap}:")
        lines.append(f"        return _zRT().slow_call(_zINFO, {{}}, _zkey, {values})")
    lines += ["    " + b for b in alias_lines]
    if info.kind == "mutating":
        rets = info.returns_args
        ret_line = ("    return None" if info.n_returns == 0 else f"    return {rets[0]}" if info.n_returns == 1
                    else f"    return ({', '.join(rets)},)")
    if can_queue:
        lines.append(f"    _zT, _zS = {call_tensors}, {call_scalars}")
        if info.kind == "mutating":  # fusible in-place ops update their first argument
            m = mutated[info.mutable[0]]
            lines.append(f"    if _zSUBMIT(_zINFO, _zkey, _zexe, _zT, _zS, {m if m.startswith('_zl') else f'[{m}]'}):")
            lines.append("    " + ret_line)
        else:
            lines.append("    _zr = _zSUBMIT(_zINFO, _zkey, _zexe, _zT, _zS)")
            lines.append("    if _zr is not None:")
            lines.append("        return _zr")
        call_tensors, call_scalars = "_zT", "_zS"
    lines.append("    try:")
    lines.append(f"        _zouts = _zexe({call_tensors}, {call_scalars})")
    lines.append("    except Exception:")
    lines.append(f"        return _zRT().slow_call(_zINFO, {{}}, _zkey, {values})")
    lines.append("    _zN[0] += 1")
    if info.kind == "mutating" and len(info.mutable) == 1 and f.returns_list and \
            mutated.get(info.mutable[0], "").startswith("_zl"):
        # One list mutated, one list returned (`_foreach_add_`): copy into the CPU views taken above.
        # An in-place executable (`compiler._base`) returns [] and has written them already.
        lines.append(f"    if _zouts: _zFC({mutated[info.mutable[0]]}, _zouts)")
    elif info.kind == "mutating" and any(a.kind in (TENSORS, OPT_TENSORS) for a in info.args
                                         if a.name in info.mutable):
        # Lists of tensors mutated (fused optimizers); an in-place executable returns [] instead.
        lines.append(f"    if _zouts: _zCBA(_zINFO, {values}, _zouts)")
    elif info.kind == "mutating":
        for i, m in enumerate(info.mutable):
            if m in mutated and mutated[m].startswith("_zc"):
                lines.append(f"    {mutated[m]}.copy_(_zouts[{i}])")
            else:  # out= argument: may need a resize; another dtype than the result's: PyTorch's rules
                lines.append(f"    if {m}.dtype != _zouts[{i}].dtype: return _zRT().slow_call(_zINFO, {{}}, _zkey, {values})")
                lines.append(f"    _zCB({m}, _zouts[{i}])")
    if info.kind == "mutating":
        lines.append(ret_line)
    elif info.returns_list:
        lines.append("    return [_zW(_zo) for _zo in _zouts]")
    elif info.n_returns == 1:
        lines.append("    return _zW(_zouts[0])")
    else:  # an output may be undefined (None), e.g. a backward op with a False output_mask entry
        lines.append("    return tuple([None if _zo is None else _zW(_zo) for _zo in _zouts])")
    lists = [a.name for a in info.args if a.mutable and a.kind == TENSORS]
    if lists:
        # The tensors of a written list changed in place: bump their version counters, as CUDA's foreach
        # kernels do (no ADInplaceOrView kernel does it for list ops), before every return.
        bump = f"_zIV({lists[0]})" if len(lists) == 1 else f"_zIV([{', '.join('*' + n for n in lists)}])"
        lines = [ln for line in lines for ln in _bump_before_return(line, bump)]
    # The executable a call would use, or None (the native hit path learns its entries from this).
    lines += ["", f"def lookup({sig}):"] + ["    " + b for b in key_lines]
    if can_queue:  # and whether fusion still queues this call (then the native kernel hands it over)
        lines += [f"    _zkey = {key}",
                  "    return (_zEG(_zkey), _zQUEUES(_zINFO, _zkey), _zINFO, _zkey, _zOUTMETA(_zINFO, _zkey))"]
    else:
        lines.append(f"    return _zEG({key})")
    src = "\n".join(lines) + "\n"
    exes: dict[Any, Executable] = {}
    _EXES[info.qualname] = (info, exes)
    scope: dict[str, Any] = {
        "_zDF": defaults, "_zAG": _alias_get, "_zAS": alias_slow, "_zASM": alias_mutated, "_zAL": alias, "_zEG": exes.get,
        "_zEXES": exes, "_zRT": runtime, "_zINFO": info, "_zW": wrap, "_zN": FAST,
        "_zCB": _copy_back_out, "_zCBA": _copy_back_all, "_zNUM": NUMBERS, "_zFC": torch._foreach_copy_,
        "_zPENDING": _fusion.PENDING, "_zFLUSH": _fusion.flush, "_zSUBMIT": _fusion.submit,
        "_zQUEUES": _fusion.queues, "_zOUTMETA": _fusion.outmeta, "_zIV": torch._C._increment_version,
        "_zOV": spans_meet, "_zOVL": spans_meet_lists, "_zOVO": spans_touch,
    }
    exec(compile(src, f"<neuron kernel {info.qualname}>", "exec"), scope)  # noqa: S102 - generated above
    kernel: Callable[..., Any] = scope["kernel"]
    kernel.__neuron_source__ = src  # type: ignore[attr-defined]
    kernel.__neuron_lookup__ = scope["lookup"]  # type: ignore[attr-defined]
    return kernel


def _overlap_test(info: OpInfo) -> str:
    """The generated kernel's test whether the argument an op writes may overlap one it reads
    (`_writes.spans_meet`), or "" for an op that writes nothing or reads no tensor. Ops that write
    several arguments (fused optimizers) are left to their kernels, as on CPU."""
    if info.kind != "mutating" or len(info.mutable) != 1:
        return ""
    by_name = {a.name: a for a in info.args}
    w = by_name[info.mutable[0]]
    one = "_zOVO" if w.kwarg_only else "_zOV"  # an out= tensor: the very same tensor as an input counts too
    tests = []
    for a in info.args:
        if a.mutable or a.kind not in (TENSOR, OPT_TENSOR, TENSORS):
            continue
        if w.kind == TENSORS and a.kind == TENSORS:
            tests.append(f"_zOVL({w.name}, {a.name})")
        elif w.kind == TENSORS:
            tests.append(f"any({one}(_zt, {a.name}) for _zt in {w.name})")
        elif a.kind == TENSORS:
            tests.append(f"any({one}({w.name}, _zt) for _zt in {a.name})")
        else:
            tests.append(f"{one}({w.name}, {a.name})")
    return " or ".join(tests)


def _bump_before_return(line: str, bump: str) -> list[str]:
    """A generated kernel's line, with `bump` run before it if it returns (`return X` -> `_zr = X`,
    `bump`, `return _zr`)."""
    body = line.lstrip()
    if not body.startswith("return"):
        assert ": return" not in line, line  # every return of a list-mutating kernel is its own line
        return [line]
    pad = line[:len(line) - len(body)]
    return [f"{pad}_zr = {body.removeprefix('return').strip() or 'None'}", f"{pad}{bump}", f"{pad}return _zr"]


def _copy_back_out(target: torch.Tensor, result: torch.Tensor) -> None:
    if target.device.type != DEVICE:
        raise out_device_error(target)  # never write across devices
    if target.dtype != result.dtype and not torch.can_cast(result.dtype, target.dtype):
        raise RuntimeError(f"result type {_dtype_name(result.dtype)} can't be cast to the desired output type "
                           f"{_dtype_name(target.dtype)}")
    host = alias(target)
    if host.shape != result.shape:
        target.resize_(result.shape)
        host = alias(target)
    host.copy_(result)


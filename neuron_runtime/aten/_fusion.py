"""Experimental adaptive fusion, behind TORCH_NEURONX_ENABLE_CONCATENATION=1.

With the flag, a pointwise op whose executable is already known is *buffered* instead of run: a
functional op's outputs are allocated (so the caller gets real neuron tensors), an in-place op returns
its argument, and the op is queued. Pointwise here means PyTorch's `pointwise` tag, and the `_foreach_`
ops over it (the foreach optimizers' updates: `_foreach_mul_`, `_foreach_lerp_`, `_foreach_addcdiv_`...).
Anything else flushes the queue first, in stream order:

  * any other op reaching the runtime: a non-pointwise op, an out= op, a view op, a host op (`.item()`,
    `bool()`, printing, `.cpu()` all read through one), a copy;
  * a queued op reading or writing memory a queued op writes through another tensor (a view of a pending
    output or of a tensor an in-place op writes);
  * a change of grad mode or autocast state; the buffer limit
    (TORCH_NEURONX_CONCATENATION_BUFFER_SIZE_LIMIT); `torch.neuron.synchronize()`.

A queued op reading a tensor an earlier queued op writes (its output, or the tensor it updates in place)
is wired to that op's result; reading it before the write gives the old value, as in stream order.

A flushed group is identified by its ops' keys and how they are wired. Until it has been seen
TORCH_NEURONX_FUSION_MIN_SEEN times it runs op by op (so fusion never multiplies cold-start compiles);
then it is compiled as one executable (a graph signature: the ops' functional signatures and their
wiring, keyed and cached like any op) and run in one call, whose results are written into the outputs
and into the tensors the in-place ops update (each once, by its last writer). An output whose memory
nobody can read any more at the flush (no tensor, view or autograd-saved tensor holds it: its buffer's
use count is back to one) is never materialised. A group that fails to compile or run falls back to op
by op and is remembered as not fusible. Results are those of the same ops in the same order.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import torch

from .._native import FUSED, NATIVE, trace_run
from ..signatures import OPT_TENSOR, OpInfo, SCALAR, SCALARS, TENSOR, TENSORS, VALUE, build_signature, classify


_ARG_KINDS = (TENSOR, OPT_TENSOR, SCALAR, SCALARS, VALUE)


#: Tags of ops whose outputs' metadata is not known ahead of running them (or that draw on a generator).
_NOT_AHEAD = (torch.Tag.nondeterministic_seeded, torch.Tag.dynamic_output_shape,
              torch.Tag.data_dependent_output)


def fusible(info: OpInfo) -> bool:
    """Ops that join the pending region: every functional op whose outputs' metadata follows from its key
    (sizes, strides and dtypes of its tensors, the values of its structural arguments): pointwise,
    reductions, softmax, norms, losses, matmuls, backward ops, `cat`; and the `_foreach_` ops over a
    pointwise op (one list output). Functional, or in place on their first argument (`x.mul_(2)`,
    `x.zero_()`, `_foreach_lerp_(exp_avgs, ...)`). Not: ops whose outputs depend on the data
    (`nonzero`), random ops (they draw on the host, DESIGN §2), factories (no tensor input), out= ops,
    ops with an undefined output (learnt per key: `learn`)."""
    foreach = info.qualname.startswith("aten::_foreach_")
    if foreach:
        base = info.qualname.removeprefix("aten::_foreach_").split(".")[0].rstrip("_")
        packet = getattr(torch.ops.aten, base, None)
        if base == "copy" or packet is None or not any(
                torch.Tag.pointwise in getattr(packet, o).tags for o in packet.overloads()):
            return False
    elif any(t in info.op.tags for t in _NOT_AHEAD) or \
            not any(a.kind in (TENSOR, TENSORS) for a in info.args):
        return False
    kinds = _ARG_KINDS + (TENSORS,)
    if not all(a.kind in kinds for a in info.args):
        return False
    if info.kind == "compute":
        return info.functional is None and (info.returns_list if foreach else
                                            info.n_returns >= 1 and not info.returns_list)
    if info.kind != "mutating" or len(info.mutable) != 1 or info.functional is None or \
            len(info.functional.args) != len(info.args):
        return False
    m = info.args[0]
    if m.name != info.mutable[0] or m.kwarg_only or m.kind != (TENSORS if foreach else TENSOR):
        return False
    f = info.functional
    return f.returns_list if foreach else (info.returns_args == [m.name] and f.n_returns == 1)


class _Node:
    """A queued op: its executable's inputs, and where its results go (`dsts`, one CPU tensor per
    output: fresh buffers for a functional op, the updated tensors' CPU views for an in-place one)."""

    __slots__ = ("info", "key", "exe", "ins", "scalars", "dsts", "inplace")

    def __init__(self, info: OpInfo, key: Any, exe: Any, ins: list[Any], scalars: list[Any],
                 dsts: list[torch.Tensor], inplace: bool) -> None:
        self.info, self.key, self.exe, self.ins, self.scalars = info, key, exe, ins, scalars
        self.dsts, self.inplace = dsts, inplace


class _Unfusible:
    """Marks a group that failed to compile or run fused."""


UNFUSIBLE = _Unfusible()

#: The queue, module-level so generated kernels test it with one truthiness check (`if PENDING:`).
#: While the native layer queues ops, it holds `_NATIVE_QUEUE` alone.
PENDING: list[Any] = []
_NATIVE_QUEUE = object()


class Fusion:
    def __init__(self, runtime: Any) -> None:
        cfg = runtime.cfg
        self.rt = runtime
        self.limit = max(1, cfg.concatenation_buffer_limit)
        self.min_seen = max(1, cfg.fusion_min_seen)
        self.min_numel = max(0, cfg.fusion_min_numel)
        self.lock = threading.RLock()
        self.written: set[int] = set()        # ids of the CPU tensors queued ops write (wired at the flush)
        self.pending_ptrs: set[int] = set()   # storage pointers of the memory queued ops write
        self.fresh: set[int] = set()          # ids of the buffers allocated for queued functional ops
        self.mode: tuple[bool, bool] | None = None  # (grad mode, autocast) of the queued ops
        # (op, key) -> each output's (sizes, strides, dtype), None for an in-place op
        self.outmeta: dict[tuple[str, Any], list[tuple[Any, Any, Any]] | None] = {}
        self.sigs: dict[tuple[str, Any], dict[str, Any]] = {}
        self.seen: dict[Any, int] = {}
        self.fused: dict[Any, Any] = {}       # (structure, live outputs, into) -> executable | UNFUSIBLE
        # Per group: seconds of its op-by-op runs, then of its fused trial runs (`_decide`).
        self.each_s: dict[Any, list[float]] = {}
        self.trial_s: dict[Any, list[float]] = {}
        # Per (op, key): flushes it was in, and whether one of them held other ops too. An op that
        # always flushes alone has nothing to fuse with: after min_seen flushes it is no longer queued
        # (`solo`, which also holds ops whose outputs are too small to be worth queueing).
        self.flushed: dict[tuple[str, Any], int] = {}
        self.grouped: set[tuple[str, Any]] = set()
        self.solo: set[tuple[str, Any]] = set()
        # Per (op, key): the groups of several ops it was in. Once every one of them is decided op by op,
        # it is no longer queued either (`_unqueue`): queueing it would only add its cost to a run.
        self.groups_of: dict[tuple[str, Any], set[Any]] = {}
        self.stats: dict[str, Any] = {"groups_fused": 0, "ops_fused": 0, "fused_executions": 0,
                                      "ops_buffered": 0, "outputs_not_materialised": 0, "ops_not_queued": 0,
                                      "ops_run_each": 0, "groups_slower_fused": 0, "ops_unqueued": 0,
                                      "flushes": {}}
        del PENDING[:]
        _native_pending(False)

    # -- what the slow path teaches us -----------------------------------------------------------
    def learn(self, info: OpInfo, key: Any, sig: dict[str, Any], outs: list[Any]) -> None:
        """After an op's first real execution: its outputs' metadata and its signature, so it can be queued.

        A single-tensor op whose output has fewer than TORCH_NEURONX_FUSION_MIN_NUMEL elements is never
        queued. Run alone on the native hit path it costs ~5 µs; queued, ~2.6 µs in the native queue (30-38
        µs in Python's), plus its share of the group's flush and fused call (~30-40 µs for a short chain:
        the flush, the call, writing back the readable results), while fusing saves ~2.5 ns per element
        (DESIGN §3: 6 ops on 1M floats, 3.1 ms eager, 0.64 ms fused). At the benchmarks' sizes a 4-op
        chain took 40 µs fused against ~20 µs op by op. A `_foreach_` op is always queued: run alone it
        pays an allocation, a copy and a Scalar per list element (40-70 µs for an optimizer's six
        tensors), all of which fusing its chain saves."""
        if not fusible(info) or not outs or any(o is None for o in outs):
            return
        k = (info.qualname, key)
        self.outmeta[k] = None if info.kind == "mutating" else [(tuple(o.shape), o.stride(), o.dtype)
                                                                 for o in outs]
        self.sigs[k] = sig
        if not info.qualname.startswith("aten::_foreach_") and outs[0].numel() < self.min_numel and \
                k not in self.solo:
            self.solo.add(k)
            self.stats["ops_not_queued"] += 1

    # -- queueing --------------------------------------------------------------------------------
    def submit(self, info: OpInfo, key: Any, exe: Any, ins: list[Any], scalars: list[Any],
               targets: list[torch.Tensor] | None) -> Any:
        """Queue one op; None to run it now instead. Otherwise its (not yet computed) neuron output(s),
        or, for an in-place op (`targets`: the CPU views of the tensors it updates), True."""
        k = (info.qualname, key)
        if PENDING and PENDING[0] is _NATIVE_QUEUE:  # the native layer queued the ops before this one
            self.flush("queue_handover")
        if k not in self.sigs or k in self.solo:
            if PENDING:  # it runs now, and may read queued results
                self.flush("unseen_op" if k not in self.sigs else "not_queued")
            return None
        with self.lock:
            mode = (torch.is_grad_enabled(), torch.is_autocast_enabled(_DEVICE))
            if PENDING and mode != self.mode:
                self.flush("grad_or_autocast")
            if PENDING:
                written, ptrs = self.written, self.pending_ptrs
                for c in (ins if targets is None else (*ins, *targets)):
                    if isinstance(c, torch.Tensor) and id(c) not in written and \
                            c.untyped_storage().data_ptr() in ptrs:
                        self.flush("reads_pending_memory")
                        break
            self.mode = mode
            j = len(PENDING)
            if targets is None:
                metas = self.outmeta[k] or []
                dsts = [torch.empty_strided(m[0], m[1], dtype=m[2]) for m in metas]
                result: Any = [self.rt.wrap(d) for d in dsts]
                if not info.returns_list:
                    result = result[0] if len(result) == 1 else tuple(result)
                self.fresh.update(id(d) for d in dsts)
            else:
                dsts, result = targets, True
            for d in dsts:
                self.written.add(id(d))
                self.pending_ptrs.add(d.untyped_storage().data_ptr())
            PENDING.append(_Node(info, key, exe, ins, scalars, dsts, targets is not None))
            if j == 0:
                _native_pending(True)
            self.stats["ops_buffered"] += 1
            if len(PENDING) >= self.limit:
                self.flush("buffer_limit")
            return result

    # -- running ---------------------------------------------------------------------------------
    def flush_for(self, info: OpInfo) -> None:
        if PENDING:
            self.flush(f"op:{info.qualname}")

    def flush(self, reason: str) -> None:
        with self.lock:
            if not PENDING:
                return
            flushes = self.stats["flushes"]
            flushes[reason] = flushes.get(reason, 0) + 1
            native = PENDING[0] is _NATIVE_QUEUE
            nodes = list(PENDING)
            del PENDING[:]
            _native_pending(False)
            if native:  # the queue is in the native layer, which hands back what it does not run itself
                NATIVE.run_queue()
                return
            fresh = self.fresh
            self.written, self.pending_ptrs, self.fresh, self.mode = set(), set(), set(), None
            self._flush_nodes(nodes, lambda w: id(nodes[w[0]].dsts[w[1]]) not in fresh or
                              nodes[w[0]].dsts[w[1]]._use_count() > 1)

    def _flush_nodes(self, nodes: list[_Node], readable: Any) -> Any:
        """Run a flushed group (fused when hot); the fused executable it ran, None, False when the group
        is decided to run op by op from now on (`_each_for_good`), or for how many milliseconds the native
        queue may run it op by op before it asks again (its executable is compiling).

        `readable((node, output))`: whether that result must be written (see the module docstring)."""
        with self.lock:
            ext: list[Any] = []
            ext_index: dict[int, int] = {}
            writer: dict[int, tuple[int, int]] = {}  # id(CPU tensor) -> (node, output) that last wrote it
            # storage pointer -> the functional op whose fresh output it is, while that op wrote it last
            fresh: dict[int, tuple[int, int] | None] = {}
            structure = []
            for j, node in enumerate(nodes):
                wiring: list[tuple[Any, ...]] = []
                for c in node.ins:
                    w = writer.get(id(c)) if isinstance(c, torch.Tensor) else None
                    v = _view_of(c, fresh, nodes) if w is None and isinstance(c, torch.Tensor) else None
                    if w is not None:
                        wiring.append(("n", w[0]) if w[1] == 0 else ("n", w[0], w[1]))
                    elif v is not None:  # a view of a queued op's fresh output (the native queue wired it)
                        wiring.append(v)
                    elif isinstance(c, torch.Tensor):
                        if id(c) not in ext_index:
                            ext_index[id(c)] = len(ext)
                            ext.append(c)
                        wiring.append(("e", ext_index[id(c)]))
                    else:  # a number in a tensor slot (`x * 2`): an input of its own, as natively
                        wiring.append(("e", len(ext)))
                        ext.append(c)
                for i, d in enumerate(node.dsts):
                    writer[id(d)] = (j, i)
                    fresh[d.untyped_storage().data_ptr()] = None if node.inplace else (j, i)
                structure.append((node.info.qualname, node.key, tuple(wiring)))
            group = tuple(structure)
            seen = self.seen[group] = self.seen.get(group, 0) + 1
            self._note_flushed(nodes, group if seen == 1 else None)
            # Each written tensor gets its last writer's result, and only if it can still be read: a
            # buffer allocated for a queued op is referenced by its neuron tensor's storage (and so by its
            # views and autograd's saved tensors) while anything can read it; our references add no use
            # count. Tensors updated in place belong to the caller: always written.
            live = tuple(sorted(w for w in writer.values() if readable(w)))
            self.stats["outputs_not_materialised"] += sum(len(n.dsts) for n in nodes) - len(live)
            hot = len(nodes) > 1 and seen >= self.min_seen and self.fused.get(group) is not UNFUSIBLE
            if hot:
                ran = self._run_fused(group, nodes, ext, live, _into(nodes, ext, ext_index, live))
                if ran is not None:
                    return self._decide(group, *ran)
            seconds = self._run_each(nodes)
            if len(nodes) > 1:
                times = self.each_s.setdefault(group, [])
                if len(times) < _TRIALS:
                    times.append(seconds)
            if self._each_for_good(group, nodes):
                return False
            # hot, its executable compiling in the background: the native queue runs it op by op and asks
            # again `_RECHECK_MS` later
            return _RECHECK_MS if hot else None

    def _each_for_good(self, group: Any, nodes: list[_Node]) -> bool:
        """Whether a group is decided to run op by op from now on (the native queue then runs it so
        itself, `run_each`): a group that could not compile or ran slower fused, or a lone op that also
        flushes with others (one that only ever flushes alone stops being queued instead)."""
        if len(nodes) > 1:
            return self.fused.get(group) is UNFUSIBLE
        return (nodes[0].info.qualname, nodes[0].key) in self.grouped

    def _decide(self, group: Any, exe: Any, seconds: float) -> Any:
        """A group ran fused: its first `_TRIALS` fused runs are timed here (None is returned for them, so
        the native queue keeps handing the group to Python), then it stays fused unless its fastest warm
        fused run (the first one pays the executable's cold start) took over `_SLOWER` times its fastest
        op-by-op run; a group slower fused is remembered and runs op by op (`groups_slower_fused`).
        Both sides time their executables and the copies into the results only, which is what the
        native queue then pays for either (Python's own bookkeeping is not), and fastest against
        fastest, which a loaded machine can only slow down, never speed up. Returns the executable the
        native queue may run the group with, or None."""
        trials = self.trial_s.setdefault(group, [])
        if len(trials) >= _TRIALS:  # decided (Python's own queue asks at every flush)
            return exe
        trials.append(seconds)
        if len(trials) < _TRIALS:
            return None
        if min(trials[1:]) > _SLOWER * min(self.each_s.get(group) or [float("inf")]):
            self.stats["groups_slower_fused"] += 1
            self._op_by_op(group)
            return None
        return exe

    def _op_by_op(self, group: Any) -> None:
        """Decide `group` runs op by op for good."""
        self.fused[group] = UNFUSIBLE
        self._unqueue(group)

    def _unqueue(self, group: Any) -> None:
        """The ops of `group` (decided op by op) whose every group is so decided stop being queued
        (`ops_unqueued`): a queued op costs about what its launch does, and a group run op by op pays both."""
        gone = [k for k in {(s[0], s[1]) for s in group} if k not in self.solo and
                all(self.fused.get(g) is UNFUSIBLE for g in self.groups_of.get(k, ()))]
        if gone:
            self.solo.update(gone)
            self.stats["ops_unqueued"] += len(gone)
            if NATIVE is not None:
                NATIVE.clear()  # native kernels ask `queues` again

    def queues(self, info: OpInfo, key: Any) -> bool:
        """Whether calls of this op and key are queued (the native hit path asks once per key)."""
        return (info.qualname, key) not in self.solo

    def counters(self) -> dict[str, Any]:
        """`stats()["fusion"]`: ours plus the native queue's."""
        out = {k: dict(v) if isinstance(v, dict) else v for k, v in self.stats.items()}
        if NATIVE is not None:
            for k, v in NATIVE.fusion_counters().items():
                out[k] += v
        return out

    def _note_flushed(self, nodes: list[_Node], new_group: Any) -> None:
        alone = len(nodes) == 1
        for node in nodes:
            k = (node.info.qualname, node.key)
            if not alone:
                self.grouped.add(k)
                if new_group is not None:
                    self.groups_of.setdefault(k, set()).add(new_group)
            elif k not in self.grouped and k not in self.solo:
                n = self.flushed[k] = self.flushed.get(k, 0) + 1
                if n >= self.min_seen:
                    self.solo.add(k)
                    self.stats["ops_not_queued"] += 1
                    if NATIVE is not None:
                        NATIVE.clear()  # native kernels ask again: this key runs natively now

    def _run_each(self, nodes: list[_Node]) -> float:
        """Run the group op by op; the seconds its executables and copies took."""
        self.stats["ops_run_each"] += len(nodes)
        seconds = 0.0
        for node in nodes:
            t0 = time.perf_counter()
            for d, o in zip(node.dsts, trace_run(node.exe, node.ins, node.scalars)):
                d.copy_(o)
            seconds += time.perf_counter() - t0
        return seconds

    def _run_fused(self, group: Any, nodes: list[_Node], ext: list[Any], live: tuple[tuple[int, int], ...],
                   into: tuple[int, ...]) -> tuple[Any, float] | None:
        """Run the group as one executable: (it, the seconds its call and copies took), or None when it
        cannot (yet)."""
        exe = self.fused.get((group, live, into))
        if exe is None:
            graph, at = _graph(group, nodes, self.sigs)
            spec = [at[j] if i == 0 else [at[j], i] for j, i in live]
            sig = {"op": "fused:" + "+".join(s[0].removeprefix("aten::") for s in group),
                   "graph": graph, "outputs": [o for o, e in zip(spec, into) if e < 0]}
            if any(e >= 0 for e in into):
                sig["into"] = [[o, e] for o, e in zip(spec, into) if e >= 0]
            try:
                exe, _ = self.rt.executable_for(sig, seen=True)  # hot: seen min_seen times
            except Exception:  # noqa: BLE001 - a group that cannot compile runs op by op, for good
                self._op_by_op(group)
                return None
            if exe is None:
                return None  # compiling in the background: op by op until it is ready
            self.fused[(group, live, into)] = exe
            self.stats["groups_fused"] += 1
        scalars = [s for node in nodes for s in node.scalars]
        t0 = time.perf_counter()
        try:
            outs = trace_run(exe, ext, scalars, FUSED)  # ext: tensors, and numbers in tensor slots
        except Exception:  # noqa: BLE001
            self._op_by_op(group)
            return None
        for (j, i), o in zip([w for w, e in zip(live, into) if e < 0], outs):
            nodes[j].dsts[i].copy_(o)
        seconds = time.perf_counter() - t0
        self.stats["fused_executions"] += 1
        self.stats["ops_fused"] += len(nodes)
        return exe, seconds


def _view_of(c: torch.Tensor, fresh: dict[int, tuple[int, int] | None],
             nodes: list[_Node]) -> tuple[Any, ...] | None:
    """`("v", node, output, sizes, strides, offset)` when `c` views the fresh output of a queued functional
    op that wrote its memory last (the native queue wires such reads: `enqueue` in _native/fastpath.cpp),
    else None."""
    w = fresh.get(c.untyped_storage().data_ptr())
    if w is None:
        return None
    d = nodes[w[0]].dsts[w[1]]
    if d.dtype != c.dtype or d.storage_offset() != 0:
        return None
    return ("v", w[0], w[1], tuple(c.shape), c.stride(), c.storage_offset())


def _graph(group: Any, nodes: list[_Node], sigs: dict[Any, Any]) -> tuple[list[Any], list[int]]:
    """A group's graph signature nodes, and each queued op's index among them: a read through a view of
    an earlier result becomes an `aten::as_strided` node of that result (a view, inside the executable)."""
    graph: list[Any] = []
    at: list[int] = []
    for j, (qualname, key, wiring) in enumerate(group):
        ins = []
        for w in wiring:
            if w[0] != "v":
                ins.append(["n", at[w[1]], *w[2:]] if w[0] == "n" else list(w))
                continue
            _, src, out, sizes, strides, offset = w
            base = nodes[src].dsts[out]
            graph.append({"sig": build_signature(_AS_STRIDED, (base, list(sizes), list(strides), offset)),
                          "in": [["n", at[src]] if out == 0 else ["n", at[src], out]]})
            ins.append(["n", len(graph) - 1])
        at.append(len(graph))
        graph.append({"sig": sigs[(qualname, key)], "in": ins})
    return graph, at


def _into(nodes: list[_Node], ext: list[Any], ext_index: dict[int, int],
          live: tuple[tuple[int, int], ...]) -> tuple[int, ...]:
    """Per live result, the group input the fused executable writes it into (-1: it returns it).

    A tensor an in-place op updates is written in place by the executable when the group also reads it
    as an input (its first reader reads the old value) and no other input shares its memory (within one
    kernel, a store to it could otherwise reach another input's reads): no output buffer, no copy. The
    native queue applies the same rule (`run_queue` in _native/fastpath.cpp) and keys groups by it."""
    out = []
    storages: dict[int, int] = {}
    for c in ext:
        if isinstance(c, torch.Tensor):
            p = c.untyped_storage().data_ptr()
            storages[p] = storages.get(p, 0) + 1
    for j, i in live:
        e = ext_index.get(id(nodes[j].dsts[i])) if nodes[j].inplace else None
        out.append(e if e is not None and storages[ext[e].untyped_storage().data_ptr()] == 1 else -1)
    return tuple(out)


_DEVICE = "neuron"
#: Fused runs timed before a group is trusted to the native queue (the first pays a cold start and is not
#: compared), and how much slower than its fastest op-by-op run its fastest warm one may be before the
#: group goes back op by op (a margin for what fastest-against-fastest still varies).
_TRIALS = 3
_SLOWER = 1.1
#: How long the native queue runs a hot group whose executable is compiling in the background op by op
#: itself (~3 µs an op, against ~30 through Python's flush) before it hands the group to Python again to
#: see if the executable is in (a compile takes seconds; this bounds Python's share and the delay).
_RECHECK_MS = 50
_AS_STRIDED = classify("aten::as_strided")
_fusion: Fusion | None = None


def get() -> Fusion | None:
    return _fusion


def flush(reason: str) -> None:
    if PENDING and _fusion is not None:
        _fusion.flush(reason)


def submit(info: OpInfo, key: Any, exe: Any, ins: list[Any], scalars: list[Any],
           targets: list[torch.Tensor] | None = None) -> Any:
    """The generated kernels' entry: queue the op (see `Fusion.submit`)."""
    if _fusion is None:
        return None
    return _fusion.submit(info, key, exe, ins, scalars, targets)


def queues(info: OpInfo, key: Any) -> bool:
    """The generated lookups' entry (see `Fusion.queues`)."""
    return _fusion is not None and _fusion.queues(info, key)


def outmeta(info: OpInfo, key: Any) -> Any:
    """The generated lookups' entry: a queued call's outputs (None for an in-place op)."""
    return None if _fusion is None else _fusion.outmeta.get((info.qualname, key))


def compiles_landed() -> None:
    """The background compiles were waited for (`wait_for_compiles`): groups run op by op while their
    executables compiled ask Python again at their next flush, not `_RECHECK_MS` later."""
    if _fusion is not None and NATIVE is not None:
        NATIVE.recheck_groups()


def _native_started() -> None:
    """The native layer queued an op into its empty queue: ours holds its marker until a flush."""
    PENDING.append(_NATIVE_QUEUE)
    _native_pending(True)


def _flush_from_native(nodes: list[tuple[Any, ...]], live: list[tuple[int, int]]) -> Any:
    """A group the native queue does not run itself: run it here; the fused executable used, False when
    the native queue may run the group op by op itself from now on, for how many milliseconds it may do
    so before it asks again, or None."""
    if _fusion is None:  # pragma: no cover - the native queue is only on with fusion
        raise RuntimeError("neuron: native fusion queue without fusion")
    readable = set(live)
    return _fusion._flush_nodes([_Node(*n) for n in nodes], lambda w: w in readable)


def install(runtime: Any) -> Fusion | None:
    """Called by the runtime: a Fusion when the flag is on, else None (and nothing changes)."""
    global _fusion
    if _fusion is not None:
        _fusion.flush("reset")
    _fusion = Fusion(runtime) if runtime.cfg.concatenation else None
    if NATIVE is not None:  # native kernels queue, and run the queue before any op they serve
        if _fusion is not None:
            NATIVE.set_fusion(flush, _native_started, _flush_from_native, _fusion.limit)
        else:
            NATIVE.set_fusion(None, None, None, 1)
    return _fusion


def _native_pending(pending: bool) -> None:
    if NATIVE is not None:
        NATIVE.set_pending(pending)

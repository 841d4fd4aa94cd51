"""Experimental adaptive fusion, behind TORCH_NEURONX_ENABLE_CONCATENATION=1.

With the flag, a pointwise op whose executable is already known is *buffered* instead of run: its output
is allocated (so the caller gets a real neuron tensor) and the op is queued. Anything else flushes the
queue first, in stream order:

  * any other op reaching the runtime: a non-pointwise op, an in-place or out= op, a view op, a host op
    (`.item()`, `bool()`, printing, `.cpu()` all read through one), a copy;
  * a pointwise op reading memory a queued op writes through another tensor (a view of a pending output);
  * a change of grad mode or autocast state; the buffer limit
    (TORCH_NEURONX_CONCATENATION_BUFFER_SIZE_LIMIT); `torch.neuron.synchronize()`.

A flushed group is identified by its ops' keys and how they are wired. Until it has been seen
TORCH_NEURONX_FUSION_MIN_SEEN times it runs op by op (so fusion never multiplies cold-start compiles);
then it is compiled as one executable (a graph signature: the ops' signatures and their wiring, keyed and
cached like any op) and run in one call. An output whose memory nobody can read any more at the flush (no
tensor, view or autograd-saved tensor holds it: its buffer's use count is back to one) is never
materialised. A group that fails to compile or run falls back to op by op and is remembered as not
fusible. Results are those of the same ops in the same order.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from . import _hostmem, _ops


def fusible(info: _ops.OpInfo) -> bool:
    """Functional pointwise ops with one tensor output and no tensor lists."""
    return (info.kind == "compute" and info.functional is None and info.n_returns == 1
            and not info.returns_list and torch.Tag.pointwise in info.op.tags
            and all(a.kind in (_ops.TENSOR, _ops.OPT_TENSOR, _ops.SCALAR, _ops.VALUE) for a in info.args))


class _Node:
    __slots__ = ("info", "key", "exe", "ins", "scalars", "out")

    def __init__(self, info: _ops.OpInfo, key: Any, exe: Any, ins: list[Any], scalars: list[Any],
                 out: torch.Tensor) -> None:
        self.info, self.key, self.exe, self.ins, self.scalars, self.out = info, key, exe, ins, scalars, out


class _Unfusible:
    """Marks a group that failed to compile or run fused."""


UNFUSIBLE = _Unfusible()

#: The queue, module-level so generated kernels test it with one truthiness check (`if PENDING:`).
PENDING: list[_Node] = []


class Fusion:
    def __init__(self, runtime: Any) -> None:
        cfg = runtime.cfg
        self.rt = runtime
        self.limit = max(1, cfg.concatenation_buffer_limit)
        self.min_seen = max(1, cfg.fusion_min_seen)
        self.min_numel = max(0, cfg.fusion_min_numel)
        self.lock = threading.RLock()
        self.producers: dict[int, int] = {}   # id(CPU buffer of a pending output) -> node index
        self.pending_ptrs: set[int] = set()   # storage pointers of pending outputs
        self.mode: tuple[bool, bool] | None = None  # (grad mode, autocast) of the queued ops
        self.outmeta: dict[tuple[str, Any], tuple[Any, Any, Any]] = {}  # (op, key) -> (sizes, strides, dtype)
        self.sigs: dict[tuple[str, Any], dict[str, Any]] = {}
        self.seen: dict[Any, int] = {}
        self.fused: dict[Any, Any] = {}       # (structure, live outputs) -> executable | UNFUSIBLE
        # Per (op, key): flushes it was in, and whether one of them held other ops too. An op that
        # always flushes alone has nothing to fuse with: after min_seen flushes it is no longer queued
        # (`solo`, which also holds ops whose outputs are too small to be worth queueing).
        self.flushed: dict[tuple[str, Any], int] = {}
        self.grouped: set[tuple[str, Any]] = set()
        self.solo: set[tuple[str, Any]] = set()
        self.stats: dict[str, Any] = {"groups_fused": 0, "ops_fused": 0, "fused_executions": 0,
                                      "ops_buffered": 0, "outputs_not_materialised": 0, "ops_not_queued": 0,
                                      "flushes": {}}
        del PENDING[:]
        _native_pending(False)

    # -- what the slow path teaches us -----------------------------------------------------------
    def learn(self, info: _ops.OpInfo, key: Any, sig: dict[str, Any], out: torch.Tensor) -> None:
        """After an op's first real execution: its output metadata and signature, so it can be queued.

        An output smaller than TORCH_NEURONX_FUSION_MIN_NUMEL elements is never queued: a queued op costs
        ~15 µs of Python (its kernel, the queue, the flush) against ~1-3 µs for running it on the native
        hit path, and fusing a chain saves ~2.5 ns per element (DESIGN §3: 6 ops on 1M floats, 3.1 ms
        eager, 0.64 ms fused), so below ~40K elements fusion costs more than it saves."""
        k = (info.qualname, key)
        self.outmeta[k] = (tuple(out.shape), out.stride(), out.dtype)
        self.sigs[k] = sig
        if out.numel() < self.min_numel and k not in self.solo:
            self.solo.add(k)
            self.stats["ops_not_queued"] += 1

    # -- queueing --------------------------------------------------------------------------------
    def submit(self, info: _ops.OpInfo, key: Any, exe: Any, ins: list[Any], scalars: list[Any]) -> Any:
        """Queue one op; its (not yet computed) neuron output, or None to run it now instead."""
        meta = self.outmeta.get((info.qualname, key))
        if meta is None or (info.qualname, key) in self.solo:
            if PENDING:  # it runs now, and may read queued results
                self.flush("unseen_op" if meta is None else "not_queued")
            return None
        from ._dispatch import wrap

        with self.lock:
            mode = (torch.is_grad_enabled(), torch.is_autocast_enabled(_DEVICE))
            if PENDING and mode != self.mode:
                self.flush("grad_or_autocast")
            if PENDING:
                for c in ins:
                    if isinstance(c, torch.Tensor) and id(c) not in self.producers and \
                            c.untyped_storage().data_ptr() in self.pending_ptrs:
                        self.flush("reads_pending_memory")
                        break
            self.mode = mode
            out = torch.empty_strided(meta[0], meta[1], dtype=meta[2])
            n = wrap(out)
            self.producers[id(out)] = len(PENDING)
            self.pending_ptrs.add(out.data_ptr())
            PENDING.append(_Node(info, key, exe, ins, scalars, out))
            if len(PENDING) == 1:
                _native_pending(True)
            self.stats["ops_buffered"] += 1
            if len(PENDING) >= self.limit:
                self.flush("buffer_limit")
            return n

    # -- running ---------------------------------------------------------------------------------
    def flush_for(self, info: _ops.OpInfo) -> None:
        if PENDING:
            self.flush(f"op:{info.qualname}")

    def flush(self, reason: str) -> None:
        with self.lock:
            if not PENDING:
                return
            nodes = list(PENDING)
            del PENDING[:]
            _native_pending(False)
            producers = self.producers
            self.producers, self.pending_ptrs, self.mode = {}, set(), None
            flushes = self.stats["flushes"]
            flushes[reason] = flushes.get(reason, 0) + 1
            ext: list[Any] = []
            ext_index: dict[int, int] = {}
            structure = []
            for node in nodes:
                wiring = []
                for c in node.ins:
                    j = producers.get(id(c)) if isinstance(c, torch.Tensor) else None
                    if j is not None:
                        wiring.append(("n", j))
                    else:
                        if id(c) not in ext_index:
                            ext_index[id(c)] = len(ext)
                            ext.append(c)
                        wiring.append(("e", ext_index[id(c)]))
                structure.append((node.info.qualname, node.key, tuple(wiring)))
            group = tuple(structure)
            seen = self.seen[group] = self.seen.get(group, 0) + 1
            self._note_flushed(nodes)
            # `out` is referenced by the neuron tensor's storage (and so by its views and by autograd's
            # saved tensors) for as long as anything can read it; our own references add no use count.
            live = tuple(j for j, node in enumerate(nodes) if node.out._use_count() > 1)
            self.stats["outputs_not_materialised"] += len(nodes) - len(live)
            if len(nodes) > 1 and seen >= self.min_seen and self.fused.get(group) is not UNFUSIBLE:
                if self._run_fused(group, nodes, ext, live):
                    return
            self._run_each(nodes)

    def queues(self, info: _ops.OpInfo, key: Any) -> bool:
        """Whether calls of this op and key are queued (the native hit path asks once per key)."""
        return (info.qualname, key) not in self.solo

    def _note_flushed(self, nodes: list[_Node]) -> None:
        alone = len(nodes) == 1
        for node in nodes:
            k = (node.info.qualname, node.key)
            if not alone:
                self.grouped.add(k)
            elif k not in self.grouped and k not in self.solo:
                n = self.flushed[k] = self.flushed.get(k, 0) + 1
                if n >= self.min_seen:
                    self.solo.add(k)
                    self.stats["ops_not_queued"] += 1
                    if _hostmem.NATIVE is not None:
                        _hostmem.NATIVE.clear()  # native kernels ask again: this key runs natively now

    def _run_each(self, nodes: list[_Node]) -> None:
        for node in nodes:
            node.out.copy_(node.exe(node.ins, node.scalars)[0])

    def _run_fused(self, group: Any, nodes: list[_Node], ext: list[Any], live: tuple[int, ...]) -> bool:
        exe = self.fused.get((group, live))
        if exe is None:
            sig = {"op": "fused:" + "+".join(s[0].removeprefix("aten::") for s in group),
                   "graph": [{"sig": self.sigs[(s[0], s[1])], "in": [list(w) for w in s[2]]} for s in group],
                   "outputs": list(live)}
            try:
                exe, _ = self.rt.executable_for(sig)
            except Exception:  # noqa: BLE001 - a group that cannot compile runs op by op, for good
                self.fused[group] = UNFUSIBLE
                return False
            self.fused[(group, live)] = exe
            self.stats["groups_fused"] += 1
        scalars = [s for node in nodes for s in node.scalars]
        try:
            outs = exe(ext, scalars)  # ext: tensors, and numbers in tensor slots (`x * 2`)
        except Exception:  # noqa: BLE001
            self.fused[group] = UNFUSIBLE
            return False
        for j, o in zip(live, outs):
            nodes[j].out.copy_(o)
        self.stats["fused_executions"] += 1
        self.stats["ops_fused"] += len(nodes)
        return True


_DEVICE = "neuron"
_fusion: Fusion | None = None


def get() -> Fusion | None:
    return _fusion


def flush(reason: str) -> None:
    if PENDING and _fusion is not None:
        _fusion.flush(reason)


def submit(info: _ops.OpInfo, key: Any, exe: Any, ins: list[Any], scalars: list[Any]) -> Any:
    """The generated kernels' entry: queue the op (see `Fusion.submit`)."""
    if _fusion is None:
        return None
    return _fusion.submit(info, key, exe, ins, scalars)


def queues(info: _ops.OpInfo, key: Any) -> bool:
    """The generated lookups' entry (see `Fusion.queues`)."""
    return _fusion is not None and _fusion.queues(info, key)


def install(runtime: Any) -> Fusion | None:
    """Called by the runtime: a Fusion when the flag is on, else None (and nothing changes)."""
    global _fusion
    if _fusion is not None:
        _fusion.flush("reset")
    _fusion = Fusion(runtime) if runtime.cfg.concatenation else None
    if _hostmem.NATIVE is not None:  # native kernels run the queue before any op they serve
        _hostmem.NATIVE.set_flush(flush if _fusion is not None else None)
    return _fusion


def _native_pending(pending: bool) -> None:
    if _hostmem.NATIVE is not None:
        _hostmem.NATIVE.set_pending(pending)

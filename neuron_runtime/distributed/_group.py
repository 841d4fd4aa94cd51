"""The `neuron` process group: c10d collectives on `neuron` tensors, carried by gloo over CPU views.

A `neuron` tensor's memory is host memory, so a collective needs no copy: every tensor argument is
relabelled as a CPU tensor over the same bytes (`_hostmem.to_cpu`, zero-copy) and handed to a gloo
backend; results land in the caller's neuron tensors because they *are* those bytes. The group is a
Python `ProcessGroup` (PyTorch's trampoline routes C++ callers — DDP's reducer, `_broadcast_coalesced`,
the functional collectives — to these methods as well as `torch.distributed`'s Python API).

Failures: gloo reports a dead peer (connection closed) at once and a hung one after the group's timeout;
both reach the caller as `CollectiveError` naming the collective, this rank and the tensor shapes.
"""

from __future__ import annotations

import datetime
import os
import threading
import zlib
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import ProcessGroupGloo

from .. import _hostmem
from . import BACKEND, CollectiveError

_DEVICE = "neuron"

# c10d's method name → the torch.distributed name users know (error messages, stats). Aliases are the
# old and new spellings torch 2.13 calls from Python and C++ respectively.
COLLECTIVES: dict[str, str] = {
    "allreduce": "all_reduce",
    "allreduce_coalesced": "all_reduce_coalesced",
    "broadcast": "broadcast",
    "reduce": "reduce",
    "allgather": "all_gather",
    "allgather_coalesced": "all_gather_coalesced",
    "all_gather_single": "all_gather_into_tensor",
    "_allgather_base": "all_gather_into_tensor",
    "all_gather_single_coalesced": "all_gather_into_tensor_coalesced",
    "allgather_into_tensor_coalesced": "all_gather_into_tensor_coalesced",
    "gather": "gather",
    "scatter": "scatter",
    "reduce_scatter": "reduce_scatter",
    "reduce_scatter_single": "reduce_scatter_tensor",
    "_reduce_scatter_base": "reduce_scatter_tensor",
    "reduce_scatter_single_coalesced": "reduce_scatter_tensor_coalesced",
    "reduce_scatter_tensor_coalesced": "reduce_scatter_tensor_coalesced",
    "all_to_all_single": "all_to_all_single",
    "alltoall_base": "all_to_all_single",
    "alltoall": "all_to_all",
    "send": "send",
    "recv": "recv",
    "recv_anysource": "recv",
    "barrier": "barrier",
}

# Collectives whose every rank passes the same dtypes and shapes (all_to_all, gather, scatter and p2p may
# legitimately differ): what the TORCH_DISTRIBUTED_DEBUG=DETAIL check compares across ranks.
_SAME_SHAPES = frozenset({
    "all_reduce", "all_reduce_coalesced", "broadcast", "reduce", "all_gather", "all_gather_coalesced",
    "all_gather_into_tensor", "all_gather_into_tensor_coalesced", "reduce_scatter", "reduce_scatter_tensor",
    "reduce_scatter_tensor_coalesced",
})

_lock = threading.Lock()
_counts: dict[str, dict[str, int]] = {}


def counts() -> dict[str, dict[str, int]]:
    with _lock:
        return {k: dict(v) for k, v in _counts.items()}


def _count(name: str, nbytes: int) -> None:
    with _lock:
        c = _counts.setdefault(name, {"calls": 0, "bytes": 0})
        c["calls"] += 1
        c["bytes"] += nbytes


class _Views:
    """The CPU views of one call's tensor arguments, and the way back to the caller's neuron tensors.

    Only the (view, tensor) pairs are kept while the collective is issued (DDP issues one a bucket, on
    the training thread); the lookup back and the shapes for an error message are built when asked for."""

    __slots__ = ("name", "pairs", "nbytes", "meta", "_back")

    def __init__(self, name: str, check: bool = False) -> None:
        self.name = name
        self.pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.nbytes = 0
        # dtype and shape of every tensor: the DETAIL check's fingerprint (None: not checked)
        self.meta: list[str] | None = [] if check else None
        self._back: dict[tuple[int, tuple[int, ...]], torch.Tensor] | None = None

    @property
    def shapes(self) -> list[tuple[int, ...]]:
        return [tuple(x.shape) for _, x in self.pairs[:4]]

    def convert(self, x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            if x.device.type != _DEVICE:
                raise CollectiveError(
                    f"{self.name}: expected {_DEVICE} tensors, got a tensor on {x.device} — the '{BACKEND}' "
                    f"process group carries {_DEVICE} tensors only (for CPU tensors use a gloo group: "
                    "dist.new_group(backend='gloo'))"
                )
            v = _to_cpu(x)
            self.pairs.append((v, x))
            self.nbytes += x.nbytes
            if self.meta is not None:
                self.meta.append(f"{x.dtype}{list(x.shape)}")
            return v
        if isinstance(x, list):
            return [self.convert(y) for y in x]
        return x

    def restore(self, x: Any) -> Any:
        """A future's CPU results as the caller's neuron tensors (the same objects where they exist)."""
        if isinstance(x, torch.Tensor):
            if x.device.type == _DEVICE:
                return x
            for v, orig in self.pairs:  # the view itself came back (in-place collectives): no lookup
                if v is x:
                    return orig
            if self._back is None:
                self._back = {(v.data_ptr(), tuple(v.shape)): t for v, t in self.pairs}
            found = self._back.get((x.data_ptr(), tuple(x.shape)))
            return found if found is not None else _hostmem.to_neuron(x)
        if isinstance(x, list):
            return [self.restore(y) for y in x]
        return x


_to_cpu = _hostmem.to_cpu


class NeuronWork(dist.Work):
    """gloo's `Work` with errors that name the collective and results that are neuron tensors."""

    def __init__(self, inner: dist.Work, views: _Views, group: dist.ProcessGroup) -> None:
        super().__init__()
        self._inner = inner
        self._views = views
        self._group = group

    def _error(self, e: BaseException) -> CollectiveError:
        shapes = ", ".join(str(list(s)) for s in self._views.shapes) or "no tensors"
        return CollectiveError(f"{self._views.name} failed on rank {self._group.rank()} ({shapes}): {e}")

    def wait(self, timeout: datetime.timedelta = datetime.timedelta(0)) -> bool:
        try:
            return bool(self._inner.wait(timeout) if timeout else self._inner.wait())
        except CollectiveError:
            raise
        except Exception as e:  # gloo's RuntimeError / DistBackendError
            raise self._error(e) from e

    def is_completed(self) -> bool:
        return bool(self._inner.is_completed())

    def is_success(self) -> bool:
        return bool(self._inner.is_success())

    def exception(self) -> Any:
        return self._inner.exception()

    def source_rank(self) -> int:
        return int(self._inner.source_rank())

    def synchronize(self) -> None:
        self.wait()

    def result(self) -> list[torch.Tensor]:
        return self._views.restore(self._inner.result())  # type: ignore[no-any-return]

    def get_future(self) -> torch.futures.Future[Any]:
        views, err = self._views, self._error

        def done(f: torch.futures.Future[Any]) -> Any:
            try:
                return views.restore(f.value())
            except Exception as e:
                raise err(e) from e

        return self._inner.get_future().then(done)


class _AllWork(dist.Work):
    """The Work of a coalesced block: done when every collective issued inside it is."""

    def __init__(self, works: list[NeuronWork]) -> None:
        super().__init__()
        self._works = works

    def wait(self, timeout: datetime.timedelta = datetime.timedelta(0)) -> bool:
        return all([w.wait(timeout) for w in self._works])

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self._works)

    def get_future(self) -> torch.futures.Future[Any]:
        return torch.futures.collect_all([w.get_future() for w in self._works])


def _method(cname: str) -> Callable[..., NeuronWork]:
    name = COLLECTIVES[cname]

    def call(self: NeuronProcessGroup, *args: Any, **kwargs: Any) -> NeuronWork:
        views = _Views(name, self._checker is not None and name in _SAME_SHAPES)
        cargs = [views.convert(a) for a in args]
        ckwargs = {k: views.convert(v) for k, v in kwargs.items()}
        if views.meta is not None:
            self._check_same(views.name, views.meta)
        try:
            work = getattr(self._transport, cname)(*cargs, **ckwargs)
        except CollectiveError:
            raise
        except Exception as e:
            raise CollectiveError(f"{name} failed on rank {self.rank()}: {e}") from e
        _count(name, views.nbytes)
        w = NeuronWork(work, views, self)
        if self._coalesced is not None:
            self._coalesced.append(w)
        return w

    call.__name__ = cname
    call.__doc__ = f"`{name}` on neuron tensors (gloo over zero-copy CPU views)."
    return call


class NeuronProcessGroup(dist.ProcessGroup):
    """The process group `init_process_group("neuron")` makes; one per group, over one gloo backend."""

    def __init__(self, store: dist.Store, rank: int, size: int, timeout: datetime.timedelta) -> None:
        super().__init__(rank, size)
        gloo = ProcessGroupGloo(store, rank, size, timeout)
        # A plain c10d ProcessGroup around gloo gives every collective's c10d entry point (the coalesced
        # and `_base` variants included) for CPU tensors; ours hands it the CPU views.
        transport = dist.ProcessGroup(store, rank, size)
        transport._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
        transport._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, gloo)
        self._gloo = gloo
        self._transport = transport
        self._timeout = timeout
        self._coalesced: list[NeuronWork] | None = None
        # TORCH_DISTRIBUTED_DEBUG=DETAIL (PyTorch's switch for collective desynchronization checks): before
        # each collective the ranks compare dtypes and shapes over a gloo group of their own, so a mismatch
        # is an error on every rank instead of gloo aborting the process that receives too many bytes.
        self._checker: ProcessGroupGloo | None = None
        if os.environ.get("TORCH_DISTRIBUTED_DEBUG", "").upper() == "DETAIL":
            self._checker = ProcessGroupGloo(dist.PrefixStore("neuron-check/", store), rank, size, timeout)

    def _check_same(self, name: str, meta: list[str]) -> None:
        desc = ",".join(meta)
        mine = torch.tensor([zlib.crc32(f"{name}:{desc}".encode()), len(desc)], dtype=torch.int64)
        every = [torch.empty_like(mine) for _ in range(self.size())]
        assert self._checker is not None
        try:
            self._checker.allgather([every], [mine]).wait()
        except Exception as e:  # a peer died or hung before the collective itself
            raise CollectiveError(f"{name} failed on rank {self.rank()} (shape check): {e}") from e
        if any(not torch.equal(e, mine) for e in every):
            raise CollectiveError(
                f"{name}: ranks passed different tensors (rank {self.rank()}: {desc}); every rank must "
                "call the same collective with the same dtypes and shapes")

    def getBackendName(self) -> str:  # noqa: N802 - c10d's name
        return BACKEND

    def name(self) -> str:
        return BACKEND

    @property
    def group_name(self) -> str:
        # Functional collectives (DTensor) find a group by the name init_process_group/new_group gave it.
        return str(dist.distributed_c10d._world.pg_names[self])

    @property
    def _device_types(self) -> list[torch.device]:
        # Object collectives (all_gather_object, DCP's planning) then stage their bytes in neuron tensors.
        return [torch.device(_DEVICE)]

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self._timeout = timeout
        self._gloo._set_default_timeout(timeout)

    # `_coalescing_manager(device=...)`: gloo has no coalescing of its own; the collectives issued inside
    # run as they come (or as one `*_coalesced` call on c10d's fast path) and the manager's Work waits
    # for all of them.
    def _start_coalescing(self, device: torch.device) -> None:
        self._coalesced = []

    def _end_coalescing(self, device: torch.device) -> dist.Work:
        works, self._coalesced = self._coalesced or [], None
        return _AllWork(works)

    def shutdown(self) -> None:
        self._transport.shutdown()

    def abort(self) -> None:
        self._transport.abort()

    def __repr__(self) -> str:
        return f"NeuronProcessGroup(rank={self.rank()}, size={self.size()})"


for _cname in COLLECTIVES:
    setattr(NeuronProcessGroup, _cname, _method(_cname))


def _barrier(self: NeuronProcessGroup, opts: Any = None) -> NeuronWork:
    """`barrier` (c10d picks its backend by `opts.device`: the transport's is the CPU)."""
    o = dist.BarrierOptions()
    if opts is not None:
        o.device_ids = list(opts.device_ids)
        o.timeout = opts.timeout
    o.device = torch.device("cpu")
    return _BARRIER(self, o)


_BARRIER = NeuronProcessGroup.barrier
NeuronProcessGroup.barrier = _barrier  # type: ignore[method-assign]


def create(store: dist.Store, rank: int, size: int, timeout: datetime.timedelta) -> NeuronProcessGroup:
    """c10d's creator of the `neuron` backend (registered by `neuron_runtime.distributed.register`)."""
    return NeuronProcessGroup(store, rank, size, timeout)

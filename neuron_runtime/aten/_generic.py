"""The kernel of an op by its kind (`signatures._ops`): view, host, or generated compute/mutating.

Below `_special` and `_decomp`, which reuse these kernels for the ops they compute from others; one
generated kernel per op (`_codegen`; its executables' table is one the runtime clears on reset and eviction).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..signatures import OpInfo, classify
from . import _codegen
from ._host import DEVICE, to_host
from ._runtime import runtime
from ._writes import may_overlap, overlapping, shared_views

_CPU_KEYS = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)
_generic: dict[str, Callable[..., Any]] = {}


def check_device(device: Any) -> None:
    """Only `neuron:0` exists; anything else gets a clear error."""
    if device is None:
        return
    d = torch.device(device)
    if d.type == DEVICE and d.index not in (None, 0):
        raise RuntimeError(f"{d} does not exist: this host has one {DEVICE} device, {DEVICE}:0 "
                           f"(torch.{DEVICE}.device_count() == 1)")


def _view_kernel(info: OpInfo) -> Callable[..., Any]:
    # The CPU kernel of a view op only computes metadata, so it runs on the neuron tensor itself and the
    # result shares its storage.
    handle = info.op._handle
    keys = _CPU_KEYS

    def kernel(*args: Any, **kwargs: Any) -> Any:
        return handle.redispatch_boxed(keys, *args, **kwargs)

    return kernel


def _host_kernel(info: OpInfo) -> Callable[..., Any]:
    names = [a.name for a in info.args]
    defaults = [a.default if a.has_default else None for a in info.args]
    writes = may_overlap(info) if any(a.mutable for a in info.args) else None

    def kernel(*args: Any, **kwargs: Any) -> Any:
        values = list(args) + [kwargs.get(n, d) for n, d in zip(names[len(args):], defaults[len(args):])]
        for a, v in zip(info.args, values):
            if a.name == "device":
                check_device(v)
        rt = runtime()
        rt.host_ops.add(info.qualname)
        host_values = tuple(to_host(v) for v in values)
        if writes is not None and writes(values) and overlapping(info, values):  # CPU's rules on views sharing memory as these tensors do
            return rt.host_shared(info, tuple(values), shared_views(values, host_values))
        return rt.host_or_widen(info, None, tuple(values), host_values)[0]

    return kernel


def kernel(info: OpInfo) -> Callable[..., Any]:
    """A new kernel for `info` by its kind (callers keep it: a compute kernel owns its executables' table)."""
    if info.kind == "view":
        return _view_kernel(info)
    if info.kind == "host":
        return _host_kernel(info)
    return _codegen.generate(info)


def kernel_for(qualname: str) -> Callable[..., Any]:
    """The one kernel of `qualname`'s kind, made on first use."""
    k = _generic.get(qualname)
    if k is None:
        k = _generic[qualname] = kernel(classify(qualname))
    return k

"""`torch.distributed` on `neuron`: the `neuron` c10d backend.

Registered when the package loads, so `dist.init_process_group("neuron")` — or `init_process_group()`
with no backend, which picks the accelerator's backend as it picks nccl for cuda — gives a process group
whose collectives take `neuron` tensors. The transport is gloo over zero-copy CPU views of the device's
memory (host memory here; on Trainium this seam would be the Neuron collectives). See docs/distributed.md.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["BACKEND", "collective_stats", "register"]

BACKEND = "neuron"

_registered = False


def register() -> None:
    """Idempotent: make `neuron` a c10d backend and the default backend of `neuron` tensors."""
    global _registered
    if _registered:
        return
    import torch.distributed as dist

    if not dist.is_available():
        return
    dist.Backend.register_backend(BACKEND, _create, devices=["neuron"])
    _default_backend_type(dist.distributed_c10d)
    _registered = True


def _default_backend_type(c10d: Any) -> None:
    """A group made without a backend (`init_process_group()`, `new_group()`) on a neuron host gets the
    `neuron` backend alone (PyTorch maps the accelerator to its registered backend), but PyTorch then sets
    the group's default backend type to gloo, which it has not got: DDP's logging and `_get_backend_name()`
    fail with `Could not find backend type 1`. As PyTorch sets nccl's for cuda, set the custom one."""
    import functools

    helper = c10d._new_process_group_helper

    @functools.wraps(helper)
    def new_group(group_size: int, group_rank: int, ranks: Any, backend: Any, *args: Any, **kwargs: Any) -> Any:
        pg, store = helper(group_size, group_rank, ranks, backend, *args, **kwargs)
        if str(backend) == c10d.Backend.UNDEFINED and pg._device_types == [torch.device("neuron")]:
            pg._set_default_backend(c10d.ProcessGroup.BackendType.CUSTOM)
        return pg, store

    c10d._new_process_group_helper = new_group


def _create(store: Any, rank: int, size: int, timeout: Any) -> Any:
    """c10d's creator of a `neuron` group (the implementation is imported with the first group)."""
    from . import _group

    return _group.create(store, rank, size, timeout)


def collective_stats() -> dict[str, dict[str, int]]:
    """Collectives this process ran through `neuron` groups: per collective, calls and bytes."""
    from . import _group

    return _group.counts()

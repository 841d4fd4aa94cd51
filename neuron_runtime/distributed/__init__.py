"""`torch.distributed` on `neuron`: the `neuron` c10d backend.

Registered when the package loads, so `dist.init_process_group("neuron")` — or `init_process_group()`
with no backend, which picks the accelerator's backend as it picks nccl for cuda — gives a process group
whose collectives take `neuron` tensors. The transport is gloo over zero-copy CPU views of the device's
memory (host memory here; on Trainium this seam would be the Neuron collectives). See docs/distributed.md.
"""

from __future__ import annotations

from typing import Any

__all__ = ["BACKEND", "CollectiveError", "collective_stats", "register"]

BACKEND = "neuron"

_registered = False


class CollectiveError(RuntimeError):
    """A collective failed or timed out (a peer died, hung or passed a different shape); the message
    names the collective, the group's rank and the cause."""


def register() -> None:
    """Idempotent: make `neuron` a c10d backend and the default backend of `neuron` tensors."""
    global _registered
    if _registered:
        return
    import torch.distributed as dist

    if not dist.is_available():
        return
    dist.Backend.register_backend(BACKEND, _create, devices=["neuron"])
    _registered = True


def _create(store: Any, rank: int, size: int, timeout: Any) -> Any:
    """c10d's creator of a `neuron` group (the implementation is imported with the first group)."""
    from . import _group

    return _group.create(store, rank, size, timeout)


def collective_stats() -> dict[str, dict[str, int]]:
    """Collectives this process ran through `neuron` groups: per collective, calls and bytes."""
    from . import _group

    return _group.counts()

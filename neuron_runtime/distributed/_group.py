"""The `neuron` process group: c10d collectives on `neuron` tensors, carried by gloo over CPU views.

A `neuron` tensor's memory is host memory, so a collective needs no copy: the backend (the native layer's
`process_group.h`) hands gloo the CPU view of each tensor's bytes, and the results land in the caller's
neuron tensors because they are those bytes. It is a C++ c10d backend, so DDP's reducer, FSDP2, the
functional collectives and `torch.distributed`'s API reach it without entering Python, and it needs the
native layer (a C++ compiler; not with TORCH_NEURONX_NATIVE=0).

Failures: gloo reports a dead peer (connection closed) at once and a hung one after the group's timeout;
both reach the caller as `torch.distributed.DistBackendError` naming the collective, this rank and the
tensor shapes. A tensor of another device is a `ValueError` naming the collective.
"""

from __future__ import annotations

import datetime

import torch.distributed as dist
from torch._C._distributed_c10d import ProcessGroupGloo

from .. import _native
from .._native import NATIVE


def counts() -> dict[str, dict[str, int]]:
    """Per collective, the calls and bytes this process ran through `neuron` groups."""
    if NATIVE is None:
        return {}
    return {name: {"calls": calls, "bytes": nbytes}
            for name, (calls, nbytes) in NATIVE.collective_counts().items()}


def create(store: dist.Store, rank: int, size: int, timeout: datetime.timedelta) -> dist.Backend:
    """c10d's creator of the `neuron` backend (registered by `neuron_runtime.distributed.register`)."""
    if NATIVE is None:
        raise RuntimeError(f"the 'neuron' process group needs the runtime's native layer, which is "
                           f"unavailable here ({_native.status()})")
    return NATIVE.process_group(ProcessGroupGloo(store, rank, size, timeout), rank, size)

"""Registers the `neuron` device with PyTorch: backend name, device module, guard, hooks, methods."""

from __future__ import annotations

from typing import Any

import torch

from .._native import NATIVE, smoke_test
from . import _torch_neuron
from ._torch_neuron import DEVICE


class DeviceConflictError(RuntimeError):
    """Another package already owns PyTorch's PrivateUse1 backend."""


class _Hooks(torch._C._acc.PrivateUse1Hooks):  # type: ignore[misc]
    def is_available(self) -> bool:
        return True

    def has_primary_context(self, dev_id: int) -> bool:
        return True

    def is_built(self) -> bool:
        return True


class _Guard(torch._C._acc.DeviceGuard):  # type: ignore[misc]
    def type_(self) -> Any:
        return torch._C._autograd.DeviceType.PrivateUse1


_registered = False


def owner_of_privateuse1() -> str | None:
    """Who owns PrivateUse1 already: None if nobody (or us)."""
    name = torch._C._get_privateuse1_backend_name()
    if name == "privateuseone":
        return None
    mod = getattr(torch, name, None)
    if name == DEVICE and getattr(mod, "__neuron_runtime__", False):
        return None
    origin = getattr(mod, "__name__", None) or getattr(mod, "__file__", None) or "an unknown package"
    return f"backend '{name}' (device module {origin})"


def register() -> None:
    """Idempotent: make `neuron` a PyTorch device."""
    global _registered
    if _registered:
        return
    owner = owner_of_privateuse1()
    if owner is not None:
        raise DeviceConflictError(
            f"neuron_runtime cannot register the '{DEVICE}' device: PyTorch's PrivateUse1 backend already "
            f"belongs to {owner}. Only one such backend can be loaded per process; set "
            "TORCH_DEVICE_BACKEND_AUTOLOAD=0 to stop automatic loading of device backends and import the one "
            "you want explicitly.")
    if torch._C._get_privateuse1_backend_name() != DEVICE:
        torch.utils.rename_privateuse1_backend(DEVICE)
    if not hasattr(torch, DEVICE):
        torch._register_device_module(DEVICE, _torch_neuron)
    torch.utils.generate_methods_for_privateuse1_backend(for_storage=True)
    # The native hooks can also resize storages in place (FSDP2 frees unsharded parameters that way).
    if NATIVE is None or not NATIVE.register_hooks():
        torch._C._acc.register_python_privateuseone_hook(_Hooks())
    # The native layer's guard when it is loaded: the Python one calls into Python on every use.
    if NATIVE is None or not NATIVE.register_device_guard():
        torch._C._acc.register_python_privateuseone_device_guard(_Guard())
    if NATIVE is not None:
        NATIVE.register_allocator()  # memory counters for torch.accelerator (see _torch_neuron)
        _torch_neuron.set_capacity()
        NATIVE.register_profiler()  # the device track of torch.profiler traces (_native/trace.h)
    smoke_test()
    # nn.Module.to() must keep Parameter objects (tied weights stay tied, optimizers keep their params).
    # PyTorch only swaps in place for backends it knows; this switch makes it swap for ours too.
    torch.__future__.set_swap_module_params_on_conversion(True)
    _registered = True

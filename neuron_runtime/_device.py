"""Registers the `neuron` device with PyTorch: backend name, device module, guard, hooks, methods."""

from __future__ import annotations

import types
from typing import Any

import torch

from . import _hostmem, _streams

DEVICE = "neuron"


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


def _device_index(device: Any = None) -> int:
    if device is None:
        return 0
    if isinstance(device, int):
        idx = device
    else:
        d = torch.device(device)
        if d.type != DEVICE:
            raise ValueError(f"expected a {DEVICE} device, got {d}")
        idx = 0 if d.index is None else d.index
    if idx != 0:
        raise RuntimeError(f"{DEVICE}:{idx} does not exist: this host has one {DEVICE} device, {DEVICE}:0")
    return 0


def _make_module() -> types.ModuleType:
    """`torch.neuron`: what PyTorch and users expect of a device module (cf. `torch.cuda`)."""
    m = types.ModuleType(f"torch.{DEVICE}")
    m.__doc__ = "The neuron device (registered by neuron_runtime). Memory is host memory."

    def is_available() -> bool:
        return True

    def device_count() -> int:
        return 1

    def current_device() -> int:
        return 0

    def set_device(device: Any) -> None:
        _device_index(device)

    def synchronize(device: Any = None) -> None:
        """Run every queued op (with fusion on); otherwise ops already ran synchronously on the host."""
        _device_index(device)
        from . import fusion

        fusion.flush("synchronize")

    def is_initialized() -> bool:
        return True

    def _is_in_bad_fork() -> bool:
        return False

    def manual_seed(seed: int) -> None:
        # neuron ops draw from the CPU generator (a pure-Python backend cannot own a Generator).
        torch.default_generator.manual_seed(seed)

    def manual_seed_all(seed: int) -> None:
        """Called by torch.manual_seed, which has already seeded the CPU generator neuron ops use."""

    def get_amp_supported_dtype() -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16]

    class device:
        """Context manager selecting a neuron device (there is only `neuron:0`)."""

        def __init__(self, device: Any) -> None:
            self.idx = _device_index(device) if device is not None else 0

        def __enter__(self) -> None:
            return None

        def __exit__(self, *exc: object) -> None:
            return None

    class _Utils:
        @staticmethod
        def _get_device_index(device: Any, optional: bool = False, allow_cpu: bool = False) -> int:
            return _device_index(device)

    m.is_available = is_available  # type: ignore[attr-defined]
    m.device_count = device_count  # type: ignore[attr-defined]
    m.current_device = current_device  # type: ignore[attr-defined]
    m.set_device = set_device  # type: ignore[attr-defined]
    m.synchronize = synchronize  # type: ignore[attr-defined]
    m.is_initialized = is_initialized  # type: ignore[attr-defined]
    m._is_in_bad_fork = _is_in_bad_fork  # type: ignore[attr-defined]
    m.manual_seed = manual_seed  # type: ignore[attr-defined]
    m.manual_seed_all = manual_seed_all  # type: ignore[attr-defined]
    m.seed = torch.seed  # type: ignore[attr-defined]
    m.initial_seed = torch.initial_seed  # type: ignore[attr-defined]
    m.get_rng_state = lambda device=None: torch.get_rng_state()  # type: ignore[attr-defined]
    m.set_rng_state = lambda state, device=None: torch.set_rng_state(state)  # type: ignore[attr-defined]
    m.get_amp_supported_dtype = get_amp_supported_dtype  # type: ignore[attr-defined]
    m._utils = _Utils  # type: ignore[attr-defined]
    m.device = device  # type: ignore[attr-defined]
    m.__neuron_runtime__ = True  # type: ignore[attr-defined]
    _streams.install(m)
    return m


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
        torch._register_device_module(DEVICE, _make_module())
    torch.utils.generate_methods_for_privateuse1_backend(for_storage=True)
    # The native hooks can also resize storages in place (FSDP2 frees unsharded parameters that way).
    if _hostmem.NATIVE is None or not _hostmem.NATIVE.register_hooks():
        torch._C._acc.register_python_privateuseone_hook(_Hooks())
    # The native layer's guard when it is loaded: the Python one calls into Python on every use.
    if _hostmem.NATIVE is None or not _hostmem.NATIVE.register_device_guard():
        torch._C._acc.register_python_privateuseone_device_guard(_Guard())
    _hostmem.smoke_test()
    # nn.Module.to() must keep Parameter objects (tied weights stay tied, optimizers keep their params).
    # PyTorch only swaps in place for backends it knows; this switch makes it swap for ours too.
    torch.__future__.set_swap_module_params_on_conversion(True)
    _registered = True

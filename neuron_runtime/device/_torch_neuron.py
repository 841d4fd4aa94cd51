"""`torch.neuron`: the device module, as PyTorch, Transformers and Accelerate call it (cf. `torch.cuda`).

One device, `neuron:0`, whose memory is host memory:
  * memory counters are bytes of live `neuron` storage, counted by the native layer when a host buffer
    becomes neuron memory and when its last neuron storage dies (`_native/memory.h`); the same counters
    answer `torch.accelerator.memory_allocated()` and friends. Nothing is cached, so `memory_reserved` is
    `memory_allocated`; `empty_cache` gives the C allocator's freed host memory back to the OS.
  * random numbers: neuron ops draw from the CPU generator (a pure-Python backend cannot own a
    `torch.Generator`), so the neuron RNG state *is* the CPU generator's state: `get_rng_state` returns
    it, `set_rng_state` checks and restores it (a resumed checkpoint reproduces the same dropout masks).
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass
from typing import Any

import torch

from .._native import _hostmem
from ..aten import _fusion
from ._streams import Event, Stream, current_stream, default_stream, stream  # noqa: F401 - FSDP2's stream API

__neuron_runtime__ = True  # _register.owner_of_privateuse1 knows its own module by this

DEVICE = "neuron"


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


def is_available() -> bool:
    return True


def device_count() -> int:
    return 1


def current_device() -> int:
    return 0


def set_device(device: Any) -> None:
    """Only `neuron:0` (or 0) exists; anything else is an error naming it."""
    _device_index(device)


def synchronize(device: Any = None) -> None:
    """Run every queued op (with fusion on); otherwise ops already ran synchronously on the host."""
    _device_index(device)
    _fusion.flush("synchronize")


def is_initialized() -> bool:
    return True


def _is_in_bad_fork() -> bool:
    return False


def is_bf16_supported(including_emulation: bool = True) -> bool:
    return True  # host kernels compute bfloat16 (the compiled executables too)


def get_amp_supported_dtype() -> list[torch.dtype]:
    return [torch.bfloat16, torch.float16]


def _host_cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def get_device_name(device: Any = None) -> str:
    _device_index(device)
    return f"neuron-runtime host device ({_host_cpu_name()})"


@dataclass(frozen=True)
class DeviceProperties:
    name: str
    total_memory: int  # bytes of host memory


def get_device_properties(device: Any = None) -> DeviceProperties:
    _device_index(device)
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return DeviceProperties(name=get_device_name(), total_memory=int(total))


def get_device_capability(device: Any = None) -> tuple[int, int]:
    _device_index(device)
    return (0, 0)


# --- memory ----------------------------------------------------------------------------------------


class MemoryStatsUnavailable(RuntimeError):
    """The memory counters live in the native layer, which is not loaded."""


def _native() -> Any:
    native = _hostmem.NATIVE
    if native is None:
        from .. import _native as native_mod

        raise MemoryStatsUnavailable(
            "neuron memory counters are kept by the native layer, which is not loaded here "
            f"({native_mod.status()}); unset TORCH_NEURONX_NATIVE=0 or install g++")
    return native


def memory_allocated(device: Any = None) -> int:
    """Bytes of host memory held by live neuron storages now."""
    _device_index(device)
    return int(_native().memory_stats()[0])


def max_memory_allocated(device: Any = None) -> int:
    """The peak of `memory_allocated` since start or the last `reset_peak_memory_stats`."""
    _device_index(device)
    return int(_native().memory_stats()[1])


def memory_reserved(device: Any = None) -> int:
    return memory_allocated(device)  # no caching allocator: nothing is reserved beyond what is live


def max_memory_reserved(device: Any = None) -> int:
    return max_memory_allocated(device)


def reset_peak_memory_stats(device: Any = None) -> None:
    _device_index(device)
    _native().reset_peak_memory()


def reset_max_memory_allocated(device: Any = None) -> None:
    reset_peak_memory_stats(device)


def reset_accumulated_memory_stats(device: Any = None) -> None:
    _device_index(device)
    _native().reset_accumulated_memory()


def memory_stats(device: Any = None) -> dict[str, int]:
    """The same keys `torch.cuda.memory_stats` uses for the counters this device has."""
    _device_index(device)
    current, peak, allocated, freed, buffers = _native().memory_stats()
    out = {f"allocated_bytes.all.{k}": int(v)
           for k, v in (("current", current), ("peak", peak), ("allocated", allocated), ("freed", freed))}
    out["allocation.all.current"] = int(buffers)
    return out


def empty_cache() -> None:
    """Give host memory the C allocator kept after frees back to the OS (glibc `malloc_trim`)."""
    if _hostmem.NATIVE is not None:
        _hostmem.NATIVE.empty_cache()
        return
    import ctypes

    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)
    if trim is not None:
        trim(0)


# --- random numbers ---------------------------------------------------------------------------------


def manual_seed(seed: int) -> None:
    torch.default_generator.manual_seed(int(seed))


def manual_seed_all(seed: int) -> None:
    """Seeds the CPU generator neuron ops draw from (`torch.manual_seed` calls this after seeding it)."""
    torch.default_generator.manual_seed(int(seed))


def seed() -> None:
    torch.seed()


def seed_all() -> None:
    torch.seed()


def initial_seed() -> int:
    return torch.initial_seed()


def get_rng_state(device: Any = None) -> torch.Tensor:
    """The state of the generator neuron ops draw from (a CPU `torch.uint8` tensor)."""
    _device_index(device)
    return torch.get_rng_state()


def get_rng_state_all() -> list[torch.Tensor]:
    return [get_rng_state()]


def set_rng_state(new_state: torch.Tensor, device: Any = None) -> None:
    """Restore a state from `get_rng_state`; a wrong type, dtype or size is a clear error."""
    _device_index(device)
    expected = torch.get_rng_state()
    if not isinstance(new_state, torch.Tensor):
        raise TypeError(f"torch.{DEVICE}.set_rng_state expects the torch.uint8 tensor get_rng_state() "
                        f"returns, got {type(new_state).__name__}")
    if new_state.dtype != torch.uint8:
        raise TypeError(f"torch.{DEVICE}.set_rng_state expects a torch.uint8 tensor, got {new_state.dtype}")
    if new_state.shape != expected.shape:
        raise ValueError(f"torch.{DEVICE}.set_rng_state expects a state of {expected.numel()} bytes (the CPU "
                         f"generator's, which neuron ops draw from), got shape {tuple(new_state.shape)}")
    torch.set_rng_state(new_state.detach().to("cpu"))


def set_rng_state_all(new_states: Any) -> None:
    """One state per device: a sequence of exactly one."""
    states = list(new_states) if isinstance(new_states, (list, tuple)) else None
    if states is None or len(states) != 1:
        got = f"{len(states)} states" if states is not None else type(new_states).__name__
        raise ValueError(f"torch.{DEVICE}.set_rng_state_all expects a list of one state (this host has one "
                         f"{DEVICE} device, {DEVICE}:0), got {got}")
    set_rng_state(states[0])


# --- device selection -------------------------------------------------------------------------------


class device:
    """Context manager selecting a neuron device (there is only `neuron:0`)."""

    def __init__(self, device: Any) -> None:
        self.idx = _device_index(device) if device is not None else 0

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


class _utils:
    @staticmethod
    def _get_device_index(device: Any, optional: bool = False, allow_cpu: bool = False) -> int:
        return _device_index(device)

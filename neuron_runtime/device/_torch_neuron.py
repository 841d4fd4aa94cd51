"""`torch.neuron`: the device module, as PyTorch, Transformers and Accelerate call it (cf. `torch.cuda`).

One device, `neuron:0`, whose memory is host memory:
  * memory counters are bytes of live `neuron` storage, counted by the native layer when a host buffer
    becomes neuron memory and when its last neuron storage dies (`_native/memory.h`); the same counters
    answer `torch.accelerator.memory_allocated()` and friends. Nothing is cached, so `memory_reserved` is
    `memory_allocated`; `empty_cache` gives the C allocator's freed host memory back to the OS.
  * capacity: TORCH_NEURONX_DEVICE_MEMORY (e.g. a Trainium2 chip's `96GiB`), by default the host's
    physical memory; `mem_get_info()` (and `torch.accelerator.get_memory_info()`) is (capacity - bytes
    counted, capacity), what Accelerate's `device_map="auto"` sizes a device by. A memory query for a
    device index other than 0 raises CUDA's allocator's error ("Invalid device argument N").
  * random numbers: neuron ops draw from the CPU generator (a pure-Python backend cannot own a
    `torch.Generator`), so the neuron RNG state *is* the CPU generator's state: `get_rng_state` returns
    it, `set_rng_state` checks and restores it (a resumed checkpoint reproduces the same dropout masks).
"""

from __future__ import annotations

import platform
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from .. import _config
from .._native import NATIVE
from ..aten import flush_fusion
from ._streams import Event, Stream, current_stream, default_stream, stream  # noqa: F401 - FSDP2's stream API

__neuron_runtime__ = True  # _register.owner_of_privateuse1 knows its own module by this

DEVICE = "neuron"


def _index(device: Any) -> int:
    """The index `device` names (None: the current one, 0); a device of another type is an error."""
    if device is None:
        return 0
    if isinstance(device, int):
        return device
    d = torch.device(device)
    if d.type != DEVICE:
        raise ValueError(f"expected a {DEVICE} device, got {d}")
    return 0 if d.index is None else d.index


def _device_index(device: Any = None) -> int:
    idx = _index(device)
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
    flush_fusion("synchronize")


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
    total_memory: int  # the device's capacity (mem_get_info()[1])


def get_device_properties(device: Any = None) -> DeviceProperties:
    _device_index(device)
    return DeviceProperties(name=get_device_name(), total_memory=mem_get_info()[1])


def get_device_capability(device: Any = None) -> tuple[int, int]:
    _device_index(device)
    return (0, 0)


# --- memory ----------------------------------------------------------------------------------------


class MemoryStatsUnavailable(RuntimeError):
    """The memory counters live in the native layer, which is not loaded."""


def _native() -> Any:
    native = NATIVE
    if native is None:
        from .. import _native as native_mod

        raise MemoryStatsUnavailable(
            "neuron memory counters are kept by the native layer, which is not loaded here "
            f"({native_mod.status()}); unset TORCH_NEURONX_NATIVE=0 or install g++")
    return native


def _memory_index(device: Any) -> int:
    """The index of a memory query: 0, or CUDA's allocator's error for another one (code written for
    CUDA reads the error it knows; `_native/memory.h` raises the same for `torch.accelerator`)."""
    idx = _index(device)
    if idx != 0:
        raise RuntimeError(f"Invalid device argument {idx}: did you call init? (this host has one {DEVICE} "
                           f"device, {DEVICE}:0)")
    return 0


def set_capacity() -> None:
    """Hand TORCH_NEURONX_DEVICE_MEMORY to the native allocator (at registration and on
    `neuron_runtime.reset()`); a value it cannot use is the error every capacity query raises."""
    native = NATIVE
    if native is None:
        return
    try:
        native.set_memory_capacity(_config.device_memory() or 0, "")
    except _config.ConfigError as e:
        native.set_memory_capacity(0, str(e))


def mem_get_info(device: Any = None) -> tuple[int, int]:
    """(free, total) bytes: total is the capacity (TORCH_NEURONX_DEVICE_MEMORY, by default the host's
    physical memory), free is the capacity less the bytes of live neuron storage (`memory_allocated`).
    Host memory other processes use is not subtracted: on Trainium each process owns its device."""
    idx = _memory_index(device)
    free, total = _native().memory_info(idx)
    return int(free), int(total)


def memory_allocated(device: Any = None) -> int:
    """Bytes of host memory held by live neuron storages now."""
    _memory_index(device)
    return int(_native().memory_stats()[0])


def max_memory_allocated(device: Any = None) -> int:
    """The peak of `memory_allocated` since start or the last `reset_peak_memory_stats`."""
    _memory_index(device)
    return int(_native().memory_stats()[1])


def memory_reserved(device: Any = None) -> int:
    return memory_allocated(device)  # no caching allocator: nothing is reserved beyond what is live


def max_memory_reserved(device: Any = None) -> int:
    return max_memory_allocated(device)


def reset_peak_memory_stats(device: Any = None) -> None:
    _memory_index(device)
    _native().reset_peak_memory()


def reset_max_memory_allocated(device: Any = None) -> None:
    reset_peak_memory_stats(device)


def reset_accumulated_memory_stats(device: Any = None) -> None:
    _memory_index(device)
    _native().reset_accumulated_memory()


def memory_stats(device: Any = None) -> OrderedDict[str, Any]:
    """`torch.cuda.memory_stats`'s keys, from the same counters as `torch.accelerator.memory_stats()`:
    one pool ("all"; the large/small pools are 0), where allocated = active = reserved = requested."""
    idx = _memory_index(device)
    _native()
    return torch.accelerator.memory_stats(idx)


def _size(n: float) -> str:
    for unit in ("B  ", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:6.0f} {unit}" if unit == "B  " else f"{n:6.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def memory_summary(device: Any = None, abbreviated: bool = False) -> str:
    """A table of the memory counters, laid out like `torch.cuda.memory_summary` (one pool, nothing
    cached: reserved equals allocated), with the capacity and what is free of it."""
    idx = _memory_index(device)
    stats = memory_stats(idx)
    free, total = mem_get_info(idx)
    width = 77
    rule, double = "|" + "-" * (width - 2) + "|", "|" + "=" * (width - 2) + "|"

    def line(text: str) -> str:
        return "| " + text.ljust(width - 4) + " |"

    rows = [("Allocated memory", "allocated_bytes", True), ("Active memory", "active_bytes", True),
            ("Requested memory", "requested_bytes", True), ("Reserved memory", "reserved_bytes", True),
            ("Allocations", "allocation", False)]
    if abbreviated:
        rows = rows[:1] + rows[-1:]
    out = [double, line(f"PyTorch {DEVICE.upper()} memory summary, device {DEVICE}:{idx}".center(width - 4)), rule,
           line(f"capacity {_size(total).strip()} ({'TORCH_NEURONX_DEVICE_MEMORY' if _config.device_memory() else 'host memory'}), "
                f"free {_size(free).strip()}"),
           rule, line(f"{'Metric':<22}| {'Cur Usage':>10} | {'Peak Usage':>10} | {'Tot Alloc':>10} | {'Tot Freed':>10}"), rule]
    for title, key, is_bytes in rows:
        vals = [stats.get(f"{key}.all.{k}", 0) for k in ("current", "peak", "allocated", "freed")]
        cells = [_size(v) if is_bytes else f"{v:>10d}" for v in vals]
        out.append(line(f"{title:<22}| " + " | ".join(f"{c:>10}" for c in cells)))
    out.append(double)
    return "\n".join(out) + "\n"


def empty_cache() -> None:
    """Give host memory the C allocator kept after frees back to the OS (glibc `malloc_trim`)."""
    if NATIVE is not None:
        NATIVE.empty_cache()
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

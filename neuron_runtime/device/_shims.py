"""Patches to PyTorch for what a pure-Python PrivateUse1 backend cannot register natively.

Each patch changes behaviour only for `neuron` and says why it exists:
  * storage allocation: `torch.UntypedStorage(n, device="neuron")` would call a C++ allocator that a
    Python backend cannot register (segfault). Used by deepcopy, torch.load(map_location=...) and
    `Storage.to()`. Routed to host memory relabelled as neuron instead.
  * `torch.accelerator.synchronize()`: the Python device guard cannot implement it; neuron ops run
    synchronously, so there is nothing to wait for.
  * `torch.utils.swap_tensors` (used by `nn.Module.to` to keep Parameter identity) refuses tensors
    with weakrefs; the runtime's CPU-view cache holds one per neuron tensor. The cache entries are
    dropped first (they are re-derived on next use).
  * lazy modules under that swap (`nn.Module.to` with `set_swap_module_params_on_conversion(True)`, which
    the runtime turns on for Parameter identity): PyTorch's swap path wraps an uninitialized parameter in a
    Parameter (which refuses it on CPU, and on neuron makes it a size-0 Parameter the module never
    materialises). A module's uninitialized parameters and buffers are converted on their own (`fn(p)`
    keeps them uninitialized, on the new device and dtype) and the rest goes through PyTorch's `_apply`.
  * pinned memory: `Tensor.pin_memory()` asks the current accelerator's hooks for a pinned allocator,
    which a Python backend cannot provide. Neuron memory *is* host memory, so pinning is a no-op.
  * backward on the calling thread: PyTorch's autograd engine runs every non-CPU device's backward on a
    worker thread of its own (CUDA needs one per GPU; nothing lets a backend say "like CPU"). For neuron,
    whose ops are synchronous Python kernels, that hand-off costs ~28 % of a small MLP training step
    (`benchmarks/dispatch.py`). The importing thread gets `torch.autograd.set_multithreading_enabled(False)`
    (a thread-local setting): its backward passes run on the calling thread, as CPU's do. Other threads keep
    PyTorch's default; `set_multithreading_enabled(True)` restores it anywhere.
  * DDP `device_ids`: launchers and trainers (Hugging Face's Trainer under torchrun) pass
    `device_ids=[LOCAL_RANK]`, an index into the host's devices. Every process owns `neuron:0` (its core;
    docs/distributed.md), and DDP has no hook through which a device maps a local rank to its index, so
    for a module on neuron an index equal to the process's LOCAL_RANK (or 0) is mapped to 0; any other
    index is an error that says so.
  * `torch.compile(m)` with the default backend: Inductor has no `neuron` device and fails deep inside
    with `KeyError: 'neuron'` (Dynamo offers no hook to pick a backend by device). A graph whose inputs
    are on neuron goes to the `neuron` backend instead (docs/compile.md); any other graph to Inductor.
    Inductor's own `mode=`/`options=` do not apply to it (logged once).
  * `linear_cross_entropy`'s chunked path picks its accumulation per device from tables keyed by device type
    (`_AUTO_DEFAULTS`, `_resolve_auto_acc_dtype`: float32 accumulation and the "accurate" policy on CPU and
    CUDA-like picks elsewhere, bf16 accumulation for an unknown device). Neuron's matmuls accumulate in
    float32 (the host's kernels here, Trainium's PSUM there), so neuron takes CPU's entries: the loss and
    its gradients equal CPU's instead of differing by bfloat16 ulps.
"""

from __future__ import annotations

from typing import Any

import torch

from . import _torch_neuron

_installed = False


def _is_neuron(device: Any) -> bool:
    if device is None:
        return False
    try:
        return torch.device(device).type == _torch_neuron.DEVICE
    except (RuntimeError, TypeError):
        return False


def _neuron_storage(nbytes: int) -> torch.UntypedStorage:
    from ..aten import wrap

    return wrap(torch.empty(int(nbytes), dtype=torch.uint8)).untyped_storage()


def _own_core(device: Any) -> int:
    """DDP's `device_ids` entry for a neuron module: this process's core is neuron:0."""
    import os

    if isinstance(device, int):
        idx: int | None = device
    else:
        d = torch.device(device)
        idx = d.index if d.type == _torch_neuron.DEVICE else -1
    local = os.environ.get("LOCAL_RANK")
    if idx is None or idx == 0 or (local is not None and local.isdigit() and idx == int(local)):
        return 0
    raise ValueError(
        f"DistributedDataParallel(device_ids=[{device}]) for a module on {_torch_neuron.DEVICE}: each process owns "
        f"{_torch_neuron.DEVICE}:0 only (rank → core: one core per process, see docs/distributed.md); pass "
        f"device_ids=[0], [LOCAL_RANK] or nothing")


def _install_ddp_device_ids() -> None:
    import functools

    from torch.nn.parallel import DistributedDataParallel

    init = DistributedDataParallel.__init__

    @functools.wraps(init)
    def ddp_init(self: Any, module: torch.nn.Module, device_ids: Any = None, output_device: Any = None,
                 *args: Any, **kwargs: Any) -> None:
        p = next(iter(module.parameters()), None)
        if device_ids and p is not None and p.device.type == _torch_neuron.DEVICE:
            device_ids = [_own_core(d) for d in device_ids]
            output_device = None if output_device is None else _own_core(output_device)
        init(self, module, device_ids, output_device, *args, **kwargs)

    DistributedDataParallel.__init__ = ddp_init  # type: ignore[method-assign]


def install() -> None:
    global _installed
    if _installed:
        return
    _installed = True
    if torch.distributed.is_available():
        _install_ddp_device_ids()
    torch._C._set_multithreading_enabled(False)  # this thread's backward passes: on the caller (see above)
    base_new = torch._C.StorageBase.__new__

    def storage_new(cls: type, *args: Any, device: Any = None, **kwargs: Any) -> Any:
        if not _is_neuron(device):
            if device is None:
                return base_new(cls, *args, **kwargs)
            return base_new(cls, *args, device=device, **kwargs)
        _torch_neuron._device_index(device)
        if not args and not kwargs:
            return _neuron_storage(0)
        if len(args) == 1 and isinstance(args[0], int) and not kwargs:
            return _neuron_storage(args[0])
        cpu = base_new(cls, *args, **kwargs)  # e.g. from a sequence of bytes: build on the host, then move
        out = _neuron_storage(cpu.nbytes())
        out.copy_(cpu)
        return out

    torch.UntypedStorage.__new__ = staticmethod(storage_new)  # type: ignore[assignment]

    sync = torch.accelerator.synchronize

    def accelerator_synchronize(device: Any = None, /) -> None:
        acc = torch.accelerator.current_accelerator()
        if acc is not None and acc.type == _torch_neuron.DEVICE:
            if device is not None and not isinstance(device, int):
                _torch_neuron._device_index(device)
            return
        sync(device)

    accelerator_synchronize.__doc__ = sync.__doc__
    torch.accelerator.synchronize = accelerator_synchronize

    pin = torch.Tensor.pin_memory
    is_pinned = torch.Tensor.is_pinned

    def pin_memory(self: torch.Tensor, device: Any = None) -> torch.Tensor:
        if (device is None or _is_neuron(device)) and self.device.type in ("cpu", _torch_neuron.DEVICE):
            return self  # neuron memory is host memory: nothing to pin
        return pin(self, device) if device is not None else pin(self)

    def tensor_is_pinned(self: torch.Tensor, device: Any = None) -> bool:
        if device is None or _is_neuron(device):
            return False
        return bool(is_pinned(self, device))

    swap = torch.utils.swap_tensors

    def swap_tensors(t1: torch.Tensor, t2: torch.Tensor) -> None:
        from ..aten import forget

        forget(t1)
        forget(t2)
        swap(t1, t2)

    swap_tensors.__doc__ = swap.__doc__
    torch.utils.swap_tensors = swap_tensors

    _route_inductor()
    _install_linear_cross_entropy_defaults()
    _install_lazy_apply()

    torch.Tensor.pin_memory = pin_memory  # type: ignore[method-assign]
    torch.Tensor.is_pinned = tensor_is_pinned  # type: ignore[method-assign]


def _still_lazy(old: Any, new: torch.Tensor) -> Any:
    """An uninitialized parameter or buffer like `old` on `new`'s device and dtype (`fn` returns a plain
    empty tensor: Parameter disables torch functions, so the subclass is not kept)."""
    if isinstance(old, torch.nn.parameter.UninitializedBuffer):
        return type(old)(requires_grad=old.requires_grad, device=new.device, dtype=new.dtype,
                         persistent=getattr(old, "persistent", True))
    return type(old)(requires_grad=old.requires_grad, device=new.device, dtype=new.dtype)


def _install_lazy_apply() -> None:
    from torch.nn.parameter import is_lazy

    apply = torch.nn.Module._apply

    def _apply(self: torch.nn.Module, fn: Any, recurse: bool = True) -> torch.nn.Module:
        lazy = [(d, k, t) for d in (self._parameters, self._buffers) for k, t in d.items()
                if t is not None and is_lazy(t)]
        if not lazy:
            return apply(self, fn, recurse)
        for d, k, _ in lazy:
            d[k] = None  # PyTorch's _apply skips None entries
        try:
            out = apply(self, fn, recurse)
        finally:
            with torch.no_grad():
                for d, k, t in lazy:
                    d[k] = _still_lazy(t, fn(t))
        return out

    _apply.__doc__ = apply.__doc__
    torch.nn.Module._apply = _apply  # type: ignore[method-assign]


def _install_linear_cross_entropy_defaults() -> None:
    try:
        from torch.nn.modules import linear_cross_entropy_options as lce
    except ImportError:  # a torch without it
        return
    table = getattr(lce, "_AUTO_DEFAULTS", None)
    options = getattr(lce, "LinearCrossEntropyOptions", None)
    if not isinstance(table, dict) or options is None or not hasattr(options, "_resolve_auto_acc_dtype"):
        return
    dev = _torch_neuron.DEVICE
    for (kind, dtype), pick in list(table.items()):
        if kind == "cpu":
            table.setdefault((dev, dtype), pick)
    resolve = options._resolve_auto_acc_dtype

    def resolve_acc_dtype(dtype: torch.dtype, device: Any) -> Any:
        if device is not None and getattr(device, "type", None) == dev:
            device = torch.device("cpu")
        return resolve(dtype, device)

    resolve_acc_dtype.__doc__ = resolve.__doc__
    options._resolve_auto_acc_dtype = staticmethod(resolve_acc_dtype)


def _route_inductor() -> None:
    wrapper = torch._TorchCompileInductorWrapper  # what `torch.compile(m)` calls with each graph
    inductor = wrapper.__call__

    def call(self: Any, model_: Any, inputs_: Any, *args: Any, **kwargs: Any) -> Any:
        if any(isinstance(t, torch.Tensor) and t.device.type == _torch_neuron.DEVICE for t in inputs_):
            import logging

            from ..graphs import backend

            logging.getLogger(__name__).info(
                "torch.compile: a graph on neuron tensors compiles with backend='neuron' (Inductor has no "
                "neuron device); Inductor's mode/options are not used")
            return backend(model_, inputs_)
        return inductor(self, model_, inputs_, *args, **kwargs)

    call.__doc__ = inductor.__doc__
    wrapper.__call__ = call  # type: ignore[method-assign]

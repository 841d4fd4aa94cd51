"""neuron-runtime: PyTorch eager on a `neuron` device, one compiled executable per op signature.

`import torch` loads this package through the `torch.backends` entry point; importing it directly
does the same. Public names are listed in `__all__`.
"""

from __future__ import annotations

from typing import Any

__all__ = ["fallback_ops", "kernel", "kernels", "reset", "stats", "wait_for_compiles", "__version__"]
from ._version import __version__

_loaded = False


def _autoload() -> None:
    """Entry point of the `torch.backends` group (called during `import torch`)."""
    _load()


def _load() -> None:
    global _loaded
    if _loaded:
        return
    from .device import DEVICE, check_conflicts, install_autocast, install_rnn, install_shims, register_device
    from .aten import register_kernels
    from .executables import register_megacache
    from . import _stats, distributed

    check_conflicts()
    _configure_logging()
    register_device()
    register_kernels()
    install_autocast(DEVICE)
    install_shims()
    install_rnn()
    _stats.install_exit_hook()
    distributed.register()
    register_megacache()  # executables travel in torch.compiler.save_cache_artifacts() bundles
    _loaded = True
    _start_prefetch()


def _start_prefetch() -> None:
    """A job named by TORCH_NEURONX_JOB fetches its executables from import on, in the background (the
    runtime is otherwise made at the first op)."""
    import os

    if not os.environ.get("TORCH_NEURONX_JOB"):
        return
    import threading

    def make() -> None:
        from .aten import runtime

        try:
            runtime()
        except Exception:  # noqa: BLE001 - a bad setting is reported by the first op, in the user's thread
            pass

    threading.Thread(target=make, name="neuron-prefetch-start", daemon=True).start()


def _configure_logging() -> None:
    """TORCH_NEURONX_LOG_LEVEL: an explicit request to see the runtime's logs on stderr."""
    import logging
    import os

    level = os.environ.get("TORCH_NEURONX_LOG_LEVEL")
    if level:
        logger = logging.getLogger("neuron_runtime")
        logger.setLevel(level.upper())
        if not logger.handlers:
            handler = logging.StreamHandler()
            handler.setFormatter(logging.Formatter("%(asctime)s neuron %(levelname)s %(name)s: %(message)s"))
            logger.addHandler(handler)


def stats() -> dict[str, Any]:
    """Counters of this process as a JSON-serialisable dict (executions, compiles, fallbacks, corrupt,
    hits per tier, collectives run through `neuron` process groups, ...)."""
    from .aten import runtime

    return runtime().stats()


def fallback_ops() -> list[str]:
    """Ops that ran on the host because they could not be compiled (one warning each)."""
    from .aten import runtime

    return sorted(runtime().fallback_ops)


def wait_for_compiles(timeout: float | None = None) -> bool:
    """Block until every executable this process asked the background compile service for is compiled
    and loaded (then the job's ops all run compiled). True when done, False if `timeout` seconds ran
    out first. Returns at once in `sync` mode (TORCH_NEURONX_COMPILE_MODE)."""
    from .aten import _fusion, runtime

    done = runtime().resolver.wait(timeout)
    _fusion.compiles_landed()
    return done


def kernel(name: str, **options: Any) -> Any:
    """Decorate a typed function of torch ops: it becomes the operator `torch.ops.<ns>.<name>`, one
    cached executable per call on neuron (docs/kernels.md; `neuron_runtime.kernels.kernel`, whose
    keyword options it takes: `mutates_args`, and `source`/`outputs` for a kernel given as C++)."""
    from .kernels import kernel as make

    return make(name, **options)


def __getattr__(name: str) -> Any:
    """`neuron_runtime.kernels` (the kernel library) is imported on first use, not at `import torch`."""
    if name == "kernels":
        import importlib

        return importlib.import_module(".kernels", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def reset() -> None:
    """Re-read the environment and start with empty in-process caches and counters."""
    from .aten import reset_runtime
    from .device import set_capacity

    set_capacity()
    reset_runtime()


# Importing torch here (not first inside `_load`) matters when a program imports this package before
# torch: torch's own start-up then calls `_autoload` once, with every submodule importable.
import torch  # noqa: E402

_load()

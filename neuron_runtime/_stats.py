"""`TORCH_NEURONX_STATS_FILE`: write `stats()` as JSON when the process exits."""

from __future__ import annotations

import atexit
import json
import os
import tempfile


_installed = False


def write(path: str) -> None:
    from .aten import runtime

    data = json.dumps(runtime().stats(), indent=2, sort_keys=True)
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=d, prefix=".stats-")
    with os.fdopen(fd, "w") as f:
        f.write(data + "\n")
    os.replace(tmp, path)


def _at_exit() -> None:
    from .aten import made_runtime

    rt = made_runtime()
    if rt is None:
        return  # nothing ran on the device (e.g. a tool that only imported torch): no counters to write
    path = rt.cfg.stats_file
    if path:
        try:
            write(path)
        except Exception as e:  # noqa: BLE001 - never turn a finished job into a failure
            import warnings

            warnings.warn(f"TORCH_NEURONX_STATS_FILE: cannot write {path}: {e}", stacklevel=1)


def install_exit_hook() -> None:
    global _installed
    if not _installed:
        atexit.register(_at_exit)
        _installed = True

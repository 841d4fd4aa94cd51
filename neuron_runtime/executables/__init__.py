"""A signature in, an executable out: memory tier -> local -> fleet store -> compile.

    _resolver.py   `Resolver.resolve(signature)`: the memory tier, shape classes, single-flight compiles
    _background.py compiles in the host's compile service while the op runs on the host
    _service/      the compile service: server, client, worker processes (JSON lines, no pickle)
    _entries.py    what a compile stores: an executable's bytes, or a refusal
    _manifest.py   a job's manifest of the keys it used (prefetched on the next run)
    _record.py     record files: the signatures a job met, for `neuron-cache warm` (the CLI's "manifest")
    _megacache.py  the executables a process used, in `torch.compiler.save_cache_artifacts()` bundles

Imports `cache/`, `compiler/` and `signatures/` below it. What the layers above use is named here;
nothing here is public API. The compile service's and the signature records' names load on first use
(`neuron-cache` needs them; a training process that only hits its cache never imports them).
"""

from __future__ import annotations

from typing import Any

from ..cache import CacheMissError, IntegrityError, TieredCache
from ..compiler import CompileRefused, Compiler, Executable
from ._megacache import register as register_megacache, set_provider, stats as megacache_stats
from ._resolver import Resolver

# What a resolve answers with, from the layers below (the layers above never import those themselves).
_VOCABULARY = ["CacheMissError", "CompileRefused", "Compiler", "Executable", "IntegrityError", "TieredCache"]
__all__ = [*_VOCABULARY, "RecordLine", "Resolver", "WorkerPool", "ask", "check_signature", "megacache_stats",
           "parse_line", "read_records", "register_megacache", "scan_records", "service_dir", "set_provider",
           "worker_env"]

_RECORD = frozenset({"RecordLine", "check_signature", "parse_line", "read_records", "scan_records"})
_CLIENT = frozenset({"ask", "service_dir"})


def __getattr__(name: str) -> Any:
    """The names only `neuron-cache` uses, imported on first use."""
    if name in _RECORD:
        from . import _record as module
    elif name in _CLIENT:
        from ._service import _client as module
    elif name == "WorkerPool":
        from ._service import _pool as module
    elif name == "worker_env":
        from ._service import _worker as module
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(module, name)

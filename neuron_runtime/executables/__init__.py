"""A signature in, an executable out: memory tier -> local -> fleet store -> compile.

    _resolver.py   `Resolver.resolve(signature)`: the memory tier, shape classes, single-flight compiles
    _background.py compiles in the host's compile service while the op runs on the host
    _service/      the compile service: server, client, worker processes (JSON lines, no pickle)
    _entries.py    what a compile stores: an executable's bytes, or a refusal
    _manifest.py   a job's manifest of the keys it used (prefetched on the next run)
    _record.py     recording signatures for `neuron-cache warm`
    _megacache.py  the executables a process used, in `torch.compiler.save_cache_artifacts()` bundles

Imports `cache/`, `compiler/` and `signatures/` below it. Nothing here is public API.
"""

__all__: list[str] = []

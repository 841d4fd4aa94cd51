"""Mega-Cache: the executables a process used travel in `torch.compiler.save_cache_artifacts()`.

PyTorch's Mega-Cache (`torch/compiler/_cache.py`) bundles what each compile cache recorded into one
byte string that `torch.compiler.load_cache_artifacts()` hot-loads in another process (vLLM, torchtitan
and serving images ship compile caches with a model this way). Ours are artifacts of type `neuron_neff`
(the type TorchNeuron registers its NEFFs as): key = the cache key, content = the entry's envelope, the
bytes every tier holds (`envelope`). PyTorch's bundle format is its own length-prefixed serializer;
nothing here pickles.

Saving: the resolver `record`s each verified entry it loads or compiles (an op's, a shape class's, a
fused group's, a torch.compile graph's executable, and refusals, so the next process asks no compiler
about those either), once per key. The recorded bytes stay in memory until the process ends, as
PyTorch's own artifacts do (an aoti executable is ~0.35 MB).

Loading: `populate_cache()` of each artifact, through the checks any entry from outside passes:
  1. the key is a cache key and the content at most `MAX_ENTRY` bytes;
  2. `TieredCache.verify`: magic, version, lengths (truncation), sha256 digest, the HMAC when a signing
     key is set (an unsigned or wrongly signed artifact is refused), the header's key;
  3. the header's fingerprint is this runtime's compiler fingerprint, and the key re-derived here from
     the header's signature and that fingerprint is the artifact's key (an artifact made for another
     compiler, ISA or torch, or whose signature does not give its key, is refused);
  4. stored in the local tier (first writer wins; nothing in `readonly` mode), where the resolver finds
     it like any entry: loaded, never compiled.
A refused artifact costs only itself: one warning naming its key and why; the others load.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable
from typing import Any

from ..cache import envelope
from ..cache import IntegrityError
from ..cache import check_key
from ._entries import REFUSED

TYPE = "neuron_neff"
MAX_ENTRY = 1 << 30  # an entry is a few MB at most; a larger artifact is not one of ours

_lock = threading.Lock()
_recorded: set[str] = set()
_seen: Any = None  # the `CacheArtifactManager._seen_artifacts` that `_recorded` describes
counts = {"recorded": 0, "loaded": 0, "refused": 0}
# The resolver artifacts load into: the runtime's, made on first use (`set_provider`, from aten/ above).
_provider: Callable[[], Any] | None = None
_registered = False


def set_provider(provider: Callable[[], Any]) -> None:
    """`provider()` returns the runtime's `Resolver` (making the runtime if there is none yet)."""
    global _provider
    _provider = provider


def record(key: str, entry: envelope.Entry, signing_key: bytes | None) -> None:
    """Offer a verified entry this process used to PyTorch's Mega-Cache (once per key and PyTorch list:
    after `CacheArtifactManager.clear()` or inside `with_fresh_cache()`, PyTorch holds a new, empty list of
    what it has seen, and every entry is offered again as it is used)."""
    global _seen
    if not _registered:
        return
    from torch.compiler._cache import CacheArtifactManager

    seen = CacheArtifactManager._seen_artifacts
    if key in _recorded and seen is _seen and len(seen):
        return
    with _lock:
        if seen is not _seen or not len(seen):
            _recorded.clear()
            _seen = seen
        if key in _recorded:
            return
        _recorded.add(key)
        data = envelope.pack(key, entry.header, entry.payload, signing_key)
        CacheArtifactManager.record_artifact(TYPE, key, data)
        counts["recorded"] += 1


def _refuse(key: str, why: str) -> None:
    with _lock:
        counts["refused"] += 1
    warnings.warn(f"neuron: Mega-Cache artifact {key[:64]!r} refused ({why}); not loaded (the others are)",
                  UserWarning, stacklevel=3)


def populate(key: str, data: bytes) -> bool:
    """Verify one artifact and store it in the local tier; False (with a warning) if it is refused."""
    try:
        check_key(key)
    except Exception as e:  # noqa: BLE001 - input from outside: refused, never raised into the loader
        _refuse(str(key), f"not a cache key: {e}")
        return False
    if not isinstance(data, (bytes, bytearray)) or len(data) > MAX_ENTRY:
        _refuse(key, f"content is not an entry of at most {MAX_ENTRY} bytes")
        return False
    if _provider is None:
        _refuse(key, "the neuron runtime is not loaded")
        return False
    resolver = _provider()
    cache = resolver.cache
    if cache is None:
        _refuse(key, "this process has no local cache tier to store it in")
        return False
    try:
        entry = cache.verify(key, bytes(data))
    except IntegrityError as e:
        _refuse(key, f"{e.reason}: {e}")
        return False
    header = entry.header
    if header.get("fingerprint") != resolver.fingerprint:
        ours, theirs = resolver.fingerprint, header.get("fingerprint")
        diff = sorted(k for k in set(ours) | set(theirs if isinstance(theirs, dict) else {})
                      if not isinstance(theirs, dict) or theirs.get(k) != ours.get(k))
        _refuse(key, f"made for another compiler fingerprint (differs in {', '.join(diff) or 'its form'})")
        return False
    try:
        derived = resolver.key(header["signature"])
    except Exception as e:  # noqa: BLE001 - a signature this runtime cannot key is not one it could use
        _refuse(key, f"its signature cannot be keyed here ({type(e).__name__}: {e})")
        return False
    if derived != key:
        _refuse(key, f"its signature gives key {derived}, not its own")
        return False
    why = None if header.get(REFUSED) else resolver.payload_mismatch(key, entry.payload)
    if why:
        _refuse(key, why)
        return False
    if not cache.writable:
        _refuse(key, "the cache is readonly (TORCH_NEURONX_CACHE_MODE=readonly)")
        return False
    if not cache.local.put(key, bytes(data)) and cache.get_local(key) is None:
        _refuse(key, "the local tier did not store it")
        return False
    with _lock:
        counts["loaded"] += 1
    return True


def register() -> None:
    """Register the `neuron_neff` artifact type with PyTorch's Mega-Cache (at import, so a process that
    only loads a bundle knows the type)."""
    global _registered
    if _registered:
        return
    from torch.compiler._cache import CacheArtifact, CacheArtifactFactory

    @CacheArtifactFactory.register
    class NeuronArtifact(CacheArtifact):  # noqa: F841 - registered by the decorator
        """One cache entry (envelope bytes) under its cache key."""

        @staticmethod
        def type() -> str:
            return TYPE

        def populate_cache(self) -> None:
            try:
                populate(self.key, self.content)
            except Exception as e:  # noqa: BLE001 - PyTorch's loader stops at an exception: refuse this one
                _refuse(str(self.key), f"{type(e).__name__}: {e}")

    _registered = True


def stats() -> dict[str, int]:
    with _lock:
        return dict(counts)


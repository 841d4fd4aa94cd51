"""Executable resolution: a signature in, a loaded executable out (DESIGN §2, §6).

    memory     loaded executables by cache key (the hit path's kernels keep their own per-key tables)
      └─ tiers     local disk, then the fleet store (`cache.TieredCache`): verified envelopes
           └─ compile  single-flight across threads, processes and hosts, through the compiler tier

`Resolver.resolve(sig)` is the whole interface the kernels see: it returns the executable, or raises
`CompileRefused` (the op runs on the host: a cached refusal, or the compiler's answer), `CacheMissError`
(strict mode) or `IntegrityError`. Nothing here knows about aten ops: a signature is an op's, or a fused
group's graph; the digest of (signature, compiler fingerprint) is the key everywhere.

One rule decides what runs (docs/cache.md, "Trust model"): a key is served only by the executable of its
own signature, or of a shape class that signature belongs to, both derived here from the call's own
signature (`allowed`). Links between keys are made only through `link`, which checks it; nothing a
manifest, a peer, the compile service or a cache entry says can widen it. An entry whose header names
another signature than its key's is never loaded (`load_entry`).
"""

from __future__ import annotations

import logging
import threading
import warnings
from collections.abc import Callable
from typing import Any

from .. import _config, _profiling
from ..cache import CacheMissError, TieredCache
from ..compiler import Compiled, CompileRefused, Compiler, Executable, PhaseTimes, get_compiler
from ..signatures import cache_key, canonical, is_class, is_flat, is_packed, kind_of, policy_allows, shape_classes
from . import _entries, _megacache

log = logging.getLogger(__name__)


class Resolver:
    """Finds or makes executables; owns the memory tier and the persistent tiers of one runtime.

    `counts` is the runtime's counter dict, shared with the `TieredCache` (which adds hits per tier,
    misses, compiles, corrupt, ...). `on_evict()` is called after the memory tier dropped executables,
    so whoever keeps references to them (the kernels' per-key tables) can drop theirs. Thread-safe:
    threads needing different keys compile in parallel; the cache's single-flight makes threads needing
    the same key wait for one compile."""

    def __init__(self, cfg: _config.Config, counts: dict[str, Any], lock: threading.RLock,
                 on_evict: Callable[[], None] = lambda: None) -> None:
        self.cfg = cfg
        self.counts = counts
        self.lock = lock
        self.on_evict = on_evict
        self.compiler: Compiler = get_compiler(cfg.compiler)
        self.fingerprint = self.compiler.fingerprint()
        self.by_digest: dict[str, Executable] = {}  # key (exact, or a shape class's) -> executable
        self.classes: dict[str, str] = {}  # exact key -> key of the shape class whose executable serves it
        self.class_keys: set[str] = set()  # keys in by_digest that are shape classes'
        self._cache: TieredCache | None = None
        self._cache_opened = False
        self._background: Any = None
        self.seen: dict[str, int] = {}  # background mode: requests of keys not yet queued for compiling
        self.compile_kinds: dict[str, int] = {"op": 0, "fused": 0, "graph": 0}  # compiles this process caused
        self.phase_times = PhaseTimes()  # seconds per compile phase of those compiles (`stats()`)
        self._kinds_lock = threading.Lock()  # its own: callers may hold the runtime's lock, or the cache's
        self.refused_classes: dict[str, str] = {}  # class key -> why it has no generic executable
        self.unloadable: dict[str, str] = {}  # key -> why this host cannot load or compile it (never cached)
        self.recorder: Callable[[dict[str, Any], str], None] | None = None
        if cfg.record_file:
            from ._record import Recorder

            self.recorder = Recorder(cfg.record_file)
        if cfg.prefetch and (cfg.job or cfg.compile_mode == "background"):
            _ = self.background  # a named job prefetches now; an unnamed one after its first keys

    def set_compiler(self, compiler: Compiler) -> None:
        """Use another compiler tier (its fingerprint keys everything from now on)."""
        self.compiler = compiler
        self.fingerprint = compiler.fingerprint()

    @property
    def cache(self) -> TieredCache | None:
        """The persistent tiers (local disk, fleet store), opened on first use. None if they cannot be
        opened at all: then every op still runs, compiling in memory (one warning)."""
        if not self._cache_opened:
            with self.lock:
                if not self._cache_opened:
                    try:
                        self._cache = TieredCache.from_config(self.cfg, self.counts)
                    except Exception as e:  # noqa: BLE001 - a cache problem never fails an op
                        warnings.warn(f"neuron: executable cache unavailable ({type(e).__name__}: {e}); "
                                      "compiling in memory only", UserWarning, stacklevel=2)
                        self._cache = None
                    self._cache_opened = True
        return self._cache

    def key(self, sig: dict[str, Any]) -> str:
        return cache_key(sig, self.fingerprint)

    # -- resolution -------------------------------------------------------------------------------
    def resolve(self, sig: dict[str, Any], wait: bool | None = None,
                seen: bool = False) -> tuple[Executable | None, str]:
        """The executable of a signature and its key: memory, then the tiers, then a compile.

        `wait=False` (the default in background mode, TORCH_NEURONX_COMPILE_MODE): the local tier is the
        last place looked at in this call; anything else (the fleet store, a compile) happens in the
        background and the result is `(None, key)` until the executable is in the memory tier. Strict
        mode always waits (a miss is an error, never a background compile). `seen`: the caller counted
        the signature's sightings itself (a fusion region, TORCH_NEURONX_FUSION_MIN_SEEN): a background
        compile is requested at once, not from the `compile_after`-th request on."""
        digest = self.key(sig)
        exe = self.executable(digest)
        if exe is not None:
            self.note(digest, sig)  # e.g. a prefetched executable: the job used it
            return exe, digest
        if wait is None:
            wait = self.cfg.compile_mode != "background"
        if wait or self.cfg.cache_mode == "strict" or self.cache is None:
            return self.resolve_now(sig, digest)
        return self._resolve_background(digest, sig, seen)

    def resolve_now(self, sig: dict[str, Any], digest: str | None = None) -> tuple[Executable, str]:
        """Memory, tiers, compile, blocking until the executable exists (or raising): the candidates in
        order (shape classes, then the exact signature: `candidates`). An executable in memory or on
        local disk under any candidate's key beats compiling an earlier one (e.g. the exact-shape entries of a runtime
        that keyed no classes); a class that has no generic executable (a refusal, cached like any) or,
        in strict mode, no entry, passes to the next candidate."""
        digest = digest or self.key(sig)
        exe = self.executable(digest)
        if exe is None:
            candidates = self.candidates(sig)
            keys = [digest if cand is sig else self.key(cand) for cand in candidates]
            found = self._known(candidates, keys) if len(candidates) > 1 else None
            exe, k = found or self._compile_first(candidates, keys)
            if k != digest:
                self.link(digest, k, sig)
        self.note(digest, sig)
        return exe, digest

    def _compile_first(self, candidates: list[dict[str, Any]], keys: list[str]) -> tuple[Executable, str]:
        """The first candidate's executable the tiers or the compiler give, with its key."""
        for i, (cand, k) in enumerate(zip(candidates, keys)):
            last = i + 1 == len(candidates)
            if not last and (k in self.refused_classes or k in self.unloadable):
                continue
            try:
                exe = self._load_or_compile(k, cand)
            except _entries.HostRefused:
                raise  # this host cannot use or build it: another candidate would fare no better here
            except (CompileRefused, CacheMissError) as e:
                if last:
                    raise
                if isinstance(e, CompileRefused):
                    with self.lock:
                        self.refused_classes[k] = str(e)
                continue
            return self.remember(k, cand, exe), k
        raise AssertionError("unreachable: the last candidate raises or returns")

    def _known(self, candidates: list[dict[str, Any]], keys: list[str]) -> tuple[Executable, str] | None:
        """The first candidate's executable found in memory or in the local tier, with its key; raises
        CompileRefused if the exact signature's refusal is the first entry found."""
        cache = self.cache
        for cand, k in zip(candidates, keys):
            exe = self.by_digest.get(k)
            if exe is None and k in self.unloadable:
                continue
            if exe is None and cache is not None:
                try:
                    exe = self._local(cache, k, cand)
                except _entries.HostRefused:
                    raise  # the op runs on the host
                except CompileRefused as e:
                    if k == keys[-1]:
                        raise
                    with self.lock:
                        self.refused_classes[k] = str(e)
                    continue
            if exe is not None:
                return exe, k
        return None

    def _local(self, cache: TieredCache, k: str, cand: dict[str, Any]) -> Executable | None:
        """Candidate `cand`'s executable (key `k`) from the local tier, or None if that holds nothing this
        call takes as an answer: no entry, or a refusal by another neuron-runtime version (the blocking
        path decides about that one: `_entries.get_or_compile`). A cached refusal raises CompileRefused,
        an entry this host cannot use `HostRefused` (the op runs on the host; nothing is deleted)."""
        entry = cache.get_local(k)
        if entry is None or _entries.stale_refusal(entry):
            return None
        return self.remember(k, cand, self.load_entry(k, entry))

    def _resolve_background(self, digest: str, sig: dict[str, Any],
                            counted: bool = False) -> tuple[Executable | None, str]:
        bg = self.background
        waiting, refused = bg.lookup(digest)
        if refused is not None:
            raise CompileRefused(refused)
        if waiting:
            return None, digest
        cache = self.cache
        assert cache is not None
        candidates = self.candidates(sig)
        self.note(digest, sig)
        for i, cand in enumerate(candidates):
            k = digest if cand is sig else self.key(cand)
            last = i + 1 == len(candidates)
            if not last and (k in self.refused_classes or k in self.unloadable):
                continue
            exe = self.by_digest.get(k)
            if exe is None:
                try:
                    exe = self._local(cache, k, cand)
                except _entries.HostRefused:
                    raise  # the op runs on the host
                except CompileRefused:
                    if not last:
                        continue  # e.g. this class has no generic kernel: the next candidate
                    raise
                if exe is None:
                    continue
            if k != digest:
                self.link(digest, k, sig)
            return exe, digest
        # A signature met once only (a decode step's KV length, a warm-up shape) is not worth a compile:
        # it is compiled from its `compile_after`-th request on (docs/background.md: the measurement).
        with self.lock:
            seen = self.seen[digest] = self.seen.get(digest, 0) + 1
        if seen == 1:
            self.count("misses")
        if seen >= self.cfg.compile_after or counted:
            bg.request(digest, sig, self.live_candidates(sig))
        return None, digest

    def candidates(self, sig: dict[str, Any]) -> list[dict[str, Any]]:
        """The signatures whose executables can serve `sig`, most general first (the exact one last):
        its shape classes (`shape_classes`: the flat class of an elementwise op, the ranked class;
        TORCH_NEURONX_SHAPES), then `sig`. Called on memory-tier misses only."""
        if is_class(sig) or not policy_allows(self.cfg.shapes, sig):
            return [sig]
        return [*shape_classes(sig), sig]

    def allowed(self, sig: dict[str, Any]) -> list[str]:
        """The keys whose executables may serve `sig`: its classes' and its own (`candidates`), derived
        here from `sig` itself. The one rule every link obeys (module docstring)."""
        return [self.key(c) for c in self.candidates(sig)]

    def live_candidates(self, sig: dict[str, Any]) -> list[dict[str, Any]]:
        """`candidates` less the classes known to have no executable here (refused, or not loadable on
        this host); the exact signature always stays."""
        cands = self.candidates(sig)
        skip = self.refused_classes.keys() | self.unloadable.keys()
        return [c for c in cands[:-1] if self.key(c) not in skip] + cands[-1:]

    def load_entry(self, key: str, entry: Any) -> Executable:
        """A verified entry's executable. Raises CompileRefused for a refusal entry, and `HostRefused`
        (the op runs on the host here; no tier is touched) for one this host cannot use: its header
        names a signature that is not its key's (under this runtime's fingerprint), or its payload does
        not load here (a CPU below the target, no file descriptors, ...). Only a digest or HMAC failure,
        found by the tiers before this, proves an entry bad and gets it quarantined and recompiled."""
        _entries.check(self.used(key, entry, refusal=True))
        sig = entry.header.get("signature")
        try:
            ok = isinstance(sig, dict) and self.key(sig) == key
        except (TypeError, ValueError):
            ok = False
        if not ok:
            raise self._unloadable(key, str(sig.get("op") if isinstance(sig, dict) else "?"),
                                   "its header names another signature than its key's")
        why = self.payload_mismatch(key, entry.payload)
        if why:
            raise self._unloadable(key, str(sig.get("op")), why)
        try:
            exe = self._load(key, entry)
        except CompileRefused:
            raise
        except Exception as e:  # noqa: BLE001 - verified bytes that do not load here: never run them
            raise self._unloadable(key, str(sig.get("op")), f"{type(e).__name__}: {str(e)[:300]}") from e
        self.count("loads")
        return exe

    def payload_mismatch(self, key: str, payload: bytes) -> str | None:
        """Why `payload` may not serve `key` (None if it may): the signature the artifact records inside
        itself (`Compiler.payload_signature`) must give `key` too. The header's signature is checked
        against the key by every reader, but a header is only the envelope's word: an unsigned entry (a
        Mega-Cache bundle, a peer's answer) could name the right signature over another op's bytes."""
        try:
            own = self.compiler.payload_signature(payload)
            if own is None:
                return None  # a tier whose artifacts record no signature (documented in compiler._base)
            if self.key(own) == key:
                return None
            return f"its payload was compiled for {str(own.get('op'))[:80]}, another signature than its key's"
        except Exception as e:  # noqa: BLE001 - bytes from outside: any failure to read them is a refusal
            return f"its payload does not say what it computes ({type(e).__name__}: {str(e)[:200]})"

    def _load(self, key: str, entry: Any) -> Executable:
        """The executable of a verified entry (a profiler range); the entry is `used` once it loaded."""
        loaded = entry.header.get("signature") or {}
        with _profiling.compile_span(loaded, key, kind_of(loaded), "load"):
            exe = self.compiler.load(entry.payload)
        self.used(key, entry)
        return exe

    def used(self, key: str, entry: Any, refusal: bool = False) -> Any:
        """A verified entry this process acts on (an executable that loaded, or with `refusal` a refusal)
        is offered to PyTorch's Mega-Cache (`_megacache`). Returns the entry."""
        if not refusal or entry.header.get(_entries.REFUSED):
            _megacache.record(key, entry, self.cfg.signing_key)
        return entry

    def _unloadable(self, key: str, op: str, why: str) -> _entries.HostRefused:
        """Remember (for this process) that `key` cannot be used here; the error to raise."""
        with self.lock:
            self.unloadable[key] = why
            first = len(self.unloadable) == 1
        self.count("unloadable")
        # One warning per process (the op's own fallback warning names each op); the rest at debug level.
        (log.warning if first else log.debug)(
            "neuron: cached executable %s for %s cannot be used on this host (%s); its op runs on the host "
            "and the cached entry is left as it is (stats()['unloadable'] counts such keys)", key, op, why)
        return _entries.HostRefused(f"{op}: cached executable {key[:16]} cannot be used on this host ({why}); "
                                    "it runs on the host, the cache is left as it is")

    def has(self, key: str) -> bool:
        return key in self.by_digest or self.classes.get(key) in self.by_digest

    def executable(self, digest: str) -> Executable | None:
        """The memory tier's executable for a key: its own, or its shape class's (`link`)."""
        exe = self.by_digest.get(digest)
        if exe is None:
            k = self.classes.get(digest)
            if k is not None:
                exe = self.by_digest.get(k)
        return exe

    def link(self, digest: str, class_key: str, sig: dict[str, Any]) -> bool:
        """Exact key `digest` (of `sig`) is served by the executable of shape class `class_key` (memory
        tier), if `class_key` is one `sig` may use (`allowed`); False (and nothing linked) otherwise.
        Links count towards TORCH_NEURONX_MEMORY_CACHE_ENTRIES like executables do: each is an entry of
        a kernel's hit-path table."""
        allowed = self.allowed(sig)
        if allowed[-1] != digest or class_key not in allowed:
            self.count("links_refused")
            log.warning("neuron: refused to serve key %s (%s) with executable %s: not one of its own candidates",
                        digest, sig.get("op"), class_key)
            return False
        with self.lock:
            if len(self.by_digest) + len(self.classes) >= self.cfg.memory_cache_entries:
                self._evict()
            self.classes[digest] = class_key
        self.count("class_hits")  # a new shape of a known class: no compile
        return True

    def note(self, digest: str, sig: dict[str, Any]) -> None:
        """A key this process uses, with its exact signature (its job's manifest records it)."""
        bg = self._background
        if bg is not None:
            bg.note(digest, sig)

    @property
    def background(self) -> Any:
        """The background compiles (`_background.Background`), made on first use."""
        if self._background is None:
            with self.lock:
                if self._background is None:
                    from ._background import Background

                    self._background = Background(self)
        return self._background

    def wait(self, timeout: float | None = None) -> bool:
        bg = self._background
        return True if bg is None else bg.wait(timeout)

    def close(self) -> None:
        bg = self._background
        if bg is not None:
            bg.close()

    def remember(self, digest: str, sig: dict[str, Any], exe: Executable) -> Executable:
        """Keep `exe`, the executable of `sig`, under its key `digest` (which must be `sig`'s)."""
        if self.key(sig) != digest:
            raise ValueError(f"executable of {sig.get('op')} offered under key {digest}, which is not its key")
        _label(exe, digest, sig)  # before any kernel can see it
        with self.lock:
            known = self.by_digest.get(digest)
            if known is not None:
                return known
            if len(self.by_digest) + len(self.classes) >= self.cfg.memory_cache_entries:
                self._evict()
            self.by_digest[digest] = exe
            if is_class(sig):
                self.class_keys.add(digest)
        if self.recorder is not None:
            self.recorder(sig, digest)
        return exe

    def _evict(self) -> None:
        """Bound the loaded executables (TORCH_NEURONX_MEMORY_CACHE_ENTRIES): drop the older half.

        Dropped executables reload from the local tier (milliseconds) when next needed. Oldest-first
        rather than true LRU, so the hit path never pays for recency bookkeeping. The links to shape
        classes all go (a dropped link costs one memory-tier lookup of its class, never a compile), and
        with them the kernels' entries for the shapes they served (`live`)."""
        for digest in list(self.by_digest)[: max(1, len(self.by_digest) // 2)]:
            del self.by_digest[digest]
            self.class_keys.discard(digest)
        self.classes.clear()
        self.on_evict()

    def live(self) -> set[int]:
        """ids of the executables the memory tier holds under exact keys (for `on_evict` callers: a shape
        class's executable serves keys whose links `_evict` dropped)."""
        return {id(e) for k, e in self.by_digest.items() if k not in self.class_keys}

    def _load_or_compile(self, digest: str, sig: dict[str, Any]) -> Executable:
        why = self.unloadable.get(digest)
        if why is not None:
            raise _entries.HostRefused(f"{sig.get('op')}: {why}")
        cache = self.cache
        if cache is None:
            self.count("misses")
            if self.cfg.cache_mode == "strict":
                raise CacheMissError(digest, self.strict_message(digest, sig))
            payload = self._compile(sig, digest).unwrap()
            self.count("compiles")
            self.count_kind(sig)
            return self.compiler.load(payload)

        def compile_entry() -> bytes:
            log.info("compiling %s", sig["op"])
            result = self._compile(sig, digest)
            entry = _entries.build_entry(cache, self.compiler, digest, sig, self.fingerprint, compiled=result)
            self.count_kind(sig)
            return entry

        try:
            entry, where = _entries.get_or_compile(cache, digest, compile_entry, self.cfg.cache_mode)
        except CacheMissError as e:
            raise CacheMissError(digest, self.strict_message(digest, sig)) from e
        if where == _entries.RECOMPILED:
            self.count("compiles")  # a stale refusal compiled again (the tiers count only their own compiles)
        # A cached refusal raises CompileRefused (the op runs on the host without asking the compiler); an
        # entry this host cannot use raises HostRefused and stays in every tier as it is: other hosts may
        # load it, and only a digest or HMAC failure proves an entry bad (the tiers quarantine those).
        return self.load_entry(digest, entry)

    def _compile(self, sig: dict[str, Any], digest: str) -> Compiled:
        """One compile of `sig` (its seconds per phase go to `stats()`); the compiler's result."""
        result = _entries.compile_one(self.compiler, sig, digest)
        self.phase_times.add(result.phases)
        return result

    def count_kind(self, sig: dict[str, Any]) -> None:
        """A compile of an op, a fused group or a torch.compile graph (`stats()["compiles_by_kind"]`)."""
        kind = kind_of(sig)
        kind = "op" if kind == "class" else kind  # (a shape class's executable serves an op)
        with self._kinds_lock:
            self.compile_kinds[kind] += 1

    def count(self, name: str) -> None:
        """Bump a counter the TieredCache may bump too: under the cache's lock when there is one."""
        cache = self._cache
        if cache is not None:
            cache._count(name)
        else:
            with self.lock:
                self.counts[name] = self.counts.get(name, 0) + 1

    @staticmethod
    def strict_message(digest: str, sig: dict[str, Any]) -> str:
        return (f"strict cache mode (TORCH_NEURONX_CACHE_MODE=strict): no cached executable for "
                f"{sig['op']} (key {digest}); warm the cache with `neuron-cache warm -- <job>`. "
                f"Signature: {canonical(sig).decode()}")


def _label(exe: Executable, key: str, sig: dict[str, Any]) -> None:
    """How the profiler's device track names this executable's runs (`_native/trace.h`): its op (or fused
    group, graph), key, kind and shape class."""
    shape_class = ("flat" if is_flat(sig) else "packed" if is_packed(sig) else "ranked") if is_class(sig) else "exact"
    try:
        exe.__neuron_trace__ = (str(sig.get("op", "?")), key, kind_of(sig), shape_class)  # type: ignore[attr-defined]
    except (AttributeError, TypeError):  # an executable that takes no attributes runs unnamed
        pass

"""A job's manifest: the signatures it used, kept in the cache tiers so its next process fetches their
executables before they are called (TORCH_NEURONX_PREFETCH, docs/background.md "Prefetch").

Identity. `TORCH_NEURONX_JOB` names the job; unset, the job is its script (the resolved path of
`sys.argv[0]`, or the module of `python -m`) plus the keys of its first `FIRST` signatures, so the same
script training two model sizes keeps two manifests. A named job prefetches from the first op (from
import, if it names itself before); an unnamed one once its first signatures are known.

A hint, never authority. A manifest lists *exact* signatures only: the reader keys each one itself and
derives the executables that may serve it (its shape classes) from its own configuration, exactly as a
call would (`Resolver.candidates`). So a manifest can make a process load or compile executables
early, and nothing else: it cannot link a key to anything its own call would not use.

Entries. A manifest is a chain of segments, each an ordinary cache entry (same tiers, envelope, digest
and HMAC as executables) under `segment_key(job, fingerprint, i)`, `i = 0, 1, ...`; its header says
`"kind": "manifest"` and carries a random `writer` id; its payload is JSON `{"format": FORMAT, "job":
..., "segment": i, "signatures": [...]}`. Writers never delete or replace: a writer appends what it used
and no segment it read holds to the first free segment of a tier, with the tier's create-only `put`,
then reads the segment back; if another writer won the race, it takes the next index. So concurrent
writers (the ranks of a job, two jobs on a shared store) lose nothing. A reader reads each tier's chain
up to its first gap and takes the union.

Generations. A chain holds `MAX_SEGMENTS` segments; a writer that finds it full starts the next
*generation* (`segment_key(..., gen=g + 1)`): its first segment there is a compaction, the union of
every signature the full generation's segments held that passed the checks (and its own), so junk
segments (unreadable, foreign, over a bound) do not carry over and cannot freeze the manifest, and
writers past the 64th lose nothing. Racing compactors are racing writers: create-only, read back, next
index. A reader finds the newest generation whose segment 0 is a compaction (probes at 1, 2, 4, ...,
then a binary search: `O(log generations)` reads), reads that generation's chain, and goes on to the
next generation only if that chain is full; so a start reads at most ~2 log2(G) + `MAX_SEGMENTS`
segments, however many writers came before. A junk segment 0 of a generation is no compaction: the
reader reads the full generation before it instead, and writers take index 1.

Bounds (a reader pays for at most these, whatever the store holds): `MAX_SEGMENTS` segments per tier,
`MAX_SEGMENT_BYTES` per segment, `MAX_ITEM_BYTES` per signature, `MAX_ITEMS` signatures in all. Each
signature is checked on its own (`_checks.check_hint`: known op, its own schema, bounded sizes); a bad
one is dropped and reported, the rest are used.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import sys
from collections.abc import Callable
from typing import Any

from ..signatures import SignatureError, canonical
from . import _checks

FORMAT = "neuron-manifest-v2"
FIRST = 4                       # signatures that name an unnamed job
MAX_ITEMS = 4096                # signatures a manifest holds, all segments together
MAX_SEGMENTS = 64               # segments per generation, read (and written) per tier
MAX_GENERATIONS = 1 << 20       # a bound on the generation numbers a reader probes (2**20 * 64 writes)
MAX_SEGMENT_BYTES = 4 << 20     # a segment's payload
MAX_ITEM_BYTES = 256 << 10      # one signature's canonical JSON (a torch.compile graph's is the largest)
# What a reader reads of one segment at most: its payload and the envelope around it (a header of at most
# 1 MiB, lengths, digest, HMAC). A larger value under a segment's key is never read (`read_tier`'s limit).
MAX_READ = MAX_SEGMENT_BYTES + (1 << 20) + 4096


class ManifestError(ValueError):
    """A manifest segment that verified but cannot be read (another format, a bad or oversized payload)."""


def script() -> str | None:
    """What the running program is: its script's resolved path, `-m module`, or None (`-c`, a REPL)."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and getattr(spec, "name", None):
        return f"-m {spec.name}"
    path = sys.argv[0] if sys.argv else ""
    if not path or path == "-c" or not os.path.exists(path):
        return None
    return os.path.realpath(path)


def job_id(named: str | None, first: list[str] | None = None) -> str | None:
    """The manifest's job identity (see the module docstring); None when there is nothing stable."""
    if named:
        return named
    where = script()
    if where is None or first is None:
        return None
    return where + "#" + hashlib.sha256(",".join(first).encode()).hexdigest()[:16]


def _where(i: int, gen: int) -> dict[str, int]:
    # Generation 0 keeps the keys and fields segments had before generations existed.
    return {"segment": i, **({"generation": gen} if gen else {})}


def segment_key(job: str, fingerprint: dict[str, Any], i: int, gen: int = 0) -> str:
    doc = {"manifest": FORMAT, "job": job, "fp": fingerprint, **_where(i, gen)}
    return hashlib.sha256(canonical(doc)).hexdigest()


def header(job: str, fingerprint: dict[str, Any], i: int, writer: str, gen: int = 0,
           compaction: bool = False) -> dict[str, Any]:
    # `signature` and `fingerprint` as every entry has them: `neuron-cache ls/explain` show what it is.
    return {"kind": "manifest", "format": FORMAT, "job": job, **_where(i, gen), "writer": writer,
            **({"compaction": True} if compaction else {}),
            "signature": {"op": "manifest", "job": job, **_where(i, gen)}, "fingerprint": fingerprint}


def payload(job: str, i: int, sigs: list[dict[str, Any]], gen: int = 0) -> bytes:
    return canonical({"format": FORMAT, "job": job, **_where(i, gen), "signatures": sigs})


def parse(entry: Any, job: str, i: int, gen: int = 0) -> tuple[list[dict[str, Any]], list[str]]:
    """(signatures, problems) of a verified segment `i` of generation `gen` of `job`'s manifest. Raises
    ManifestError for one that is not such a segment at all, or is over `MAX_SEGMENT_BYTES`; a bad
    signature is a problem (reported) and is left out (`_checks.check_hint`)."""
    h = entry.header
    where = _where(i, gen)
    if h.get("kind") != "manifest" or h.get("format") != FORMAT or h.get("job") != job or \
            h.get("segment") != i or h.get("generation", 0) != gen:
        raise ManifestError(f"not segment {i} (generation {gen}) of a {FORMAT} manifest of this job "
                            f"(kind {str(h.get('kind'))[:40]!r}, format {str(h.get('format'))[:40]!r})")
    if len(entry.payload) > MAX_SEGMENT_BYTES:
        raise ManifestError(f"segment {i} is {len(entry.payload)} bytes, over the {MAX_SEGMENT_BYTES}-byte limit")
    try:
        doc = json.loads(bytes(entry.payload))
        items = doc["signatures"]
        if not isinstance(items, list) or doc.get("format") != FORMAT or doc.get("job") != job \
                or doc.get("segment") != i or doc.get("generation", 0) != where.get("generation", 0):
            raise TypeError("not this segment's payload")
    except (ValueError, KeyError, TypeError, RecursionError) as e:
        raise ManifestError(f"unreadable manifest segment {i}: {type(e).__name__}: {str(e)[:200]}") from None
    out: list[dict[str, Any]] = []
    problems: list[str] = []
    for n, sig in enumerate(items[:MAX_ITEMS]):
        try:
            if len(canonical(sig)) > MAX_ITEM_BYTES:
                raise ValueError(f"over {MAX_ITEM_BYTES} bytes")
            out.append(_checks.check_hint(sig))
        except (ValueError, TypeError, KeyError, AttributeError, RecursionError) as e:
            problems.append(f"segment {i} item {n}: {str(e)[:200]}")
    if len(items) > MAX_ITEMS:
        problems.append(f"segment {i}: {len(items) - MAX_ITEMS} signatures over the {MAX_ITEMS} limit dropped")
    return out, problems


class Chain:
    """A job's manifest as this process knows it: what each tier holds, read and appended segment by
    segment (module docstring). `key_of(sig)` is the reader's own key of a signature."""

    def __init__(self, cache: Any, job: str, fingerprint: dict[str, Any],
                 key_of: Callable[[dict[str, Any]], str]) -> None:
        self.cache = cache
        self.job = job
        self.fp = fingerprint
        self.key_of = key_of
        self.writer = secrets.token_hex(8)
        self.items: dict[str, dict[str, Any]] = {}     # key -> signature, every tier's together
        self.held: dict[str, set[str]] = {}             # tier name -> keys its current generation holds
        self.gen: dict[str, int] = {}                   # tier name -> its current generation
        self.next: dict[str, int] = {}                  # tier name -> its first free segment (as far as known)
        self.problems: list[str] = []

    def read(self) -> dict[str, dict[str, Any]]:
        """Read every tier's chain; returns key -> signature (the union, at most MAX_ITEMS)."""
        for name, _ in self.cache.tiers:
            if name not in self.gen:
                self._move(name, self._newest(name))
            while True:
                held, gen = self.held[name], self.gen[name]
                i = self.next[name]
                while i < MAX_SEGMENTS and self._take(name, i, held, gen=gen):
                    i += 1
                self.next[name] = i
                if i < MAX_SEGMENTS or gen + 1 >= MAX_GENERATIONS:
                    break
                self._move(name, gen + 1)  # a full generation: its successor holds the newer segments
        return self.items

    def _move(self, tier: str, gen: int) -> None:
        self.gen[tier], self.next[tier], self.held[tier] = gen, 0, set()

    def _compaction(self, tier: str, gen: int) -> bool:
        """Whether segment 0 of generation `gen` of `tier` is a compaction (read into `items` if it is)."""
        entry = self.cache.read_tier(tier, segment_key(self.job, self.fp, 0, gen), MAX_READ)
        if entry is None or not entry.header.get("compaction"):
            return False
        try:
            parse(entry, self.job, 0, gen)
        except ManifestError:
            return False
        return True

    def _newest(self, tier: str) -> int:
        """The newest generation of `tier` that starts with a compaction (0 if none): probes at 1, 2, 4,
        ..., then a binary search between the last hit and the first miss."""
        lo, hi = 0, 1
        while hi < MAX_GENERATIONS and self._compaction(tier, hi):
            lo, hi = hi, hi * 2
        hi = min(hi, MAX_GENERATIONS)
        while hi - lo > 1:  # lo starts with a compaction (or is 0), hi does not
            mid = (lo + hi) // 2
            if self._compaction(tier, mid):
                lo = mid
            else:
                hi = mid
        return lo

    def _take(self, tier: str, i: int, held: set[str], entry: Any = None, gen: int = 0) -> bool:
        """Read segment `i` of generation `gen` of `tier` (or take `entry`, read already) into `items`;
        False if the tier has no such segment."""
        if entry is None:
            key = segment_key(self.job, self.fp, i, gen)
            entry = self.cache.read_tier(tier, key, MAX_READ)
            if entry is None:
                if not self.cache.holds(tier, key):
                    return False
                # Something no reader takes (over MAX_READ, or unreadable): it occupies the index.
                self.problems.append(f"segment {i} (generation {gen}) is over {MAX_READ} bytes or unreadable; "
                                     "not read")
                return True
        try:
            sigs, problems = parse(entry, self.job, i, gen)
        except ManifestError as e:
            self.problems.append(str(e))
            return True  # an unreadable segment still occupies its index
        self.problems += problems
        for sig in sigs:
            try:
                k = self.key_of(sig)
            except (ValueError, TypeError, KeyError, SignatureError) as e:
                self.problems.append(f"segment {i}: {e}")
                continue
            held.add(k)
            if k not in self.items and len(self.items) < MAX_ITEMS:
                self.items[k] = sig
        return True

    def append(self, used: dict[str, dict[str, Any]]) -> int:
        """Add `used` (key -> exact signature) to every writable tier that lacks some of it; returns the
        number of segments written. A full generation is followed by the next, whose first segment this
        writer writes (if no one beats it there) holds everything known: a compaction."""
        if not self.cache.writable:
            return 0
        for k, s in used.items():
            if k not in self.items and len(self.items) < MAX_ITEMS and \
                    len(canonical(s)) <= MAX_ITEM_BYTES:  # readers would drop it
                self.items[k] = s
        written = 0
        for name, _ in self.cache.tiers:
            if name not in self.gen:
                self._move(name, 0)
            while True:
                held, gen = self.held[name], self.gen[name]
                want = {k: s for k, s in self.items.items() if k not in held}
                i = self.next[name]
                refused = False
                while want and i < MAX_SEGMENTS:
                    key = segment_key(self.job, self.fp, i, gen)
                    sigs = self._fit(list(want.values()))
                    data = self.cache.pack(key, header(self.job, self.fp, i, self.writer, gen,
                                                       compaction=gen > 0 and i == 0),
                                           payload(self.job, i, sigs, gen))
                    back = self.cache.read_tier(name, key, MAX_READ)
                    if back is None:
                        # Create-only: if another writer gets there first, the read back shows its segment.
                        if self.cache.put_tier(name, key, data):
                            back = self.cache.read_tier(name, key, MAX_READ)
                        if back is None:
                            if self.cache.holds(name, key):  # occupied by what no reader takes: next index
                                i += 1
                                continue
                            refused = True  # the tier refused the write (full, down, read-only): nothing more now
                            break
                    if back.header.get("writer") == self.writer:
                        held.update(self.key_of(s) for s in sigs)
                        written += 1
                    else:  # another writer's segment: what it holds, we need not write
                        self._take(name, i, held, back, gen)
                    want = {k: s for k, s in self.items.items() if k not in held}
                    i += 1
                self.next[name] = i
                if refused or not want or gen + 1 >= MAX_GENERATIONS:
                    break
                self._move(name, gen + 1)  # this generation is full: the next starts with a compaction
        return written

    @staticmethod
    def _fit(sigs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """As many signatures as one segment holds (MAX_SEGMENT_BYTES, with room for the envelope)."""
        out, size = [], 0
        for s in sigs:
            n = len(canonical(s)) + 1
            if size + n > MAX_SEGMENT_BYTES - 4096 and out:
                break
            out.append(s)
            size += n
        return out

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
MAX_SEGMENTS = 64               # segments read (and written) per tier
MAX_SEGMENT_BYTES = 4 << 20     # a segment's payload
MAX_ITEM_BYTES = 256 << 10      # one signature's canonical JSON (a torch.compile graph's is the largest)


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


def segment_key(job: str, fingerprint: dict[str, Any], i: int) -> str:
    doc = {"manifest": FORMAT, "job": job, "fp": fingerprint, "segment": i}
    return hashlib.sha256(canonical(doc)).hexdigest()


def header(job: str, fingerprint: dict[str, Any], i: int, writer: str) -> dict[str, Any]:
    # `signature` and `fingerprint` as every entry has them: `neuron-cache ls/explain` show what it is.
    return {"kind": "manifest", "format": FORMAT, "job": job, "segment": i, "writer": writer,
            "signature": {"op": "manifest", "job": job, "segment": i}, "fingerprint": fingerprint}


def payload(job: str, i: int, sigs: list[dict[str, Any]]) -> bytes:
    return canonical({"format": FORMAT, "job": job, "segment": i, "signatures": sigs})


def parse(entry: Any, job: str, i: int) -> tuple[list[dict[str, Any]], list[str]]:
    """(signatures, problems) of a verified segment `i` of `job`'s manifest. Raises ManifestError for one
    that is not such a segment at all, or is over `MAX_SEGMENT_BYTES`; a bad signature is a problem
    (reported) and is left out (`_checks.check_hint`)."""
    h = entry.header
    if h.get("kind") != "manifest" or h.get("format") != FORMAT or h.get("job") != job or h.get("segment") != i:
        raise ManifestError(f"not segment {i} of a {FORMAT} manifest of this job (kind {str(h.get('kind'))[:40]!r}, "
                            f"format {str(h.get('format'))[:40]!r})")
    if len(entry.payload) > MAX_SEGMENT_BYTES:
        raise ManifestError(f"segment {i} is {len(entry.payload)} bytes, over the {MAX_SEGMENT_BYTES}-byte limit")
    try:
        doc = json.loads(bytes(entry.payload))
        items = doc["signatures"]
        if not isinstance(items, list) or doc.get("format") != FORMAT or doc.get("job") != job \
                or doc.get("segment") != i:
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
        self.held: dict[str, set[str]] = {}             # tier name -> keys its segments hold
        self.next: dict[str, int] = {}                  # tier name -> its first free segment (as far as known)
        self.problems: list[str] = []

    def read(self) -> dict[str, dict[str, Any]]:
        """Read every tier's chain; returns key -> signature (the union, at most MAX_ITEMS)."""
        for name, _ in self.cache.tiers:
            held = self.held.setdefault(name, set())
            i = self.next.get(name, 0)
            while i < MAX_SEGMENTS:
                if not self._take(name, i, held):
                    break
                i += 1
            self.next[name] = i
        return self.items

    def _take(self, tier: str, i: int, held: set[str], entry: Any = None) -> bool:
        """Read segment `i` of `tier` (or take `entry`, read already) into `items`; False if the tier has
        no such segment."""
        if entry is None:
            entry = self.cache.read_tier(tier, segment_key(self.job, self.fp, i))
        if entry is None:
            return False
        try:
            sigs, problems = parse(entry, self.job, i)
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
        number of segments written."""
        if not self.cache.writable:
            return 0
        for k, s in used.items():
            if k not in self.items and len(self.items) < MAX_ITEMS and \
                    len(canonical(s)) <= MAX_ITEM_BYTES:  # readers would drop it
                self.items[k] = s
        written = 0
        for name, _ in self.cache.tiers:
            held = self.held.setdefault(name, set())
            want = {k: s for k, s in self.items.items() if k not in held}
            i = self.next.get(name, 0)
            while want and i < MAX_SEGMENTS:
                key = segment_key(self.job, self.fp, i)
                sigs = self._fit(list(want.values()))
                data = self.cache.pack(key, header(self.job, self.fp, i, self.writer), payload(self.job, i, sigs))
                back = self.cache.read_tier(name, key)
                if back is None:
                    # Create-only: if another writer gets there first, the read back shows its segment.
                    if not self.cache.put_tier(name, key, data):
                        break  # the tier refused the write (full, down, read-only): nothing more for it now
                    back = self.cache.read_tier(name, key)
                    if back is None:
                        break
                if back.header.get("writer") == self.writer:
                    held.update(self.key_of(s) for s in sigs)
                    written += 1
                else:  # another writer's segment: what it holds, we need not write
                    self._take(name, i, held, back)
                want = {k: s for k, s in self.items.items() if k not in held}
                i += 1
            self.next[name] = i
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

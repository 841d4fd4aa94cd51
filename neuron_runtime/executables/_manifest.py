"""A job's manifest: the executables it used, kept in the cache tiers so its next process fetches them
before they are called (TORCH_NEURONX_PREFETCH, docs/cache.md "Prefetch").

Identity. `TORCH_NEURONX_JOB` names the job; unset, the job is its script (the resolved path of
`sys.argv[0]`, or the module of `python -m`) plus the keys of its first `FIRST` signatures, so the same
script training two model sizes keeps two manifests. A named job prefetches from the first op (from
import, if it names itself before); an unnamed one once its first signatures are known.

Entry. A manifest is an ordinary cache entry (same tiers, envelope, digest and signature as
executables) under the key sha256({"manifest": FORMAT, "job": ..., "fp": <compiler fingerprint>}). Its
header says `"kind": "manifest"`; its payload is JSON: `{"format": FORMAT, "job": ..., "entries":
[{"key": ..., "signatures": [...]}, ...]}` (the candidates a compile worker takes). Entries are added,
never removed, up to `MAX_ENTRIES`; a new version replaces the old one in each tier (delete, then put).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from typing import Any

from ..signatures import _signature

FORMAT = "neuron-manifest-v1"
FIRST = 4           # signatures that name an unnamed job
MAX_ENTRIES = 20000


class ManifestError(ValueError):
    """A manifest entry that verified but cannot be read (another format, a bad payload)."""


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


def key(job: str, fingerprint: dict[str, Any]) -> str:
    return hashlib.sha256(_signature.canonical({"manifest": FORMAT, "job": job, "fp": fingerprint})).hexdigest()


def header(job: str, fingerprint: dict[str, Any]) -> dict[str, Any]:
    # `signature` and `fingerprint` as every entry has them: `neuron-cache ls/explain` show what it is.
    return {"kind": "manifest", "format": FORMAT, "job": job, "signature": {"op": "manifest", "job": job},
            "fingerprint": fingerprint}


def payload(job: str, entries: dict[str, list[dict[str, Any]]]) -> bytes:
    items = [{"key": k, "signatures": v} for k, v in list(entries.items())[:MAX_ENTRIES]]
    return _signature.canonical({"format": FORMAT, "job": job, "entries": items})


def parse(entry: Any) -> tuple[dict[str, list[dict[str, Any]]], list[str]]:
    """(key -> candidate signatures, problems) of a verified manifest entry. Raises ManifestError for
    one that is not a manifest at all; a bad item is a problem (reported) and is skipped."""
    if entry.header.get("kind") != "manifest" or entry.header.get("format") != FORMAT:
        raise ManifestError(f"not a {FORMAT} manifest (kind {entry.header.get('kind')!r}, format "
                            f"{entry.header.get('format')!r})")
    try:
        doc = json.loads(bytes(entry.payload))
        items = doc["entries"]
        if not isinstance(items, list):
            raise TypeError("entries is not a list")
    except (ValueError, KeyError, TypeError) as e:
        raise ManifestError(f"unreadable manifest payload: {e}") from e
    out: dict[str, list[dict[str, Any]]] = {}
    problems: list[str] = []
    for n, item in enumerate(items):
        try:
            k, sigs = item["key"], item["signatures"]
            if not (isinstance(k, str) and len(k) == 64 and isinstance(sigs, list) and sigs
                    and all(isinstance(s, dict) and isinstance(s.get("op"), str) for s in sigs)):
                raise TypeError("needs a 64-hex key and a list of signatures with an 'op'")
        except (KeyError, TypeError) as e:
            problems.append(f"item {n}: {e}")
            continue
        out[k] = sigs
    return out, problems

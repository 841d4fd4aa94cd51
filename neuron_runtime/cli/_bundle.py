"""`neuron-cache export FILE` / `import FILE`: a single-file bundle of cache entries.

The bundle is a tar archive (gzip-compressed when FILE ends in .gz or .tgz), no pickle anywhere::

    entries/<key>.neff    the raw envelopes, byte for byte as the cache stores them
    bundle.json           {"format": "neuron-cache-bundle", "version": 1, "created", "producer", "signed",
                           "entries": [{"key", "sha256", "size", "op", "compiler"}, ...]}   (written last)
    bundle.json.hmac      hex HMAC-SHA256 of bundle.json with the signing key, when one is set

Import never extracts anything to disk: each member is read into memory by name and checked before it is
stored (1. a regular file named entries/<64 hex>.neff, 2. listed in bundle.json with the same sha256,
3. the envelope verifies: digest, HMAC when a signing key is set, key, and the header's signature and
fingerprint hash to the key). A member that fails any check is refused and named; the others are imported.
With a signing key set, an unsigned bundle or one whose bundle.json HMAC does not verify is refused whole.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import io
import json
import os
import re
import socket
import sys
import tarfile
import time
from typing import Any

from neuron_runtime.cache import CacheError, IntegrityError
from neuron_runtime.cli import _common
from neuron_runtime.cli._errors import PROBLEMS, BundleError, UsageError
from neuron_runtime.cli._inspect import check_entry
from neuron_runtime.executables import read_records
from neuron_runtime.signatures import cache_key

FORMAT = "neuron-cache-bundle"
VERSION = 1
INDEX = "bundle.json"  # the bundle's table of contents (format, entries, their digests)
MAC = "bundle.json.hmac"
_ENTRY = re.compile(r"^entries/([0-9a-f]{64})\.neff$")
# One envelope larger than this is not an op executable (they are ~0.3-2 MiB): refuse before reading it.
_MAX_ENTRY = 1 << 30


def add_parsers(sub: Any) -> None:
    p = sub.add_parser("export", help="write entries to a single-file bundle (tar + JSON manifest)")
    p.add_argument("file", metavar="FILE", help="bundle to write (.tar, or .tar.gz/.tgz to compress)")
    _common.add_tiers_option(p, "all")
    p.add_argument("--op", metavar="SUBSTRING", help="only entries whose op name contains SUBSTRING")
    p.add_argument("--manifest", metavar="MANIFEST",  # a record file of signatures (`read_records`)
                   help="only the entries a manifest needs, keyed for --tier (what a job on that tier will look up)")
    _common.finish_command(p, cmd_export, tier=True)

    p = sub.add_parser("import", help="verify a bundle entry by entry and store the good entries")
    p.add_argument("file", metavar="FILE")
    _common.add_tiers_option(p, "all")
    _common.finish_command(p, cmd_import, fleet_flags=("--to", "--fleet"))


def _mac(key: bytes, data: bytes) -> str:
    return hmac.new(key, data, hashlib.sha256).hexdigest()


def _add(tar: tarfile.TarFile, name: str, data: bytes, mtime: float) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mtime = int(mtime)
    info.mode = 0o600
    tar.addfile(info, io.BytesIO(data))


def _wanted_keys(args: argparse.Namespace, cfg: Any) -> set[str] | None:
    if not args.manifest:
        return None
    from neuron_runtime.compiler import make_compiler

    fp = make_compiler(cfg).fingerprint()
    try:
        return {cache_key(s, fp) for s in read_records(args.manifest)}
    except (OSError, ValueError) as e:
        raise UsageError(f"--manifest {args.manifest}: {e}") from e


def cmd_export(args: argparse.Namespace) -> int:
    cfg = _common.load_config(_common.runtime_env(args))
    wanted = _wanted_keys(args, cfg)
    tiers = _common.open_tiers(cfg, args.tiers)
    path = os.path.abspath(args.file)
    mode = "w:gz" if path.endswith((".gz", ".tgz")) else "w"
    tmp = f"{path}.{os.getpid()}.tmp"
    listed: list[dict[str, Any]] = []
    skipped: list[dict[str, Any]] = []
    seen: set[str] = set()
    try:
        with tarfile.open(tmp, mode) as tar:
            for tier in tiers:
                for info in list(tier.backend.entries()):
                    if info.key in seen or (wanted is not None and info.key not in wanted):
                        continue
                    try:
                        data = _common.read_entry(tier.backend, info.key)
                        if data is None:
                            continue
                        entry = check_entry(info.key, data, cfg.signing_key)
                    except IntegrityError as e:
                        # Never ship an entry this host would refuse itself.
                        skipped.append({"key": info.key, "tier": tier.name, "reason": str(e)})
                        print(f"neuron-cache export: skipping {tier.name} entry {info.key}: {e} "
                              "(run `neuron-cache verify`)", file=sys.stderr)
                        continue
                    op = entry.header["signature"].get("op")
                    if args.op and (not op or args.op not in op):
                        continue
                    seen.add(info.key)
                    _add(tar, f"entries/{info.key}.neff", data, info.mtime)
                    listed.append({"key": info.key, "sha256": hashlib.sha256(data).hexdigest(), "size": len(data),
                                   "op": op, "compiler": entry.header["fingerprint"].get("tier")})
            index = json.dumps({"format": FORMAT, "version": VERSION, "created": time.time(),
                                "producer": f"neuron-cache@{socket.gethostname()}",
                                "signed": cfg.signing_key is not None, "entries": listed},
                               indent=1, sort_keys=True).encode()
            now = time.time()
            _add(tar, INDEX, index, now)
            if cfg.signing_key:
                _add(tar, MAC, _mac(cfg.signing_key, index).encode(), now)
        os.replace(tmp, path)
    except OSError as e:
        raise UsageError(f"cannot write {path}: {e}") from e
    finally:
        _common.close_tiers(tiers)
        if os.path.exists(tmp):
            os.remove(tmp)
    missing = sorted(wanted - seen) if wanted is not None else []
    out = {"bundle": path, "entries": len(listed), "bytes": sum(e["size"] for e in listed),
           "signed": cfg.signing_key is not None, "skipped": skipped, "missing": missing}
    if args.json:
        _common.print_json(out)
    else:
        print(f"exported {out['entries']} entries ({_common.human_size(out['bytes'])}) to {path}"
              + (" (signed)" if out["signed"] else "") + (f"; skipped {len(skipped)} bad" if skipped else "")
              + (f"; {len(missing)} manifest signature(s) not in the cache" if missing else ""))
    return PROBLEMS if skipped else 0


def _read_member(tar: tarfile.TarFile, m: tarfile.TarInfo) -> bytes:
    f = tar.extractfile(m)
    if f is None:
        raise BundleError(f"{m.name}: not a regular file")
    return f.read()


def _load_index(tar: tarfile.TarFile, members: dict[str, tarfile.TarInfo], path: str,
                   signing_key: bytes | None) -> dict[str, Any]:
    m = members.get(INDEX)
    if m is None or not m.isfile():
        raise BundleError(f"{path} has no {INDEX}: not a neuron-cache bundle (make one with `neuron-cache export`)")
    raw = _read_member(tar, m)
    if signing_key:
        mac = members.get(MAC)
        if mac is None or not mac.isfile():
            raise BundleError(f"{path} is not signed and a signing key is set: re-export it on a host with the "
                              "same TORCH_NEURONX_CACHE_SIGNING_KEY")
        if not hmac.compare_digest(_read_member(tar, mac).strip().decode("ascii", "replace"),
                                   _mac(signing_key, raw)):
            raise BundleError(f"{path}: {INDEX} does not verify with this signing key (tampered, or signed "
                              "with another key); nothing imported")
    try:
        doc = json.loads(raw)
    except ValueError as e:
        raise BundleError(f"{path}: {INDEX} is not JSON: {e}") from e
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or not isinstance(doc.get("entries"), list):
        raise BundleError(f"{path}: {INDEX} is not a {FORMAT} manifest")
    if doc.get("version") != VERSION:
        raise BundleError(f"{path}: bundle version {doc.get('version')!r}; this neuron-cache reads {VERSION}")
    return doc


def cmd_import(args: argparse.Namespace) -> int:
    cfg = _common.load_config(_common.runtime_env(args))
    path = os.path.abspath(args.file)
    try:
        tar = tarfile.open(path, "r:*")
    except (OSError, tarfile.TarError) as e:
        raise BundleError(f"cannot read {path} as a bundle: {e}") from e
    imported = present = 0
    refused: list[dict[str, Any]] = []
    tiers = _common.open_tiers(cfg, args.tiers)
    try:
        with tar:
            all_members = tar.getmembers()
            members = {m.name: m for m in all_members}
            doc = _load_index(tar, members, path, cfg.signing_key)
            listed = {e.get("key"): e for e in doc["entries"] if isinstance(e, dict)}
            have = {t.name: t.backend.contains_many([k for k in listed if isinstance(k, str) and
                                                     _ENTRY.match(f"entries/{k}.neff")]) for t in tiers}

            def refuse(key: str | None, name: str, reason: str, op: str | None = None) -> None:
                refused.append({"key": key, "member": name, "op": op, "reason": reason})
                print(f"neuron-cache import: REFUSED {name}" + (f" ({op})" if op else "") + f": {reason}",
                      file=sys.stderr)

            found: set[str] = set()
            for m in all_members:
                if m.name in (INDEX, MAC):
                    continue
                match = _ENTRY.match(m.name)
                if not match or not m.isfile():
                    refuse(None, m.name, "unexpected member (only regular files entries/<key>.neff belong in a bundle)")
                    continue
                key = match.group(1)
                found.add(key)
                meta = listed.get(key)
                op = meta.get("op") if meta else None
                if meta is None:
                    refuse(key, m.name, f"not listed in {INDEX}", op)
                    continue
                if m.size > _MAX_ENTRY:
                    refuse(key, m.name, f"{m.size} bytes: larger than any executable entry", op)
                    continue
                data = _read_member(tar, m)
                if hashlib.sha256(data).hexdigest() != meta.get("sha256"):
                    refuse(key, m.name, f"sha256 differs from {INDEX} (tampered or damaged in transit)", op)
                    continue
                try:
                    check_entry(key, data, cfg.signing_key)
                except IntegrityError as e:
                    refuse(key, m.name, f"entry does not verify: {e}", op)
                    continue
                if all(key in have[t.name] for t in tiers):
                    present += 1
                    continue
                stored = False
                for t in tiers:
                    if key not in have[t.name]:
                        stored = bool(t.backend.put(key, data)) or stored
                if stored:
                    imported += 1
                else:
                    refuse(key, m.name, "no tier accepted the write (see warnings above)", op)
            for key, meta in listed.items():
                if key not in found:
                    refuse(key if isinstance(key, str) else None, f"entries/{key}.neff",
                           f"listed in {INDEX} but missing from the archive", meta.get("op"))
    except (tarfile.TarError, OSError, CacheError) as e:
        raise BundleError(f"cannot read {path}: {e}") from e
    finally:
        _common.close_tiers(tiers)
    out = {"bundle": path, "imported": imported, "present": present, "refused": refused,
           "tiers": [t.name for t in tiers], "signed": bool(doc.get("signed"))}
    if args.json:
        _common.print_json(out)
    else:
        print(f"imported {imported} entries, {present} already present, {len(refused)} refused from {path}")
        for r in refused:
            print(f"  refused {r['member']}" + (f" ({r['op']})" if r["op"] else "") + f": {r['reason']}")
    return PROBLEMS if refused else 0

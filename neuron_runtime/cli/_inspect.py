"""`neuron-cache ls | stats | verify | prune | clear`: the everyday tools over the local tier and the fleet store.

Deleting goes through each backend's own `delete`, which is atomic for readers: the local tier deletes a
row in one SQLite transaction (a reader that already had the row and finds its value file gone gets a
miss), the shared-path store unlinks an immutable file (an open reader keeps reading the whole file). So
pruning a cache that running jobs use costs them at most a recompile, never a torn entry.
"""

from __future__ import annotations

import argparse
import functools
import glob
import json
import os
import sys
import time
from typing import Any

from neuron_runtime import _config

from neuron_runtime.cache import envelope
from neuron_runtime.cache import CacheError, IntegrityError
from neuron_runtime.cli import _common
from neuron_runtime.cli._errors import PROBLEMS, UsageError
from neuron_runtime.signatures import describe_shapes, is_class
from neuron_runtime.compiler import PhaseTimes


def add_parsers(sub: Any) -> None:
    p = sub.add_parser("ls", help="list entries (key, tier, size, age, op, compiler tier)")
    _common.add_tiers_option(p, "all")
    p.add_argument("--op", metavar="SUBSTRING", help="only entries whose op name contains SUBSTRING")
    _common.finish_command(p, cmd_ls)

    p = sub.add_parser("stats", help="entries and bytes per tier, plus hit/miss counters of the last runs")
    _common.add_tiers_option(p, "all")
    p.add_argument("--run-stats", action="append", default=None, metavar="FILE",
                   help="a JSON file written by a run with TORCH_NEURONX_STATS_FILE (repeatable, globs allowed) "
                        "[default: $TORCH_NEURONX_STATS_FILE]")
    p.add_argument("--by-op", action="store_true", help="also count entries and bytes per op (reads every header)")
    _common.finish_command(p, cmd_stats)

    p = sub.add_parser("verify", help="re-check every entry's digest, signature and key; quarantine bad ones; "
                                      "exit 1 if any (with --manifest: also if any of its entries is missing)")
    _common.add_tiers_option(p, None, "all; with --manifest: fleet if one is set, else local")
    p.add_argument("--manifest", metavar="FILE",
                   help="check only the entries of this manifest (all shards of a sharded warm-up), and report "
                        "those missing: did everything land? Works on stores that cannot list (http://)")
    p.add_argument("--dry-run", action="store_true", help="report bad entries but leave them in place")
    _common.finish_command(p, cmd_verify, tier=True)

    p = sub.add_parser("prune", help="delete entries unused for a while and/or least recently used ones over a size")
    _common.add_tiers_option(p, "local")
    p.add_argument("--max-size", type=_common.parse_size, metavar="SIZE",
                   help="keep at most SIZE bytes per tier (e.g. 5GiB), dropping least recently used entries first "
                        "[env NEURON_CACHE_PRUNE_MAX_SIZE]")
    p.add_argument("--older-than", type=_common.parse_age, metavar="AGE",
                   help="drop entries not used (local) or written (fleet) for AGE (e.g. 30d, 12h) "
                        "[env NEURON_CACHE_PRUNE_OLDER_THAN]")
    p.add_argument("--dry-run", action="store_true", help="say what would go, delete nothing")
    _common.finish_command(p, cmd_prune)

    p = sub.add_parser("clear", help="delete every entry (local tier unless --tiers says otherwise)")
    _common.add_tiers_option(p, "local")
    p.add_argument("--yes", action="store_true", help="needed to clear a fleet store (it is shared by every host)")
    p.add_argument("--refusals", action="store_true",
                   help="delete only cached compiler refusals, so the compiler is asked again (after a "
                        "compiler fix within one neuron-runtime version; another version re-asks by itself)")
    _common.finish_command(p, cmd_clear)


def _cfg(args: argparse.Namespace) -> _config.Config:
    return _common.load_config(_common.runtime_env(args))


# ------------------------------------------------------------------------------------------ ls


def cmd_ls(args: argparse.Namespace) -> int:
    cfg = _cfg(args)
    tiers = _common.open_tiers(cfg, args.tiers)
    now = time.time()
    rows: list[dict[str, Any]] = []
    try:
        for tier in tiers:
            for key, size, mtime, header, _ in _common.iter_headers(tier):
                h = header or {}
                op = (h.get("signature") or {}).get("op")
                if args.op and (not op or args.op not in op):
                    continue
                rows.append({"key": key, "tier": tier.name, "size": size, "mtime": mtime,
                             "op": op, "compiler": (h.get("fingerprint") or {}).get("tier"),
                             "created": h.get("created"), "producer": h.get("producer"),
                             "refused": h.get("refused"),  # a cached compiler refusal (no executable)
                             # a shape class's entry serves every shape of its class (docs/dispatch.md)
                             "shape_class": is_class(h.get("signature") or {}),
                             "shapes": _describe(h.get("signature")),
                             "readable": header is not None})
    finally:
        _common.close_tiers(tiers)
    rows.sort(key=lambda r: (r["tier"], r["op"] or "", r["key"]))
    if args.json:
        _common.print_json(rows)
        return 0
    print(f"{'KEY':<14}{'TIER':<7}{'SIZE':>11}{'USED':>8}  {'COMPILER':<10}{'SHAPES':<7}OP")
    for r in rows:
        print(f"{r['key'][:12]:<14}{r['tier']:<7}{_common.human_size(r['size']):>11}"
              f"{_common.human_age(max(0.0, now - r['mtime'])):>8}  {str(r['compiler'] or '?'):<10}"
              f"{'class' if r['shape_class'] else 'exact':<7}"
              f"{r['op'] or '(unreadable header: run verify)'} {r['shapes']}".rstrip()
              + (" (refused: runs on the host)" if r["refused"] else ""))
    return 0


def _describe(sig: Any) -> str:
    """The tensor shapes of a signature (`[s0,s1,64] [64]` for a class), or "" if it has none readable."""
    try:
        return describe_shapes(sig) if isinstance(sig, dict) else ""
    except (KeyError, TypeError, ValueError):
        return ""


# ------------------------------------------------------------------------------------------ stats


def _stats_files(args: argparse.Namespace) -> list[str]:
    default = _common.STATS_FILE_ENV or os.environ.get("TORCH_NEURONX_STATS_FILE")
    patterns = args.run_stats or ([default] if default else [])
    files: list[str] = []
    for pat in patterns:
        files.extend(sorted(glob.glob(pat)) or ([pat] if args.run_stats else []))
    return files


def _run_counters(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            s = json.load(f)
    except (OSError, ValueError) as e:
        return {"file": path, "error": f"{type(e).__name__}: {e}"}
    hits = s.get("hits") or {}
    return {"file": path, "mtime": os.path.getmtime(path), "compiler": s.get("compiler"),
            "hits": hits, "hits_total": sum(v for v in hits.values() if isinstance(v, int)),
            **{k: s.get(k, 0) for k in ("misses", "compiles", "corrupt", "fallbacks", "executions",
                                          "fleet_errors", "writes_skipped")}}


def cmd_stats(args: argparse.Namespace) -> int:
    cfg = _cfg(args)
    tiers = _common.open_tiers(cfg, args.tiers)
    out: dict[str, Any] = {"tiers": {}, "entries": 0, "bytes": 0}
    try:
        for tier in tiers:
            infos = list(tier.backend.entries())
            t: dict[str, Any] = {"url": tier.url, "entries": len(infos), "bytes": sum(i.size for i in infos)}
            if tier.name == "local":
                t["max_size"] = cfg.cache_max_size
                t["volume"] = getattr(tier.backend, "volume", lambda: None)()
            if args.by_op or tier.name == "local":
                # The local tier's headers: compile seconds per phase (what each entry's compile cost,
                # wherever it ran), and with --by-op the entries and bytes per op.
                by_op: dict[str, dict[str, int]] = {}
                phases = PhaseTimes(keep=1 << 20)
                for _, size, _, header, _ in _common.iter_headers(tier):
                    phases.add((header or {}).get("compile"))
                    op = ((header or {}).get("signature") or {}).get("op") or "(unreadable)"
                    e = by_op.setdefault(op, {"entries": 0, "bytes": 0})
                    e["entries"] += 1
                    e["bytes"] += size
                if args.by_op:
                    t["by_op"] = by_op
                if tier.name == "local":
                    out["compile_phases"] = phases.summary()
            out["tiers"][tier.name] = t
            out["entries"] += t["entries"]
            out["bytes"] += t["bytes"]
    finally:
        _common.close_tiers(tiers)
    runs = [_run_counters(f) for f in _stats_files(args)]
    out["runs"] = runs
    out["totals"] = {k: sum(r.get(k, 0) for r in runs if "error" not in r)
                     for k in ("hits_total", "misses", "compiles", "corrupt", "fallbacks")}
    out["warm_runs"] = _common.read_runs(cfg)[-5:]
    quarantine = os.path.join(cfg.local_cache_dir, _common.QUARANTINE_DIR)
    out["quarantined"] = len(os.listdir(quarantine)) if os.path.isdir(quarantine) else 0
    if args.json:
        _common.print_json(out)
        return 0
    for name, t in out["tiers"].items():
        print(f"{name:<6} {t['entries']:>7} entries {_common.human_size(t['bytes']):>11}  {t['url']}")
        for op, e in sorted(t.get("by_op", {}).items(), key=lambda kv: -kv[1]["bytes"]):
            print(f"         {e['entries']:>5} {_common.human_size(e['bytes']):>11}  {op}")
    if out.get("compile_phases"):
        print("compile seconds per phase (local tier's entries): " + "; ".join(
            f"{k} p50 {v['p50']:.2f} p95 {v['p95']:.2f} (n {v['n']})" for k, v in out["compile_phases"].items()))
    for r in runs:
        if "error" in r:
            print(f"run    {r['file']}: {r['error']}")
        else:
            print(f"run    {r['file']}: hits {r['hits']} misses {r['misses']} compiles {r['compiles']} "
                  f"corrupt {r['corrupt']} fallbacks {r['fallbacks']}")
    for w in out["warm_runs"]:
        print(f"{w.get('command')}   {time.strftime('%Y-%m-%d %H:%M', time.localtime(w.get('finished', 0)))}: "
              f"compiled {w.get('compiled')} present {w.get('present')} failed {w.get('failed')} "
              f"(tier {w.get('tier')})")
    if out["quarantined"]:
        print(f"quarantine {out['quarantined']} file(s) in {quarantine}")
    return 0


# ------------------------------------------------------------------------------------------ verify


def check_entry(key: str, data: bytes, signing_key: bytes | None) -> envelope.Entry:
    """Everything `verify` and `import` check: the envelope (magic, lengths, digest, HMAC when a key is
    set, header key) and that the header's signature and fingerprint hash to the key, so an entry cannot
    claim to be something it was not compiled for."""
    from neuron_runtime.signatures import cache_key

    entry = envelope.unpack(data, expected_key=key, signing_key=signing_key)
    try:
        expected = cache_key(entry.header["signature"], entry.header["fingerprint"])
    except (TypeError, ValueError) as e:
        raise IntegrityError("header", f"signature/fingerprint cannot be keyed: {e}") from e
    if expected != key:
        raise IntegrityError("header", f"signature and fingerprint in the header hash to {expected}, not to the key")
    _check_payload(key, entry)
    return entry


@functools.lru_cache(maxsize=None)
def _payload_reader(tier: str) -> Any:
    """A compiler of tier `tier` to read what its payloads record (`Compiler.payload_signature`); None
    for a tier this runtime does not know."""
    from neuron_runtime.compiler import get_compiler

    try:
        return get_compiler(tier)
    except ValueError:
        return None


def _check_payload(key: str, entry: envelope.Entry) -> None:
    """The signature an executable's payload records must give its key too (as `Resolver.load_entry`
    checks at every load): a header over another op's bytes is a bad entry."""
    from neuron_runtime.signatures import cache_key

    h = entry.header
    fp = h.get("fingerprint")
    if h.get("refused") or h.get("kind") == "manifest" or not isinstance(fp, dict):
        return
    reader = _payload_reader(str(fp.get("tier")))
    if reader is None:
        return
    try:
        own = reader.payload_signature(entry.payload)
        if own is None:
            return
        got = cache_key(own, fp)
    except (TypeError, ValueError) as e:
        raise IntegrityError("payload", f"the payload does not say what it computes: {e}") from e
    if got != key:
        raise IntegrityError("payload", f"the payload was compiled for {str(own.get('op'))[:80]}, "
                                        "another signature than its key's")


def _quarantine(cfg: _config.Config, tier: str, key: str, reason: str, data: bytes | None) -> str | None:
    """Keep a refused entry's bytes for a post-mortem, outside every tier (0o700, never read back)."""
    if data is None:
        return None
    d = os.path.join(cfg.local_cache_dir, _common.QUARANTINE_DIR)
    try:
        os.makedirs(d, mode=0o700, exist_ok=True)
        path = os.path.join(d, f"{tier}-{key}.{reason}")
        with open(path, "wb") as f:
            f.write(data)
        return path
    except OSError:
        return None


def _records_wanted(cfg: _config.Config, record_file: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """What `verify --manifest` looks for: one item per signature with its candidate keys (a shape class
    lands under its class key, or under its recorded exact shape's key where the tier has no generic
    executable), and the record file's bad lines (`--manifest` names a record file of signatures)."""
    from neuron_runtime.cli._warm import key_records
    from neuron_runtime.compiler import make_compiler
    from neuron_runtime.signatures import cache_key

    if not os.path.isfile(record_file):
        raise UsageError(f"no manifest at {record_file}")
    fp = make_compiler(cfg).fingerprint()
    keyed, errors = key_records(record_file, fp)
    wanted = []
    for rec, key in keyed:
        sig = rec.signature or {}
        candidates = [key]
        if is_class(sig) and isinstance(sig.get("example"), dict):
            try:
                candidates.append(cache_key(sig["example"], fp))
            except (TypeError, ValueError):
                pass
        wanted.append({"line": rec.line, "op": sig.get("op"), "keys": candidates})
    return wanted, errors


def cmd_verify(args: argparse.Namespace) -> int:
    cfg = _cfg(args)
    wanted: list[dict[str, Any]] | None = None
    manifest_errors: list[dict[str, Any]] = []
    which = args.tiers
    if args.manifest:
        wanted, manifest_errors = _records_wanted(cfg, args.manifest)
        which = which or ("fleet" if cfg.cache_dir else "local")
    tiers = _common.open_tiers(cfg, which or "all", listing=wanted is None)
    checked = 0
    bad: list[dict[str, Any]] = []
    missing: list[dict[str, Any]] = []
    try:
        for tier in tiers:
            if wanted is not None:
                present = tier.backend.contains_many([k for w in wanted for k in w["keys"]])
                infos = []
                for w in wanted:
                    key = next((k for k in w["keys"] if k in present), None)
                    if key is None:
                        missing.append({"tier": tier.name, "line": w["line"], "op": w["op"], "key": w["keys"][0]})
                    else:
                        infos.append(key)
            else:
                infos = [info.key for info in tier.backend.entries()]
            for key in infos:
                data: bytes | None = None
                try:
                    data = _common.read_entry(tier.backend, key)
                    if data is None:
                        if wanted is not None:  # gone between the lookup and the read
                            missing.append({"tier": tier.name, "line": None, "op": None, "key": key})
                        continue  # deleted since the listing
                    checked += 1
                    check_entry(key, data, cfg.signing_key)
                except IntegrityError as e:
                    if data is None:
                        checked += 1
                    op = None
                    try:
                        op = envelope.peek_header(data)["signature"]["op"] if data else None
                    except (CacheError, KeyError, TypeError):
                        pass
                    item = {"tier": tier.name, "key": key, "op": op, "reason": e.reason, "detail": str(e)}
                    if not args.dry_run:
                        item["quarantined_to"] = _quarantine(cfg, tier.name, key, e.reason, data)
                        item["deleted"] = bool(tier.backend.delete(key))
                    bad.append(item)
                    print(f"neuron-cache verify: BAD {tier.name} {key} ({op or 'unknown op'}): {e}",
                          file=sys.stderr)
    finally:
        _common.close_tiers(tiers)
    out: dict[str, Any] = {"checked": checked, "ok": checked - len(bad), "bad": bad,
                           "signed": cfg.signing_key is not None}
    if wanted is not None:
        out.update(manifest=os.path.abspath(args.manifest), signatures=len(wanted), missing=missing,
                   manifest_errors=manifest_errors, tiers=[t.name for t in tiers])
    if args.json:
        _common.print_json(out)
    else:
        if wanted is not None:
            print(f"manifest {args.manifest}: {len(wanted)} signature(s); missing {len(missing)} "
                  f"(tiers: {', '.join(t.name for t in tiers)})")
            for m in missing:
                print(f"  missing {m['tier']} {m['key']} {m['op'] or ''}"
                      + (f" (manifest line {m['line']})" if m["line"] else ""))
            for e in manifest_errors:
                print(f"  bad manifest line {e['line']}: {e['error']}")
        print(f"checked {checked} entries: {out['ok']} ok, {len(bad)} bad"
              + ("" if not bad or args.dry_run else " (quarantined and deleted)"))
        for b in bad:
            print(f"  {b['tier']} {b['key']} {b['op'] or ''}: {b['detail']}"
                  + (f" -> {b['quarantined_to']}" if b.get("quarantined_to") else ""))
    return PROBLEMS if bad or missing or manifest_errors else 0


# ------------------------------------------------------------------------------------------ prune / clear


def cmd_prune(args: argparse.Namespace) -> int:
    if args.max_size is None and os.environ.get("NEURON_CACHE_PRUNE_MAX_SIZE"):
        args.max_size = _common.parse_size(os.environ["NEURON_CACHE_PRUNE_MAX_SIZE"])
    if args.older_than is None and os.environ.get("NEURON_CACHE_PRUNE_OLDER_THAN"):
        args.older_than = _common.parse_age(os.environ["NEURON_CACHE_PRUNE_OLDER_THAN"])
    if args.max_size is None and args.older_than is None:
        raise UsageError("prune needs --max-size SIZE and/or --older-than AGE (e.g. --max-size 5GiB --older-than 30d)")
    cfg = _cfg(args)
    tiers = _common.open_tiers(cfg, args.tiers)
    now = time.time()
    report: dict[str, Any] = {"dry_run": args.dry_run, "tiers": {}}
    try:
        for tier in tiers:
            infos = sorted(tier.backend.entries(), key=lambda i: i.mtime)  # least recently used first
            doomed = [i for i in infos if args.older_than is not None and now - i.mtime > args.older_than]
            kept = [i for i in infos if i not in doomed]
            if args.max_size is not None:
                total = sum(i.size for i in kept)
                while kept and total > args.max_size:
                    victim = kept.pop(0)
                    doomed.append(victim)
                    total -= victim.size
            removed = freed = 0
            for i in doomed:
                if args.dry_run or tier.backend.delete(i.key):
                    removed += 1
                    freed += i.size
            report["tiers"][tier.name] = {"url": tier.url, "removed": removed, "freed": freed,
                                          "entries": len(kept), "bytes": sum(i.size for i in kept)}
    finally:
        _common.close_tiers(tiers)
    if args.json:
        _common.print_json(report)
    else:
        verb = "would remove" if args.dry_run else "removed"
        for name, t in report["tiers"].items():
            print(f"{name}: {verb} {t['removed']} entries ({_common.human_size(t['freed'])}); "
                  f"{t['entries']} entries ({_common.human_size(t['bytes'])}) remain")
    return 0


def cmd_clear(args: argparse.Namespace) -> int:
    cfg = _cfg(args)
    tiers = _common.open_tiers(cfg, args.tiers)
    if any(t.name == "fleet" for t in tiers) and not args.yes:
        _common.close_tiers(tiers)
        raise UsageError("clearing the fleet store deletes every host's entries: add --yes if you mean it")
    report: dict[str, Any] = {}
    try:
        for tier in tiers:
            if args.refusals:
                keys = [key for key, _, _, header, _ in _common.iter_headers(tier)
                        if header is not None and header.get("refused")]
            else:
                keys = [i.key for i in tier.backend.entries()]
            removed = sum(bool(tier.backend.delete(k)) for k in keys)
            report[tier.name] = {"url": tier.url, "removed": removed}
    finally:
        _common.close_tiers(tiers)
    if args.json:
        _common.print_json(report)
    else:
        for name, t in report.items():
            print(f"{name}: removed {t['removed']} entries from {t['url']}")
    return 0

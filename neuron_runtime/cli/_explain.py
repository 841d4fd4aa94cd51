"""`neuron-cache explain TARGET`: why does this signature miss? The closest entries and what differs.

TARGET is a signature (JSON text, a file, or `-` for stdin), a signature record (a line of a record file,
what `warm --manifest` keeps), a whole record file (every line is explained), a strict-mode error message
(the JSON after "Signature:" is used), or a 64-hex key. (Its help and messages say "manifest", the CLI's
word for a record file.)

A key is sha256(format version, signature, fingerprint): a miss means some field of one of them differs
from every stored entry. Entries store their signature and fingerprint in the header, so each candidate is
compared field by field and the differences are named by the part of the key they belong to:

    op, schema, arguments          which op overload; its schema (changes with torch); argument names/count
    shape, strides, dtype          a tensor argument's sizes, strides, dtype
    scalar type                    a run-time scalar or wrapped number: int vs float vs bool (values are
                                   never keyed, types are)
    structural value (type)        an argument keyed by value: dims, sizes, flags, dtypes (1 vs 1.0 vs True)
    argument kind, tensor count    a tensor vs a number, a None vs a tensor, list lengths
    compiler tier, torch version, ISA, Inductor config, C++ compiler, machine, libc, Python, artifact format
                                   the compiler fingerprint (aoti: _toolchain.fingerprint)
    graph node <part>, graph wiring, graph nodes, graph outputs
                                   a torch.compile graph or fused group: the node (`graph[i]`) whose op
                                   signature differs and how, which inputs a node reads, the node count

A signature whose exact key misses but whose shape class (docs/dispatch.md) has an executable is a hit:
"new shape, same class: no compile" (unless TORCH_NEURONX_SHAPES=static).

Candidates are ranked by the number of differing parts (another op counts as far away). Headers are read
without verifying the entry (this is a diagnosis; nothing is loaded).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from typing import Any

from neuron_runtime.cli import _common
from neuron_runtime.cli._errors import PROBLEMS, UsageError
from neuron_runtime.executables import check_signature, parse_line
from neuron_runtime.signatures import (
    LIST_KINDS,
    SCALAR,
    SCALARS,
    TENSOR_KINDS,
    VALUE,
    cache_key,
    describe_shapes,
    has_nodes,
    is_wrapped,
    shape_classes,
)

# Fingerprint field -> the name users know it by.
FINGERPRINT_PARTS = {
    "tier": "compiler tier",
    "format": "artifact format",
    "target": "ISA",
    "march": "ISA",
    "simdlen": "ISA",
    "pins": "Inductor config",
    "inductor_config": "Inductor config",
    "torch": "torch version",
    "torch_git": "torch version",
    "cxx": "C++ compiler",
    "machine": "machine",
    "libc": "libc",
    "python": "Python",
    "python_abi": "Python",
}
_FAR = 1000  # distance of an entry for another op: listed only when nothing closer exists
_KEY = re.compile(r"^[0-9a-f]{64}$")


def add_parsers(sub: Any) -> None:
    p = sub.add_parser("explain", help="why a signature misses: the closest cached entries and which key part differs")
    p.add_argument("target", metavar="TARGET",
                   help="signature JSON, manifest line or file, strict-mode error text, `-` for stdin, or a key")
    p.add_argument("--top", type=int, default=3, metavar="N", help="closest entries to show per signature (default 3)")
    p.add_argument("--fingerprint", metavar="JSON|FILE",
                   help="compare as a host with this compiler fingerprint (default: this host's, for --tier)")
    _common.add_tiers_option(p, "all")
    _common.finish_command(p, cmd_explain, tier=True)


# ------------------------------------------------------------------------------------------ parsing


def _signatures_from_text(text: str, origin: str) -> list[dict[str, Any]]:
    text = text.strip()
    if "Signature:" in text and not text.startswith("{"):
        text = text.split("Signature:", 1)[1].strip()
        try:
            obj, _ = json.JSONDecoder().raw_decode(text)
        except ValueError as e:
            raise UsageError(f"{origin}: no JSON signature after 'Signature:' ({e})") from e
        return [check_signature(obj)]
    try:
        return [parse_line(text)]
    except ValueError as whole:
        sigs: list[dict[str, Any]] = []
        lines = [ln for ln in text.splitlines() if ln.strip()]
        if len(lines) < 2:
            raise UsageError(f"{origin}: not a signature or manifest line ({whole})") from None
        for n, line in enumerate(lines, 1):
            try:
                sigs.append(parse_line(line))
            except ValueError as e:
                print(f"neuron-cache explain: {origin}:{n}: skipped ({e})", file=sys.stderr)
        if not sigs:
            raise UsageError(f"{origin}: no signature on any line") from None
        return sigs


def parse_target(target: str) -> tuple[list[dict[str, Any]], str | None]:
    """(signatures, key): a key target gives ([], key)."""
    if _KEY.match(target.strip()):
        return [], target.strip()
    if target == "-":
        return _signatures_from_text(sys.stdin.read(), "stdin"), None
    if os.path.isfile(target):
        with open(target, encoding="utf-8") as f:
            return _signatures_from_text(f.read(), target), None
    return _signatures_from_text(target, "argument"), None


# ------------------------------------------------------------------------------------------ diffing


def _diff(part: str, path: str, here: Any, entry: Any) -> dict[str, Any]:
    return {"part": part, "path": path, "here": here, "entry": entry}


def _same(a: Any, b: Any) -> bool:
    """Equal as the key sees them: 1, 1.0 and True are three different values."""
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def _tensor_diffs(path: str, a: Any, b: Any) -> list[dict[str, Any]]:
    if _same(a, b):
        return []
    if a is None or b is None:
        return [_diff("argument kind", path, a, b)]
    if not isinstance(a, dict) or not isinstance(b, dict):
        return [_diff("argument kind", path, a, b)]
    wa, wb = is_wrapped(a), is_wrapped(b)
    if wa and wb:
        return [_diff("scalar type", path, a["wrapped"], b["wrapped"])]
    if wa != wb:
        return [_diff("argument kind", path, "number" if wa else "tensor", "number" if wb else "tensor")]
    out = []
    for field, part in (("dtype", "dtype"), ("sizes", "shape"), ("strides", "strides")):
        if not _same(a.get(field), b.get(field)):
            out.append(_diff(part, f"{path}.{field}", a.get(field), b.get(field)))
    for field in sorted((set(a) | set(b)) - {"dtype", "sizes", "strides"}):
        if not _same(a.get(field), b.get(field)):
            out.append(_diff("tensor metadata", f"{path}.{field}", a.get(field), b.get(field)))
    return out


def _value_type(v: Any) -> str:
    if isinstance(v, list):
        return "[" + ",".join(_value_type(x) for x in v) + "]"
    if isinstance(v, dict):
        return next(iter(v), "object")
    return type(v).__name__


def _arg_diffs(name: str, kind: str, a: Any, b: Any) -> list[dict[str, Any]]:
    path = f"args.{name}"
    if _same(a, b):
        return []
    if kind in LIST_KINDS:
        if not isinstance(a, list) or not isinstance(b, list) or len(a) != len(b):
            return [_diff("tensor count", path, len(a) if isinstance(a, list) else a,
                          len(b) if isinstance(b, list) else b)]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _tensor_diffs(f"{path}[{i}]", x, y)]
    if kind in TENSOR_KINDS:  # one tensor, or an optional one
        return _tensor_diffs(path, a, b)
    if kind in (SCALAR, SCALARS):
        return [_diff("scalar type", path, a, b)]
    if kind == VALUE:
        # 1 == 1.0 == True in Python but not in the key: name the type, or the diff would look empty.
        if _value_type(a) != _value_type(b) and a == b:
            return [_diff("structural value type", path, a, b)]
        return [_diff("structural value", path, a, b)]
    return [_diff("argument", path, a, b)]


def _graph_diffs(here: dict[str, Any], entry: dict[str, Any]) -> list[dict[str, Any]]:
    """A graph (torch.compile, or a fused group): which node differs, and in which part; the wiring (which
    input or earlier result a node reads) and the graph's outputs."""
    hg, eg = here.get("graph") or [], entry.get("graph") or []
    out: list[dict[str, Any]] = []
    if len(hg) != len(eg):
        out.append(_diff("graph nodes", "graph", len(hg), len(eg)))
    for i, (a, b) in enumerate(zip(hg, eg)):
        for d in signature_diffs(a.get("sig") or {}, b.get("sig") or {}):
            out.append(dict(d, part=f"graph node {d['part']}", path=f"graph[{i}].{d['path']}"))
        if not _same(a.get("in"), b.get("in")):
            out.append(_diff("graph wiring", f"graph[{i}].in", a.get("in"), b.get("in")))
    for k in sorted((set(here) | set(entry)) - {"op", "graph"}):
        if not _same(here.get(k), entry.get(k)):
            out.append(_diff("graph outputs" if k == "outputs" else "signature field", k, here.get(k),
                             entry.get(k)))
    return out


def signature_diffs(here: dict[str, Any], entry: dict[str, Any]) -> list[dict[str, Any]]:
    if here.get("op") != entry.get("op"):
        return [_diff("op", "op", here.get("op"), entry.get("op"))]
    if has_nodes(here) or has_nodes(entry):
        return _graph_diffs(here, entry)
    out: list[dict[str, Any]] = []
    if here.get("schema") != entry.get("schema"):
        out.append(_diff("schema", "schema", here.get("schema"), entry.get("schema")))
    ha, ea = here.get("args") or [], entry.get("args") or []
    if [(a[0], a[1]) for a in ha] != [(a[0], a[1]) for a in ea]:
        out.append(_diff("arguments", "args", [a[0] for a in ha], [a[0] for a in ea]))
        return out
    for (name, kind, a), (_, _, b) in zip(ha, ea):
        out.extend(_arg_diffs(name, kind, a, b))
    for k in sorted((set(here) | set(entry)) - {"op", "schema", "args"}):
        if not _same(here.get(k), entry.get(k)):
            out.append(_diff("signature field", k, here.get(k), entry.get(k)))
    return out


def fingerprint_diffs(here: dict[str, Any], entry: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for k in sorted(set(here) | set(entry)):
        if not _same(here.get(k), entry.get(k)):
            out.append(_diff(FINGERPRINT_PARTS.get(k, f"fingerprint {k}"), f"fingerprint.{k}",
                             here.get(k), entry.get(k)))
    return out


def compare(sig: dict[str, Any], fp: dict[str, Any], header: dict[str, Any]) -> tuple[int, list[dict[str, Any]]]:
    sd = signature_diffs(sig, header.get("signature") or {})
    fd = fingerprint_diffs(fp, header.get("fingerprint") or {})
    distance = (_FAR if sd and sd[0]["part"] == "op" else len(sd)) + len(fd)
    return distance, sd + fd


# ------------------------------------------------------------------------------------------ command


def _fingerprint(args: argparse.Namespace, cfg: Any) -> dict[str, Any]:
    if args.fingerprint:
        text = args.fingerprint
        if os.path.isfile(text):
            with open(text, encoding="utf-8") as f:
                text = f.read()
        try:
            fp = json.loads(text)
        except ValueError as e:
            raise UsageError(f"--fingerprint: not JSON: {e}") from e
        if not isinstance(fp, dict):
            raise UsageError("--fingerprint: expected a JSON object")
        return fp
    from neuron_runtime.compiler import make_compiler

    return make_compiler(cfg).fingerprint()


def cmd_explain(args: argparse.Namespace) -> int:
    cfg = _common.load_config(_common.runtime_env(args))
    sigs, key = parse_target(args.target)
    tiers = _common.open_tiers(cfg, args.tiers)
    try:
        entries = [(tier.name, k, h) for tier in tiers for k, _, _, h, _ in _common.iter_headers(tier) if h]
    finally:
        _common.close_tiers(tiers)
    results: list[dict[str, Any]] = []
    if key is not None:
        found = [(t, h) for t, k, h in entries if k == key]
        if not found:
            raise UsageError(f"key {key} is not in the cache ({', '.join(t.name for t in tiers)}), and a key alone "
                             "cannot say what it was for: pass the signature instead (the strict-mode error "
                             "prints it after 'Signature:', the warm-up manifest has one per line)")
        results.append({"key": key, "hit": True, "tier": found[0][0], "op": found[0][1]["signature"].get("op"),
                        "signature": found[0][1]["signature"], "fingerprint": found[0][1]["fingerprint"],
                        "closest": []})
    else:
        fp = _fingerprint(args, cfg)
        for sig in sigs:
            k = cache_key(sig, fp)
            hit = [t for t, ek, _ in entries if ek == k]
            res: dict[str, Any] = {"key": k, "op": sig.get("op"), "hit": bool(hit), "tier": hit[0] if hit else None}
            for cls in [] if hit or cfg.shapes == "static" else shape_classes(sig):
                # A new shape of a class with an executable: the runtime links it, nothing compiles.
                # (The classes in the runtime's order: an elementwise op's flat class, its ranked class.)
                ck = cache_key(cls, fp)
                served = [t for t, ek, h in entries if ek == ck and not h.get("refused")]
                if served:
                    res.update(hit=True, tier=served[0], class_key=ck, shapes=describe_shapes(cls))
                    break
            if not res["hit"]:
                ranked = sorted(((compare(sig, fp, h), t, ek, h) for t, ek, h in entries),
                                key=lambda r: (r[0][0], r[1], r[2]))
                res["closest"] = [
                    {"key": ek, "tier": t, "op": (h.get("signature") or {}).get("op"), "distance": d,
                     "differs_in": sorted({x["part"] for x in diffs}), "diffs": diffs}
                    for (d, diffs), t, ek, h in ranked[: max(0, args.top)]
                ]
            else:
                res["closest"] = []
            results.append(res)
    misses = sum(not r["hit"] for r in results)
    if args.json:
        _common.print_json(results if len(results) != 1 else results[0])
    else:
        for r in results:
            if r.get("class_key"):
                print(f"HIT   {r['op']} key {r['key']}: new shape, same class: no compile (class {r['shapes']}, "
                      f"key {r['class_key']} in the {r['tier']} tier)")
                continue
            if r["hit"]:
                print(f"HIT   {r['op']} key {r['key']} is in the {r['tier']} tier")
                continue
            print(f"MISS  {r['op']} key {r['key']}: no entry in {', '.join(t.name for t in tiers)}")
            if not r["closest"]:
                print("      the cache is empty")
            for i, c in enumerate(r["closest"], 1):
                print(f"  {i}. {c['key'][:16]} ({c['tier']}, {c['op']}) differs in: {', '.join(c['differs_in'])}")
                for d in c["diffs"][:8]:
                    print(f"       {d['part']:<22} {d['path']}: here {json.dumps(d['here'])}, "
                          f"entry {json.dumps(d['entry'])}")
    return PROBLEMS if misses else 0

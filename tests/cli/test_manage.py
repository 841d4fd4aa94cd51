"""The management commands over real cache directories: ls, stats, verify, prune (while another process
reads), clear, export/import bundles, explain. The CLI runs in this process (`main(argv)`); the
concurrent reader is a process of its own. Entries are made the way the runtime makes them
(`envelope.pack` under `cache_key(signature, fingerprint)`), with payloads big enough to live in files."""

from __future__ import annotations

import copy
import io
import json
import os
import subprocess
import sys
import tarfile
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from neuron_runtime.cache import envelope
from neuron_runtime.cache import LocalCache, SharedPathStore
from neuron_runtime.cli import main
from neuron_runtime.compiler import get_compiler
from neuron_runtime.signatures import _signature

FP = get_compiler("reference").fingerprint()

ADD = {"op": "aten::add.Tensor", "schema": "aten::add.Tensor(Tensor self, Tensor other, *, Scalar alpha=1) -> Tensor",
       "args": [["self", "tensor", {"dtype": "float32", "sizes": [8, 16], "strides": [16, 1]}],
                ["other", "tensor", {"dtype": "float32", "sizes": [8, 16], "strides": [16, 1]}],
                ["alpha", "scalar", "int"]]}
SUM = {"op": "aten::sum.dim_IntList",
       "schema": "aten::sum.dim_IntList(Tensor self, int[1]? dim, bool keepdim=False, *, ScalarType? dtype=None) -> Tensor",
       "args": [["self", "tensor", {"dtype": "float32", "sizes": [4, 3], "strides": [3, 1]}], ["dim", "value", [1]],
                ["keepdim", "value", False], ["dtype", "value", None]]}


def sig_n(i: int) -> dict[str, Any]:
    s = copy.deepcopy(ADD)
    for a in s["args"][:2]:
        a[2]["sizes"] = [i + 1, 16]
    return s


def entry(sig: dict[str, Any], fp: dict[str, Any] = FP, size: int = 48_000,
          signing_key: bytes | None = None) -> tuple[str, bytes]:
    key = _signature.cache_key(sig, fp)
    # A reference tier's descriptor (what `verify` reads the payload's own signature from), padded.
    desc = {"format": "reference-v1", "signature": sig, "pad": ""}
    desc["pad"] = "x" * max(0, size - len(json.dumps(desc)))
    return key, envelope.pack(key, {"signature": sig, "fingerprint": fp}, json.dumps(desc).encode(), signing_key)


def fill(directory: Path, sigs: list[dict[str, Any]], fp: dict[str, Any] = FP, size: int = 48_000,
         signing_key: bytes | None = None) -> list[str]:
    cache = LocalCache(str(directory), 1 << 34)
    keys = []
    for s in sigs:
        key, data = entry(s, fp, size, signing_key)
        assert cache.put(key, data)
        keys.append(key)
    cache.close()
    return keys


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, Any, str]:
    rc = main(list(args))
    out, err = capsys.readouterr()
    return rc, json.loads(out) if "--json" in args and out.strip() else out, err


# ------------------------------------------------------------------------------------------ ls / stats


def test_ls_stats_and_clear(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    local = tmp_path / "local"
    keys = fill(local, [sig_n(i) for i in range(3)] + [SUM])
    rc, rows, _ = run(capsys, "ls", "--local-dir", str(local), "--json")
    assert rc == 0 and sorted(r["key"] for r in rows) == sorted(keys)
    assert {r["op"] for r in rows} == {"aten::add.Tensor", "aten::sum.dim_IntList"}
    assert all(r["compiler"] == "reference" and r["tier"] == "local" for r in rows)
    rc, text, _ = run(capsys, "ls", "--local-dir", str(local), "--op", "sum")
    assert rc == 0 and "aten::sum.dim_IntList" in text and "aten::add" not in text
    rc, st, _ = run(capsys, "stats", "--local-dir", str(local), "--by-op", "--json")
    assert rc == 0 and st["entries"] == 4 and st["bytes"] >= 4 * 48_000
    assert st["tiers"]["local"]["by_op"]["aten::add.Tensor"]["entries"] == 3
    rc, _, err = run(capsys, "clear", "--local-dir", str(local), "--fleet", str(tmp_path / "fleet"), "--tiers", "all")
    assert rc == 2 and "--yes" in err
    rc, cleared, _ = run(capsys, "clear", "--local-dir", str(local), "--json")
    assert rc == 0 and cleared["local"]["removed"] == 4
    rc, st, _ = run(capsys, "stats", "--local-dir", str(local), "--json")
    assert st["entries"] == 0 and st["bytes"] == 0


def test_clear_refusals_only(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    local = tmp_path / "local"
    kept = fill(local, [sig_n(i) for i in range(2)])
    cache = LocalCache(str(local), 1 << 34)
    refused_key = _signature.cache_key(SUM, FP)
    assert cache.put(refused_key, envelope.pack(refused_key, {"signature": SUM, "fingerprint": FP,
                                                              "refused": "not supported"}, b"", None))
    cache.close()
    rc, rows, _ = run(capsys, "ls", "--local-dir", str(local), "--json")
    assert [r["key"] for r in rows if r["refused"]] == [refused_key]
    rc, cleared, _ = run(capsys, "clear", "--refusals", "--local-dir", str(local), "--json")
    assert rc == 0 and cleared["local"]["removed"] == 1
    rc, rows, _ = run(capsys, "ls", "--local-dir", str(local), "--json")
    assert sorted(r["key"] for r in rows) == sorted(kept)


# ------------------------------------------------------------------------------------------ verify


def test_verify_quarantines_damaged_entries_and_exits_nonzero(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    local = tmp_path / "local"
    keys = fill(local, [sig_n(i) for i in range(4)])
    # 1. a bit flip in one value file (what a bad disk or a torn copy does)
    victim = sorted((local / "v1").rglob("*.val"))[0]
    raw = bytearray(victim.read_bytes())
    raw[len(raw) // 2] ^= 0x40
    victim.write_bytes(bytes(raw))
    # 2. an intact envelope that lies about what it is: its header's signature does not hash to its key
    lying_key, _ = entry(sig_n(10))
    lie = envelope.pack(lying_key, {"signature": sig_n(11), "fingerprint": FP}, b"x" * 40_000, None)
    # 3. a right header over another op's bytes: the payload records SUM's signature
    _, other = entry(SUM)
    forged_key, _ = entry(sig_n(12))
    forged = envelope.pack(forged_key, {"signature": sig_n(12), "fingerprint": FP},
                           envelope.unpack(other, expected_key=_signature.cache_key(SUM, FP), signing_key=None).payload, None)
    cache = LocalCache(str(local), 1 << 34)
    assert cache.put(lying_key, lie) and cache.put(forged_key, forged)
    cache.close()

    rc, out, err = run(capsys, "verify", "--local-dir", str(local), "--json")
    assert rc == 1
    assert out["checked"] == 6 and out["ok"] == 3
    reasons = {b["key"]: b["reason"] for b in out["bad"]}
    assert reasons[forged_key] == "payload"
    assert reasons[lying_key] == "header" and sorted(reasons.values()) == ["digest", "header", "payload"]
    damaged = next(k for k, r in reasons.items() if r == "digest")
    assert damaged in keys and f"BAD local {damaged}" in err
    for b in out["bad"]:
        assert b["deleted"] and Path(b["quarantined_to"]).is_file()
    rc, rows, _ = run(capsys, "ls", "--local-dir", str(local), "--json")
    assert sorted(r["key"] for r in rows) == sorted(set(keys) - {damaged})
    rc, again, _ = run(capsys, "verify", "--local-dir", str(local), "--json")
    assert rc == 0 and again["bad"] == [] and again["ok"] == 3
    rc, st, _ = run(capsys, "stats", "--local-dir", str(local), "--json")
    assert st["quarantined"] == 3


def test_verify_with_a_signing_key_refuses_unsigned_entries(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    local = tmp_path / "local"
    key_file = tmp_path / "key"
    key_file.write_text("s3cret")
    signed = fill(local, [sig_n(0)], signing_key=b"s3cret")
    unsigned = fill(local, [sig_n(1)])
    rc, out, _ = run(capsys, "verify", "--local-dir", str(local), "--signing-key-file", str(key_file), "--dry-run", "--json")
    assert rc == 1 and out["signed"] and [(b["key"], b["reason"]) for b in out["bad"]] == [(unsigned[0], "unsigned")]
    assert "deleted" not in out["bad"][0]  # --dry-run
    assert out["ok"] == 1 and signed


# ------------------------------------------------------------------------------------------ prune


READER = textwrap.dedent("""
    import json, os, sys, time
    from neuron_runtime.cache import envelope
    from neuron_runtime.cache import IntegrityError, LocalCache, SharedPathStore
    local_dir, fleet_dir, keys_file, stop, ready = sys.argv[1:6]
    keys = json.load(open(keys_file))
    tiers = [LocalCache(local_dir, 1 << 34), SharedPathStore(fleet_dir)]
    counts = {"whole": 0, "missing": 0, "corrupt": [], "passes": 0}
    while not os.path.exists(stop):
        for key in keys:
            for tier in tiers:
                try:
                    data = tier.get(key)
                    if data is None:
                        counts["missing"] += 1
                        continue
                    envelope.unpack(data, expected_key=key, signing_key=None)
                    counts["whole"] += 1
                except IntegrityError as e:
                    counts["corrupt"].append(f"{tier.tier} {key}: {e}")
        counts["passes"] += 1
        if counts["passes"] == 1:
            open(ready, "w").close()
    print(json.dumps(counts))
""")


def test_prune_while_another_process_reads(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    local, fleet = tmp_path / "local", tmp_path / "fleet"
    sigs = [sig_n(i) for i in range(80)]
    keys = fill(local, sigs, size=40_000)
    store = SharedPathStore(str(fleet))
    for s in sigs:
        assert store.put(*entry(s, size=40_000))
    # Older entries first: prune --older-than must take exactly these.
    old = time.time() - 3 * 86400
    for k in keys[:20]:
        os.utime(fleet / "v1" / k[:2] / k[2:4] / f"{k}.neff", (old, old))
    keys_file, stop, ready = tmp_path / "keys.json", tmp_path / "stop", tmp_path / "ready"
    keys_file.write_text(json.dumps(keys))
    reader = subprocess.Popen([sys.executable, "-c", READER, str(local), str(fleet), str(keys_file), str(stop),
                               str(ready)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not ready.exists():
            assert reader.poll() is None, reader.communicate()[1]
            assert time.monotonic() < deadline, "reader never finished a pass"
            time.sleep(0.1)
        rc, pruned, _ = run(capsys, "prune", "--tiers", "all", "--local-dir", str(local), "--fleet", str(fleet),
                            "--older-than", "2d", "--json")
        assert rc == 0 and pruned["tiers"]["fleet"]["removed"] == 20 and pruned["tiers"]["local"]["removed"] == 0
        rc, pruned, _ = run(capsys, "prune", "--tiers", "all", "--local-dir", str(local), "--fleet", str(fleet),
                            "--max-size", "1MB", "--json")
        assert rc == 0
        for t in pruned["tiers"].values():
            assert t["bytes"] <= 1_000_000 and t["removed"] > 0
        time.sleep(0.5)  # a few more reads against the pruned cache
        rc, cleared, _ = run(capsys, "clear", "--local-dir", str(local), "--json")
        assert rc == 0
        time.sleep(0.5)
    finally:
        stop.touch()
        out, err = reader.communicate(timeout=120)
    counts = json.loads(out.strip().splitlines()[-1])
    assert counts["corrupt"] == [], counts["corrupt"]
    assert counts["whole"] > 0 and counts["missing"] > 0 and counts["passes"] >= 2


def test_scans_do_not_count_as_use(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """ls, verify, export and explain read every entry; that must not make them look recently used."""
    import sqlite3

    local = tmp_path / "local"
    fill(local, [sig_n(i) for i in range(3)], size=1_000)
    with sqlite3.connect(local / "v1" / "cache.db") as db:
        db.execute("UPDATE Cache SET access_time = ?", (time.time() - 3 * 86400,))
    for cmd in (["ls"], ["verify"], ["export", str(tmp_path / "b.tar")], ["explain", json.dumps(ADD)]):
        run(capsys, *cmd, "--local-dir", str(local), "--json")
    rc, out, _ = run(capsys, "prune", "--older-than", "2d", "--local-dir", str(local), "--json")
    assert rc == 0 and out["tiers"]["local"]["removed"] == 3


def test_prune_needs_a_limit(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = run(capsys, "prune", "--local-dir", str(tmp_path))
    assert rc == 2 and "--max-size" in err


# ------------------------------------------------------------------------------------------ bundles


def _rewrite_member(src: Path, dst: Path, name: str, edit: Any) -> None:
    with tarfile.open(src) as tin, tarfile.open(dst, "w") as tout:
        for m in tin.getmembers():
            data = tin.extractfile(m).read()  # type: ignore[union-attr]
            if m.name == name:
                data = edit(data)
                m.size = len(data)
            tout.addfile(m, io.BytesIO(data))


def test_bundle_round_trip_and_tampered_entry_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "src"
    keys = fill(src, [sig_n(i) for i in range(5)] + [SUM])
    bundle = tmp_path / "cache.tar.gz"
    rc, out, _ = run(capsys, "export", str(bundle), "--local-dir", str(src), "--json")
    assert rc == 0 and out["entries"] == 6 and not out["signed"]

    rc, out, _ = run(capsys, "import", str(bundle), "--local-dir", str(tmp_path / "dst"), "--json")
    assert rc == 0 and out["imported"] == 6 and out["refused"] == []
    rc, out, _ = run(capsys, "import", str(bundle), "--local-dir", str(tmp_path / "dst"), "--json")
    assert rc == 0 and out["present"] == 6

    # One entry's payload changed in transit.
    sum_key = keys[-1]
    tampered = tmp_path / "tampered.tar"

    def flip(data: bytes) -> bytes:
        b = bytearray(data)
        b[len(b) // 2] ^= 1
        return bytes(b)

    _rewrite_member(bundle, tampered, f"entries/{sum_key}.neff", flip)
    rc, out, err = run(capsys, "import", str(tampered), "--local-dir", str(tmp_path / "dst2"), "--json")
    assert rc == 1 and out["imported"] == 5
    (refused,) = out["refused"]
    assert refused["key"] == sum_key and refused["op"] == "aten::sum.dim_IntList" and "sha256" in refused["reason"]
    assert f"REFUSED entries/{sum_key}.neff (aten::sum.dim_IntList)" in err
    rc, rows, _ = run(capsys, "ls", "--local-dir", str(tmp_path / "dst2"), "--json")
    assert sum_key not in {r["key"] for r in rows} and len(rows) == 5

    # The same change with bundle.json updated to match: the envelope's own digest still catches it.
    def relist(data: bytes) -> bytes:
        import hashlib

        doc = json.loads(data)
        with tarfile.open(tampered) as t:
            new = t.extractfile(f"entries/{sum_key}.neff").read()  # type: ignore[union-attr]
        for e in doc["entries"]:
            if e["key"] == sum_key:
                e["sha256"] = hashlib.sha256(new).hexdigest()
        return json.dumps(doc).encode()

    relisted = tmp_path / "relisted.tar"
    _rewrite_member(tampered, relisted, "bundle.json", relist)
    rc, out, _ = run(capsys, "import", str(relisted), "--local-dir", str(tmp_path / "dst3"), "--json")
    assert rc == 1 and [r["key"] for r in out["refused"]] == [sum_key] and "digest" in out["refused"][0]["reason"]


def test_signed_bundle(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    key_file, other = tmp_path / "key", tmp_path / "other"
    key_file.write_text("fleet-key")
    other.write_text("not-the-key")
    fill(tmp_path / "src", [sig_n(i) for i in range(3)], signing_key=b"fleet-key")
    bundle = tmp_path / "b.tar"
    rc, out, _ = run(capsys, "export", str(bundle), "--local-dir", str(tmp_path / "src"),
                     "--signing-key-file", str(key_file), "--json")
    assert rc == 0 and out["signed"] and out["entries"] == 3
    rc, out, _ = run(capsys, "import", str(bundle), "--local-dir", str(tmp_path / "ok"),
                     "--signing-key-file", str(key_file), "--json")
    assert rc == 0 and out["imported"] == 3
    rc, _, err = run(capsys, "import", str(bundle), "--local-dir", str(tmp_path / "bad"),
                     "--signing-key-file", str(other))
    assert rc == 1 and "does not verify with this signing key" in err and "nothing imported" in err
    rc, _, err = run(capsys, "import", str(tmp_path / "key"), "--local-dir", str(tmp_path / "bad"))
    assert rc == 1 and "cannot read" in err


# ------------------------------------------------------------------------------------------ explain


def _changed(path: tuple[int, str], value: Any, base: dict[str, Any] = ADD) -> dict[str, Any]:
    s = copy.deepcopy(base)
    i, field = path
    if field:
        s["args"][i][2][field] = value
    else:
        s["args"][i][2] = value
    return s


def test_explain_names_the_part_of_the_key_that_differs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    local = tmp_path / "local"
    aoti_fp = {"tier": "aoti", "format": 1, "target": {"march": "x86-64-v3", "simdlen": 256}, "torch": "2.13.0+cpu",
               "machine": "x86_64"}
    fill(local, [ADD, SUM], size=2_000)
    fill(local, [ADD], fp=aoti_fp, size=2_000)
    base = ["--local-dir", str(local), "--tier", "reference", "--json"]

    rc, out, _ = run(capsys, "explain", json.dumps(ADD), *base)
    assert rc == 0 and out["hit"] and out["tier"] == "local"

    cases = {
        "shape": _changed((0, "sizes"), [8, 32]),
        "dtype": _changed((1, "dtype"), "bfloat16"),
        "scalar type": _changed((2, ""), "float"),
        "structural value": _changed((1, ""), [0], SUM),
        "structural value type": _changed((2, ""), 0, SUM),
    }
    for part, sig in cases.items():
        rc, out, _ = run(capsys, "explain", json.dumps({"op": sig["op"], "signature": sig}), *base)
        assert rc == 1 and not out["hit"], part
        best = out["closest"][0]
        assert best["op"] == sig["op"] and best["differs_in"] == [part], (part, best)

    # Fingerprint changes: a host with another torch, or another ISA, than the entries were built for.
    newer_torch = dict(FP, torch="2.14.0+cpu")
    rc, out, _ = run(capsys, "explain", json.dumps(ADD), "--fingerprint", json.dumps(newer_torch), *base)
    assert rc == 1 and out["closest"][0]["differs_in"] == ["torch version"]
    d = out["closest"][0]["diffs"][0]
    assert d["path"] == "fingerprint.torch" and d["here"] == "2.14.0+cpu" and d["entry"] == FP["torch"]
    other_isa = dict(aoti_fp, target={"march": "x86-64-v4", "simdlen": 512})
    rc, out, _ = run(capsys, "explain", json.dumps(ADD), "--fingerprint", json.dumps(other_isa), *base)
    assert out["closest"][0]["differs_in"] == ["ISA"]

    # The text a strict-mode miss prints, pasted as is; and human output names the part too.
    strict_text = ("CacheMissError: strict cache mode (TORCH_NEURONX_CACHE_MODE=strict): no cached executable for "
                   f"aten::add.Tensor (key abc); warm the cache. Signature: {json.dumps(cases['dtype'])}")
    rc, text, _ = run(capsys, "explain", strict_text, "--local-dir", str(local), "--tier", "reference")
    assert rc == 1 and "MISS  aten::add.Tensor" in text and "dtype" in text and "bfloat16" in text

    # A whole manifest: one result per line.
    manifest = tmp_path / "m.jsonl"
    manifest.write_text("\n".join(json.dumps({"op": s["op"], "signature": s}) for s in (ADD, cases["shape"])) + "\n")
    rc, out, _ = run(capsys, "explain", str(manifest), *base)
    assert rc == 1 and [r["hit"] for r in out] == [True, False]

    key = _signature.cache_key(ADD, FP)
    rc, out, _ = run(capsys, "explain", key, *base)
    assert rc == 0 and out["op"] == "aten::add.Tensor"
    rc, _, err = run(capsys, "explain", "0" * 64, *base)
    assert rc == 2 and "pass the signature" in err


def test_fleet_commands_on_s3(tmp_path: Path, capsys: pytest.CaptureFixture[str], moto_s3: Any) -> None:
    """A bundle imported straight into an S3 fleet store, then listed, verified, pruned and cleared there."""
    bucket = f"neff-cli-{os.getpid()}"
    moto_s3.make_bucket(bucket)
    url = f"s3://{bucket}/cache"
    fill(tmp_path / "src", [sig_n(i) for i in range(4)], size=20_000)
    bundle = tmp_path / "b.tar"
    assert run(capsys, "export", str(bundle), "--local-dir", str(tmp_path / "src"), "--json")[0] == 0
    fleet = ["--local-dir", str(tmp_path / "local"), "--fleet", url, "--json"]
    rc, out, _ = run(capsys, "import", str(bundle), "--tiers", "fleet", *fleet)
    assert rc == 0 and out["imported"] == 4 and out["tiers"] == ["fleet"]
    rc, rows, _ = run(capsys, "ls", "--tiers", "fleet", *fleet)
    assert rc == 0 and len(rows) == 4 and {r["tier"] for r in rows} == {"fleet"}
    rc, out, _ = run(capsys, "verify", "--tiers", "all", *fleet)
    assert rc == 0 and out["checked"] == 4
    rc, out, _ = run(capsys, "prune", "--tiers", "fleet", "--max-size", "50KB", *fleet)
    assert rc == 0 and out["tiers"]["fleet"]["removed"] == 2 and out["tiers"]["fleet"]["entries"] == 2
    rc, out, _ = run(capsys, "clear", "--tiers", "fleet", "--yes", *fleet)
    assert rc == 0 and out["fleet"]["removed"] == 2
    rc, st, _ = run(capsys, "stats", "--tiers", "fleet", *fleet)
    assert st["entries"] == 0


def test_ls_and_explain_know_shape_classes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from neuron_runtime.signatures import _shapes

    local = tmp_path / "local"
    cls = _shapes.shape_class(ADD)
    assert cls is not None
    fill(local, [cls, SUM], size=2_000)
    base = ["--local-dir", str(local), "--tier", "reference", "--json"]
    rc, rows, _ = run(capsys, "ls", "--local-dir", str(local), "--json")
    by_op = {r["op"]: r for r in rows}
    assert rc == 0 and by_op["aten::add.Tensor"]["shape_class"] and not by_op["aten::sum.dim_IntList"]["shape_class"]
    # add is elementwise: its class is flat, one 1-D kernel for every rank (docs/dispatch.md)
    assert by_op["aten::add.Tensor"]["shapes"] == "[s0] [s0]" and by_op["aten::sum.dim_IntList"]["shapes"] == "[4,3]"

    rc, out, _ = run(capsys, "explain", json.dumps(sig_n(40)), *base)  # 41x16: a shape never compiled
    assert rc == 0 and out["hit"] and out["class_key"] == _signature.cache_key(cls, FP)
    rc, text, _ = run(capsys, "explain", json.dumps(sig_n(40)), *base[:-1])
    assert "new shape, same class: no compile" in text
    rc, out, _ = run(capsys, "explain", json.dumps(sig_n(0)), *base)  # 1x16: flat, 16 elements: served
    assert rc == 0 and out["hit"] and out["class_key"] == _signature.cache_key(cls, FP)
    one = sig_n(0)  # 1x16 + 8x16: broadcasting is another class; nothing serves it
    one["args"][1][2]["sizes"] = [8, 16]
    rc, out, _ = run(capsys, "explain", json.dumps(one), *base)
    assert rc == 1 and not out["hit"] and out["closest"][0]["differs_in"] == ["shape", "signature field", "strides"]

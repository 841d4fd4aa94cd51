"""Classify each test's neuron result against its CPU result; the report's JSON and markdown.

| class | meaning | counted in the pass rate |
|---|---|---|
| `pass` | passed on both | yes, as a pass |
| `neuron_only` | passed on CPU, failed / crashed / timed out on neuron (the reason is the neuron message; a known cause from `KNOWN` is added) | yes, as a failure |
| `shared` | fails on CPU too (torch's own test vs its build): not ours | no |
| `neuron_better` | fails on CPU, passes on neuron | no |
| `skipped_neuron` | passed on CPU, skipped on neuron by the test's own decorators (its reason: `onlyNativeDeviceTypes`, `onlyCUDA`, ...) | no, listed with the reason |
| `skipped` | skipped on both (`onlyCUDA`, slow tests, ...) | no |
| `one_device` | instantiated for one device only | no |

The pass rate is `pass / (pass + neuron_only)`: of the tests that pass on CPU and run on neuron, how many
pass on neuron. Per dtype family too (float32, integer, bfloat16, ...; a test without a dtype is `none`).
"""

from __future__ import annotations

import fnmatch
import hashlib
from pathlib import Path
from typing import Any

from ._names import dtypes_of

CLASSES = ("pass", "neuron_only", "shared", "neuron_better", "skipped_neuron", "skipped", "one_device")
_GOOD = ("passed", "xfailed")


def classify(neuron: dict[str, Any] | None, cpu: dict[str, Any] | None) -> str:
    if neuron is None or cpu is None:
        return "one_device"
    n, c = neuron["outcome"], cpu["outcome"]
    if c == "skipped":
        return "skipped" if n == "skipped" else ("neuron_better" if n in _GOOD else "shared")
    if n == "skipped":
        return "skipped_neuron" if c in _GOOD else "skipped"
    if c in _GOOD:
        return "pass" if n in _GOOD else "neuron_only"
    return "neuron_better" if n in _GOOD else "shared"


def family(test_key: str) -> str:
    ds = dtypes_of(test_key.rsplit("::", 1)[-1])
    if not ds:
        return "none"
    d = ds[0]
    if d.startswith(("int", "uint")):
        return "integer"
    return d


def _rate(c: dict[str, int]) -> float | None:
    n = c.get("pass", 0) + c.get("neuron_only", 0)
    return round(100.0 * c.get("pass", 0) / n, 3) if n else None


def build(files: dict[str, dict[str, Any]], known: dict[str, str], meta: dict[str, Any]) -> dict[str, Any]:
    """`files[name] = {"neuron": task, "cpu": task, "path", "kind"}` -> the report."""
    out_files: dict[str, Any] = {}
    total: dict[str, int] = dict.fromkeys(CLASSES, 0)
    fams: dict[str, dict[str, int]] = {}
    for name, f in sorted(files.items()):
        nt, ct = f["neuron"], f["cpu"]
        tests: dict[str, Any] = {}
        counts = dict.fromkeys(CLASSES, 0)
        for k in sorted(set(nt.results) | set(ct.results)):
            nr, cr = nt.results.get(k), ct.results.get(k)
            cls = classify(nr, cr)
            counts[cls] += 1
            total[cls] += 1
            fam = fams.setdefault(family(k), dict.fromkeys(CLASSES, 0))
            fam[cls] += 1
            if cls == "pass":
                continue  # passes are counted, not listed
            e: dict[str, Any] = {"class": cls,
                                 "neuron": nr["outcome"] if nr else None, "cpu": cr["outcome"] if cr else None}
            if cls == "neuron_only":
                e["reason"] = nr.get("message", "") if nr else ""
                cause = next((why for pat, why in known.items() if fnmatch.fnmatchcase(k, pat)), None)
                if cause:
                    e["known"] = cause
            elif cls == "skipped_neuron":
                e["reason"] = nr.get("message", "") if nr else ""
            elif cls == "shared":
                e["reason"] = (cr or {}).get("message", "")
            elif cls == "skipped":
                e["reason"] = (nr or cr or {}).get("message", "")
            tests[k] = e
        import_error = (nt.collect_errors or ct.collect_errors) and not (nt.results or ct.results)
        out_files[name] = {
            "kind": f["kind"], "path": str(f["path"]), "sha256": _sha256(f["path"]),
            "status": "import_error" if import_error else "ran",
            "import_error": (nt.collect_errors or ct.collect_errors or [None])[0] if import_error else None,
            "collect_errors": {"neuron": nt.collect_errors, "cpu": ct.collect_errors},
            "counts": counts, "pass_rate": _rate(counts),
            "seconds": {"neuron": round(sum(r.get("seconds", 0.0) for r in nt.results.values()), 1),
                        "cpu": round(sum(r.get("seconds", 0.0) for r in ct.results.values()), 1),
                        "neuron_wall": round(nt.seconds, 1), "cpu_wall": round(ct.seconds, 1)},
            "restarts": {"neuron": nt.restarts, "cpu": ct.restarts},
            "tests": tests,
        }
        s = out_files[name]["seconds"]
        s["ratio"] = round(s["neuron"] / s["cpu"], 2) if s["cpu"] else None
    summary = {
        "files": len(out_files),
        "import_errors": sorted(n for n, f in out_files.items() if f["status"] == "import_error"),
        "counts": total, "pass_rate": _rate(total),
        "families": {k: {**v, "pass_rate": _rate(v)} for k, v in sorted(fams.items())},
        **meta,
    }
    return {"summary": summary, "files": out_files}


def _sha256(path: Any) -> str | None:
    p = Path(path)
    return hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else None


def markdown(rep: dict[str, Any]) -> str:
    s = rep["summary"]
    c = s["counts"]
    L = ["# Device-generic test files on `neuron` and on CPU", "",
         f"torch {s.get('torch')} (git {s.get('torch_git', '?')[:12]}), tier `{s.get('tier')}`, dtype sample "
         f"{', '.join(s.get('dtypes') or ['every dtype'])}, per-test timeout {s.get('timeout_s')} s, "
         f"{s.get('jobs')} jobs, {s.get('seconds')} s wall (load average before/after: {s.get('load_before')} / "
         f"{s.get('load_after')}).", "",
         f"**{c['pass']} of {c['pass'] + c['neuron_only']} tests that pass on CPU pass on neuron "
         f"({s['pass_rate']} %)**; {c['neuron_only']} fail only on neuron (listed below with reasons), "
         f"{c['shared']} fail on CPU too (not counted), {c['skipped_neuron']} skipped on neuron by the tests' own "
         f"device decorators, {c['skipped']} skipped on both, {c['neuron_better']} pass only on neuron.", ""]
    if s["import_errors"]:
        L += ["**Files that failed to import** (no test counted): " + ", ".join(f"`{n}`" for n in s["import_errors"]), ""]
    L += ["| file | kind | pass | neuron only | shared with CPU | skipped on neuron | skipped | pass rate | CPU s | "
          "neuron s | ratio |",
          "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for n, f in rep["files"].items():
        k, t = f["counts"], f["seconds"]
        rate = "import error" if f["status"] == "import_error" else f"{f['pass_rate']} %"
        L.append(f"| `{n}` | {f['kind']} | {k['pass']} | {k['neuron_only']} | {k['shared']} | {k['skipped_neuron']} | "
                 f"{k['skipped']} | {rate} | {t['cpu']} | {t['neuron']} | {t['ratio']} |")
    L += ["", "## Per dtype family", "", "| family | pass | neuron only | shared | pass rate |", "|---|---:|---:|---:|---:|"]
    for fam, v in s["families"].items():
        L.append(f"| {fam} | {v['pass']} | {v['neuron_only']} | {v['shared']} | {v['pass_rate']} % |")
    L += ["", "## Neuron-only failures", "", "| test | neuron | reason | known cause |", "|---|---|---|---|"]
    for n, f in rep["files"].items():
        for k, e in f["tests"].items():
            if e["class"] == "neuron_only":
                L.append(f"| `{k}` | {e['neuron']} | {_cell(e.get('reason', ''))} | {_cell(e.get('known', ''))} |")
    L += ["", "## Failing on CPU too (not counted)", "", "| test | CPU's failure |", "|---|---|"]
    for n, f in rep["files"].items():
        for k, e in f["tests"].items():
            if e["class"] == "shared":
                L.append(f"| `{k}` | {_cell(e.get('reason', ''))} |")
    L += ["", "## Skipped on neuron, run on CPU (by reason)", "", "| reason | tests |", "|---|---:|"]
    reasons: dict[str, int] = {}
    for f in rep["files"].values():
        for e in f["tests"].values():
            if e["class"] == "skipped_neuron":
                r = _cell(e.get("reason", ""))[:160]
                reasons[r] = reasons.get(r, 0) + 1
    L += [f"| {r} | {m} |" for r, m in sorted(reasons.items(), key=lambda x: -x[1])]
    return "\n".join(L) + "\n"


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")[:300]

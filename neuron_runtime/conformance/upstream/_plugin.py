"""The pytest plugin each worker process loads (`-p neuron_runtime.conformance.upstream._plugin`).

It keeps one JSON line per event in `--neuron-results`, flushed as it goes, so the parent knows what ran
even when a test kills the interpreter:

  {"collected": [ids]}                       after collection and the dtype sample
  {"collect_error": message}                 a file (or class) that failed to import
  {"start": id}                              a test began (the last one without an end is the culprit)
  {"test": id, "outcome", "seconds", "message"?}   a test ended: passed, failed, skipped, xfailed, xpassed

Ids are the device-independent names of `_names.key` (the device in the class and test names replaced),
so a test's CPU and neuron results meet under one key. `--neuron-dtypes` keeps only tests whose names
carry no dtype or only dtypes of the sample; `--neuron-skip-file` deselects ids (tests already done, or
the one that killed the previous worker); `--neuron-shard i/n` keeps every n-th test."""

from __future__ import annotations

import json
from typing import Any

import pytest

try:
    from ._names import dtypes_of, key
except ImportError:  # loaded as a top-level plugin (`-p _plugin`): the CPU worker never imports neuron_runtime
    from _names import dtypes_of, key  # type: ignore[no-redef]

_state: dict[str, Any] = {"out": None, "results": {}}


def pytest_addoption(parser: pytest.Parser) -> None:
    g = parser.getgroup("neuron-upstream")
    g.addoption("--neuron-results", help="JSON-lines file the worker appends its events to")
    g.addoption("--neuron-dtypes", default="", help="comma-separated dtype sample (empty: every dtype)")
    g.addoption("--neuron-skip-file", default="", help="file of test ids (one a line) not to run")
    g.addoption("--neuron-shard", default="", help="i/n: run every n-th selected test, starting at i")


def _emit(d: dict[str, Any]) -> None:
    out = _state["out"]
    if out is not None:
        out.write(json.dumps(d) + "\n")
        out.flush()


def pytest_configure(config: pytest.Config) -> None:
    path = config.getoption("--neuron-results")
    if path:
        _state["out"] = open(path, "a", buffering=1)  # noqa: SIM115 - closed at unconfigure


def pytest_unconfigure(config: pytest.Config) -> None:
    if _state["out"] is not None:
        _state["out"].close()
        _state["out"] = None


def pytest_collectreport(report: pytest.CollectReport) -> None:
    if report.failed:
        _emit({"collect_error": _last_error(str(report.longrepr))})


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    sample = {d for d in config.getoption("--neuron-dtypes").split(",") if d}
    skip_file = config.getoption("--neuron-skip-file")
    skip: set[str] = set()
    if skip_file:
        with open(skip_file) as f:
            skip = {line.strip() for line in f if line.strip()}
    keep, drop = [], []
    for it in items:
        k = key(it.nodeid)
        ok = k not in skip and (not sample or all(d in sample for d in dtypes_of(it.name)))
        (keep if ok else drop).append(it)
    shard = config.getoption("--neuron-shard")
    if shard:
        i, n = (int(x) for x in shard.split("/"))
        drop += [it for j, it in enumerate(keep) if j % n != i]
        keep = [it for j, it in enumerate(keep) if j % n == i]
    items[:] = keep
    if drop:
        config.hook.pytest_deselected(items=drop)
    _emit({"collected": [key(it.nodeid) for it in keep]})


def pytest_runtest_logstart(nodeid: str, location: Any) -> None:
    _emit({"start": key(nodeid)})


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    r = _state["results"].setdefault(report.nodeid, {"outcome": "passed", "seconds": 0.0})
    r["seconds"] += report.duration
    if hasattr(report, "wasxfail"):
        r["outcome"] = "xpassed" if report.passed else "xfailed"
        return
    if report.skipped and r["outcome"] == "passed":
        r["outcome"] = "skipped"
        lr = report.longrepr
        r["message"] = lr[2] if isinstance(lr, tuple) and len(lr) == 3 else str(lr)
    elif report.failed and r["outcome"] != "failed":
        r["outcome"] = "failed"
        r["message"] = _last_error(report.longreprtext) + ("" if report.when == "call" else f" (in {report.when})")


def pytest_runtest_logfinish(nodeid: str, location: Any) -> None:
    r = _state["results"].pop(nodeid, {"outcome": "failed", "seconds": 0.0, "message": "no report"})
    _emit({"test": key(nodeid), **{k: (round(v, 3) if k == "seconds" else v) for k, v in r.items()}})


def _last_error(text: str) -> str:
    """The exception line of a traceback (`E   RuntimeError: ...`), else its last non-empty line."""
    lines = [ln for ln in text.splitlines() if ln.strip()]
    errs = [ln[1:].strip() for ln in lines if ln.startswith("E ")]
    if errs:
        # The first `E` line holds the exception type and message; later ones continue it.
        first = next((i for i, ln in enumerate(errs) if ":" in ln and ln.split(":")[0].replace(".", "").isidentifier()), 0)
        return " ".join(errs[first:first + 3])[:500]
    return (lines[-1] if lines else "")[:500]

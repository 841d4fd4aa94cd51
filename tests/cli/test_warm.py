"""`neuron-cache warm` / `compile` end to end, with real processes: the job, the CLI, its workers, and a
strict consumer afterwards. Target tier `reference` (milliseconds per compile) unless marked aoti."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from neuron_runtime.cli import main

# The training job every warm test runs (a process of its own).
JOB = Path(__file__).resolve().parents[1] / "jobs" / "train_small.py"


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    for var in ("TORCH_NEURONX_NEFF_CACHE_DIR", "TORCH_NEURONX_CACHE_MODE", "TORCH_NEURONX_STATS_FILE"):
        env.pop(var, None)
    env.update(extra)
    return env


def _cli(args: list[str], env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "neuron_runtime.cli", *args], env=env, capture_output=True,
                          text=True, timeout=timeout)


def _in_process(capsys: pytest.CaptureFixture[str], args: list[str]) -> tuple[int, Any, str]:
    rc = main(args)
    out, err = capsys.readouterr()
    return rc, json.loads(out) if "--json" in args else out, err


def test_warm_then_strict_job_compiles_nothing(tmp_path: Path, capfd: pytest.CaptureFixture[str],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    # A busy host can stall a file operation past the 10 s default; a fleet timeout is a miss, which in
    # strict mode is an error. This test is about warm, not about timeouts.
    monkeypatch.setenv("TORCH_NEURONX_FLEET_TIMEOUT", "120")
    job = JOB
    local, fleet, manifest = tmp_path / "local", tmp_path / "fleet", tmp_path / "manifest.jsonl"
    # The CLI runs in this process to save one more torch start-up on a busy host; the job, the two
    # compile workers and the strict consumer are processes of their own.
    rc = main(["warm", "--tier", "reference", "--jobs", "2", "--local-dir", str(local), "--to", str(fleet),
               "--manifest", str(manifest), "--json", "--", sys.executable, str(job)])
    out, err = capfd.readouterr()
    assert rc == 0, err
    summary = json.loads(out)  # stdout holds the summary alone: the job's print went to stderr
    assert "loss" in err and "compile [" in err  # job output and progress on stderr
    n = summary["signatures"]
    assert n > 10 and summary["compiled"] == n and summary["failed"] == 0 and summary["job"]["returncode"] == 0
    assert len(manifest.read_text().splitlines()) == n

    # A production host: strict mode, an empty local tier, only the fleet store that warm pushed to.
    stats = tmp_path / "strict.stats.json"
    r = subprocess.run([sys.executable, str(job)], capture_output=True, text=True, timeout=300, env=_env(
        TORCH_NEURONX_COMPILER="reference", TORCH_NEURONX_CACHE_MODE="strict",
        TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR=str(tmp_path / "prod-local"), TORCH_NEURONX_NEFF_CACHE_DIR=str(fleet),
        TORCH_NEURONX_STATS_FILE=str(stats)))
    assert r.returncode == 0, r.stderr
    s = json.loads(stats.read_text())
    assert s["compiles"] == 0 and s["misses"] == 0 and s["hits"]["fleet"] == n

    # The same manifest again: everything present, no worker started; stats sees the strict run's counters.
    rc, again, _ = _in_process(capfd, ["compile", str(manifest), "--tier", "reference", "--local-dir", str(local),
                                        "--to", str(fleet), "--json"])
    assert rc == 0 and again["present"] == n and again["compiled"] == 0
    rc, st, _ = _in_process(capfd, ["stats", "--local-dir", str(local), "--fleet", str(fleet),
                                     "--run-stats", str(stats), "--json"])
    assert rc == 0 and st["tiers"]["local"]["entries"] == n and st["tiers"]["fleet"]["entries"] == n
    assert st["entries"] == 2 * n and st["bytes"] > 0
    assert st["compile_phases"]["compile"]["n"] == n  # each entry's header keeps its compile's seconds
    assert st["runs"][0]["compiles"] == 0 and st["runs"][0]["hits"]["fleet"] == n
    assert [w["command"] for w in st["warm_runs"]] == ["warm", "compile"]


def test_warm_script_crashing_midway_still_compiles_what_it_recorded(
        tmp_path: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    job = JOB
    local = tmp_path / "local"
    monkeypatch.setenv("CRASH_AFTER_FORWARD", "1")
    # The CLI in this process (the job and the worker are still processes of their own).
    rc = main(["warm", "--tier", "reference", "--jobs", "1", "--local-dir", str(local), "--json", "--no-progress",
               "--", sys.executable, str(job)])
    out, err = capfd.readouterr()
    assert rc == 1, err  # the job failed: CI must notice
    assert "crashed midway" in err
    summary = json.loads(out)
    assert summary["job"]["returncode"] != 0
    assert summary["signatures"] >= 5 and summary["compiled"] == summary["signatures"] and summary["failed"] == 0
    rc, rows, _ = _in_process(capfd, ["ls", "--local-dir", str(local), "--json"])
    assert rc == 0 and len(rows) == summary["signatures"]
    assert any(row["op"] == "aten::addmm" for row in rows)  # the forward pass, recorded before the crash


SIGNATURES = [
    {"op": "aten::fill.Scalar", "schema": "aten::fill.Scalar(Tensor self, Scalar value) -> Tensor",
     "args": [["self", "tensor", {"dtype": "float32", "sizes": [4, 3], "strides": [3, 1]}],
              ["value", "scalar", "float"]]},
    {"op": "aten::mul.Tensor", "schema": "aten::mul.Tensor(Tensor self, Tensor other) -> Tensor",
     "args": [["self", "tensor", {"dtype": "float32", "sizes": [4, 3], "strides": [3, 1]}],
              ["other", "tensor", {"wrapped": "int"}]]},
    {"op": "aten::sum.dim_IntList",
     "schema": "aten::sum.dim_IntList(Tensor self, int[1]? dim, bool keepdim=False, *, ScalarType? dtype=None) -> Tensor",
     "args": [["self", "tensor", {"dtype": "float32", "sizes": [4, 3], "strides": [3, 1]}], ["dim", "value", [1]],
              ["keepdim", "value", False], ["dtype", "value", None]]},
]


def test_compile_manifest_with_bad_lines(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    manifest = tmp_path / "m.jsonl"
    unknown = {"op": "aten::no_such_op.default", "schema": "aten::no_such_op(Tensor self) -> Tensor",
               "args": [["self", "tensor", {"dtype": "float32", "sizes": [2], "strides": [1]}]]}
    lines = [json.dumps({"op": SIGNATURES[0]["op"], "signature": SIGNATURES[0]}),
             '{"op": "aten::mul.Tensor", "signature": {"op": "aten::mul.Tensor", "args": [',  # cut short
             json.dumps({"op": SIGNATURES[1]["op"], "signature": SIGNATURES[1]}),
             json.dumps({"op": "aten::add.Tensor"}),  # no signature
             "",
             json.dumps(SIGNATURES[2]),  # a bare signature is accepted too
             json.dumps({"op": unknown["op"], "signature": unknown})]
    manifest.write_text("\n".join(lines) + "\n")
    local = tmp_path / "local"
    rc, s, err = _in_process(capsys, ["compile", str(manifest), "--tier", "reference", "--jobs", "1",
                                      "--local-dir", str(local), "--json", "--no-progress"])
    assert rc == 1
    assert [e["line"] for e in s["manifest_errors"]] == [2, 4]
    assert f"{manifest}:2: not a manifest line (invalid JSON" in err and f"{manifest}:4:" in err
    assert s["compiled"] == 3 and s["refused"] == 1 and s["failed"] == 0
    (refusal,) = s["failures"]
    assert refusal["line"] == 7 and refusal["op"] == unknown["op"] and "unknown op" in refusal["reason"]
    rc, rows, _ = _in_process(capsys, ["ls", "--local-dir", str(local), "--json"])
    # the refusal is cached too, so a strict job runs that op on the host instead of failing on a miss
    assert sorted(r["op"] for r in rows if not r["refused"]) == sorted(sig["op"] for sig in SIGNATURES)
    assert [r["op"] for r in rows if r["refused"]] == [unknown["op"]]


def test_usage_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["warm", "--local-dir", str(tmp_path)]) == 2
    assert "neuron-cache warm [options] -- python train.py" in capsys.readouterr().err
    # `python -m neuron_runtime.cli` is the same program (the one CLI start-up paid in a process here)
    r = _cli(["compile", str(tmp_path / "missing.jsonl")], _env())
    assert r.returncode == 2 and "TORCH_NEURONX_RECORD_FILE" in r.stderr
    assert main(["warm", "--local-dir", str(tmp_path), "--", str(tmp_path / "no-such-program")]) == 1
    assert "cannot start" in capsys.readouterr().err


def test_entries_the_fleet_store_did_not_take_are_failures(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A fleet write the runtime skips is only a warning there; for a warm-up it is a failure, named."""
    manifest = tmp_path / "m.jsonl"
    manifest.write_text("\n".join(json.dumps(s) for s in SIGNATURES[:2]) + "\n")
    not_a_dir = tmp_path / "fleet-is-a-file"
    not_a_dir.write_text("")
    monkeypatch.setenv("TORCH_NEURONX_FLEET_TIMEOUT", "0.2")  # short pauses between push attempts
    rc, s, _ = _in_process(capsys, ["compile", str(manifest), "--tier", "reference", "--jobs", "1", "--json",
                                    "--local-dir", str(tmp_path / "local"), "--to", str(not_a_dir), "--no-progress"])
    assert rc == 1 and s["failed"] == 2 and s["compiled"] == 0
    assert all("not in the fleet store" in f["reason"] for f in s["failures"])


def test_warm_records_and_compiles_torch_compile_graphs(tmp_path: Path, capfd: pytest.CaptureFixture[str],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCH_NEURONX_FLEET_TIMEOUT", "120")
    job = JOB.parent / "compile_small.py"
    local, fleet, manifest = tmp_path / "local", tmp_path / "fleet", tmp_path / "manifest.jsonl"
    rc = main(["warm", "--tier", "reference", "--jobs", "2", "--local-dir", str(local), "--to", str(fleet),
               "--manifest", str(manifest), "--json", "--", sys.executable, str(job)])
    out, err = capfd.readouterr()
    assert rc == 0, err
    summary = json.loads(out)
    assert summary["failed"] == 0 and summary["compiled"] == summary["signatures"]
    ops = [json.loads(line).get("signature", json.loads(line)).get("op", "") for line in
           manifest.read_text().splitlines()]
    assert sorted(o for o in ops if o.startswith("graph:")) == ["graph:backward", "graph:forward"], ops
    graphs = tmp_path / "graphs.json"
    r = subprocess.run([sys.executable, str(job)], capture_output=True, text=True, timeout=300, env=_env(
        TORCH_NEURONX_COMPILER="reference", TORCH_NEURONX_CACHE_MODE="strict", COMPILE_SMALL_OUT=str(graphs),
        TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR=str(tmp_path / "prod-local"), TORCH_NEURONX_NEFF_CACHE_DIR=str(fleet)))
    assert r.returncode == 0, r.stderr
    g = json.loads(graphs.read_text())
    assert g["compiles"] == 0 and g["graph_executions"] == 4 and g["graph_eager_runs"] == 0


def test_costliest_signatures_are_handed_out_first() -> None:
    """The compile queue starts with the signatures of most tensors (an optimizer's foreach ops, recorded
    last): started last, one of them would be a single worker's long tail."""
    import torch

    from neuron_runtime.cli._warm import compile_order, tensor_count
    from neuron_runtime.signatures import _ops, _signature

    xs = [torch.zeros(3), torch.zeros(2, 2), torch.zeros(5)]
    add = _signature.build(_ops.classify("aten::add.Tensor"), (xs[0], xs[0], 1))
    foreach = _signature.build(_ops.classify("aten::_foreach_add_.Scalar"), (xs, 1.0))
    arange = _signature.build(_ops.classify("aten::arange.start_step"), (0, 4, 1))
    assert (tensor_count(foreach), tensor_count(add), tensor_count(arange)) == (3, 2, 0)
    tasks = list(enumerate([arange, add, foreach, add]))
    assert [i for i, _ in compile_order(tasks)] == [2, 1, 3, 0]


def test_warm_and_the_compile_service_give_workers_the_same_environment(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # One rule (`worker_env`): a worker runs exactly the configuration, never records, writes no stats
    # and fetches no job manifest; one OpenMP thread unless neuron-cache's user set OMP_NUM_THREADS.
    from neuron_runtime import _config
    from neuron_runtime.cli._warm import compile_env
    from neuron_runtime.executables._background import service_address

    for var in [k for k in os.environ if k.startswith("TORCH_NEURONX_")] + ["OMP_NUM_THREADS"]:
        monkeypatch.delenv(var, raising=False)
    inherited = {"TORCH_NEURONX_COMPILER": "reference", "TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR": str(tmp_path),
                 "TORCH_NEURONX_RECORD_FILE": str(tmp_path / "r.jsonl"), "TORCH_NEURONX_JOB": "llama",
                 "TORCH_NEURONX_STATS_FILE": str(tmp_path / "s.json"), "TORCH_NEURONX_COMPILE_MODE": "background",
                 "TORCH_NEURONX_CACHE_SIGNING_KEY": "k" * 32}
    for k, v in inherited.items():
        monkeypatch.setenv(k, v)
    cfg = _config.load(dict(os.environ))
    service = service_address(cfg, {"tier": "reference"})[2]
    warm = compile_env(cfg, dict(os.environ))
    assert warm == service
    dropped = {"TORCH_NEURONX_RECORD_FILE", "TORCH_NEURONX_STATS_FILE", "TORCH_NEURONX_JOB"}
    assert {k: v for k, v in warm.items() if k.startswith("TORCH_NEURONX_")} == {
        **{k: v for k, v in _config.to_env(cfg).items() if k not in dropped}, "TORCH_NEURONX_COMPILE_MODE": "sync"}
    assert warm["OMP_NUM_THREADS"] == "1" and "TORCH_NEURONX_CACHE_SIGNING_KEY_HEX" in warm

    monkeypatch.setenv("OMP_NUM_THREADS", "4")  # docs/cli.md: the user's setting wins for neuron-cache...
    assert compile_env(cfg, dict(os.environ))["OMP_NUM_THREADS"] == "4"
    # ...while a training process's is its own compute's, not its compile service's workers'.
    assert service_address(cfg, {"tier": "reference"})[2]["OMP_NUM_THREADS"] == "1"

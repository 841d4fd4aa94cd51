"""Background compiles end to end, with real processes: training jobs, the host's compile service and its
workers. Reference tier (milliseconds per compile) with compiles slowed or broken on purpose by
`hooks/sitecustomize.py` inside the real worker processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

JOB = Path(__file__).resolve().parents[1] / "jobs" / "train_background.py"
HOOKS = Path(__file__).resolve().parent / "hooks"


def _tmpdir(tmp: Path) -> Path:
    """A TMPDIR of the test's own: its compile services (sockets under $TMPDIR/neuron-runtime-<uid>) are
    never another test's or another session's."""
    d = tmp / "tmp"
    d.mkdir(parents=True, exist_ok=True)
    return d


def job_env(tmp: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCH_NEURONX_", "NEURON_TEST_"))}
    env.update(TORCH_NEURONX_COMPILER="reference", TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR=str(tmp / "local"),
               TORCH_NEURONX_COMPILE_MODE="background", TORCH_NEURONX_COMPILE_IDLE_TIMEOUT="1",
               TORCH_NEURONX_COMPILE_WORKERS="1", TORCH_NEURONX_PREFETCH="0", TMPDIR=str(_tmpdir(tmp)),
               PYTHONPATH=os.pathsep.join([str(HOOKS), env.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    env.update(extra)
    return env


def start_job(tmp: Path, name: str, env: dict[str, str]) -> tuple[subprocess.Popen[str], Path]:
    out = tmp / f"{name}.json"
    proc = subprocess.Popen([sys.executable, str(JOB)], env=dict(env, JOB_OUT=str(out)), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    return proc, out


def finish(proc: subprocess.Popen[str], out: Path, timeout: float = 300) -> tuple[dict[str, Any], str]:
    _, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.read_text()), err


def run_job(tmp: Path, name: str, env: dict[str, str]) -> tuple[dict[str, Any], str]:
    return finish(*start_job(tmp, name, env))


def sync_losses(tmp: Path, steps: str) -> list[float]:
    r, _ = run_job(tmp, "sync", job_env(tmp / "sync", TORCH_NEURONX_COMPILE_MODE="sync", JOB_STEPS=steps))
    return r["losses"]


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False


def worker_pids(path: Path) -> set[int]:
    return {int(line.split()[0]) for line in path.read_text().splitlines()} if path.exists() else set()


def assert_all_gone(pids: set[int], within: float) -> None:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.2)
    assert not [p for p in pids if alive(p)], "service or worker processes outlived their idle timeout"


def test_first_steps_run_on_the_host_then_compiled(tmp_path: Path) -> None:
    pids = tmp_path / "workers.txt"
    r, err = run_job(tmp_path, "bg", job_env(tmp_path, JOB_STEPS="3", JOB_WAIT="120",
                                             NEURON_TEST_COMPILE_DELAY="*=0.05", NEURON_TEST_WORKER_PIDS=str(pids)))
    s = r["stats"]
    # The first step did not wait for any compile: its ops ran on the host while the service compiled.
    assert r["host_runs"][0] > 0 and s["compile_mode"] == "background"
    assert r["waited"] is True
    assert r["host_runs"][3:] == [0, 0, 0]  # after wait_for_compiles every op runs an executable
    bg = s["background"]
    assert s["compiles"] == bg["queued"] == bg["loaded"] > 10 and bg["pending"] == 0
    assert s["fallback_ops"] == [] and "Traceback" not in err
    # The host path and the executables agree (reference: the same aten kernels).
    assert r["losses"] == pytest.approx(sync_losses(tmp_path, "6"), rel=1e-6)
    # The service and its workers exit once idle (1 s here).
    assert r["service_pid"] and worker_pids(pids)
    assert_all_gone({r["service_pid"], *worker_pids(pids)}, within=30)


def test_four_processes_compile_each_key_once(tmp_path: Path) -> None:
    env = job_env(tmp_path, JOB_STEPS="2", JOB_WAIT="180", NEURON_TEST_COMPILE_DELAY="*=0.2",
                  TORCH_NEURONX_COMPILE_IDLE_TIMEOUT="3")
    jobs = [start_job(tmp_path, f"rank{i}", env) for i in range(4)]
    results = [finish(p, o)[0] for p, o in jobs]
    keys = set().union(*(r["keys"] for r in results))
    assert sum(r["stats"]["compiles"] for r in results) == len(keys) > 10
    for r in results:
        assert r["waited"] is True and r["host_runs"][0] > 0 and r["host_runs"][-1] == 0
        assert r["losses"] == results[0]["losses"]
    assert len({r["service_pid"] for r in results}) == 1  # one service for the host's four processes


def test_worker_killed_mid_compile_is_retried(tmp_path: Path) -> None:
    pids = tmp_path / "workers.txt"
    env = job_env(tmp_path, JOB_STEPS="3", JOB_WAIT="120", NEURON_TEST_COMPILE_DELAY="aten::addmm=5",
                  NEURON_TEST_WORKER_PIDS=str(pids))
    proc, out = start_job(tmp_path, "bg", env)
    deadline = time.monotonic() + 120
    victim = None
    while victim is None and time.monotonic() < deadline:
        for line in (pids.read_text().splitlines() if pids.exists() else []):
            pid, op = line.split()
            if op.startswith("aten::addmm"):
                victim = int(pid)
        time.sleep(0.05)
    assert victim is not None, "no worker ever compiled addmm"
    os.kill(victim, signal.SIGKILL)
    r, err = finish(proc, out)
    s = r["stats"]
    assert r["waited"] is True and "aten::addmm" not in s["fallback_ops"]
    assert r["host_runs"][3:] == [0, 0, 0]
    assert r["losses"] == pytest.approx(sync_losses(tmp_path, "6"), rel=1e-6)
    assert victim not in worker_pids(pids) - {victim} and len(worker_pids(pids)) >= 2  # a fresh worker retried


def test_hanging_worker_times_out_and_the_op_is_refused(tmp_path: Path) -> None:
    env = job_env(tmp_path, JOB_STEPS="3", JOB_WAIT="120", NEURON_TEST_COMPILE_DELAY="aten::addmm=hang",
                  TORCH_NEURONX_COMPILE_TIMEOUT="2")
    r, err = run_job(tmp_path, "bg", env)
    s = r["stats"]
    # Tried twice (2 s each), then refused like any refusal: the op runs on the host, one warning.
    assert r["waited"] is True and s["fallback_ops"] == ["aten::addmm"], err[-3000:]
    assert err.count("aten::addmm runs on the host") == 1 and "timed out after 2 s" in err
    assert s["background"]["refused"] >= 1
    assert r["losses"] == pytest.approx(sync_losses(tmp_path, "6"), rel=1e-6)


@pytest.mark.parametrize("how", ["exit", "exception", "sigterm"])
def test_job_ending_with_compiles_queued_leaves_no_process_and_whole_entries(tmp_path: Path, how: str) -> None:
    pids = tmp_path / "workers.txt"
    # Two steps: a key is asked for on its second call (TORCH_NEURONX_COMPILE_AFTER=2).
    env = job_env(tmp_path, JOB_STEPS="2", NEURON_TEST_COMPILE_DELAY="*=0.3", NEURON_TEST_WORKER_PIDS=str(pids))
    if how == "sigterm":
        env["JOB_SIGTERM_SELF"] = "1"
    elif how == "exception":
        env["JOB_RAISE"] = "1"
    proc, out = start_job(tmp_path, "bg", env)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == {"exit": 0, "exception": 1, "sigterm": -signal.SIGTERM}[how], err[-2000:]
    if how == "exception":
        assert "the job failed after its steps" in err
    r = json.loads(out.read_text())
    assert r["stats"]["background"]["pending"] > 0  # it left with compiles queued
    # The service finishes what was queued (it lands in the cache for the next run), then idles out.
    assert_all_gone({r["service_pid"]}, within=120)
    assert_all_gone(worker_pids(pids), within=10)
    v = subprocess.run([sys.executable, "-m", "neuron_runtime.cli", "verify", "--local-dir", str(tmp_path / "local"),
                        "--json"], env=job_env(tmp_path), capture_output=True, text=True, timeout=120)
    assert v.returncode == 0, v.stdout + v.stderr
    # Every entry is whole: the next (sync) run of the job finds them all and compiles nothing.
    again, _ = run_job(tmp_path, "again", job_env(tmp_path, TORCH_NEURONX_COMPILE_MODE="sync", JOB_STEPS="1"))
    assert again["stats"]["compiles"] == 0 and again["stats"]["hits"]["local"] > 10


def test_strict_mode_never_compiles_in_the_background(tmp_path: Path) -> None:
    env = job_env(tmp_path, TORCH_NEURONX_CACHE_MODE="strict", JOB_STEPS="1")
    proc, out = start_job(tmp_path, "strict", env)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode != 0 and "strict cache mode" in err and not out.exists()


def test_local_tier_that_keeps_nothing_still_serves_the_job(tmp_path: Path) -> None:
    # A local tier capped below one entry evicts every write at once (as a full disk keeps none): the
    # worker sends the entry in its answer, and the job verifies and loads it from there.
    env = job_env(tmp_path, JOB_STEPS="2", JOB_WAIT="120", TORCH_NEURONX_NEFF_CACHE_MAX_SIZE="1")
    r, err = run_job(tmp_path, "bg", env)
    s = r["stats"]
    assert r["waited"] is True and r["host_runs"][-1] == 0 and s["fallback_ops"] == []
    assert s["background"]["loaded"] == s["compiles"] > 10
    assert r["losses"] == pytest.approx(sync_losses(tmp_path, "4"), rel=1e-6)


def test_fusion_groups_compile_in_the_background_too(tmp_path: Path) -> None:
    # AdamW's foreach update is one fused group from its third flush on (once its ops are compiled); in
    # background mode the group runs op by op until its executable is in, then fused.
    fuse = {"TORCH_NEURONX_ENABLE_CONCATENATION": "1", "TORCH_NEURONX_FUSION_MIN_NUMEL": "0", "JOB_STEPS": "5"}
    r, _ = run_job(tmp_path, "bg", job_env(tmp_path, JOB_WAIT="120", JOB_ROUNDS="2", **fuse))
    s = r["stats"]
    assert r["waited"] is True and s["fusion"]["groups_fused"] >= 1 and s["fusion"]["fused_executions"] >= 3
    sync, _ = run_job(tmp_path, "sync", job_env(tmp_path / "sync", TORCH_NEURONX_COMPILE_MODE="sync",
                                                 **dict(fuse, JOB_STEPS="15")))
    assert r["losses"] == pytest.approx(sync["losses"], rel=1e-6)


def test_neuron_cache_service_lists_and_stops_the_service(tmp_path: Path) -> None:
    env = job_env(tmp_path, JOB_STEPS="2", NEURON_TEST_COMPILE_DELAY="*=1", TORCH_NEURONX_COMPILE_IDLE_TIMEOUT="60")
    r, _ = run_job(tmp_path, "bg", env)  # exits with ~25 compiles of 1 s queued
    pid = r["service_pid"]

    def cli(*args: str) -> dict[str, Any]:
        out = subprocess.run([sys.executable, "-m", "neuron_runtime.cli", "service", *args, "--json"], env=env,
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        return {s["pid"]: s for s in json.loads(out.stdout)["services"]}

    mine = cli("status")[pid]
    assert mine["queued"] + mine["running"] > 0 and mine["clients"] == 0 and mine["workers"] == 1
    assert cli("stop")[pid]["stopped"] is True
    assert not alive(pid)


def test_a_new_shape_of_a_compiled_class_runs_compiled_at_once(tmp_path: Path) -> None:
    # Background mode: the first shape runs on the host while its class compiles; a new batch size of
    # the same class then runs its executable on its very first call (no host run, no compile).
    code = """
import json, sys, torch, neuron_runtime
def run(n):
    x = torch.randn(n, 5)
    for _ in range(2):  # a key is compiled from its second request on
        torch.testing.assert_close((x.to("neuron") * 3).cpu(), x * 3)
run(4)
assert neuron_runtime.wait_for_compiles(120)
before = neuron_runtime.stats()
run(7)
after = neuron_runtime.stats()
print(json.dumps({"before": before, "after": after}))
"""
    p = subprocess.run([sys.executable, "-c", code], env=job_env(tmp_path), capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(p.stdout.strip().splitlines()[-1])
    before, after = r["before"], r["after"]
    assert before["compiles"] == 1 and before["host_runs"] >= 1
    assert after["compiles"] == 1 and after["host_runs"] == before["host_runs"]
    assert after["class_hits"] == before["class_hits"] + 1 and after["executions"] >= before["executions"] + 2

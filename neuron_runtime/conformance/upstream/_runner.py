"""Runs device-generic test files on `neuron` and on CPU in worker processes, surviving crashes and hangs.

1. Each (file, device, shard) is a task: `python -m pytest FILE` with our plugin (`_plugin.py`) and
   `PYTORCH_TESTING_DEVICE_ONLY_FOR` set to `privateuse1` (neuron) or `cpu`, `--jobs` tasks at a time.
2. The plugin appends a line per event to the task's results file; the parent reads it as it grows.
3. A test running past `timeout_s` is stopped inside the worker (pytest-timeout, signal method); if the
   worker does not answer within a grace period (a hang in C code), the parent kills it. A worker that dies
   (SIGSEGV, SIGKILL, os._exit) is restarted on the tests it had not run; the test it died in is recorded
   as `crashed` or `timeout`.
4. A file whose import fails collects nothing: it is reported as `import_error` with the message, never
   as passing.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

DEVICES = {"neuron": "privateuse1", "cpu": "cpu"}
MAX_RESTARTS = 40  # per task: a file where every test kills the worker stops being retried


@dataclass
class Task:
    path: Path
    device: str
    shard: str = ""  # "i/n"
    results: dict[str, dict[str, Any]] = field(default_factory=dict)
    collected: list[str] | None = None
    collect_errors: list[str] = field(default_factory=list)
    restarts: int = 0
    seconds: float = 0.0
    exit_codes: list[int] = field(default_factory=list)
    stderr_tail: str = ""


def _env(device: str, cache_dir: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTORCH_TESTING_DEVICE_ONLY_FOR"] = DEVICES[device]
    # The CPU baseline is PyTorch alone: with the runtime loaded, its process-wide switches (the swap of
    # module parameters on conversion) would change what CPU does and hide what they break.
    env["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0" if device == "cpu" else "1"
    # The plugin loads as a top-level module from its own directory, so importing it imports no runtime.
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parent), *filter(None, [env.get("PYTHONPATH")])])
    env.setdefault("TORCH_NEURONX_COMPILER", "reference")
    env["TORCH_NEURONX_FALLBACK"] = "1"
    env["TORCH_NEURONX_COMPILE_MODE"] = "sync"
    env["TORCH_NEURONX_PREFETCH"] = "0"
    env["TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR"] = cache_dir
    env.setdefault("OMP_NUM_THREADS", "1")
    env.pop("TORCH_NEURONX_CACHE_MODE", None)
    env.pop("TORCH_NEURONX_NEFF_CACHE_DIR", None)
    # PyTorch's test utilities: no network (disabled/slow test lists come from files only when asked for),
    # no per-test subprocess re-runs, no XML reports.
    env.pop("CI", None)
    env["PYTORCH_TEST_SKIP_FAST"] = env.get("PYTORCH_TEST_SKIP_FAST", "0")
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def _command(task: Task, results: Path, skip_file: Path, ini: Path, dtypes: list[str], timeout_s: float) -> list[str]:
    cmd = [sys.executable, "-m", "pytest", str(task.path), "-c", str(ini), "-q", "-p", "no:cacheprovider",
           "-p", "_plugin", "--neuron-results", str(results),
           "--neuron-dtypes", ",".join(dtypes), "--neuron-skip-file", str(skip_file),
           "--timeout", str(timeout_s), "--timeout-method", "signal"]
    if task.shard:
        cmd += ["--neuron-shard", task.shard]
    return cmd


def run(tasks: list[Task], jobs: int, dtypes: list[str], timeout_s: float, progress: TextIO,
        budget_s: float | None = None, grace_s: float = 30.0) -> float:
    """Run every task to the end (or the budget); fills each task's results. Returns the wall seconds.
    A test still running `grace_s` after its timeout (the worker could not stop it) kills the worker."""
    t0 = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="neuron-upstream-"))
    ini = work / "pytest.ini"
    ini.write_text("[pytest]\naddopts =\n")
    cache_dir = str(work / "cache")
    todo = list(tasks)
    live: dict[int, tuple[Task, subprocess.Popen[bytes], Path, Path, float]] = {}
    n = 0

    def launch(task: Task) -> None:
        nonlocal n
        n += 1
        results, skip, err = work / f"t{n}.jsonl", work / f"t{n}.skip", work / f"t{n}.err"
        skip.write_text("\n".join(task.results) + "\n")
        with open(err, "wb") as ef:
            p = subprocess.Popen(_command(task, results, skip, ini, dtypes, timeout_s), env=_env(task.device, cache_dir),
                                 cwd=task.path.parent, stdout=subprocess.DEVNULL, stderr=ef, start_new_session=True)
        live[n] = (task, p, results, err, time.monotonic())

    stopped: list[int] = []
    old = {s: signal.signal(s, lambda signum, frame: stopped.append(signum)) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        while todo or live:
            while todo and len(live) < max(1, jobs) and not stopped:
                launch(todo.pop(0))
            time.sleep(0.2)
            over_budget = budget_s is not None and time.monotonic() - t0 > budget_s
            for i in list(live):
                task, p, results, err, started = live[i]
                running, since = _read(task, results)
                hung = running is not None and since is not None and time.time() - since > timeout_s + grace_s
                if p.poll() is None and not hung and not over_budget and not stopped:
                    continue
                if p.poll() is None:
                    _kill(p)
                del live[i]
                task.seconds += time.monotonic() - started
                task.exit_codes.append(p.returncode)
                task.stderr_tail = err.read_text(errors="replace")[-3000:]
                running, _ = _read(task, results)
                if over_budget or stopped:
                    continue
                if running is not None:  # it died in (or hung in) this test: record it, run the rest
                    what = "timeout" if hung else "crashed"
                    why = (f"ran past {timeout_s:g} s and the worker did not stop it; killed" if hung else
                           f"the worker process died (exit {p.returncode}): "
                           f"{_tail_line(task.stderr_tail)}")
                    task.results[running] = {"outcome": what, "seconds": 0.0, "message": why}
                    progress.write(f"  {task.path.name} [{task.device}] {running}: {what}\n")
                    progress.flush()
                pending = [k for k in (task.collected or []) if k not in task.results]
                if pending and task.restarts < MAX_RESTARTS:
                    task.restarts += 1
                    todo.insert(0, task)
                elif task.collected is None and not task.collect_errors:
                    task.collect_errors.append(f"the worker exited {p.returncode} before collecting: "
                                               f"{_tail_line(task.stderr_tail)}")
                done = sum(1 for r in task.results.values() if r["outcome"] == "passed")
                if not pending or task.restarts >= MAX_RESTARTS:
                    broken = task.collect_errors and not task.results
                    progress.write(f"{task.path.name} [{task.device}{' ' + task.shard if task.shard else ''}]: "
                                   f"{len(task.results)} tests, {done} passed, {task.seconds:.0f} s"
                                   f"{' - IMPORT ERROR: ' + task.collect_errors[0][:200] if broken else ''}\n")
                    progress.flush()
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        for task, p, *_ in live.values():
            _kill(p)
    return time.monotonic() - t0


def _kill(p: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(p.pid, signal.SIGKILL)  # the worker and anything it started
    except (ProcessLookupError, PermissionError):
        p.kill()
    p.wait()


_offsets: dict[Path, tuple[str | None, int]] = {}


def _read(task: Task, path: Path) -> tuple[str | None, float | None]:
    """Fold the results file into `task`; returns the test running now (started, not finished) and when
    it started (by the file's modification time)."""
    if not path.exists():
        return None, None
    running, pos = _offsets.get(path, (None, 0))
    with open(path, "rb") as f:
        f.seek(pos)
        chunk = f.read()
    # Only whole lines; a partial last line is read again next time.
    cut = chunk.rfind(b"\n") + 1
    _offsets[path] = (running, pos + cut)
    for line in chunk[:cut].decode(errors="replace").splitlines():
        try:
            d = json.loads(line)
        except json.JSONDecodeError:
            continue  # cut short by a crash
        if "collected" in d:
            if task.collected is None:
                task.collected = d["collected"]
        elif "collect_error" in d:
            if d["collect_error"] not in task.collect_errors:
                task.collect_errors.append(d["collect_error"])
        elif "start" in d:
            running = d["start"]
        elif "test" in d:
            k = d.pop("test")
            task.results[k] = d
            if running == k:
                running = None
    _offsets[path] = (running, _offsets[path][1])
    return running, (path.stat().st_mtime if running is not None else None)


def _tail_line(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1][:300] if lines else "no output"

"""The compile service's worker processes (`WorkerPool`), also `neuron-cache warm/compile`'s.

Standard library only, like `_server.py`, which imports it by path as well as by package: the workers
(`_worker.py`) are the only processes that import torch. Each slot thread owns one worker at a time and
speaks JSON lines to it over pipes; what a death, a timeout or a worker that cannot start costs is the
class docstring's contract.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from typing import IO, Any

log = logging.getLogger("neuron_runtime.executables._service")

START_TIMEOUT_S = 300.0  # a worker that is not ready by then is killed (and counts as dead on arrival)
BACKOFF_S = (0.5, 60.0)  # after a worker fails to start: the first pause, the longest (doubling between)
KILLS_TO_REFUSE = 2      # a key whose compile killed this many workers is refused (the others go on)
MAX_REFUSED_KEYS = 4096  # such keys remembered (oldest forgotten first)
GATHER_S = 0.02  # how long a slot waits for more tasks before it sends a batch (see `_slot`)


class WorkerPool:
    """N worker processes, each fed one task (or one batch of tasks) at a time by a slot thread; answers
    are JSON lines.

    `next_task()` blocks until there is a task `(task_id, payload)` for a slot, or returns None when the
    pool closes; each task is sent as `{"i": task_id, **payload}`. With `batch` > 1, the slot then takes
    up to `batch - 1` more tasks that are waiting after `GATHER_S` (`more_tasks(limit)`, never blocking) and sends
    them together, `{"batch": [task, ...]}`: the worker compiles them in one C++ translation unit.
    `on_event(kind, task_id, answer)` is called from the slot threads with kind "started" (a worker took
    the task) and "done" (its answer, or a "failed" answer saying why). A worker that dies or runs past
    `timeout` (per task of its batch) is killed with its process group (the C++ compiler's processes too)
    and replaced; every task of its batch it had not answered is tried again, one at a time (so a
    signature that kills workers costs only itself), up to `retries` times, then reported failed with the
    reason and the tail of the worker's log. A key whose compiles, run alone, killed `KILLS_TO_REFUSE`
    workers is answered "failed" at once from then on (it alone: a signature that crashes the compiler,
    or needs more memory than the host has). A worker that dies before it is ready means workers cannot
    start right now (a broken environment, no memory): the pool backs off (`BACKOFF_S`, doubling) before
    it starts another, answers tasks meanwhile "failed" with `retry_after` (their clients ask again
    later), and is back to normal with the next worker that starts. Nothing here is permanent."""

    def __init__(self, n: int, argv: list[str], env: dict[str, str], timeout: float | None,
                 next_task: Callable[[], tuple[Any, dict[str, Any]] | None],
                 on_event: Callable[[str, Any, dict[str, Any]], None], retries: int = 0, batch: int = 1,
                 more_tasks: Callable[[int], list[tuple[Any, dict[str, Any]]]] | None = None) -> None:
        self.n = n
        self.batch = max(1, batch)
        self.more_tasks = more_tasks
        self.argv = argv
        self.env = env
        self.timeout = timeout
        self.next_task = next_task
        self.on_event = on_event
        self.retries = retries
        self.lock = threading.Lock()
        self.procs: set[subprocess.Popen[str]] = set()
        self.started = 0
        self.ready = 0  # workers that said they are ready (imports and warm-up done)
        self.busy = 0
        self.closing = False
        self.down_until = 0.0          # no worker is started before this (monotonic time)
        self.down_why = ""
        self.start_failures = 0        # workers in a row that died before they were ready
        self.kills: dict[Any, int] = {}           # key -> workers its compiles killed
        self.refused: dict[Any, str] = {}         # key -> why it is refused at once (bounded)
        self.logs = tempfile.mkdtemp(prefix="neuron-compile-workers-")
        self.threads = [threading.Thread(target=self._slot, args=(s,), name=f"neuron-compile-slot-{s}",
                                         daemon=True) for s in range(n)]
        for t in self.threads:
            t.start()

    # -- one slot ----------------------------------------------------------------------------------
    def _start(self, slot: int) -> tuple[subprocess.Popen[str], IO[str]] | None:
        """A new worker, once it said it is ready (imports take seconds; they count against no task's
        timeout); None if it died (or timed out) before that, after starting the back-off."""
        with self.lock:
            self.started += 1
            n = self.started
        log_file = open(os.path.join(self.logs, f"worker-{slot}-{n}.log"), "w+", encoding="utf-8")  # noqa: SIM115
        # Its own process group: a timeout kills the C++ compiler under it too.
        proc = subprocess.Popen(self.argv, env=self.env, text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=log_file, bufsize=1, start_new_session=True)
        with self.lock:
            self.procs.add(proc)
        assert proc.stdout is not None
        timer = threading.Timer(START_TIMEOUT_S, self._kill, args=(proc,))
        timer.start()
        try:
            ready = proc.stdout.readline()  # {"ready": pid}, or "" if it died
        except (OSError, ValueError):
            ready = ""
        finally:
            timer.cancel()
        if '"ready"' in ready:
            with self.lock:
                self.ready += 1
                self.start_failures = 0
                self.down_until = 0.0
            return proc, log_file
        self._kill(proc)
        rc = proc.wait()
        tail = self._tail(log_file)
        log_file.close()
        with self.lock:
            self.procs.discard(proc)
            self.start_failures += 1
            pause = min(BACKOFF_S[1], BACKOFF_S[0] * 2 ** (self.start_failures - 1))
            self.down_until = time.monotonic() + pause
            self.down_why = f"compile workers cannot start (exit status {rc}{'; worker log: ' + tail if tail else ''})"
        log.warning("%s; starting another in %.1f s", self.down_why, pause)
        return None

    def _refuse(self, key: Any, why: str) -> None:
        with self.lock:
            self.refused[key] = why
            while len(self.refused) > MAX_REFUSED_KEYS:
                self.refused.pop(next(iter(self.refused)))
            self.kills.pop(key, None)

    @staticmethod
    def _tail(log_file: IO[str], n: int = 5) -> str:
        log_file.flush()
        log_file.seek(0)
        lines = [ln for ln in log_file.read().splitlines() if ln.strip()]
        return " | ".join(lines[-n:])

    def _kill(self, proc: subprocess.Popen[str]) -> None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            proc.kill()

    def _ask(self, proc: subprocess.Popen[str], tasks: dict[Any, dict[str, Any]],
             answered: Callable[[Any, dict[str, Any]], None]) -> tuple[bool, bool]:
        """Send `tasks` (one line: a task, or a batch) and hand each answer to `answered` as it comes.
        Returns (every task answered, killed for time); False when the worker died first."""
        assert proc.stdin is not None and proc.stdout is not None
        timed_out = threading.Event()

        def kill() -> None:
            timed_out.set()
            self._kill(proc)

        timer = threading.Timer(self.timeout * len(tasks), kill) if self.timeout else None
        waiting = set(tasks)
        try:
            items = [{"i": i, **p} for i, p in tasks.items()]
            proc.stdin.write(json.dumps(items[0] if len(items) == 1 else {"batch": items}) + "\n")
            proc.stdin.flush()
            if timer is not None:
                timer.start()
            while waiting:
                line = proc.stdout.readline()
                if not line:
                    return False, timed_out.is_set()
                try:
                    answer = json.loads(line)
                except ValueError:
                    continue
                if isinstance(answer, dict) and answer.get("i") in waiting:
                    waiting.discard(answer["i"])
                    answered(answer["i"], answer)
            return True, timed_out.is_set()
        except (OSError, ValueError):
            return False, timed_out.is_set()
        finally:
            if timer is not None:
                timer.cancel()

    def _slot(self, slot: int) -> None:
        state = _SlotState()
        try:
            # The worker starts before the slot takes a task: its imports and warm-up (seconds) overlap
            # the first requests, and the tasks that queue up meanwhile go out as one batch.
            if not self.closing and self.down_until <= time.monotonic():
                started = self._start(slot)
                if started is not None:
                    state.proc, state.log_file = started
            while True:
                task = self.next_task()
                if task is None:
                    break
                tasks = [task]
                if self.batch > 1 and self.more_tasks is not None:
                    # The misses of one step arrive milliseconds apart: a moment's wait lets them go out
                    # as one batch rather than a first batch of one (a compiler run each, ~0.5 s).
                    time.sleep(GATHER_S)
                    tasks += self.more_tasks(self.batch - 1)
                run = []
                for task_id, payload in tasks:
                    refused = self.refused.get(task_id)
                    if refused is not None:
                        self.on_event("done", task_id, {"i": task_id, "status": "failed", "reason": refused})
                    else:
                        run.append((task_id, payload))
                if not run:
                    continue
                with self.lock:
                    self.busy += len(run)
                for task_id, _ in run:
                    self.on_event("started", task_id, {"i": task_id})
                try:
                    self._run_tasks(slot, state, dict(run))
                finally:
                    with self.lock:
                        self.busy -= len(run)
        finally:
            if state.proc is not None:
                self._stop(state.proc)
            if state.log_file is not None:
                state.log_file.close()

    def _run_tasks(self, slot: int, state: _SlotState, pending: dict[Any, dict[str, Any]]) -> None:
        """Answer every task of `pending` (see the class docstring: retries one at a time after a death)."""
        attempts = dict.fromkeys(pending, 0)
        t0 = time.monotonic()

        def answered(task_id: Any, answer: dict[str, Any]) -> None:
            pending.pop(task_id, None)
            if answer.get("status") != "failed":
                with self.lock:
                    self.kills.pop(task_id, None)
            self.on_event("done", task_id, answer)

        solo = False
        while pending:
            if state.proc is None:
                wait = self.down_until - time.monotonic()
                if wait > 0:  # backing off: the clients ask again later
                    for task_id in list(pending):
                        del pending[task_id]
                        self.on_event("done", task_id, {"i": task_id, "status": "failed", "reason": self.down_why,
                                                        "retry_after": round(wait, 1)})
                    return
                started = self._start(slot)
                if started is None:
                    continue  # now backing off: answered just above
                state.proc, state.log_file = started
            assert state.log_file is not None
            send = dict([next(iter(pending.items()))]) if solo else dict(pending)
            ok, timed_out = self._ask(state.proc, send, answered)
            if ok:
                continue
            rc = state.proc.wait()
            why = (f"timed out after {self.timeout:g} s (worker killed)" if timed_out
                   else f"compile worker died with status {rc}")
            tail = self._tail(state.log_file)
            why = f"{why}; worker log: {tail}" if tail else why
            state.log_file.close()
            with self.lock:
                self.procs.discard(state.proc)
            state.proc, state.log_file = None, None  # a fresh worker for the retry or the next task
            left = [i for i in send if i in pending]
            for task_id in left:
                attempts[task_id] += 1
                kills = 0
                if len(left) == 1 and not timed_out:  # it alone was running: the death is its own
                    with self.lock:
                        kills = self.kills[task_id] = self.kills.get(task_id, 0) + 1
                        while len(self.kills) > MAX_REFUSED_KEYS:
                            self.kills.pop(next(iter(self.kills)))
                reason = why
                if kills >= KILLS_TO_REFUSE:
                    reason = f"its compile killed {kills} compile workers; refused ({why})"
                    self._refuse(task_id, reason)
                if attempts[task_id] > self.retries or kills >= KILLS_TO_REFUSE or self.closing:
                    tried = f" (tried {attempts[task_id]} times)" if attempts[task_id] > 1 else ""
                    del pending[task_id]
                    self.on_event("done", task_id, {"i": task_id, "status": "failed", "reason": reason + tried,
                                                    "seconds": round(time.monotonic() - t0, 3)})
            solo = True  # what is left is retried one signature at a time

    def _stop(self, proc: subprocess.Popen[str], grace: float = 60.0) -> None:
        """EOF on its stdin ends a worker between tasks; one still busy after `grace` is killed."""
        try:
            assert proc.stdin is not None
            proc.stdin.close()
        except OSError:
            pass
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            self._kill(proc)
            proc.wait()
        with self.lock:
            self.procs.discard(proc)

    def close(self, grace: float = 60.0) -> None:
        """Stop taking tasks; let running ones finish for up to `grace` s, then kill what is left.
        (`next_task` must return None from now on for the slots to end.)"""
        self.closing = True
        deadline = time.monotonic() + grace
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))
        with self.lock:
            left = list(self.procs)
        for p in left:
            self._kill(p)
            p.wait()
        for t in self.threads:
            t.join(5)
        shutil.rmtree(self.logs, ignore_errors=True)


class _SlotState:
    """A slot's current worker process and its log."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen[str] | None = None
        self.log_file: IO[str] | None = None

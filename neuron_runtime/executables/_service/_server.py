"""The host's compile service: one process per host and configuration, shared by every job on it.

Standard library only, and started by path (`python .../_server.py`), so the service itself never
imports torch: it queues, de-duplicates and hands signatures to worker processes (`_worker.py`), which
do the compiling. Protocol and lifecycle: see `neuron_runtime.executables._service`.

    clients (training processes) ──JSON lines over a Unix socket──▶ Server
         ▲                                                           │ one job per key, a bounded queue
         └──────── {"op": "started" | "done", "key": ...} ◀──────────┤ (needed-now before prefetch)
                                                                     ▼
                                                   WorkerPool: N `_worker.py` processes (JSON lines)
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
import logging
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import IO, Any

try:
    from ._client import ServiceDir
except ImportError:  # started by path (`python .../_server.py`): its directory is sys.path[0]
    from _client import ServiceDir  # type: ignore[no-redef]

log = logging.getLogger("neuron_runtime.executables._service")

PROTOCOL = 1

#: The longest line a client may send (a compile request is a few kB): a client that sends more without a
#: newline is told so and disconnected, instead of growing the service's memory without bound.
MAX_LINE = 1 << 22
MAX_CLIENTS = 256       # connections at once (each has a reader thread); more are told so and closed
MAX_CANDIDATES = 8      # signatures in one compile request (a shape class or two, then the exact one)
SEND_TIMEOUT_S = 30.0   # a client that reads nothing for this long while we answer it is disconnected
KEY_CHARS = frozenset("0123456789abcdef")

START_TIMEOUT_S = 300.0  # a worker that is not ready by then is killed (and counts as dead on arrival)
BACKOFF_S = (0.5, 60.0)  # after a worker fails to start: the first pause, the longest (doubling between)
KILLS_TO_REFUSE = 2      # a key whose compile killed this many workers is refused (the others go on)
MAX_REFUSED_KEYS = 4096  # such keys remembered (oldest forgotten first)

#: What a worker's answer may say (see `_worker.py`); everything else is reported as "failed".
STATUSES = ("compiled", "present", "refused", "failed")


# --------------------------------------------------------------------------------------------------
# Worker processes
# --------------------------------------------------------------------------------------------------
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


# --------------------------------------------------------------------------------------------------
# The service
# --------------------------------------------------------------------------------------------------
class _Job:
    __slots__ = ("key", "origin", "payload", "priority", "state", "waiters")

    def __init__(self, key: str, payload: dict[str, Any], priority: int, origin: _Conn) -> None:
        self.key = key
        self.payload = payload
        self.priority = priority
        self.waiters: set[_Conn] = set()
        self.state = "queued"  # queued | running
        self.origin = origin  # the client that asked first: the compile counts in its stats


class _Conn:
    """One client connection: a reader thread; writes from any thread under a lock."""

    def __init__(self, server: Server, sock: socket.socket) -> None:
        self.server = server
        self.sock = sock
        self.wlock = threading.Lock()
        self.alive = True
        self.pid: int | None = None

    def send(self, msg: dict[str, Any]) -> None:
        """Write one answer; a client that does not read it within SEND_TIMEOUT_S (the socket's send
        timeout) is disconnected, so it can never hold a worker slot that answers it."""
        if not self.alive:
            return
        data = (json.dumps(msg) + "\n").encode()
        try:
            with self.wlock:
                self.sock.sendall(data)
        except OSError as e:
            log.warning("compile service: a client that does not read its answers (%s) is disconnected", e)
            self.alive = False
            try:
                self.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def serve(self) -> None:
        buf = b""
        try:
            while True:
                chunk = self.sock.recv(1 << 16)
                if not chunk:
                    break
                buf += chunk
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    if not line.strip():
                        continue
                    try:
                        self.server.handle(self, line)
                    except Exception as e:  # noqa: BLE001 - a bug here costs this line, never the service
                        log.exception("compile service: a request failed: %r", line[:200])
                        self.send({"op": "error", "reason": f"internal error: {type(e).__name__}"})
                if len(buf) > MAX_LINE:
                    self.send({"op": "error", "reason": f"line longer than {MAX_LINE} bytes: disconnected"})
                    break
        except OSError:
            pass
        finally:
            self.alive = False
            self.server.disconnected(self)
            try:
                self.sock.close()
            except OSError:
                pass


class Server:
    """Jobs by key (one compile however many clients ask), needed-now before prefetched, FIFO within.

    A client that disconnects leaves its jobs queued: what started is finished and lands in the cache
    for the next run. The service exits when it has had no client and no job for `idle_timeout`
    seconds, or on SIGTERM/SIGINT (running compiles get `grace` seconds, queued ones are dropped)."""

    def __init__(self, socket_path: str, workers: int, worker_argv: list[str], env: dict[str, str],
                 timeout: float | None, idle_timeout: float, max_queue: int, grace: float = 30.0,
                 batch: int = 1) -> None:
        # The socket's directory is checked as the client checks it (a private directory of this user's,
        # no link followed), and the socket is bound and removed through that open directory.
        self.dir = ServiceDir(os.path.dirname(os.path.abspath(socket_path)), create=False)
        self.name = os.path.basename(socket_path)
        self.socket_path = socket_path
        self.idle_timeout = idle_timeout
        self.max_queue = max_queue
        self.grace = grace
        self.cv = threading.Condition()
        self.jobs: dict[str, _Job] = {}
        self.heap: list[tuple[int, int, str]] = []
        self.seq = itertools.count()
        self.conns: set[_Conn] = set()
        self.results: dict[str, dict[str, Any]] = {}  # recent answers, for a client asking again
        self.stopping = False
        self.last_busy = time.monotonic()
        self.counts = {"jobs": 0, "compiled": 0, "present": 0, "refused": 0, "failed": 0, "rejected": 0}
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.pool = WorkerPool(workers, worker_argv, env, timeout, self._next_task, self._on_event, retries=1,
                               batch=batch, more_tasks=self._more_tasks)

    # -- queue ---------------------------------------------------------------------------------------
    def _next_task(self) -> tuple[Any, dict[str, Any]] | None:
        with self.cv:
            while True:
                if self.stopping:
                    return None
                while self.heap:
                    prio, _, key = heapq.heappop(self.heap)
                    job = self.jobs.get(key)
                    if job is None or job.state != "queued" or job.priority != prio:
                        continue  # a stale heap entry (the job was bumped, or is done)
                    job.state = "running"
                    return key, job.payload
                self.cv.wait()

    def _more_tasks(self, limit: int) -> list[tuple[Any, dict[str, Any]]]:
        """Up to `limit` queued jobs, in queue order, without waiting (a worker's batch beyond its first)."""
        out: list[tuple[Any, dict[str, Any]]] = []
        with self.cv:
            # Share what is queued among the workers rather than let the first take a whole batch.
            queued = sum(j.state == "queued" for j in self.jobs.values())
            limit = min(limit, -(-queued // self.pool.n))
            while self.heap and len(out) < limit and not self.stopping:
                prio, _, key = heapq.heappop(self.heap)
                job = self.jobs.get(key)
                if job is None or job.state != "queued" or job.priority != prio:
                    continue
                job.state = "running"
                out.append((key, job.payload))
        return out

    def _on_event(self, kind: str, key: Any, answer: dict[str, Any]) -> None:
        with self.cv:
            job = self.jobs.get(key)
            if job is None:
                return
            waiters = list(job.waiters)
            origin = job.origin
            if kind == "done":
                del self.jobs[key]
                status = answer.get("status")
                if status not in STATUSES:
                    answer = {"status": "failed", "reason": f"unexpected worker answer {answer!r}"[:500]}
                    status = "failed"
                self.counts[str(status)] += 1
                self.results[key] = answer
                if len(self.results) > 10000:
                    self.results.pop(next(iter(self.results)))
                self.last_busy = time.monotonic()
                self.cv.notify_all()
        msg = {k: v for k, v in answer.items() if k != "i"}
        msg.update(op=kind, key=key)
        for c in waiters:
            c.send(dict(msg, caused=c is origin) if kind == "done" else msg)

    # -- clients -------------------------------------------------------------------------------------
    def handle(self, conn: _Conn, line: bytes) -> None:
        try:
            msg = json.loads(line)
            op = msg["op"] if isinstance(msg, dict) else None
        except (ValueError, KeyError, TypeError, RecursionError):
            op = None
        if not isinstance(op, str):
            conn.send({"op": "error", "reason": "not a JSON object with an 'op'"})
            return
        if op == "hello":
            pid = msg.get("pid")
            conn.pid = pid if isinstance(pid, int) and not isinstance(pid, bool) else None
            conn.send({"op": "hello", "protocol": PROTOCOL, "pid": os.getpid(), "workers": self.pool.n})
        elif op == "compile":
            self._compile(conn, msg)
        elif op == "status":
            with self.cv:
                state = {"op": "status", "queued": sum(j.state == "queued" for j in self.jobs.values()),
                         "running": sum(j.state == "running" for j in self.jobs.values()),
                         "clients": len(self.conns), "workers": self.pool.n, "ready": self.pool.ready,
                         "counts": dict(self.counts)}
            conn.send(state)
        else:
            conn.send({"op": "error", "reason": f"unknown op {op[:64]!r}"})

    @staticmethod
    def check_compile(msg: dict[str, Any]) -> tuple[str, dict[str, Any], int]:
        """(key, payload for the worker, priority) of a compile request, or ValueError saying what is wrong.
        The worker gets only what it needs, rebuilt here: `signatures` (1 to MAX_CANDIDATES objects) and
        `key`; nothing else a client sent reaches it."""
        key, payload = msg.get("key"), msg.get("payload")
        if not (isinstance(key, str) and len(key) == 64 and set(key) <= KEY_CHARS):
            raise ValueError("compile needs a 'key' of 64 lowercase hex characters")
        if not isinstance(payload, dict):
            raise ValueError("compile needs a 'payload' object")
        sigs = payload.get("signatures")
        if not (isinstance(sigs, list) and 0 < len(sigs) <= MAX_CANDIDATES
                and all(isinstance(s, dict) and isinstance(s.get("op"), str) for s in sigs)):
            raise ValueError(f"a compile payload needs 'signatures': 1 to {MAX_CANDIDATES} objects with an 'op'")
        if payload.get("key", key) != key:
            raise ValueError("the payload's 'key' is not the request's")
        priority = msg.get("priority", 0)
        return key, {"signatures": sigs, "key": key}, 0 if priority == 0 or isinstance(priority, bool) else 1

    def _compile(self, conn: _Conn, msg: dict[str, Any]) -> None:
        try:
            key, payload, priority = self.check_compile(msg)
        except ValueError as e:
            conn.send({"op": "error", "reason": str(e)})
            return
        with self.cv:
            job = self.jobs.get(key)
            if job is None:
                if len(self.jobs) >= self.max_queue:
                    self.counts["rejected"] += 1
                    reply: dict[str, Any] | None = {"op": "done", "key": key, "status": "busy",
                                                    "reason": f"compile queue full ({self.max_queue} jobs)"}
                else:
                    job = self.jobs[key] = _Job(key, payload, priority, conn)
                    self.counts["jobs"] += 1
                    heapq.heappush(self.heap, (priority, next(self.seq), key))
                    self.cv.notify_all()
                    reply = None
            else:
                reply = {"op": "started", "key": key} if job.state == "running" else None
                if priority < job.priority and job.state == "queued":
                    job.priority = priority  # a prefetched key is needed now: ahead of the queue
                    heapq.heappush(self.heap, (priority, next(self.seq), key))
            if job is not None:
                job.waiters.add(conn)
        if reply is not None:
            conn.send(reply)

    def disconnected(self, conn: _Conn) -> None:
        with self.cv:
            self.conns.discard(conn)
            for job in self.jobs.values():
                job.waiters.discard(conn)
            self.last_busy = time.monotonic()
            self.cv.notify_all()

    # -- lifecycle -----------------------------------------------------------------------------------
    def _accept(self) -> None:
        while not self.stopping:
            try:
                sock, _ = self.sock.accept()
            except OSError:
                break
            conn = _Conn(self, sock)
            sec = int(SEND_TIMEOUT_S)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", sec, 0))
            with self.cv:
                if self.stopping:
                    sock.close()
                    break
                if len(self.conns) >= MAX_CLIENTS:
                    conn.send({"op": "error", "reason": f"too many clients ({MAX_CLIENTS}); try again later"})
                    sock.close()
                    continue
                self.conns.add(conn)
                self.last_busy = time.monotonic()
            threading.Thread(target=conn.serve, name="neuron-compile-conn", daemon=True).start()

    def _unlink(self) -> None:
        try:
            os.unlink(self.name, dir_fd=self.dir.fd)
        except FileNotFoundError:
            pass

    def stop(self, *_: Any) -> None:
        with self.cv:
            self.stopping = True
            self.cv.notify_all()

    def serve(self) -> int:
        """Bind, serve until idle or signalled, drain. The socket path is removed on the way out."""
        self._unlink()
        old = os.umask(0o177)  # the socket is created 0o600: no window in which it is more open
        try:
            self.sock.bind(self.dir.at(self.name))
        finally:
            os.umask(old)
        self.sock.listen(64)
        threading.Thread(target=self._accept, name="neuron-compile-accept", daemon=True).start()
        log.info("compile service %d on %s with %d worker(s)", os.getpid(), self.socket_path, self.pool.n)
        with self.cv:
            while not self.stopping:
                idle = not self.conns and not self.jobs
                if idle and time.monotonic() - self.last_busy >= self.idle_timeout:
                    log.info("compile service idle for %.0f s: exiting", self.idle_timeout)
                    self.stopping = True
                    break
                self.cv.wait(0.25 if idle else 1.0)
            self.cv.notify_all()
        # Stop accepting first (a client connecting now starts a new service), then drain.
        self._unlink()
        self.sock.close()
        self.pool.close(self.grace)
        with self.cv:
            conns = list(self.conns)
        for c in conns:
            try:
                c.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        log.info("compile service %d done: %s", os.getpid(), self.counts)
        return 0


def _build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="neuron-compile-service", description="The host's compile service "
                                "(started on demand by the runtime; see neuron_runtime.executables._service).")
    p.add_argument("--socket", required=True, help="Unix socket path to serve on")
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--timeout", type=float, default=None, help="seconds one compile may take")
    p.add_argument("--idle-timeout", type=float, default=300.0)
    p.add_argument("--max-queue", type=int, default=4096)
    p.add_argument("--batch", type=int, default=1, help="signatures a worker compiles together at most")
    p.add_argument("--nice", type=int, default=10, help="niceness of the worker processes")
    p.add_argument("--python", default=sys.executable)
    return p


def main(argv: list[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    logging.basicConfig(level=os.environ.get("TORCH_NEURONX_LOG_LEVEL", "WARNING").upper(),
                        format="%(asctime)s neuron-compile-service %(levelname)s: %(message)s")
    env = dict(os.environ)
    worker = [args.python, "-m", "neuron_runtime.executables._service._worker", "--nice", str(args.nice)]
    server = Server(args.socket, max(1, args.workers), worker, env, args.timeout, args.idle_timeout, args.max_queue,
                    batch=max(1, args.batch))
    signal.signal(signal.SIGTERM, server.stop)
    signal.signal(signal.SIGINT, server.stop)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # the terminal of the job that started it may go away
    return server.serve()


if __name__ == "__main__":
    raise SystemExit(main())

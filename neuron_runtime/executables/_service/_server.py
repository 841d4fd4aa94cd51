"""The host's compile service: one process per host and configuration, shared by every job on it.

Standard library only, and started by path (`python .../_server.py`), so the service itself never
imports torch: it queues, de-duplicates and hands signatures to worker processes (`_worker.py`), which
do the compiling. Protocol and lifecycle: see `neuron_runtime.executables._service`.

    clients (training processes) ──JSON lines over a Unix socket──▶ Server
         ▲                                                           │ one job per key, a bounded queue
         └──────── {"op": "started" | "done", "key": ...} ◀──────────┤ (needed-now before prefetch)
                                                                     ▼
                                                   WorkerPool (_pool.py): N `_worker.py` processes
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
import logging
import os
import signal
import socket
import struct
import sys
import threading
import time
from typing import Any

try:
    from ._client import ServiceDir
    from ._pool import WorkerPool
except ImportError:  # started by path (`python .../_server.py`): its directory is sys.path[0]
    from _client import ServiceDir  # type: ignore[no-redef]
    from _pool import WorkerPool  # type: ignore[no-redef]

log = logging.getLogger("neuron_runtime.executables._service")

PROTOCOL = 1

#: The longest line a client may send (a compile request is a few kB): a client that sends more without a
#: newline is told so and disconnected, instead of growing the service's memory without bound.
MAX_LINE = 1 << 22
MAX_CLIENTS = 256       # connections at once (each has a reader thread); more are told so and closed
MAX_CANDIDATES = 8      # signatures in one compile request (a shape class or two, then the exact one)
SEND_TIMEOUT_S = 30.0   # a client that reads nothing for this long while we answer it is disconnected
KEY_CHARS = frozenset("0123456789abcdef")

#: What a worker's answer may say (see `_worker.py`); everything else is reported as "failed".
STATUSES = ("compiled", "present", "refused", "failed")


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

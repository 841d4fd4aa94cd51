"""A process's connection to its host's compile service, started on demand. Standard library only.

`ServiceClient.submit(key, payload, priority)` never blocks on the service: it sends one line when the
connection is up, and otherwise leaves the job for the client's thread, which (1) connects, starting the
service if none answers (under a lock file, so concurrent processes start one), (2) says hello, (3) sends
every job not yet answered (again after a reconnect: a service that idled out or died loses nothing a
client still waits for), and (4) hands each answer to `on_message` (from that thread). When the service
cannot be started (three attempts in a row), every outstanding job is answered `unavailable` with the
reason, once, and the client stays broken: its owner compiles some other way.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

SERVER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_server.py")


def service_dir() -> str:
    """This user's private directory of compile-service sockets (`/tmp/neuron-runtime-<uid>`, 0o700).
    Raises OSError if it exists but is not private to this user."""
    d = os.path.join("/tmp", f"neuron-runtime-{os.getuid()}")
    os.makedirs(d, mode=0o700, exist_ok=True)
    st = os.stat(d)
    if st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise OSError(f"{d} is not a private directory of this user's (owner {st.st_uid}, mode "
                      f"{oct(st.st_mode & 0o777)}); refusing to use a compile service there")
    return d


def ask(socket_path: str, msgs: list[dict[str, Any]], timeout: float = 5.0) -> list[dict[str, Any]]:
    """Send `msgs` to the service at `socket_path` and read one answer each (for `neuron-cache service`)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(socket_path)
        s.sendall(b"".join(_line(m) for m in msgs))
        buf, out = b"", []
        while len(out) < len(msgs):
            chunk = s.recv(1 << 16)
            if not chunk:
                break
            buf += chunk
            while b"\n" in buf and len(out) < len(msgs):
                line, buf = buf.split(b"\n", 1)
                out.append(json.loads(line))
        return out


class ServiceClient:
    def __init__(self, socket_path: str, server_argv: list[str], env: dict[str, str],
                 on_message: Callable[[dict[str, Any]], None], start_timeout: float = 60.0) -> None:
        self.socket_path = socket_path
        self.server_argv = server_argv
        self.env = env
        self.on_message = on_message
        self.start_timeout = start_timeout
        self.lock = threading.Lock()
        self.wake = threading.Event()
        self.outstanding: dict[str, tuple[dict[str, Any], int]] = {}  # key -> (payload, priority)
        self.unsent: list[str] = []
        self.sock: socket.socket | None = None
        self.broken: str | None = None
        self.closed = False
        self.spawned: list[subprocess.Popen[bytes]] = []
        self.service_pid: int | None = None
        self.thread = threading.Thread(target=self._run, name="neuron-compile-client", daemon=True)
        self.thread.start()

    # -- API -----------------------------------------------------------------------------------------
    def submit(self, key: str, payload: dict[str, Any], priority: int = 0) -> None:
        with self.lock:
            known = self.outstanding.get(key)
            if known is not None and known[1] <= priority:
                return
            self.outstanding[key] = (payload, priority)
            sock = self.sock
            if sock is None or self.broken is not None:
                self.unsent.append(key)
                self.wake.set()
                return
            try:
                sock.sendall(_line({"op": "compile", "key": key, "payload": payload, "priority": priority}))
            except OSError:
                self.unsent.append(key)
                self.wake.set()

    def close(self, flush_timeout: float = 5.0) -> None:
        """Disconnect once every job asked for was sent (up to `flush_timeout` s, the service's start
        included): the service keeps what it queued, and finished compiles land in the cache."""
        deadline = time.monotonic() + flush_timeout
        while time.monotonic() < deadline:
            with self.lock:
                if self.broken is not None or not self.outstanding or (self.sock is not None and not self.unsent):
                    break
            self.wake.set()
            time.sleep(0.02)
        self.closed = True
        self.wake.set()
        with self.lock:
            sock, self.sock = self.sock, None
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()
        self.thread.join(5)

    # -- the client's thread -------------------------------------------------------------------------
    def _run(self) -> None:
        failures = 0
        while not self.closed:
            with self.lock:
                idle = not self.outstanding
            if idle:
                self.wake.wait(1.0)
                self.wake.clear()
                continue
            try:
                sock = self._connect()
            except OSError as e:
                failures += 1
                log.warning("compile service unavailable (%s); attempt %d of 3", e, failures)
                if failures >= 3:
                    self._give_up(f"the host's compile service cannot be started: {e}")
                    return
                time.sleep(0.5 * failures)
                continue
            failures = 0
            self._serve(sock)

    def _give_up(self, why: str) -> None:
        with self.lock:
            self.broken = why
            keys = list(self.outstanding)
            self.outstanding.clear()
            self.unsent.clear()
        for key in keys:
            self.on_message({"op": "done", "key": key, "status": "unavailable", "reason": why})

    def _serve(self, sock: socket.socket) -> None:
        """Send what is unsent, read answers until the connection ends."""
        buf = b""
        with self.lock:
            self.sock = sock
            self.unsent = list(self.outstanding)  # a new connection: (re)send everything still wanted
        sock.settimeout(0.2)
        try:
            with self.lock:
                sock.sendall(_line({"op": "hello", "pid": os.getpid()}))
            while not self.closed:
                self._flush(sock)
                try:
                    chunk = sock.recv(1 << 16)
                except TimeoutError:
                    continue
                if not chunk:
                    break
                buf += chunk
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    self._dispatch(line)
        except OSError as e:
            log.debug("compile service connection lost: %s", e)
        finally:
            with self.lock:
                if self.sock is sock:
                    self.sock = None
            try:
                sock.close()
            except OSError:
                pass

    def _flush(self, sock: socket.socket) -> None:
        # Under the lock: `submit` writes to the same socket from the op's thread.
        with self.lock:
            keys, self.unsent = self.unsent, []
            for key in dict.fromkeys(keys):
                if key in self.outstanding:
                    payload, priority = self.outstanding[key]
                    sock.sendall(_line({"op": "compile", "key": key, "payload": payload, "priority": priority}))

    def _dispatch(self, line: bytes) -> None:
        try:
            msg = json.loads(line)
        except ValueError:
            log.warning("compile service sent a line that is not JSON: %r", line[:200])
            return
        op = msg.get("op")
        if op == "hello":
            self.service_pid = msg.get("pid")
            return
        if op == "done":
            with self.lock:
                if msg.get("status") == "busy":
                    # The service's queue is full: ask again in a while (the op runs on the host meanwhile).
                    threading.Timer(5.0, self._resend, args=(msg.get("key"),)).start()
                    return
                self.outstanding.pop(msg.get("key"), None)
        if op in ("done", "started"):
            try:
                self.on_message(msg)
            except Exception:  # noqa: BLE001 - the owner's bug must not kill the connection
                log.exception("compile service answer handler failed for %s", msg.get("key"))

    def _resend(self, key: Any) -> None:
        with self.lock:
            if key in self.outstanding:
                self.unsent.append(key)

    # -- connecting, starting ------------------------------------------------------------------------
    def _try_connect(self) -> socket.socket | None:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.connect(self.socket_path)
            return s
        except OSError:
            s.close()
            return None

    def _connect(self) -> socket.socket:
        s = self._try_connect()
        if s is not None:
            return s
        lock_path = self.socket_path[: -len(".sock")] + ".lock"
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            deadline = time.monotonic() + self.start_timeout
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise OSError(f"timed out waiting for {lock_path}") from None
                    time.sleep(0.05)
            # Another process may have started the service while we waited for the lock.
            s = self._try_connect()
            if s is not None:
                return s
            return self._start(deadline)
        finally:
            os.close(fd)  # releases the lock

    def _start(self, deadline: float) -> socket.socket:
        log_path = self.socket_path[: -len(".sock")] + ".log"
        with open(log_path, "ab") as log_file:
            proc = subprocess.Popen(self.server_argv, env=self.env, stdin=subprocess.DEVNULL,
                                    stdout=log_file, stderr=log_file, start_new_session=True, close_fds=True)
        self.spawned = [p for p in self.spawned if p.poll() is None] + [proc]
        while time.monotonic() < deadline:
            s = self._try_connect()
            if s is not None:
                return s
            if proc.poll() is not None:
                raise OSError(f"the compile service exited with status {proc.returncode} at start; "
                              f"see {log_path}: {_tail(log_path)}")
            time.sleep(0.05)
        raise OSError(f"the compile service did not answer within {self.start_timeout:g} s; see {log_path}")


def _line(msg: dict[str, Any]) -> bytes:
    return (json.dumps(msg) + "\n").encode()


def _tail(path: str, n: int = 3) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return " | ".join(ln.strip() for ln in f.read().splitlines()[-n:] if ln.strip())
    except OSError:
        return ""

"""A process's connection to its host's compile service, started on demand. Standard library only.

`ServiceClient.submit(key, payload, priority)` never blocks on the service: it sends one line when the
connection is up, and otherwise leaves the job for the client's thread, which (1) connects, starting the
service if none answers (under a lock file, so concurrent processes start one), (2) says hello, (3) sends
every job not yet answered (again after a reconnect: a service that idled out or died loses nothing a
client still waits for), and (4) hands each answer to `on_message` (from that thread). When the service
cannot be started (three attempts in a row), every outstanding job is answered `unavailable` with the
reason, once, and the client stays broken: its owner compiles some other way. A "busy" answer (the
service's queue is full) is asked again 5 s later by the same thread: no thread per answer.

What the service answers is input: a line that is not a JSON object, or longer than `MAX_ANSWER`, is
dropped (the latter with the connection); whether an answer's entry may serve a key is the owner's
check (`_background`).

The socket directory (`service_dir`) is opened once, without following links, and checked (a directory
owned by this user, mode 0o700) on the open descriptor; sockets, lock and log files are reached through
that descriptor (`/proc/self/fd/N/<name>`), so the directory's path is never resolved again.
"""

from __future__ import annotations

import fcntl
import hashlib
import hmac
import json
import logging
import os
import secrets
import socket
import stat
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

SERVER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_server.py")

#: The longest answer line a client reads (an inline entry is a few MiB at most).
MAX_ANSWER = 64 << 20
BUSY_RETRY_S = 5.0
_SALT = ".salt"


class ServiceDir:
    """A private directory of this user's, opened once (`O_NOFOLLOW`: a symlink is refused) and checked
    on the open descriptor: a directory, owned by this user, no access for group or others. `at(name)`
    is a path to `name` inside it that goes through the descriptor, never through `path` again.
    Raises OSError naming what is wrong."""

    def __init__(self, path: str, create: bool = True) -> None:
        self.path = path
        if create:
            try:
                os.mkdir(path, 0o700)
            except FileExistsError:
                pass
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as e:
            raise OSError(f"{path} is not a directory of this user's ({e.strerror}; a symbolic link is refused); "
                          "refusing to use a compile service there") from e
        st = os.fstat(fd)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) & 0o077:
            os.close(fd)
            raise OSError(f"{path} is not a private directory of this user's (owner {st.st_uid}, mode "
                          f"{oct(stat.S_IMODE(st.st_mode))}); refusing to use a compile service there")
        self.fd = fd
        self._via = f"/proc/self/fd/{fd}" if os.path.isdir(f"/proc/self/fd/{fd}") else path

    def at(self, name: str) -> str:
        """A path to `name` in this directory through the checked descriptor."""
        return os.path.join(self._via, name)

    def names(self) -> list[str]:
        return sorted(os.listdir(self.fd))

    def salt(self) -> bytes:
        """This user's random salt (32 bytes, made once, 0o600): socket names are keyed with it, so a
        name reveals nothing about the configuration it stands for (signing key, credentials)."""
        for _ in range(5):
            try:
                fd = os.open(_SALT, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self.fd)
            except FileNotFoundError:
                tmp = f".salt-{os.getpid()}-{secrets.token_hex(4)}"
                w = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                            dir_fd=self.fd)
                try:
                    os.write(w, secrets.token_bytes(32))
                finally:
                    os.close(w)
                try:  # link(2) never replaces: the first process's salt is everyone's
                    os.link(tmp, _SALT, src_dir_fd=self.fd, dst_dir_fd=self.fd)
                except FileExistsError:
                    pass
                finally:
                    os.unlink(tmp, dir_fd=self.fd)
                continue
            with os.fdopen(fd, "rb") as f:
                st = os.fstat(f.fileno())
                data = f.read(64)
            if st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) & 0o077 or len(data) != 32:
                raise OSError(f"{os.path.join(self.path, _SALT)} is not this user's private 32-byte salt")
            return data
        raise OSError(f"cannot make {os.path.join(self.path, _SALT)}")

    def name(self, identity: dict[str, Any]) -> str:
        """The socket name of a configuration: an HMAC of it under this directory's salt."""
        doc = json.dumps(identity, sort_keys=True, separators=(",", ":")).encode()
        return hmac.new(self.salt(), doc, hashlib.sha256).hexdigest()[:24] + ".sock"


_dirs: dict[tuple[int, str], ServiceDir] = {}
_dirs_lock = threading.Lock()


def service_dir() -> ServiceDir:
    """This user's private directory of compile-service sockets: `$TMPDIR/neuron-runtime-<uid>` (TMPDIR
    as `tempfile` reads it; usually `/tmp`), opened and checked once per process (`ServiceDir`)."""
    path = os.path.join(tempfile.gettempdir(), f"neuron-runtime-{os.getuid()}")
    with _dirs_lock:
        d = _dirs.get((os.getpid(), path))
        if d is None:
            d = _dirs[(os.getpid(), path)] = ServiceDir(path)
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
        self.retry: dict[str, float] = {}  # key -> when to ask again (the service said busy)
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

    def pending(self) -> int:
        """Jobs asked for and not answered yet."""
        with self.lock:
            return len(self.outstanding)

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
                if len(buf) > MAX_ANSWER:
                    log.warning("compile service sent more than %d bytes without a newline; reconnecting", MAX_ANSWER)
                    break
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
            if self.retry:
                now = time.monotonic()
                for key in [k for k, due in self.retry.items() if due <= now]:
                    del self.retry[key]
                    keys.append(key)
            for key in dict.fromkeys(keys):
                if key in self.outstanding:
                    payload, priority = self.outstanding[key]
                    sock.sendall(_line({"op": "compile", "key": key, "payload": payload, "priority": priority}))

    def _dispatch(self, line: bytes) -> None:
        try:
            msg = json.loads(line)
        except (ValueError, RecursionError):
            msg = None
        if not isinstance(msg, dict) or not isinstance(msg.get("key", ""), str):
            log.warning("compile service sent a line that is not an answer: %r", line[:200])
            return
        op = msg.get("op")
        if op == "hello":
            pid = msg.get("pid")
            self.service_pid = pid if isinstance(pid, int) and not isinstance(pid, bool) else None
            return
        if op == "done":
            with self.lock:
                key = msg.get("key")
                if key not in self.outstanding:
                    return  # nothing we asked for (or answered already)
                if msg.get("status") == "busy":
                    # The service's queue is full: ask again in a while (the op runs on the host meanwhile).
                    self.retry[str(key)] = time.monotonic() + BUSY_RETRY_S
                    return
                self.outstanding.pop(key, None)
        if op in ("done", "started"):
            try:
                self.on_message(msg)
            except Exception:  # noqa: BLE001 - the owner's bug must not kill the connection
                log.exception("compile service answer handler failed for %s", msg.get("key"))

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
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
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
        fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "ab") as log_file:
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

"""Scripted fleet stores: real socket servers on 127.0.0.1 that answer the way a test says (a drip, a lie
about the size, a truncation, a hang). Used by the deadline and read-bound tests and by
benchmarks/store_fuzz.py.

`Answer` is one scripted reply: the size it announces (Content-Length, the RESP bulk length), the bytes it
really sends, how (`chunk` bytes every `drip_s` seconds), and whether it then hangs (keeps the connection
open, sends nothing more) or closes. `ScriptedServer(proto, answer)` speaks just enough HTTP (the
bazel-remote API of `HttpStore`: an honest action-cache record, then the scripted blob) or RESP (the
handshake, then the scripted reply to every GET/GETEX) for the store's client to get that far.
"""

from __future__ import annotations

import hashlib
import socket
import threading
from dataclasses import dataclass, field

from neuron_runtime.cache._http import make_record


@dataclass
class Answer:
    body: bytes = b""
    announce: int | None = None  # the size the framing announces (None: len(body))
    chunk: int = 1 << 16  # bytes per send
    drip_s: float = 0.0  # pause before each send
    hang: bool = False  # after the body: keep the connection open, silent
    chunked: bool = False  # HTTP only: Transfer-Encoding: chunked, no Content-Length
    status: int = 200  # HTTP only
    record_size: int | None = None  # HTTP only: the size the action-cache record names (None: `size`)
    stats: dict[str, int] = field(default_factory=lambda: {"sent": 0, "requests": 0})

    @property
    def size(self) -> int:
        return len(self.body) if self.announce is None else self.announce


class ScriptedServer:
    """A real server on 127.0.0.1 (`proto`: "http" or "resp") answering every entry read with `answer`."""

    def __init__(self, proto: str, answer: Answer) -> None:
        self.proto, self.answer = proto, answer
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self._conns: list[socket.socket] = []
        self._stop = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def url(self, **opts: str) -> str:
        query = "&".join(f"{k}={v}" for k, v in opts.items())
        base = f"http://127.0.0.1:{self.port}/c" if self.proto == "http" else f"redis://127.0.0.1:{self.port}"
        return base + (f"?{query}" if query else "")

    def close(self) -> None:
        self._stop.set()
        self.sock.close()
        for c in list(self._conns):
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            c.close()

    def __enter__(self) -> "ScriptedServer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self._conns.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    # -- sending the scripted answer -------------------------------------------------------------
    def _send(self, conn: socket.socket, head: bytes, body: bytes, tail: bytes = b"") -> bool:
        a = self.answer
        a.stats["requests"] += 1
        try:
            conn.sendall(head)
            view = memoryview(body)  # slices without copies (the fuzz measures the client's memory)
            for i in range(0, len(view), max(1, a.chunk)):
                if a.drip_s:
                    if self._stop.wait(a.drip_s):
                        return False
                part = view[i:i + max(1, a.chunk)]
                if a.chunked:
                    conn.sendall(b"%x\r\n" % len(part))
                conn.sendall(part)
                if a.chunked:
                    conn.sendall(b"\r\n")
                a.stats["sent"] += len(part)
            conn.sendall(tail)
            if a.hang:
                self._stop.wait(3600)
                return False
        except OSError:
            return False
        return True

    # -- HTTP ------------------------------------------------------------------------------------
    def _serve(self, conn: socket.socket) -> None:
        try:
            if self.proto == "http":
                self._serve_http(conn)
            else:
                self._serve_resp(conn)
        except OSError:
            pass
        finally:
            conn.close()

    def _serve_http(self, conn: socket.socket) -> None:
        buf = b""
        while True:
            while b"\r\n\r\n" not in buf:
                data = conn.recv(65536)
                if not data:
                    return
                buf += data
            head, buf = buf.split(b"\r\n\r\n", 1)
            line = head.split(b"\r\n", 1)[0].decode()
            method, path = line.split(" ")[:2]
            a = self.answer
            if "/ac/" in path:  # an honest record naming the scripted blob
                key = self.key_of(path)
                record = make_record(key, hashlib.sha256(a.body).hexdigest(),
                                     a.size if a.record_size is None else a.record_size) if key else b""
                status = b"200 OK" if key else b"404 Not Found"
                conn.sendall(b"HTTP/1.1 " + status + b"\r\nContent-Length: %d\r\n\r\n" % len(record) + record)
                continue
            if method != "GET":
                conn.sendall(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")
                continue
            framing = (b"Transfer-Encoding: chunked\r\n" if a.chunked else b"Content-Length: %d\r\n" % a.size)
            head_out = b"HTTP/1.1 %d X\r\n" % a.status + framing + b"\r\n"
            if not self._send(conn, head_out, a.body, b"0\r\n\r\n" if a.chunked else b""):
                return
            if a.announce is not None and a.announce != len(a.body) and not a.chunked:
                return  # a lie about the length: the connection cannot be reused

    #: keys whose record the HTTP server answers (others: 404); a test sets it
    keys: tuple[str, ...] = ()

    def key_of(self, path: str) -> str | None:
        from neuron_runtime.cache._fleet import LAYOUT_VERSION

        for key in self.keys:
            if path.endswith(hashlib.sha256(f"neuron-runtime:{LAYOUT_VERSION}:{key}".encode()).hexdigest()):
                return key
        return None

    # -- RESP ------------------------------------------------------------------------------------
    def _serve_resp(self, conn: socket.socket) -> None:
        reader = conn.makefile("rb")
        while True:
            line = reader.readline()
            if not line:
                return
            if not line.startswith(b"*"):
                continue
            args = []
            for _ in range(int(line[1:])):
                n = int(reader.readline()[1:])
                args.append(reader.read(n + 2)[:-2])
            cmd = args[0].upper() if args else b""
            if cmd == b"HELLO":
                conn.sendall(b"%1\r\n$5\r\nproto\r\n:3\r\n")
            elif cmd in (b"GET", b"GETEX"):
                a = self.answer
                if not self._send(conn, b"$%d\r\n" % a.size, a.body, b"\r\n"):
                    return
            elif cmd == b"EXISTS":
                conn.sendall(b":1\r\n")
            else:
                conn.sendall(b"+OK\r\n")


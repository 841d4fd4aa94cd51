"""A small HTTP cache server that follows bazel-remote's HTTP API as its README and server/http.go define
it (read, not copied), for the http:// store's tests and benchmarks:

* `/cas/<sha256>` and `/ac/<64 hex>`, optionally under `/<instance>/...` (bazel-remote ignores the
  instance; we keep instances apart, as BuildBuddy and WebDAV servers do); any other path: 400.
* PUT needs Content-Length; a CAS upload whose bytes do not hash to its name: 400. An `/ac/` upload must
  parse as a protobuf message and is rewritten with `execution_metadata.worker` set to the client's
  address (bazel-remote does this), so clients must tolerate fields they did not write.
* GET/HEAD of an `/ac/` record answer 404 while a blob it names is missing (bazel-remote's validated AC).
* GET, HEAD and PUT only: anything else 405 (bazel-remote has no DELETE).
* Basic auth from a users dict (bazel-remote's htpasswd); bearer tokens too (BuildBuddy-style).

Why ours and not bazel-remote itself: it is a Go program with no Debian or PyPI package, and nothing may be
downloaded from elsewhere here. nginx's WebDAV (Debian) is the second server the tests run.

Faults for the tests (attributes, changed while it runs): `fail_status` (answer every request with it),
`delay_s` (sleep before answering: timeouts), `lie` (answer CAS reads with another blob's bytes),
`evict(digest)`.

    python tests/_httpcache.py [--port P] [--user U:P]   (for benchmarks: prints its port, serves until killed)
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import http.server
import re
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from neuron_runtime.cache._http import _fields, _field  # noqa: E402  (the test server checks the wire format)

_PATH = re.compile(r"^/?(.*/)?(ac/|cas/)([a-f0-9]{64})$")


class CacheServer:
    def __init__(self, users: dict[str, str] | None = None, tokens: set[str] | None = None, port: int = 0) -> None:
        self.blobs: dict[tuple[str, str, str], bytes] = {}  # (instance, kind, hash) -> bytes
        self.lock = threading.Lock()
        self.users = users or {}
        self.tokens = tokens or set()
        self.fail_status = 0
        self.delay_s = 0.0
        self.lie = False
        self.max_per_connection = 0  # > 0: close each connection after that many answers (like keepalive_requests)
        self.requests: list[tuple[str, str, int]] = []
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def _send(self, status: int, body: bytes = b"") -> None:
                server.requests.append((self.command, self.path, status))
                self.answered = getattr(self, "answered", 0) + 1
                self.send_response(status)
                if server.max_per_connection and self.answered >= server.max_per_connection:
                    self.send_header("Connection", "close")
                    self.close_connection = True
                self.send_header("Content-Length", str(len(body)))
                self.send_header("Content-Type", "application/octet-stream")
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            def _authorized(self) -> bool:
                if not server.users and not server.tokens:
                    return True
                auth = self.headers.get("Authorization", "")
                if auth.startswith("Basic "):
                    try:
                        user, _, pw = base64.b64decode(auth[6:]).decode().partition(":")
                    except ValueError:
                        return False
                    return server.users.get(user) == pw
                return auth.startswith("Bearer ") and auth[7:] in server.tokens

            def _handle(self) -> None:
                body = b""
                if self.command == "PUT":
                    if self.headers.get("Content-Length") is None:
                        return self._send(400, b"PUT without Content-Length")
                    body = self.rfile.read(int(self.headers["Content-Length"]))
                if server.delay_s:
                    time.sleep(server.delay_s)
                if server.fail_status:
                    return self._send(server.fail_status, b"injected failure")
                if not self._authorized():
                    return self._send(401, b"Unauthorized")
                m = _PATH.match(self.path)
                if m is None:
                    return self._send(400, b"resource name must be a SHA256 hash in hex")
                instance, kind, name = (m.group(1) or "").strip("/"), m.group(2)[:-1], m.group(3)
                if self.command not in ("GET", "HEAD", "PUT"):
                    return self._send(405, f"Method '{self.command}' not supported.".encode())
                with server.lock:
                    if self.command == "PUT":
                        if kind == "cas" and hashlib.sha256(body).hexdigest() != name:
                            return self._send(400, b"hash mismatch")
                        if kind == "ac":
                            try:
                                list(_fields(body))
                            except ValueError as e:
                                return self._send(400, f"not an ActionResult: {e}".encode())
                            body = body + _field(9, _field(1, self.client_address[0].encode()))
                        server.blobs[(instance, kind, name)] = body
                        return self._send(200)
                    data = server.blobs.get((instance, kind, name))
                    if data is not None and kind == "ac" and not server._outputs_present(instance, data):
                        data = None
                    if data is not None and kind == "cas" and server.lie:
                        others = [v for (i, k, n), v in server.blobs.items() if k == "cas" and n != name]
                        data = others[0] if others else data[::-1]
                if data is None:
                    return self._send(404, b"Not found")
                return self._send(200, data)

            do_GET = do_HEAD = do_PUT = do_DELETE = do_POST = _handle

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.httpd.daemon_threads = True
        self.port = int(self.httpd.server_address[1])
        self.url = f"http://127.0.0.1:{self.port}"
        self.thread: threading.Thread | None = None

    def _outputs_present(self, instance: str, record: bytes) -> bool:
        for number, wire, value in _fields(record):
            if number == 2 and wire == 2 and isinstance(value, bytes):
                for n, w, v in _fields(value):
                    if n == 2 and w == 2 and isinstance(v, bytes):
                        digest = next((x for nn, ww, x in _fields(v) if nn == 1), b"")
                        if (instance, "cas", bytes(digest).decode()) not in self.blobs:  # type: ignore[arg-type]
                            return False
        return True

    def evict(self, digest: str | None = None) -> None:
        """Drop one CAS blob (or all of them), as an LRU eviction would."""
        with self.lock:
            for k in [k for k in self.blobs if k[1] == "cas" and (digest is None or k[2] == digest)]:
                del self.blobs[k]

    def reset(self) -> None:
        with self.lock:
            self.blobs.clear()
        self.fail_status, self.delay_s, self.lie, self.max_per_connection = 0, 0.0, False, 0

    def start(self) -> "CacheServer":
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--user", action="append", default=[], help="USER:PASSWORD")
    args = ap.parse_args()
    server = CacheServer(users=dict(u.split(":", 1) for u in args.user), port=args.port)
    print(server.port, flush=True)
    server.httpd.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())

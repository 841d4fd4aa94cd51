"""The fleet store behind `http://` and `https://`: bazel-remote's HTTP cache API, as served by
bazel-remote, BuildBuddy, Buildbarn's bb-storage, and a plain WebDAV server (nginx `dav_methods PUT`).

URL: `http[s]://[USER:PASSWORD@]HOST[:PORT][/INSTANCE][?ca=FILE&cert=FILE&key=FILE&max_entry=SIZE]`.
Basic auth from the URL's user and password, else a bearer token from `TORCH_NEURONX_CACHE_TOKEN`.
`/INSTANCE` is a path prefix (bazel-remote ignores it; BuildBuddy and WebDAV servers keep instances apart).

Layout: the API's two halves, as Bazel itself uses them::

    PUT/GET/HEAD {base}/cas/{sha256 of the entry's bytes}   the entry (the envelope), content-addressed
    PUT/GET      {base}/ac/{sha256("neuron-runtime:v1:" + key)}   an ActionResult naming that blob

The action-cache record is a REAPI `ActionResult` protobuf with one output file
(`neuron-runtime/v1/<key>.neff`, digest, size): bazel-remote validates `/ac/` uploads as ActionResults and
rewrites them (it adds the worker's address), so any other payload would be refused there. Its key is
derived from ours, so entries never collide with a Bazel build's actions in a shared cache, and a new
layout version changes every name.

Guarantees, and what this store cannot give:
  * Atomicity: a record points only at a blob uploaded before it, and a blob's name is its sha256, which
    the server checks on upload (bazel-remote) or not (WebDAV). The bytes a read returns go through the
    tiered cache's envelope check (digest, key, HMAC) like every store's, so a server that answers with
    someone else's bytes is refused there, never loaded, counted in `stats["corrupt"]`; `quarantine`
    then names the server's answer (fault kind `digest`) instead of dropping a record that was right.
  * First writer wins only as far as the API allows: `put` looks for a live record first and keeps it,
    but the API has no conditional create, so two hosts writing the same key at the same moment both
    upload and the last record wins (both entries are whole and valid for the key).
  * No fleet-wide single-flight: without a conditional create there is no lease, so `try_lease` hands out
    a no-op lease and single-flight is per host (the tiered cache's thread and flock levels). N hosts
    cold on the same keys may compile them up to N times; each ends with every entry.
  * No listing: the API cannot enumerate entries (`lists_entries` is False), so `neuron-cache ls`,
    `prune` and `verify` without `--manifest` skip this tier; eviction is the server's own (bazel-remote's
    LRU by size). An entry evicted between a lookup and a read is a miss and is recompiled and re-put.
  * Delete writes a tombstone record (an ActionResult with no outputs): bazel-remote has no DELETE.

Failure policy: as the other fleet stores (`FleetStore`): misses and skipped writes counted by kind
(`timeout`, `unavailable`, `server` for 5xx, `permission` for 401/403, `too_large` for 413 or an entry
over `max_entry`, `digest` for a blob that was not the one asked for), one warning per kind, and a
cooldown after timeouts, refused connections and 5xx. Each request is bounded by
`TORCH_NEURONX_FLEET_TIMEOUT`. Lookups and prefetches pipeline their record GETs (HTTP/1.1), since the
API has no batch call.
"""

from __future__ import annotations

import base64
import hashlib
import logging
import socket
import ssl
import threading
import urllib.parse
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from neuron_runtime.cache import _urls
from neuron_runtime.cache._base import EntryInfo, check_key, check_keys
from neuron_runtime.cache._deadline import carried, remaining
from neuron_runtime.cache._fleet import LAYOUT_VERSION, FleetStore

if TYPE_CHECKING:
    from neuron_runtime._config import Config

log = logging.getLogger(__name__)

DEFAULT_MAX_ENTRY = 1024**3
_MAX_RECORD = 64 * 1024  # an action-cache record is ~150 bytes; bazel-remote adds a worker name
_PARALLEL = 16
_PIPELINE = 250  # requests written ahead on one connection (nginx closes after keepalive_requests=1000)
_OPTIONS = {"ca", "cert", "key", "max_entry"}


class HttpStatusError(Exception):
    """An answer the store treats as a fault (anything but 2xx, and 404 where a miss is expected)."""

    def __init__(self, method: str, path: str, status: int, body: bytes = b"") -> None:
        self.status = status
        snippet = body[:200].decode("utf-8", "replace").strip()
        super().__init__(f"{method} {path}: HTTP {status}" + (f" ({snippet})" if snippet else ""))


class HttpStore(FleetStore):
    """`http(s)://`, bazel-remote's HTTP cache API: see the module docstring."""

    lists_entries = False
    max_entry: int

    def __init__(self, url: str, *, token: str | None = None, timeout_s: float = 10.0) -> None:
        import urllib3

        parts, opts, port = _urls.split(url, "http", "https", _OPTIONS, "http(s)://HOST[:PORT][/INSTANCE]")
        assert parts.hostname is not None
        super().__init__(_urls.redact(url), timeout_s)
        self.base = parts.path.rstrip("/")
        self.max_entry = _urls.size(url, "max_entry", opts["max_entry"]) if "max_entry" in opts else DEFAULT_MAX_ENTRY
        self.headers: dict[str, str] = {"User-Agent": "neuron-runtime"}
        if parts.username:
            user = urllib.parse.unquote(parts.username)
            password = urllib.parse.unquote(parts.password or "")
            self.headers["Authorization"] = "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()
        elif token:
            self.headers["Authorization"] = f"Bearer {token}"
        pool_kw: dict[str, Any] = {}
        if parts.scheme == "https":
            context = ssl.create_default_context(cafile=opts.get("ca"))
            if "cert" in opts:
                context.load_cert_chain(opts["cert"], opts.get("key"))
            pool_kw["ssl_context"] = context
            self._ssl_context = context
        host = parts.hostname if ":" not in parts.hostname else f"[{parts.hostname}]"
        self.origin = f"{parts.scheme}://{host}" + (f":{port}" if port else "")
        self.pool = urllib3.PoolManager(
            num_pools=2, maxsize=_PARALLEL, block=False,
            timeout=urllib3.Timeout(connect=min(timeout_s, 5.0), read=timeout_s),
            # One retry of a dropped connection (a restarted server, a stale keep-alive); answers are not retried.
            retries=urllib3.Retry(total=1, connect=1, read=1, status=0, redirect=0, other=0, raise_on_status=False),
            **pool_kw)
        self._urllib3 = urllib3
        self._executor: ThreadPoolExecutor | None = None
        self._executor_lock = threading.Lock()
        self._listing_warned = False

    # ------------------------------------------------------------------ requests

    def _ac(self, key: str) -> str:
        name = hashlib.sha256(f"neuron-runtime:{LAYOUT_VERSION}:{check_key(key)}".encode()).hexdigest()
        return f"{self.base}/ac/{name}"

    def _cas(self, digest: str) -> str:
        return f"{self.base}/cas/{digest}"

    def _request(self, method: str, path: str, body: bytes | None = None, limit: int = 0) -> tuple[int, bytes]:
        """(status, body) for 2xx and 404; any other answer raises `HttpStatusError`. A body over `limit`
        bytes (when set; else `_MAX_RECORD`) is refused from its Content-Length, or after reading at most
        `limit` + 1 bytes of it."""
        headers = dict(self.headers)
        if body is not None:
            headers["Content-Type"] = "application/octet-stream"
        # Connect and each read get what is left of the whole call's deadline (`_deadline`), not more.
        timeout = self._urllib3.Timeout(connect=remaining(min(self.timeout_s, 5.0)), read=remaining(self.timeout_s))
        resp = self.pool.request(method, self.origin + path, body=body, headers=headers, preload_content=False,
                                 timeout=timeout)
        try:
            length = resp.headers.get("Content-Length")
            known = int(length) if length is not None and length.isdigit() else None
            if limit and known is not None and known > limit and resp.status == 200:
                raise HttpStatusError(method, path, 413, f"answer of {length} bytes is over the {limit}-byte cap".encode())
            cap = limit or _MAX_RECORD  # answers without data of ours (PUT, errors) are small
            data = b"" if method == "HEAD" else self._body(resp, cap + 1 if known is None else min(known, cap + 1))
            if len(data) > cap:
                raise HttpStatusError(method, path, 413, f"answer is over the {cap}-byte cap".encode())
            if known is not None and len(data) < known and method != "HEAD":
                # Ended before its announced length: a torn answer, never handed out as a short one.
                raise self._urllib3.exceptions.ProtocolError(f"{method} {path}: {len(data)} of {known} bytes")
        except BaseException:
            resp.close()  # unread bytes left on it: the connection must not go back to the pool
            raise
        resp.release_conn()
        if 200 <= resp.status < 300 or resp.status == 404:
            return resp.status, bytes(data)
        raise HttpStatusError(method, path, resp.status, data)

    def _body(self, resp: Any, want: int) -> bytes:
        """At most `want` bytes of the answer's body (fewer if it ends first), each socket read within
        what is left of the call's deadline: a dripping answer ends at the deadline (`DeadlineExceeded`),
        not when the server stops."""
        sock = getattr(resp.connection, "sock", None)
        parts: list[bytes] = []
        got = 0
        while got < want:
            left = remaining(self.timeout_s)
            if sock is not None:
                sock.settimeout(left)
            chunk = resp.read1(min(1 << 20, want - got))
            if not chunk:
                break
            parts.append(chunk)
            got += len(chunk)
        return b"".join(parts) if len(parts) != 1 else parts[0]

    def _classify(self, e: BaseException) -> str:
        if isinstance(e, HttpStatusError):
            if e.status in (401, 403, 407):
                return "permission"
            if e.status == 413:
                return "too_large"
            if e.status == 507:
                return "full"
            if e.status == 429:
                return "throttled"
            return "server" if e.status >= 500 else "refused"
        exc = self._urllib3.exceptions
        if isinstance(e, exc.MaxRetryError) and e.reason is not None:
            e = e.reason
        if isinstance(e, (exc.TimeoutError, TimeoutError)):
            return "timeout"
        if isinstance(e, exc.SSLError):
            return "tls"
        if isinstance(e, (exc.NewConnectionError, exc.ProtocolError, ConnectionError)):
            return "unavailable"
        return super()._classify(e)

    def _record(self, key: str) -> tuple[str, int] | None:
        """The live record's (digest, size), or None (no record, a tombstone, or not ours)."""
        status, body = self._request("GET", self._ac(key), limit=_MAX_RECORD)
        return None if status == 404 else parse_record(body, key)

    # ------------------------------------------------------------------ the contract

    def get(self, key: str, limit: int | None = None) -> bytes | None:
        check_key(key)
        cap = self.cap(self.max_entry, limit)
        assert cap is not None  # (the HTTP store always has a max_entry)

        def read() -> bytes | None:
            record = self._record(key)
            if record is None:
                return None
            digest, size = record
            if size > cap:
                if cap < self.max_entry:
                    return None  # over the call's own limit: a miss, not a fault of the store
                raise HttpStatusError("GET", self._cas(digest), 413, b"entry over max_entry")
            status, data = self._request("GET", self._cas(digest), limit=cap)
            if status == 404:
                log.debug("%s: cas/%s of key %s is gone (evicted after its record was read): a miss",
                          self.url, digest, key)
                return None
            # No digest check here: the bytes go to the tiered cache, whose envelope check (digest, key,
            # HMAC) refuses anything but a whole entry for this key, as for every store (one hash per read).
            return data

        return self._guard("get", None, read)

    def get_many(self, keys: Iterable[str], parallel: int = _PARALLEL) -> dict[str, bytes]:
        """A job's prefetch: every record in one pipelined batch (see `contains_many`), then the blobs of
        the live ones, `_PARALLEL` in flight. A single `get` pays two round trips (record, then blob);
        here the records cost a few microseconds each."""
        wanted = check_keys(list(dict.fromkeys(keys)))
        if len(wanted) <= 4:
            return {k: d for k, d in zip(wanted, self._map(self.get, wanted)) if d is not None}
        answers: list[tuple[int, bytes] | None] | None = self._guard(
            "get_many", None, lambda: self._pipelined([self._ac(k) for k in wanted]))
        if answers is None:
            return {}
        records: dict[str, tuple[str, int]] = {}
        rest: list[str] = []
        for key, answer in zip(wanted, answers):
            if answer is None:
                rest.append(key)
            elif answer[0] == 200 and (record := parse_record(answer[1], key)) is not None:
                if record[1] <= self.max_entry:
                    records[key] = record

        def blob(key: str) -> bytes | None:
            status, data = self._request("GET", self._cas(records[key][0]), limit=self.max_entry)
            return None if status == 404 else data

        live = list(records)
        blobs: list[bytes | None] = self._guard("get_many", [], lambda: self._map(blob, live))
        out = {k: d for k, d in zip(live, blobs) if d is not None}
        out.update((k, d) for k, d in zip(rest, self._map(self.get, rest)) if d is not None)
        return out

    def _put(self, key: str, data: bytes) -> bool:
        ac = self._ac(key)
        digest = hashlib.sha256(data).hexdigest()

        def write() -> bool:
            # 1. First writer wins: keep a live record whose blob is still there.
            record = self._record(key)
            if record is not None and self._request("HEAD", self._cas(record[0]))[0] != 404:
                return True
            # 2. The blob before the record, so a record never names a missing blob (until eviction).
            if self._request("HEAD", self._cas(digest))[0] == 404:
                self._request("PUT", self._cas(digest), data)
            self._request("PUT", ac, make_record(key, digest, len(data)))
            return True

        return self._guard("put", False, write)

    def contains_many(self, keys: Iterable[str]) -> set[str]:
        """A live record per key. The API has no batch lookup, so the record GETs are pipelined (HTTP/1.1:
        up to `_PIPELINE` requests written ahead on each of a few connections, answers read in order),
        which costs a fraction of one request at a time; a server that answers in a way pipelining
        cannot follow (no Content-Length, an early close) gets the rest as ordinary requests.
        bazel-remote answers a record only while its blob is there; a WebDAV server does not check, and a
        blob gone since is a miss when read."""
        wanted = check_keys(list(dict.fromkeys(keys)))
        if not wanted:
            return set()
        if len(wanted) > 4:
            paths = [self._ac(k) for k in wanted]
            answers: list[tuple[int, bytes] | None] | None = self._guard(
                "contains_many", None, lambda: self._pipelined(paths))
            if answers is None:
                return set()
            found = {k for k, a in zip(wanted, answers) if a is not None and a[0] == 200 and parse_record(a[1], k)}
            rest = [k for k, a in zip(wanted, answers) if a is None]
            if not rest:
                return found
            wanted = rest
        else:
            found = set()
        more: set[str] = self._guard(
            "contains_many", set(),
            lambda: {k for k, rec in zip(wanted, self._map(self._record, wanted)) if rec is not None})
        return found | more

    def _pipelined(self, paths: list[str]) -> list[tuple[int, bytes] | None]:
        """GET every path over a few pipelined connections: (status, body) per path, None where the
        answer could not be read this way (the caller asks again one request at a time). Raises for a
        status other than 2xx/404, like `_request`."""
        chunks = [paths[i:i + _PIPELINE] for i in range(0, len(paths), _PIPELINE)]
        out: list[tuple[int, bytes] | None] = []
        for got in self._map(self._pipeline_one, chunks):  # type: ignore[arg-type]
            out.extend(got)
        return out

    def _pipeline_one(self, paths: list[str]) -> list[tuple[int, bytes] | None]:
        parts = urllib.parse.urlsplit(self.origin)
        host, port = parts.hostname or "", parts.port or (443 if parts.scheme == "https" else 80)
        head = "".join(f"{k}: {v}\r\n" for k, v in self.headers.items())
        requests = "".join(f"GET {p} HTTP/1.1\r\nHost: {parts.netloc}\r\n{head}\r\n" for p in paths).encode()
        sock = socket.create_connection((host, port), timeout=remaining(min(self.timeout_s, 5.0)))
        try:
            if parts.scheme == "https":
                sock = self._ssl_context.wrap_socket(sock, server_hostname=host)

            def recv() -> bytes:
                sock.settimeout(remaining(self.timeout_s))  # what is left of the whole call, at most
                return sock.recv(1 << 16)

            # Write from another thread, so a server that stops reading until we read cannot deadlock us.
            writer = threading.Thread(target=_send_all, args=(sock, requests), daemon=True)
            writer.start()
            answers: list[tuple[int, bytes] | None] = []
            buf = b""
            for path in paths:
                while b"\r\n\r\n" not in buf:
                    if len(buf) > _MAX_RECORD:
                        raise HttpStatusError("GET", path, 413, b"answer headers over the cap")
                    data = recv()
                    if not data:
                        break
                    buf += data
                end = buf.find(b"\r\n\r\n")
                if end < 0:
                    break  # closed early (keepalive_requests, a proxy): the rest one at a time
                lines = buf[:end].decode("latin-1").split("\r\n")
                status = int(lines[0].split(" ", 2)[1])
                fields = {ln.split(":", 1)[0].strip().lower(): ln.split(":", 1)[1].strip() for ln in lines[1:] if ":" in ln}
                length = fields.get("content-length")
                if length is None or not length.isdigit() or "chunked" in fields.get("transfer-encoding", ""):
                    break  # not an answer pipelining can delimit
                n = int(length)
                if n > _MAX_RECORD:
                    raise HttpStatusError("GET", path, 413, b"record over the cap")
                while len(buf) < end + 4 + n:
                    data = recv()
                    if not data:
                        break
                    buf += data
                if len(buf) < end + 4 + n:
                    break
                body, buf = buf[end + 4:end + 4 + n], buf[end + 4 + n:]
                if not (200 <= status < 300 or status == 404):
                    raise HttpStatusError("GET", path, status, body)
                answers.append((status, body))
                if fields.get("connection", "").lower() == "close":
                    break
            writer.join(timeout=remaining(self.timeout_s))
        finally:
            sock.close()
        return answers + [None] * (len(paths) - len(answers))

    def delete(self, key: str) -> bool:
        ac = self._ac(key)

        def tombstone() -> bool:
            if self._record(key) is None:
                return False
            self._request("PUT", ac, make_record(key, None, 0))
            return True

        return self._guard("delete", False, tombstone)

    def quarantine(self, key: str, bad: bytes) -> bool:
        """Tombstone the record if it still names `bad`'s digest (another host may have republished a good
        entry meanwhile). A record naming another digest while `bad` came back means the server answered
        with bytes that are not the blob it was asked for: counted (kind `digest`), record kept."""
        bad_digest = hashlib.sha256(bad).hexdigest()

        def tombstone() -> bool:
            record = self._record(key)
            if record is None:
                return False
            if record[0] != bad_digest:
                self.faults.record("digest", "get",
                                   f"the server answered cas/{record[0]} with {len(bad)} bytes whose sha256 is "
                                   f"{bad_digest} (refused, never loaded)")
                return False
            self._request("PUT", self._ac(key), make_record(key, None, 0))
            return True

        return self._guard("quarantine", False, tombstone)

    def entries(self) -> Iterator[EntryInfo]:
        # Not a fault (nothing failed): one log line, no CacheWarning.
        if not self._listing_warned:
            self._listing_warned = True
            log.warning("%s: the HTTP cache API cannot list entries; `neuron-cache verify --manifest FILE` "
                        "checks a job's entries", self.url)
        return iter([])

    def _lease_live(self, key: str) -> bool:
        return False  # no leases: waiters look once more and compile (per-host single-flight)

    def _map(self, fn: Any, items: list[str]) -> list[Any]:
        if len(items) <= 1:
            return [fn(k) for k in items]
        with self._executor_lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=_PARALLEL, thread_name_prefix="neuron-cache-http")
            executor = self._executor
        return list(executor.map(carried(fn), items))

    def close(self) -> None:
        with self._executor_lock:
            if self._executor is not None:
                self._executor.shutdown(wait=False)
                self._executor = None
        self.pool.clear()


# ------------------------------------------------------------------------------- the ActionResult record
# The few fields of build.bazel.remote.execution.v2.ActionResult we write and read, in protobuf's wire
# format: ActionResult.output_files = 2 (OutputFile: path = 1, digest = 2), ActionResult.exit_code = 4,
# Digest: hash = 1, size_bytes = 2. Unknown fields (bazel-remote adds execution_metadata = 9) are skipped.


def _send_all(sock: socket.socket, data: bytes) -> None:
    try:
        sock.sendall(data)
    except OSError:
        pass  # the reader sees the connection end and asks the rest one at a time


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def output_path(key: str) -> str:
    return f"neuron-runtime/{LAYOUT_VERSION}/{key}.neff"


def make_record(key: str, digest: str | None, size: int) -> bytes:
    """The ActionResult for `key`'s entry, or (digest None) a tombstone: no outputs, exit code 1."""
    if digest is None:
        return _varint(4 << 3 | 0) + _varint(1)
    d = _field(1, digest.encode()) + _varint(2 << 3 | 0) + _varint(size)
    return _field(2, _field(1, output_path(key).encode()) + _field(2, d))


def _fields(buf: bytes) -> Iterator[tuple[int, int, int | bytes]]:
    """(number, wire type, value) of each field; raises ValueError on a malformed message."""
    i = 0
    while i < len(buf):
        tag, i = _read_varint(buf, i)
        number, wire = tag >> 3, tag & 7
        if wire == 0:
            value, i = _read_varint(buf, i)
            yield number, wire, value
        elif wire == 2:
            n, i = _read_varint(buf, i)
            if i + n > len(buf):
                raise ValueError("truncated field")
            yield number, wire, buf[i:i + n]
            i += n
        elif wire in (1, 5):
            i += 8 if wire == 1 else 4
            if i > len(buf):
                raise ValueError("truncated field")
        else:
            raise ValueError(f"unsupported wire type {wire}")


def _read_varint(buf: bytes, i: int) -> tuple[int, int]:
    n = shift = 0
    while True:
        if i >= len(buf) or shift > 63:
            raise ValueError("bad varint")
        b = buf[i]
        i += 1
        n |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return n, i


def parse_record(body: bytes, key: str) -> tuple[str, int] | None:
    """(digest, size) of `key`'s output in an ActionResult; None for a tombstone, a record of something
    else, or bytes that are not an ActionResult (input from the server: never trusted further)."""
    want = output_path(key).encode()
    try:
        for number, wire, value in _fields(body):
            if number != 2 or wire != 2:
                continue
            assert isinstance(value, bytes)
            path, digest = b"", b""
            for n, w, v in _fields(value):
                if n == 1 and w == 2:
                    assert isinstance(v, bytes)
                    path = v
                elif n == 2 and w == 2:
                    assert isinstance(v, bytes)
                    digest = v
            if path != want:
                continue
            hash_, size = "", -1
            for n, w, v in _fields(digest):
                if n == 1 and w == 2:
                    assert isinstance(v, bytes)
                    hash_ = v.decode("ascii", "replace")
                elif n == 2 and w == 0:
                    assert isinstance(v, int)
                    size = v
            if size >= 0 and len(hash_) == 64 and all(c in "0123456789abcdef" for c in hash_):
                return hash_, size
    except ValueError:
        return None
    return None


def open_http(url: str, cfg: Config) -> HttpStore:
    """Factory for the URL registry: `http://` and `https://` URLs."""
    return HttpStore(url, token=cfg.cache_token, timeout_s=cfg.fleet_timeout_s)


__all__ = ["HttpStore", "open_http"]

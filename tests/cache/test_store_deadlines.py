"""A slow or hostile fleet store costs at most its deadline, and no read is bigger than its cap.

Every server here is real (sockets on 127.0.0.1, `_scripted.ScriptedServer`; FIFOs, devices and sparse
files on the real filesystem; a real blocked `read(2)` for a hung mount). Deadlines are short (0.5 s):
the public-API figures at TORCH_NEURONX_FLEET_TIMEOUT=3 are `benchmarks/store_fuzz.py --public-api`'s.
"""

from __future__ import annotations

import os
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _cachetest import key_of, make_cfg, make_entry  # type: ignore[import-not-found]
from _scripted import Answer, ScriptedServer  # type: ignore[import-not-found]

from neuron_runtime.cache import CacheWarning, HttpStore, LocalCache, RedisStore, SharedPathStore, TieredCache
from neuron_runtime.cache._deadline import DeadlineRunner, StoreHung
from neuron_runtime.cache._fleet import FleetStore

DEADLINE = 0.5
SLACK = 0.6  # scheduling on a loaded 2-core host: a call may come back this much after its deadline


def store_for(server: ScriptedServer, timeout_s: float = DEADLINE, **opts: str) -> FleetStore:
    if server.proto == "http":
        return HttpStore(server.url(**opts), timeout_s=timeout_s)
    return RedisStore(server.url(**opts), timeout_s=timeout_s)


@pytest.fixture(params=["http", "resp"])
def drip(request: pytest.FixtureRequest) -> Iterator[ScriptedServer]:
    """A store that answers every entry read one byte every 0.2 s (each socket read gets a byte well within
    any per-read timeout: only a whole-call deadline ends it)."""
    with ScriptedServer(request.param, Answer(body=b"x" * 4096, chunk=1, drip_s=0.2)) as server:
        yield server


def test_a_dripping_store_costs_a_call_its_deadline_then_is_skipped(drip: ScriptedServer, tmp_path: Path) -> None:
    k = key_of("drip")
    drip.keys = (k,)
    store = store_for(drip)
    cfg = make_cfg(tmp_path, fleet_timeout_s=DEADLINE)
    cache = TieredCache(LocalCache(cfg.local_cache_dir, cfg.cache_max_size), store, cfg, {})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t0 = time.monotonic()
        entry, source = cache.get_or_compile(k, lambda: make_entry(k, b"compiled here"))
        took = time.monotonic() - t0
        assert (entry.payload, source) == (b"compiled here", "compiled")
        assert took < DEADLINE + SLACK, took  # one deadline, then the breaker skips the lease and the put
        t0 = time.monotonic()
        assert store.get(key_of("another")) is None  # skipped at once while the breaker is open
        assert time.monotonic() - t0 < 0.05
    assert store.faults.counts.get("timeout") == 1, store.faults.counts
    timeouts = [w for w in caught if issubclass(w.category, CacheWarning) and "(timeout)" in str(w.message)]
    assert len(timeouts) == 1 and "TORCH_NEURONX_FLEET_TIMEOUT" in str(timeouts[0].message)
    # The abandoned socket call stops at its deadline too (the transport checks it before each read).
    deadline = time.monotonic() + 2.0
    while store.calls.abandoned and time.monotonic() < deadline:
        time.sleep(0.02)
    assert store.calls.abandoned == 0
    store.close()


def test_a_dripping_http_header_still_costs_only_the_deadline() -> None:
    """The answer's status line itself drips: the caller leaves at the deadline (the thread reading the
    header is abandoned; at most `max_abandoned` of them per store)."""
    with ScriptedServer("http", Answer(body=b"", chunk=1, drip_s=0.2)) as server:
        store = HttpStore(server.url(), timeout_s=DEADLINE)
        server.answer.body = b""
        import socket

        real = server._serve_http

        def header_drip(conn: socket.socket) -> None:
            conn.recv(65536)
            for b in b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\n\r\nx":
                time.sleep(0.2)
                conn.sendall(bytes([b]))

        server._serve_http = header_drip  # type: ignore[method-assign]
        t0 = time.monotonic()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            assert store.get(key_of("h")) is None
        assert time.monotonic() - t0 < DEADLINE + SLACK
        assert "timeout" in store.faults.counts
        server._serve_http = real  # type: ignore[method-assign]


def test_redis_value_announced_at_600_mib_is_refused_before_it_is_read(tmp_path: Path) -> None:
    """The issue's figure: a value announced at 600 MiB (and really sent, 1 MiB at a time, as fast as the
    client reads) grows the reader's peak RSS by < 300 MiB. Refused from the length line: ~0."""
    one_mib = b"v" * (1 << 20)
    answer = Answer(body=one_mib, announce=600 << 20, chunk=1 << 20)
    with ScriptedServer("resp", answer) as server:
        server.answer.body = one_mib
        # Send the same MiB 600 times (the test process holds 1 MiB, not 600).
        real_send = server._send

        def send_600(conn: Any, head: bytes, body: bytes, tail: bytes = b"") -> bool:
            return real_send(conn, head, b"", b"") and all(real_send(conn, b"", body) for _ in range(600))

        server._send = send_600  # type: ignore[method-assign]
        store = RedisStore(server.url(), timeout_s=10.0)
        _reset_peak_rss()
        before = _rss("VmHWM")
        t0 = time.monotonic()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            assert store.get(key_of("big")) is None
        grew = _rss("VmHWM") - before
        assert grew < 300 << 20, grew >> 20
        assert time.monotonic() - t0 < 5
        assert store.faults.counts.get("too_large") == 1, store.faults.counts
        assert answer.stats["sent"] < 64 << 20  # it stopped reading at the length line
        store.close()


def _reset_peak_rss() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := the current RSS


def _rss(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise AssertionError(field)


def test_http_record_that_understates_the_blob_is_read_only_to_the_cap() -> None:
    """The record says 10 bytes, the blob answer announces 8 MiB: refused from Content-Length; and a
    chunked one (no length) is cut at max_entry + 1."""
    k = key_of("understated")
    for chunked in (False, True):
        with ScriptedServer("http", Answer(body=b"z" * (8 << 20), record_size=10, chunked=chunked)) as server:
            server.keys = (k,)
            store = HttpStore(server.url(max_entry="64KiB"), timeout_s=5)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                assert store.get(k) is None
            assert store.faults.counts == {"too_large": 1}, store.faults.counts
            store.close()


# ------------------------------------------------------------------------------------------ path store
def test_path_entries_that_are_not_regular_files_are_refused_unread(tmp_path: Path) -> None:
    store = SharedPathStore(str(tmp_path / "fleet"), timeout_s=DEADLINE)
    fifo, zero, big, ok = (key_of(n) for n in ("fifo", "zero", "big", "ok"))
    for k in (fifo, zero, big, ok):
        Path(store._path(k)).parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(store._path(fifo))  # no writer: a blocking open would wait forever
    os.symlink("/dev/zero", store._path(zero))  # reads never end
    with open(store._path(big), "wb") as f:
        f.truncate(store.max_entry + 1)  # sparse: announced by stat, never read
    assert store.put(ok, b"fine")
    t0 = time.monotonic()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert [store.get(k) for k in (fifo, zero, big)] == [None, None, None]
    assert time.monotonic() - t0 < DEADLINE  # refused at once, not at the deadline
    assert store.faults.counts == {"not_regular": 2, "too_large": 1}, store.faults.counts
    assert store.get(ok) == b"fine"


class _HungMount(SharedPathStore):
    """A path store whose filesystem hangs: each `get` blocks in a real `read(2)` on a pipe that nobody
    writes to until the test lets it go (what a hung NFS mount does to `open`/`read`)."""

    def __init__(self, root: str) -> None:
        super().__init__(root, timeout_s=DEADLINE)
        self.pipes: list[tuple[int, int]] = []

    def get(self, key: str) -> bytes | None:
        r, w = os.pipe()
        self.pipes.append((r, w))
        return self._guard("get", None, lambda: os.read(r, 1) or None)


def test_a_hung_mount_costs_each_call_its_deadline_and_stuck_calls_are_capped(tmp_path: Path) -> None:
    store = _HungMount(str(tmp_path / "fleet"))
    store.cooldown_s = 0.0  # look at every call (the breaker is another test's)
    store.calls.max_abandoned = 2
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for _ in range(2):
                t0 = time.monotonic()
                assert store.get(key_of("hung")) is None
                assert DEADLINE - 0.05 < time.monotonic() - t0 < DEADLINE + SLACK
            t0 = time.monotonic()
            assert store.get(key_of("hung")) is None  # two calls still stuck: answered at once
            assert time.monotonic() - t0 < 0.1
        assert store.calls.abandoned == 2 and store.faults.counts == {"timeout": 3}
    finally:
        for _, w in store.pipes:
            os.write(w, b"x")  # the mount comes back: the stuck calls end, their slots free
    deadline = time.monotonic() + 2
    while store.calls.abandoned and time.monotonic() < deadline:
        time.sleep(0.01)
    assert store.calls.abandoned == 0


def test_deadline_runner_returns_results_and_raises_errors() -> None:
    runner = DeadlineRunner("t")
    assert runner.run(lambda: 42, 1.0) == 42
    with pytest.raises(KeyError):
        runner.run(lambda: {}["x"], 1.0)
    runner.max_abandoned = 0
    with pytest.raises(StoreHung):
        runner.run(lambda: 1, 1.0)


def test_a_store_error_with_percent_signs_is_a_miss_not_a_crash() -> None:
    """A store's own words go into the fault's one warning: '%' in them is text, not a format (the fuzz
    found `get` raising ValueError on an HTTP 500 whose body held '%')."""
    k = key_of("percent")
    with ScriptedServer("http", Answer(body=b"100% full: %s %d %`", status=500)) as server:
        server.keys = (k,)
        store = HttpStore(server.url(), timeout_s=5)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert store.get(k) is None
        assert store.faults.counts == {"server": 1}
        assert any("100% full" in str(w.message) for w in caught)
        store.close()


@pytest.fixture(params=["unary", "stream"])
def slow_grpc(request: pytest.FixtureRequest) -> Iterator[str]:
    """A real gRPC server on 127.0.0.1 speaking the cache service's `Get` and `GetStream` (raw bytes, as
    cache_server does): `unary` answers `Get` after 5 s; `stream` sends the entry through `GetStream` one
    byte every 0.2 s (each message in time for any per-message wait: only the call's deadline ends it)."""
    from concurrent import futures

    import grpc

    from cache_server._keys import SERVICE, SIZE_MD

    stop = threading.Event()

    def get(raw: bytes, ctx: Any) -> bytes:
        if request.param == "unary":
            stop.wait(5.0)
            return b"x" * 16
        ctx.set_trailing_metadata(((SIZE_MD, "4096"),))
        ctx.abort(grpc.StatusCode.FAILED_PRECONDITION, "fetch it with GetStream")

    def get_stream(raw: bytes, ctx: Any) -> Iterator[bytes]:
        ctx.send_initial_metadata(((SIZE_MD, "4096"),))
        for _ in range(4096):
            if stop.wait(0.2):
                return
            yield b"x"

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {
        "Get": grpc.unary_unary_rpc_method_handler(get),
        "GetStream": grpc.unary_stream_rpc_method_handler(get_stream)}),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"grpc://127.0.0.1:{port}"
    finally:
        stop.set()
        server.stop(0)


def _one_deadline_then_skipped(store: FleetStore, fault: str) -> None:
    """A read of `store` (slow) costs its deadline, counted as `fault` with a warning; the next is
    answered at once while the breaker is open."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t0 = time.monotonic()
        assert store.get(key_of("slow")) is None
        took = time.monotonic() - t0
        assert took < DEADLINE + SLACK, took
        t0 = time.monotonic()
        assert store.get(key_of("another")) is None  # skipped while the breaker is open
        assert time.monotonic() - t0 < 0.05
    assert store.faults.counts.get(fault) == 1, store.faults.counts
    assert any(f"({fault})" in str(w.message) for w in caught), [str(w.message) for w in caught]


def test_a_slow_grpc_store_costs_a_read_its_deadline_then_is_skipped(slow_grpc: str) -> None:
    """gRPC carries the deadline on the call itself (a slow answer, a dripping stream)."""
    from neuron_runtime.cache._grpc import GrpcBackend

    store = GrpcBackend(slow_grpc, timeout_s=DEADLINE)
    try:
        _one_deadline_then_skipped(store, "unavailable")  # (DEADLINE_EXCEEDED counts as unavailable)
    finally:
        store.close()


def test_a_dripping_s3_endpoint_costs_a_read_its_deadline_then_is_skipped() -> None:
    """An S3 endpoint that answers GetObject one byte every 0.2 s (a real socket server)."""
    from neuron_runtime.cache import S3Store

    with ScriptedServer("http", Answer(body=b"x" * 4096, chunk=1, drip_s=0.2)) as server:
        _one_deadline_then_skipped(S3Store("s3://bucket/prefix", timeout_s=DEADLINE, key="test", secret="test",
                                           endpoint_url=f"http://127.0.0.1:{server.port}"), "timeout")

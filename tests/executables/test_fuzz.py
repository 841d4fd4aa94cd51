"""Fuzzing (hypothesis) what crosses a process boundary into the runtime (issue 29): job manifests and the
compile service's protocol. Zero crashes, zero wrong results, no unbounded growth of threads or memory.

FUZZ_EXAMPLES (default 300 each here) sets the number of cases; the issue's run uses 10,000:
`FUZZ_EXAMPLES=10000 pytest tests/executables/test_fuzz.py`."""

from __future__ import annotations

import json
import os
import queue
import socket
import threading
import time
from pathlib import Path
from typing import Any

import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from test_server import add_signature, start_service

from neuron_runtime import _config

from neuron_runtime.cache import envelope
from neuron_runtime.cache import TieredCache
from neuron_runtime.cache._memory import MemoryStore
from neuron_runtime.compiler import get_compiler
from neuron_runtime.executables import _checks, _manifest
from neuron_runtime.signatures import _ops, _shapes, _signature

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", 300))
SETTINGS = settings(max_examples=EXAMPLES, deadline=None, database=None, phases=[Phase.generate],
                    suppress_health_check=list(HealthCheck))
JOB = "fuzz-job"
FP = get_compiler("reference").fingerprint()

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner, max_size=5),
    max_leaves=30)


def _real_signatures() -> list[dict[str, Any]]:
    x, m = torch.zeros(3, 4), torch.zeros(4, 5)
    return [_signature.build(_ops.classify("aten::add.Tensor"), (x, x, 1)),
            _signature.build(_ops.classify("aten::mul.Tensor"), (x, x)),
            _signature.build(_ops.classify("aten::mm"), (x, m)),
            _signature.build(_ops.classify("aten::relu"), (x,))]


REAL = _real_signatures()


def _paths(v: Any, at: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [at]
    if isinstance(v, dict):
        for k, x in v.items():
            out += _paths(x, (*at, k))
    elif isinstance(v, list):
        for i, x in enumerate(v):
            out += _paths(x, (*at, i))
    return out


@st.composite
def mutated(draw: Any) -> Any:
    """A real signature with one part replaced (sizes, a name, a kind, a whole subtree), or as it is."""
    sig = json.loads(json.dumps(draw(st.sampled_from(REAL))))
    for _ in range(draw(st.integers(0, 3))):
        paths = _paths(sig)[1:]
        if not paths:
            break
        path = draw(st.sampled_from(paths))
        node = sig
        for p in path[:-1]:
            node = node[p]
        node[path[-1]] = draw(st.one_of(json_values, st.integers(-(2**63), 2**63), st.sampled_from(
            ["aten::add.Tensor", "aten::no_such", "tensor", "value", [2**40], [3, 4], "s0"])))
    return sig


signatures = st.one_of(mutated(), json_values)


@st.composite
def segments(draw: Any) -> bytes:
    kind = draw(st.integers(0, 3))
    if kind == 0:
        return draw(st.binary(max_size=200))
    if kind == 1:
        return json.dumps(draw(json_values)).encode()
    doc: dict[str, Any] = {"format": _manifest.FORMAT, "job": JOB, "segment": 0,
                           "signatures": draw(st.lists(signatures, max_size=8))}
    if kind == 3:  # the envelope's fields, but one of them wrong
        doc[draw(st.sampled_from(["format", "job", "segment", "signatures"]))] = draw(json_values)
    return _signature.canonical(doc)


def _resolver() -> Any:
    from neuron_runtime.aten import _runtime

    return _runtime.runtime().resolver


@SETTINGS
@given(st.lists(segments(), min_size=1, max_size=3))
def test_fuzz_manifest_chains(payloads: list[bytes]) -> None:
    """Segments of any content in a tier: reading the chain never raises, keeps the bounds, keeps only
    exact signatures of real ops, and none of them can make a key use another key's executable."""
    cfg = _config.Config(local_cache_dir="/nonexistent-fuzz")
    cache = TieredCache(MemoryStore(), MemoryStore(), cfg, {})
    for i, payload in enumerate(payloads):
        key = _manifest.segment_key(JOB, FP, i)
        header = _manifest.header(JOB, FP, i, "fuzz")
        cache.fleet.put(key, envelope.pack(key, header, payload, None))  # type: ignore[union-attr]
    res = _resolver()
    chain = _manifest.Chain(cache, JOB, FP, lambda s: _signature.cache_key(s, FP))
    items = chain.read()
    assert len(items) <= _manifest.MAX_ITEMS
    for k, sig in items.items():
        _checks.check_hint(sig)  # what was kept passes the checks (and is an exact signature)
        assert not _shapes.is_class(sig) and k == res.key(sig)
        allowed = res.allowed(sig)
        assert allowed[-1] == k and all(c.get("example") == sig for c in _shapes.classes(sig))
        assert not res.link(k, "0" * 64, sig)  # nothing but its own candidates may serve it


@SETTINGS
@given(signatures)
def test_fuzz_signature_checks(sig: Any) -> None:
    """The checks a worker and a manifest reader run never raise anything but ValueError."""
    try:
        _checks.check_hint(sig)
    except ValueError:
        pass
    try:
        _checks.check_bounds(sig)
    except ValueError:
        pass


# -- the compile service's protocol ----------------------------------------------------------------------
@st.composite
def lines(draw: Any) -> bytes:
    kind = draw(st.integers(0, 5))
    if kind == 0:
        return draw(st.binary(max_size=300)).replace(b"\n", b" ") + b"\n"
    if kind == 1:
        return json.dumps(draw(json_values)).encode() + b"\n"
    if kind == 2:  # well formed, with signatures of any content: what reaches the worker
        sigs = draw(st.lists(mutated(), min_size=1, max_size=3))
        key = _signature.cache_key(sigs[0], FP)
        return json.dumps({"op": "compile", "key": key, "payload": {"signatures": sigs, "key": key},
                           "priority": draw(st.integers(0, 1))}).encode() + b"\n"
    msg: dict[str, Any] = {"op": draw(st.sampled_from(["hello", "status", "compile", "compile", "nope"]))}
    if msg["op"] == "compile":
        sigs = draw(st.lists(signatures, min_size=0, max_size=3))
        key = draw(st.one_of(st.just(None), st.text(max_size=70), st.sampled_from(["0" * 64])))
        if isinstance(sigs, list) and sigs and isinstance(sigs[0], dict):
            key = draw(st.sampled_from([key, _signature.cache_key(sigs[0], FP)]))
        msg.update(key=key, payload=draw(st.one_of(st.just({"signatures": sigs, "key": key}), json_values)),
                   priority=draw(st.one_of(st.integers(-2, 3), json_values)))
    for _ in range(draw(st.integers(0, 2))):
        msg[draw(st.text(max_size=6))] = draw(json_values)
    return json.dumps(msg).encode() + b"\n"


def _proc_status(pid: int) -> dict[str, int]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("Threads", "VmRSS"):
            out[name] = int(value.split()[0])
    return out


class _Conn:
    """A client that reads its answers all the time, on a thread of its own (as `ServiceClient` does)."""

    def __init__(self, path: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(path)
        self.inbox: queue.Queue[Any] = queue.Queue()
        self.done: dict[str, list[dict[str, Any]]] = {}
        threading.Thread(target=self._reader, daemon=True).start()

    def _reader(self) -> None:
        buf = b""
        while True:
            try:
                chunk = self.sock.recv(1 << 16)
            except OSError:
                chunk = b""
            if not chunk:
                self.inbox.put(None)
                return
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                self.inbox.put(json.loads(line))

    def read(self) -> dict[str, Any]:
        msg = self.inbox.get(timeout=120)
        assert msg is not None, "the service hung up"
        assert isinstance(msg, dict) and msg.get("op") in ("hello", "status", "error", "started", "done"), msg
        if msg["op"] == "done":
            self.done.setdefault(msg["key"], []).append(msg)
        return msg

    def until_status(self) -> int:
        """Ask for the status; read up to its answer. Returns the number of errors seen meanwhile."""
        self.sock.sendall(b'{"op": "status"}\n')
        errors = 0
        while (m := self.read())["op"] != "status":
            errors += m["op"] == "error"
        return errors


def test_fuzz_service_protocol(tmp_path: Path) -> None:
    """Fuzzed lines at one real service: each is answered (an error for anything malformed), the service
    and its worker live, a compile's answer names one of the request's own candidates, and threads and
    memory stay bounded."""
    with start_service(tmp_path) as (path, proc):
        c = _Conn(path)
        key, sig = add_signature(5)
        c.sock.sendall(json.dumps({"op": "compile", "key": key, "payload": {"signatures": [sig], "key": key}}).encode()
                       + b"\n")
        while key not in c.done:
            c.read()
        assert c.done[key][0]["status"] == "compiled"  # warm: the worker is up
        base = _proc_status(proc.pid)
        # key -> candidate keys of every request under it (the service keeps one job per key: a later request
        # joins the first one's; its client checks the answer against its own candidates)
        asked: dict[str, set[str]] = {}
        counts = {"lines": 0, "errors": 0}

        @SETTINGS
        @given(lines())
        def one(line: bytes) -> None:
            try:
                msg = json.loads(line)
            except ValueError:
                msg = None
            if isinstance(msg, dict) and msg.get("op") == "compile" and isinstance(msg.get("key"), str):
                sigs = (msg.get("payload") or {}).get("signatures") if isinstance(msg.get("payload"), dict) else None
                if isinstance(sigs, list):
                    try:
                        asked.setdefault(msg["key"], set()).update(_signature.cache_key(s, FP) for s in sigs)
                    except (TypeError, ValueError):
                        pass
            c.sock.sendall(line)
            counts["lines"] += 1
            counts["errors"] += c.until_status()
            assert proc.poll() is None

        one()
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:  # every compile the service took is answered
            c.sock.sendall(b'{"op": "status"}\n')
            while (m := c.read())["op"] != "status":
                pass
            if m["queued"] + m["running"] == 0:
                break
        end = _proc_status(proc.pid)
        print(f"fuzz: {counts['lines']} lines, {counts['errors']} errors, {m['counts']['jobs']} compile jobs")
        for k, answers in c.done.items():
            for a in answers:
                if a["status"] in ("compiled", "present"):
                    assert a.get("found") in asked.get(k, {a.get("found")}), a
                assert a["status"] in ("compiled", "present", "refused", "failed", "busy"), a
        print(f"fuzz: service threads {base['Threads']} -> {end['Threads']}, RSS {base['VmRSS']} -> "
              f"{end['VmRSS']} kB, {sum(len(v) for v in c.done.values())} compile answers")
        assert end["Threads"] <= base["Threads"] + 4
        assert end["VmRSS"] - base["VmRSS"] < 64 * 1024
        c.sock.close()

"""The compile service's protocol, against a real service process with real (reference-tier) workers: bad
lines get an error and the connection goes on, a key asked for by several clients is one job, a client
that floods without a newline is cut off alone, and the service removes its socket when idle."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from neuron_runtime.compiler import get_compiler
from neuron_runtime.executables._service import _client, _server
from neuron_runtime.signatures import _ops, _signature


class Client:
    def __init__(self, path: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(60)
        self.sock.connect(path)
        self.buf = b""

    def send(self, raw: bytes) -> None:
        self.sock.sendall(raw)

    def ask(self, msg: dict[str, Any]) -> None:
        self.send(json.dumps(msg).encode() + b"\n")

    def read(self) -> dict[str, Any] | None:
        while b"\n" not in self.buf:
            chunk = self.sock.recv(1 << 16)
            if not chunk:
                return None
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return json.loads(line)

    def until_done(self, key: str) -> dict[str, Any]:
        while True:
            m = self.read()
            assert m is not None, "the service hung up before answering"
            if m.get("op") == "done" and m.get("key") == key:
                return m

    def close(self) -> None:
        self.sock.close()


HOOKS = Path(__file__).resolve().parent / "hooks"


def service_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCH_NEURONX_", "NEURON_TEST_"))}
    env.update(TORCH_NEURONX_COMPILER="reference", TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR=str(tmp_path / "local"),
               PYTHONPATH=os.pathsep.join([str(HOOKS), env.get("PYTHONPATH", "")]).rstrip(os.pathsep), **extra)
    return env


@contextlib.contextmanager
def start_service(tmp_path: Path, *args: str, **extra: str) -> Iterator[tuple[str, subprocess.Popen[str]]]:
    """A real service (reference workers) on a socket of its own in this user's service directory."""
    d = _client.service_dir()
    path = os.path.join(getattr(d, "path", d), f"test-{os.getpid()}-{tmp_path.name}.sock")
    log = open(tmp_path / "service.log", "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen([sys.executable, _client.SERVER, "--socket", path, "--workers", "1",
                             "--idle-timeout", "2", "--timeout", "120", *args], env=service_env(tmp_path, **extra), text=True,
                            stderr=log)
    deadline = time.monotonic() + 30
    while not os.path.exists(path):
        assert proc.poll() is None and time.monotonic() < deadline, "the service did not start"
        time.sleep(0.05)
    try:
        yield path, proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        log.close()
        print((tmp_path / "service.log").read_text()[-3000:])  # shown when a test fails


@pytest.fixture
def service(tmp_path: Path) -> Iterator[tuple[str, subprocess.Popen[str]]]:
    with start_service(tmp_path) as got:
        yield got


def add_signature(n: int, op: str = "aten::add.Tensor") -> tuple[str, dict[str, Any]]:
    x = torch.zeros(n)
    sig = _signature.build(_ops.classify(op), (x, x, 1) if op == "aten::add.Tensor" else (x, x))
    return _signature.cache_key(sig, get_compiler("reference").fingerprint()), sig


def compile_request(key: str, sig: dict[str, Any]) -> dict[str, Any]:
    return {"op": "compile", "key": key, "payload": {"signatures": [sig], "key": key}, "priority": 0}


def test_the_service_runs_on_the_standard_library_alone() -> None:
    # As the runtime starts it (by path), with no site-packages at all: the service and its worker pool
    # load, and nothing outside the standard library (torch least of all) is imported; then it runs.
    here = os.path.dirname(_client.SERVER)
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import _server; own = {'__main__', '_server', '_client', '_pool'}; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] not in sys.stdlib_module_names | own))")
    r = subprocess.run([sys.executable, "-I", "-S", "-c", code, here], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr
    r = subprocess.run([sys.executable, "-E", "-s", "-S", _client.SERVER, "--help"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0 and "--socket" in r.stdout, r.stderr


def test_bad_lines_get_an_error_and_the_connection_goes_on(service: tuple[str, subprocess.Popen[str]]) -> None:
    path, _ = service
    c = Client(path)
    for raw in (b"not json\n", b"[1, 2]\n", b'{"no": "op"}\n', b'{"op": "format-disk"}\n',
                b'{"op": "compile", "key": 7}\n', b'{"op": "compile", "key": "k", "payload": "x"}\n'):
        c.send(raw)
        m = c.read()
        assert m is not None and m["op"] == "error" and m["reason"], raw
    c.ask({"op": "hello", "pid": os.getpid()})
    hello = c.read()
    assert hello is not None and hello["protocol"] == _server.PROTOCOL and hello["workers"] == 1
    c.ask({"op": "status"})
    status = c.read()
    assert status is not None and status["counts"]["jobs"] == 0  # nothing bad was queued
    c.close()


def test_one_job_per_key_however_many_clients_ask(service: tuple[str, subprocess.Popen[str]]) -> None:
    path, _ = service
    key, sig = add_signature(5)
    clients = [Client(path) for _ in range(3)]
    for c in clients:
        c.ask({"op": "compile", "key": key, "payload": {"signatures": [sig], "key": key}, "priority": 0})
    answers = [c.until_done(key) for c in clients]
    assert {a["status"] for a in answers} == {"compiled"}
    assert sum(a["caused"] for a in answers) == 1  # one client's stats count the compile
    # Asked again once it is in: the worker finds it present, nothing is compiled twice.
    clients[0].ask({"op": "compile", "key": key, "payload": {"signatures": [sig], "key": key}})
    assert clients[0].until_done(key)["status"] == "present"
    clients[0].ask({"op": "status"})
    status = clients[0].read()
    assert status is not None and status["counts"]["compiled"] == 1 and status["counts"]["jobs"] == 2
    for c in clients:
        c.close()


def test_a_client_flooding_without_newlines_is_cut_off_alone(service: tuple[str, subprocess.Popen[str]]) -> None:
    path, proc = service
    flood = Client(path)
    chunk = b"x" * (1 << 20)
    try:
        for _ in range(_server.MAX_LINE // len(chunk) + 2):
            flood.send(chunk)
    except OSError:
        pass  # the service hung up first
    # The service says why and hangs up; with the flood still unread in its socket the kernel may turn
    # the hang-up into a reset that overtakes the message. Either way this client is cut off.
    try:
        m = flood.read()
        assert m is not None and m["op"] == "error" and "longer than" in m["reason"]
        assert flood.read() is None
    except ConnectionResetError:
        pass
    other = Client(path)
    other.ask({"op": "status"})
    assert (other.read() or {}).get("op") == "status" and proc.poll() is None
    other.close()


def test_idle_service_exits_and_removes_its_socket(service: tuple[str, subprocess.Popen[str]]) -> None:
    path, proc = service
    key, sig = add_signature(6)
    c = Client(path)
    c.ask({"op": "compile", "key": key, "payload": {"signatures": [sig], "key": key}})
    assert c.until_done(key)["status"] == "compiled"
    c.close()
    assert proc.wait(timeout=60) == 0  # 2 s idle timeout once the last client left
    assert not os.path.exists(path)


# -- issue 29: the service survives its clients ------------------------------------------------------------
def test_malformed_compiles_are_answered_and_compiles_go_on(service: tuple[str, subprocess.Popen[str]]) -> None:
    path, proc = service
    key, sig = add_signature(7)
    c = Client(path)
    bad = [{"signatures": []}, {"signatures": "x"}, {"signatures": [1, 2]}, {}, {"signatures": [sig] * 9},
           {"signatures": [sig], "key": "f" * 64}]
    for payload in bad + bad:  # each twice: two dead workers used to break the service for good
        c.ask({"op": "compile", "key": key, "payload": payload})
        m = c.read()
        assert m is not None and m["op"] == "error" and m["reason"], payload
    for raw in (b"[" * 200000 + b"\n", b'{"op": ["compile"]}\n', b'{"op": "compile", "key": "' + b"a" * 64 + b'"}\n'):
        c.send(raw)
        m = c.read()
        assert m is not None and m["op"] == "error", raw[:40]
    c.ask(compile_request(key, sig))
    assert c.until_done(key)["status"] == "compiled" and proc.poll() is None
    c.close()


def test_a_signature_that_kills_workers_is_refused_alone(tmp_path: Path) -> None:
    with start_service(tmp_path, NEURON_TEST_COMPILE_CRASH="aten::mul") as (path, proc):
        c = Client(path)
        mul, mul_sig = add_signature(5, "aten::mul.Tensor")
        c.ask(compile_request(mul, mul_sig))
        first = c.until_done(mul)
        assert first["status"] == "failed" and "killed 2 compile workers" in first["reason"]
        t0 = time.monotonic()
        c.ask(compile_request(mul, mul_sig))  # asked again: refused at once, no worker dies for it
        assert c.until_done(mul)["status"] == "failed" and time.monotonic() - t0 < 5
        for n in (5, 6):  # every other signature compiles as before
            key, sig = add_signature(n)
            c.ask(compile_request(key, sig))
            m = c.until_done(key)
            assert m["status"] == "compiled", m
        c.close()
        assert proc.poll() is None


def test_workers_that_cannot_start_back_off_and_recover(tmp_path: Path) -> None:
    flag = tmp_path / "no-workers"
    flag.touch()
    with start_service(tmp_path, NEURON_TEST_WORKER_START_FAIL=str(flag)) as (path, proc):
        c = Client(path)
        key, sig = add_signature(5)
        c.ask(compile_request(key, sig))
        m = c.until_done(key)
        assert m["status"] == "failed" and "cannot start" in m["reason"] and m["retry_after"] > 0
        flag.unlink()  # the environment is fixed (memory freed, a package reinstalled, ...)
        time.sleep(m["retry_after"] + 0.2)
        c.ask(compile_request(key, sig))
        assert c.until_done(key)["status"] == "compiled"
        c.close()


def test_huge_tensor_sizes_are_refused_before_any_example_is_made(service: tuple[str, subprocess.Popen[str]]) -> None:
    path, proc = service
    _, sig = add_signature(5)
    huge = json.loads(json.dumps(sig))
    for a in huge["args"]:
        if isinstance(a[2], dict) and "sizes" in a[2]:
            a[2]["sizes"] = [1 << 45]
    key = _signature.cache_key(huge, get_compiler("reference").fingerprint())
    c = Client(path)
    c.ask(compile_request(key, huge))
    m = c.until_done(key)
    assert m["status"] == "failed" and "bytes" in m["reason"]
    key, sig = add_signature(6)
    c.ask(compile_request(key, sig))
    assert c.until_done(key)["status"] == "compiled" and proc.poll() is None
    c.close()


def test_the_worker_answers_every_line_and_lives(tmp_path: Path) -> None:
    key, sig = add_signature(5)
    proc = subprocess.Popen([sys.executable, "-m", "neuron_runtime.executables._service._worker"],
                            env=service_env(tmp_path), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdin is not None and proc.stdout is not None
    try:
        assert "ready" in proc.stdout.readline()
        lines = ["not json", "[]", '{"i": 1}', '{"i": 2, "signatures": []}', '{"i": 3, "signatures": [1]}',
                 "[" * 200000, json.dumps({"i": 4, "signatures": [{"op": "aten::add.Tensor"}]}),
                 json.dumps({"i": 5, "signature": sig, "key": "0" * 64}), json.dumps({"i": 6, "signatures": [sig]})]
        for line in lines:
            proc.stdin.write(line + "\n")
            proc.stdin.flush()
            answer = json.loads(proc.stdout.readline())
            assert answer["status"] == ("compiled" if line.startswith('{"i": 6') else "failed"), (line[:40], answer)
    finally:
        proc.stdin.close()
        assert proc.wait(timeout=60) == 0


def test_a_worker_killed_mid_batch_costs_no_key(tmp_path: Path) -> None:
    """Four signatures queued while the one worker starts go out as one batch; the worker is killed while
    it compiles the batch's second: a fresh worker compiles each unanswered one again, alone, and every
    key ends compiled with a whole entry in the local tier."""
    from neuron_runtime import _config
    from neuron_runtime.cache import envelope

    pids = tmp_path / "workers.txt"
    with start_service(tmp_path, "--batch", "4", NEURON_TEST_COMPILE_DELAY="*=0.5",
                       NEURON_TEST_WORKER_PIDS=str(pids)) as (path, proc):
        c = Client(path)
        jobs = [add_signature(n) for n in (11, 12, 13, 14)]
        c.send(b"".join(json.dumps({"op": "compile", "key": k, "payload": {"signatures": [sig], "key": k}}).encode()
                        + b"\n" for k, sig in jobs))
        deadline = time.monotonic() + 120
        lines: list[str] = []
        while len(lines) < 2:
            assert time.monotonic() < deadline, "the worker never compiled two signatures"
            lines = pids.read_text().splitlines() if pids.exists() else []
            time.sleep(0.02)
        victim = int(lines[0].split()[0])
        assert int(lines[1].split()[0]) == victim  # one worker, one batch
        os.kill(victim, 9)
        answers = [c.until_done(k) for k, _ in jobs]
        assert [a["status"] for a in answers] == ["compiled"] * 4, answers
        retried = [ln.split() for ln in pids.read_text().splitlines() if int(ln.split()[0]) != victim]
        assert len(retried) >= 3 and len({pid for pid, _ in retried}) == 1  # one fresh worker, one at a time
        cfg = _config.load({"TORCH_NEURONX_COMPILER": "reference",
                            "TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR": str(tmp_path / "local")})
        from neuron_runtime.cache import TieredCache

        cache = TieredCache.from_config(cfg, {})
        try:
            for k, _ in jobs:
                data, _where = cache.get(k)
                assert data is not None
                envelope.unpack(data, expected_key=k, signing_key=None)  # whole and verified
        finally:
            cache.close()
        c.close()

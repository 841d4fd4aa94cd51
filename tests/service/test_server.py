"""The compile service's protocol, against a real service process with real (reference-tier) workers: bad
lines get an error and the connection goes on, a key asked for by several clients is one job, a client
that floods without a newline is cut off alone, and the service removes its socket when idle."""

from __future__ import annotations

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


@pytest.fixture
def service(tmp_path: Path) -> Iterator[tuple[str, subprocess.Popen[str]]]:
    path = os.path.join(_client.service_dir(), f"test-{os.getpid()}-{tmp_path.name}.sock")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCH_NEURONX_")}
    env.update(TORCH_NEURONX_COMPILER="reference", TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR=str(tmp_path / "local"))
    proc = subprocess.Popen([sys.executable, _client.SERVER, "--socket", path, "--workers", "1",
                             "--idle-timeout", "2", "--timeout", "120"], env=env, text=True,
                            stderr=subprocess.PIPE)
    deadline = time.monotonic() + 30
    while not os.path.exists(path):
        assert proc.poll() is None and time.monotonic() < deadline, "the service did not start"
        time.sleep(0.05)
    try:
        yield path, proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


def add_signature(n: int) -> tuple[str, dict[str, Any]]:
    x = torch.zeros(n)
    sig = _signature.build(_ops.classify("aten::add.Tensor"), (x, x, 1))
    return _signature.cache_key(sig, get_compiler("reference").fingerprint()), sig


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

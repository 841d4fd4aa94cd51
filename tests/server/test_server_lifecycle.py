"""The process: CLI, env twins, health lifecycle, reflection flag, torch-freedom, generated code drift."""

from __future__ import annotations

import filecmp
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cache_server.__main__ import FLAGS, config_from_args
from cache_server._errors import ConfigError
from cache_server._keys import HEALTH_SERVICE, parse_size
from tests.conftest import REPO
from tests.server.conftest import ServerProc, key_of

pytestmark = pytest.mark.timeout(120)


def test_sizes() -> None:
    assert parse_size("10GiB") == 10 * 1024**3
    assert parse_size("500MB") == 500 * 1000**2
    assert parse_size("12345") == 12345
    assert parse_size("1.5G") == int(1.5 * 1024**3)
    assert parse_size("64KiB") == 65536
    with pytest.raises(ConfigError):
        parse_size("ten gigs")


def test_every_flag_has_an_env_twin(tmp_path: Path) -> None:
    env = {f.env: v for f, v in zip(FLAGS, [
        "127.0.0.1:1234", str(tmp_path), "2GiB", "1MiB", "", "", "", "", "127.0.0.1:9999", "0", "3", "DEBUG"])}
    cfg, level = config_from_args([], env)
    assert (cfg.listen, cfg.storage, cfg.max_size, cfg.max_blob_size, cfg.metrics_listen, cfg.grace_s) == (
        "127.0.0.1:1234", str(tmp_path), 2 * 1024**3, 1 << 20, "127.0.0.1:9999", 3.0)
    assert level == "DEBUG"
    # A flag beats its twin.
    cfg, _ = config_from_args(["--listen", "127.0.0.1:4321"], env)
    assert cfg.listen == "127.0.0.1:4321"
    cfg, _ = config_from_args([], {"NEURON_CACHE_SERVER_STORAGE": "/x", "NEURON_CACHE_SERVER_REFLECTION": "1"})
    assert cfg.reflection is True
    assert {f.env for f in FLAGS} == {"NEURON_CACHE_SERVER_" + f.name[2:].replace("-", "_").upper() for f in FLAGS}


@pytest.mark.parametrize("argv, words", [
    ([], "--storage is required"),
    (["--storage", "/x", "--max-size", "lots"], "not a size"),
    (["--storage", "/x", "--tls-cert", "c.pem"], "go together"),
    (["--storage", "/x", "--listen", "nowhere"], "HOST:PORT"),
])
def test_bad_flags_are_clear_errors(argv: list[str], words: str) -> None:
    r = subprocess.run([sys.executable, "-m", "cache_server", *argv], capture_output=True, text=True, cwd=REPO,
                       env={k: v for k, v in os.environ.items() if not k.startswith("NEURON_CACHE_SERVER_")})
    assert r.returncode == 2
    assert words in r.stderr


def test_reflection_without_the_package_is_a_clear_error(tmp_path: Path) -> None:
    try:
        import grpc_reflection  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("grpcio-reflection is installed here")
    r = subprocess.run([sys.executable, "-m", "cache_server", "--storage", str(tmp_path), "--listen",
                        "127.0.0.1:0", "--reflection"], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert r.returncode == 2
    assert "pip install grpcio-reflection" in r.stderr


def test_help_lists_every_flag_and_twin() -> None:
    r = subprocess.run([sys.executable, "-m", "cache_server", "--help"], capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 0
    text = " ".join(r.stdout.split())
    for f in FLAGS:
        assert f.name in text and f.env in text


def test_never_imports_torch() -> None:
    code = ("import sys, cache_server, cache_server.server, cache_server.client, cache_server.__main__, "
            "cache_server.storage.disk, cache_server.storage.s3, cache_server.metrics, cache_server.auth, "
            "cache_server.probe\n"
            "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))\n"
            "assert not bad, bad\nprint('ok')")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok"


def test_generated_code_matches_the_proto(tmp_path: Path) -> None:
    from grpc_tools import protoc

    rc = protoc.main(["protoc", f"-I{REPO / 'proto'}", f"--python_out={tmp_path}", f"--pyi_out={tmp_path}",
                      str(REPO / "proto/neuron_cache/v1/cache.proto")])
    assert rc == 0
    committed = REPO / "cache_server/_proto/neuron_cache/v1"
    for name in ("cache_pb2.py", "cache_pb2.pyi"):
        assert filecmp.cmp(tmp_path / "neuron_cache/v1" / name, committed / name, shallow=False), (
            f"{name} is stale: regenerate with `python -m grpc_tools.protoc -Iproto --python_out=cache_server/_proto "
            "--pyi_out=cache_server/_proto proto/neuron_cache/v1/cache.proto`")


def test_open_server_says_so_and_logs_json(server: ServerProc) -> None:
    import json

    time.sleep(0.2)
    lines = [json.loads(line) for line in server.read_log().splitlines() if line.startswith("{")]
    assert any(r["level"] == "warning" and "OPEN" in r["msg"] for r in lines)
    serving = [r for r in lines if r["msg"] == "serving"]
    assert serving and serving[0]["port"] == server.port


def test_sigterm_not_serving_then_drains(server_factory: type[ServerProc]) -> None:
    """Health flips to NOT_SERVING on SIGTERM, an in-flight call still completes, the process exits 0."""
    server = server_factory(None, "--grace", "15").start()
    channel = grpc.insecure_channel(server.address)
    watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=HEALTH_SERVICE),
                                                      timeout=30)
    assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
    client = server.client()
    key = key_of("in-flight")
    lease = client.acquire_lease(key, ttl_s=30)
    assert lease.acquired
    result: list[object] = []
    waiter = threading.Thread(target=lambda: result.append(client.wait_for(key, 4.0)))
    waiter.start()
    time.sleep(1.0)  # the WaitFor call is in flight now (it lasts 4 s; the grace is 15 s)
    assert server.proc is not None
    server.proc.send_signal(signal.SIGTERM)
    assert next(watch).status == health_pb2.HealthCheckResponse.NOT_SERVING
    waiter.join(20)
    assert [getattr(r, "name", r) for r in result] == ["TIMEOUT"]  # finished normally during the drain
    assert server.proc.wait(15) == 0
    channel.close()


def test_metrics_endpoint(server_factory: type[ServerProc]) -> None:
    import urllib.request

    from tests.conftest import free_port

    mport = free_port()
    s = server_factory(None, "--metrics-listen", f"127.0.0.1:{mport}").start()
    c = s.client()
    c.put(key_of("m"), b"abc")
    c.get(key_of("m"))
    c.get(key_of("absent"))
    text = urllib.request.urlopen(f"http://127.0.0.1:{mport}/metrics", timeout=5).read().decode()
    assert "neuron_cache_hits_total 1" in text
    assert "neuron_cache_misses_total 1" in text
    assert 'neuron_cache_requests_total{code="OK",method="Put"} 1' in text
    assert "neuron_cache_entries 1" in text
    with pytest.raises(urllib.error.HTTPError):
        urllib.request.urlopen(f"http://127.0.0.1:{mport}/other", timeout=5)


def test_docs_table_lists_every_flag_and_twin() -> None:
    doc = (REPO / "docs/server.md").read_text()
    rows = [line for line in doc.splitlines() if line.startswith("| `--")]
    for f in FLAGS:
        assert any(f"`{f.name}" in r and f"`{f.env}`" in r for r in rows), f"docs/server.md: no row for {f.name}"
    assert len(rows) == len(FLAGS)
    assert "run code on every reader" in doc  # the trust model is stated

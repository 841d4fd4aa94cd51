"""`rediss://` and `https://` stores over real TLS: Debian's redis-server with its TLS port and nginx with
`ssl`, certificates made for the test by `openssl` (a private CA, a server certificate for 127.0.0.1)."""

from __future__ import annotations

import shutil
import subprocess
import warnings
from pathlib import Path
from typing import Any

import pytest
from _cachetest import free_port, key_of, make_entry  # type: ignore[import-not-found]

from neuron_runtime.cache import HttpStore, RedisStore


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    d = tmp_path_factory.mktemp("pki")

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True, timeout=60)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=test CA",
        "-keyout", "ca.key", "-out", "ca.pem")
    run("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1", "-keyout", "server.key", "-out", "server.csr")
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    run("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial", "-days", "2",
        "-extfile", "san.ext", "-out", "server.pem")
    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=someone else",
        "-keyout", "other.key", "-out", "other.pem")
    return d


def test_rediss_with_a_private_ca(pki: Path, tmp_path: Path) -> None:
    from tests.conftest import RedisServer

    port = free_port()
    server = RedisServer(tmp_path / "redis", extra=[
        "--tls-port", str(port), "--tls-cert-file", str(pki / "server.pem"), "--tls-key-file", str(pki / "server.key"),
        "--tls-ca-cert-file", str(pki / "ca.pem"), "--tls-auth-clients", "no"])
    server.start()  # plaintext on server.port, TLS on `port`
    try:
        url = f"rediss://:{server.PASSWORD}@127.0.0.1:{port}?prefix=tls:"
        store = RedisStore(url + f"&ca={pki / 'ca.pem'}", timeout_s=5)
        k = key_of("tls")
        assert store.put(k, make_entry(k)) and store.get(k) is not None
        assert store.faults.total == 0
        # A server certificate from a CA we were not told to trust: a counted fault, never a connection.
        wrong = RedisStore(url + f"&ca={pki / 'other.pem'}", timeout_s=5)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            assert wrong.get(k) is None
        assert wrong.faults.total == 1
    finally:
        server.stop()


def test_https_with_a_private_ca(pki: Path, tmp_path: Path) -> None:
    from tests.conftest import NginxDav

    nginx = NginxDav(tmp_path / "nginx")
    conf = (tmp_path / "nginx" / "nginx.conf").read_text()
    conf = conf.replace(f"listen 127.0.0.1:{nginx.port};",
                        f"listen 127.0.0.1:{nginx.port} ssl; ssl_certificate {pki / 'server.pem'}; "
                        f"ssl_certificate_key {pki / 'server.key'};")
    (tmp_path / "nginx" / "nginx.conf").write_text(conf)
    nginx.start()
    try:
        base = nginx.url("tls").replace("http://", "https://")
        store = HttpStore(f"{base}?ca={pki / 'ca.pem'}", timeout_s=5)
        k = key_of("tls")
        data = make_entry(k)
        assert store.put(k, data) and store.get(k) == data
        # the pipelined lookups speak TLS too
        others = [key_of(f"o{i}") for i in range(6)]
        assert store.contains_many([k, *others]) == {k}
        assert store.faults.total == 0, store.faults.counts
        wrong = HttpStore(f"{base}?ca={pki / 'other.pem'}", timeout_s=5)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            assert wrong.get(k) is None
        assert set(wrong.faults.counts) == {"tls"}
    finally:
        nginx.stop()


def test_tls_options_need_a_tls_scheme(pki: Path) -> None:
    from neuron_runtime.cache import StoreConfigError

    with pytest.raises(StoreConfigError, match="rediss://"):
        RedisStore(f"redis://127.0.0.1:1?ca={pki / 'ca.pem'}")
    with pytest.raises(StoreConfigError, match="https://"):
        HttpStore(f"http://127.0.0.1:1/x?ca={pki / 'ca.pem'}")
    with pytest.raises(StoreConfigError, match="unknown option"):
        RedisStore("redis://127.0.0.1:1?prefx=a")
    with pytest.raises(StoreConfigError, match="ttl"):
        RedisStore("redis://127.0.0.1:1?ttl=soon")

"""The runtime's grpc:// backend against real servers: the cache contract, failures as misses, the
circuit breaker, leases for single-flight, a server killed under a running job, TLS and mTLS."""

from __future__ import annotations

import datetime
import socket
import threading
import time
import warnings
from pathlib import Path

import pytest

# `import torch` first: importing neuron_runtime loads the device, and the torch.backends entry point
# expects torch to be the one importing it (neuron_runtime before torch is a circular import today).
import torch  # noqa: F401,E402  isort: skip
from neuron_runtime._config import Config
from neuron_runtime.cache._base import InvalidKeyError
from neuron_runtime.cache._errors import StoreConfigError
from neuron_runtime.cache._grpc import GrpcBackend, open_grpc
from tests.conftest import free_port
from tests.server.conftest import ServerProc, key_of

pytestmark = [pytest.mark.timeout(120), pytest.mark.filterwarnings("ignore::UserWarning")]


def backend(server: ServerProc, **kw: object) -> GrpcBackend:
    cfg = Config(cache_token=kw.pop("token", None), fleet_timeout_s=kw.pop("timeout", 5.0))  # type: ignore[arg-type]
    b = open_grpc(f"grpc://{server.address}", cfg)
    for k, v in kw.items():
        setattr(b, k, v)
    return b


def test_contract(server: ServerProc) -> None:
    b = backend(server)
    k1, k2, k3 = key_of("c1"), key_of("c2"), key_of("c3")
    assert b.get(k1) is None
    assert b.put(k1, b"one") is True
    assert b.put(k1, b"again") is True  # existing key: a no-op that reports presence
    assert b.get(k1) == b"one"
    assert b.put(k2, bytes(6 << 20)) is True  # above the unary limit: streamed
    assert b.get(k2) == bytes(6 << 20)
    assert b.contains_many([k1, k2, k3]) == {k1, k2}
    assert b.contains_many([]) == set()
    assert b.get_many([k1, k3]) == {k1: b"one"}
    infos = {e.key: e for e in b.entries()}
    assert set(infos) == {k1, k2} and infos[k1].size == 3 and infos[k1].mtime > 0
    assert b.delete(k1) is True and b.delete(k1) is False and b.get(k1) is None
    with pytest.raises(InvalidKeyError):
        b.get("../../etc/passwd")
    with pytest.raises(InvalidKeyError):
        b.contains_many(["nope"])
    b.close()
    b.close()  # idempotent
    assert b.get(k2) is None  # closed: a miss, not an error


def test_concurrent_threads(server: ServerProc) -> None:
    b = backend(server)
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            for j in range(20):
                k = key_of(f"t{i}-{j}")
                assert b.put(k, str(j).encode())
                assert b.get(k) == str(j).encode()
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(b.contains_many(key_of(f"t{i}-{j}") for i in range(8) for j in range(20))) == 160


def test_refusals_are_misses_and_counted(server_factory: type[ServerProc], tmp_path: Path) -> None:
    tf = tmp_path / "tokens"
    tf.write_text("rrr read\nwww write\n")
    s = server_factory(None, "--tokens-file", str(tf)).start()
    writer, reader, nobody = backend(s, token="www"), backend(s, token="rrr"), backend(s)
    k = key_of("refused")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert nobody.get(k) is None and nobody.put(k, b"x") is False
        assert reader.put(k, b"x") is False
    assert nobody.faults.counts == {"auth": 2} and reader.faults.counts == {"auth": 1}
    assert any("auth" in str(w.message) for w in caught)
    assert not nobody.breaker.is_open  # a refusal proves the server is alive
    assert writer.put(k, b"x") and reader.get(k) == b"x"


class BlackHole:
    """A TCP port that accepts connections and never answers: every call there runs into its deadline."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.conns: list[socket.socket] = []
        self._stop = False
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        self.sock.settimeout(0.1)
        while not self._stop:
            try:
                self.conns.append(self.sock.accept()[0])
            except OSError:
                continue

    def close(self) -> None:
        self._stop = True
        self.thread.join()
        for c in self.conns:
            c.close()
        self.sock.close()


def test_dead_server_costs_one_deadline_per_breaker_window() -> None:
    hole = BlackHole()
    try:
        # A window far longer than the test: every call after the first is answered by the open breaker.
        b = GrpcBackend(f"grpc://127.0.0.1:{hole.port}?breaker=600", timeout_s=0.3)
        k = key_of("dead")
        for _ in range(50):
            assert b.get(k) is None
            assert b.put(k, b"x") is False
            assert b.contains_many([k]) == set()
            assert b.try_lease(k, 10) is not None  # no answer: compile without a lease
        # Every spent deadline is one counted fault; an open breaker answers without spending one.
        assert b.faults.counts["unavailable"] == 1
        assert b.faults.counts["circuit_open"] == 199
        assert b.breaker.trips == 1
        # After a window: exactly one probe, which fails and reopens the breaker for another window.
        short = GrpcBackend(f"grpc://127.0.0.1:{hole.port}?breaker=3", timeout_s=0.3)
        assert short.get(k) is None
        time.sleep(3.2)
        for _ in range(10):
            assert short.get(k) is None
        assert short.faults.counts["unavailable"] == 2 and short.breaker.trips == 2
    finally:
        hole.close()


def test_refused_port_is_a_fast_miss() -> None:
    b = GrpcBackend(f"grpc://127.0.0.1:{free_port()}", timeout_s=5.0)
    assert b.get(key_of("x")) is None and b.put(key_of("x"), b"y") is False
    assert b.faults.counts == {"unavailable": 1, "circuit_open": 1}


def test_job_survives_server_kill_and_recovers(server_factory: type[ServerProc]) -> None:
    """A "training job" keeps stepping through a SIGKILL of the server and uses it again after a restart."""
    s = server_factory().start()
    b = GrpcBackend(f"grpc://{s.address}?breaker=1", timeout_s=1.0)
    steps: list[int] = []
    errors: list[BaseException] = []
    stop = threading.Event()

    def job() -> None:
        i = 0
        while not stop.is_set():
            try:
                k = key_of(f"step{i % 50}")
                if b.get(k) is None:  # miss: "compile" and write through
                    b.put(k, b"exe%d" % (i % 50))
                steps.append(i)
            except BaseException as e:  # noqa: BLE001 - any exception fails the test
                errors.append(e)
                return
            i += 1
            time.sleep(0.005)

    t = threading.Thread(target=job)
    t.start()
    time.sleep(0.5)
    s.kill()
    before = len(steps)
    wait_until = time.monotonic() + 30
    while len(steps) <= before + 20 and time.monotonic() < wait_until:
        time.sleep(0.05)
    assert len(steps) > before + 20  # still stepping while the server is gone
    s2 = server_factory(s.storage, port=s.port).start()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and b.get(key_of("step1")) is None:
        time.sleep(0.2)
    stop.set()
    t.join(10)
    assert not errors
    assert b.get(key_of("step1")) == b"exe1"  # reconnected after the breaker window
    assert s2.alive()


def test_leases_single_flight(server: ServerProc) -> None:
    """Eight workers (own channels, as separate hosts would have) want the same keys: each compiles once."""
    compiles: list[str] = []
    lock = threading.Lock()
    keys = [key_of(f"sf{i}") for i in range(5)]

    def worker() -> None:
        b = backend(server)
        for k in keys:
            if b.get(k) is not None:
                continue
            lease = b.try_lease(k, ttl_s=30)
            if lease is None:
                if b.wait_for(k, timeout_s=20) is not None:
                    continue
                lease = b.try_lease(k, ttl_s=30)  # the holder gave up: take over
            with lease:  # type: ignore[union-attr]
                with lock:
                    compiles.append(k)
                time.sleep(0.1)  # compiling
                b.put(k, b"exe-" + k.encode())
        b.close()

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(compiles) == sorted(keys)


def test_released_lease_without_entry_wakes_waiters(server: ServerProc) -> None:
    a, b = backend(server), backend(server)
    k = key_of("gave-up")
    lease = a.try_lease(k, ttl_s=30)
    assert lease is not None and b.try_lease(k, ttl_s=30) is None
    threading.Timer(0.3, lease.release).start()
    assert b.wait_for(k, timeout_s=20) is None  # woken by the release, not by the 20 s timeout
    assert b.try_lease(k, ttl_s=30) is not None


def test_bad_urls() -> None:
    for url in ("grpc://", "grpc://host", "http://h:1", "grpc://h:1?what=1"):
        with pytest.raises(StoreConfigError):
            GrpcBackend(url)
    with pytest.raises(StoreConfigError, match="cannot read ca"):
        GrpcBackend("grpcs://h:1?ca=/no/such/file")


def _certs(tmp: Path) -> dict[str, Path]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)

    def make(name: str, issuer: tuple[x509.Certificate, ec.EllipticCurvePrivateKey] | None, ca: bool,
             san: list[x509.GeneralName] | None = None) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        builder = (x509.CertificateBuilder().subject_name(subject)
                   .issuer_name(issuer[0].subject if issuer else subject).public_key(key.public_key())
                   .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(days=1))
                   .not_valid_after(now + datetime.timedelta(days=1))
                   .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if san:
            builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
        return builder.sign(issuer[1] if issuer else key, hashes.SHA256()), key

    import ipaddress

    ca = make("test-ca", None, True)
    srv = make("localhost", ca, False, [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))])
    cli = make("client", ca, False)
    out: dict[str, Path] = {}
    for name, (cert, key) in {"ca": ca, "server": srv, "client": cli}.items():
        out[f"{name}.pem"] = tmp / f"{name}.pem"
        out[f"{name}.pem"].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        out[f"{name}.key"] = tmp / f"{name}.key"
        out[f"{name}.key"].write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                                         serialization.PrivateFormat.PKCS8,
                                                         serialization.NoEncryption()))
    return out


def test_tls_and_mtls(server_factory: type[ServerProc], tmp_path: Path) -> None:
    from cache_server import CacheClient

    c = _certs(tmp_path)
    s = server_factory(None, "--tls-cert", str(c["server.pem"]), "--tls-key", str(c["server.key"]),
                       "--tls-client-ca", str(c["ca.pem"]))
    probe = CacheClient(s.address, root_certificates=c["ca.pem"].read_bytes(),
                        client_cert=c["client.pem"].read_bytes(), client_key=c["client.key"].read_bytes(),
                        timeout=2)
    s.start(tls_client=probe)
    url = f"grpcs://127.0.0.1:{s.port}?ca={c['ca.pem']}&cert={c['client.pem']}&key={c['client.key']}"
    b = GrpcBackend(url, timeout_s=3)
    k = key_of("tls")
    assert b.put(k, b"secret") and b.get(k) == b"secret"
    # Without a client certificate the handshake fails: a miss, counted.
    anon = GrpcBackend(f"grpcs://127.0.0.1:{s.port}?ca={c['ca.pem']}", timeout_s=2)
    assert anon.get(k) is None and anon.faults.total == 1 and anon.breaker.is_open
    # Plaintext to a TLS port: also a miss.
    plain = GrpcBackend(f"grpc://127.0.0.1:{s.port}", timeout_s=2)
    assert plain.get(k) is None
    probe.close()

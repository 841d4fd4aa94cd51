"""Fleet trouble is a miss or a skipped write, counted and warned about, never an error in the step:
the S3 server stopped mid-run, throttling and 5xx answers, a bucket and a directory without write
permission."""

from __future__ import annotations

import http.server
import json
import os
import threading
import urllib.request
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _cachetest import fork_call, key_of, make_cfg, make_entry, shared_tmp  # type: ignore[import-not-found]

from neuron_runtime.cache import CacheWarning, LocalCache, S3Store, SharedPathStore, TieredCache


def compile_for(key: str) -> Any:
    return lambda: make_entry(key, f"payload {key}".encode())


def test_s3_server_stopped_mid_run(tmp_path: Path, private_moto: Any) -> None:
    private_moto.make_bucket("neff")
    cfg = make_cfg(tmp_path)
    stats: dict[str, Any] = {}
    fleet = S3Store("s3://neff/c", timeout_s=10.0, endpoint_url=private_moto.endpoint)
    cache = TieredCache(LocalCache(cfg.local_cache_dir, cfg.cache_max_size), fleet, cfg, stats)
    before = [key_of(f"before{i}") for i in range(3)]
    for k in before:
        assert cache.get_or_compile(k, compile_for(k))[1] == "compiled"
    assert stats["fleet_errors"] == 0 and len(list(fleet.entries())) == 3

    private_moto.stop()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for k in before:
            assert cache.get_or_compile(k, compile_for(k))[1] == "local"
        after = [key_of(f"after{i}") for i in range(5)]
        for k in after:
            entry, source = cache.get_or_compile(k, compile_for(k))
            assert (entry.payload, source) == (f"payload {k}".encode(), "compiled")
    assert stats["fleet_errors"] >= len(after) and stats["writes_skipped"] == len(after)
    assert stats["corrupt"] == 0
    shown = [str(w.message) for w in caught if issubclass(w.category, CacheWarning)]
    assert len(shown) == len(fleet.faults.counts), shown  # once per kind of fault, not once per op
    assert all("s3://neff/c" in m for m in shown)


class _ErrorS3(http.server.BaseHTTPRequestHandler):
    """Answers every S3 request with one error (throttling or a 5xx), as a struggling endpoint would."""

    status, code = 503, "SlowDown"
    requests = 0

    def _reply(self) -> None:
        type(self).requests += 1
        length = int(self.headers.get("Content-Length") or 0)
        if length:
            self.rfile.read(length)
        body = (f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{self.code}</Code>'
                f"<Message>injected {self.code}</Message><RequestId>1</RequestId></Error>").encode()
        self.send_response(self.status)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    do_GET = do_PUT = do_HEAD = do_DELETE = do_POST = _reply

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def error_s3(request: pytest.FixtureRequest) -> Iterator[tuple[str, type[_ErrorS3]]]:
    status, code = request.param
    handler = type("Handler", (_ErrorS3,), {"status": status, "code": code, "requests": 0})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", handler
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize(
    ("error_s3", "kind"),
    [((503, "SlowDown"), "throttled"), ((500, "InternalError"), "server")],
    indirect=["error_s3"],
)
def test_throttling_and_5xx_are_misses(tmp_path: Path, moto_s3: Any, error_s3: tuple[str, Any], kind: str) -> None:
    endpoint, handler = error_s3
    # A generous timeout, so the fault is classified from the answer, not from a slow, busy test host.
    fleet = S3Store("s3://neff/c", timeout_s=30.0, endpoint_url=endpoint)
    cfg = make_cfg(tmp_path)
    stats: dict[str, Any] = {}
    cache = TieredCache(LocalCache(cfg.local_cache_dir, cfg.cache_max_size), fleet, cfg, stats)
    keys = [key_of(f"t{i}") for i in range(4)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for k in keys:
            assert cache.get_or_compile(k, compile_for(k))[1] == "compiled"
    assert kind in fleet.faults.counts
    assert stats["fleet_errors"] >= len(keys) and stats["writes_skipped"] == len(keys)
    # Retries are bounded and the breaker stops hammering a struggling endpoint: the first op pays a
    # few attempts, the rest are skipped until the cooldown ends.
    assert 1 <= handler.requests <= 4, handler.requests
    assert sum(issubclass(w.category, CacheWarning) for w in caught) == len(fleet.faults.counts)


def _enable_iam(server: Any) -> dict[str, str]:
    """Create a read-only IAM user on a private moto server, then turn authentication on."""
    import boto3

    iam = boto3.client("iam", endpoint_url=server.endpoint, region_name="us-east-1",
                       aws_access_key_id="testing", aws_secret_access_key="testing")
    iam.create_user(UserName="reader")
    policy = {"Version": "2012-10-17", "Statement": [
        {"Effect": "Allow", "Action": ["s3:GetObject", "s3:ListBucket"], "Resource": "*"}]}
    iam.put_user_policy(UserName="reader", PolicyName="read-only", PolicyDocument=json.dumps(policy))
    key = iam.create_access_key(UserName="reader")["AccessKey"]
    req = urllib.request.Request(server.endpoint + "/moto-api/reset-auth", data=b"0", method="POST",
                                 headers={"Content-Type": "application/json"})
    urllib.request.urlopen(req, timeout=5).read()
    return {"key": key["AccessKeyId"], "secret": key["SecretAccessKey"]}


def test_read_only_bucket_still_serves_reads(tmp_path: Path, private_moto: Any) -> None:
    private_moto.make_bucket("neff")
    seeded = key_of("seeded")
    writer = S3Store("s3://neff/c", timeout_s=5.0, endpoint_url=private_moto.endpoint)
    assert writer.put(seeded, make_entry(seeded, b"from the warm-up job"))
    creds = _enable_iam(private_moto)

    reader = S3Store("s3://neff/c", timeout_s=5.0, endpoint_url=private_moto.endpoint, **creds)
    cfg = make_cfg(tmp_path)
    stats: dict[str, Any] = {}
    cache = TieredCache(LocalCache(cfg.local_cache_dir, cfg.cache_max_size), reader, cfg, stats)
    new = key_of("new")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        entry, source = cache.get_or_compile(seeded, compile_for(seeded))
        assert (entry.payload, source) == (b"from the warm-up job", "fleet")
        entry, source = cache.get_or_compile(new, compile_for(new))
        assert source == "compiled"
    assert reader.faults.counts.get("permission", 0) >= 1  # the put (and the lease) were denied
    assert stats["writes_skipped"] == 1 and stats["corrupt"] == 0
    assert any("permission" in str(w.message) for w in caught)
    assert cache.get_or_compile(new, compile_for(new))[1] == "local"


def test_read_only_directory_still_serves_reads() -> None:
    base = shared_tmp()
    fleet_dir = base / "fleet"
    seeded = key_of("seeded")
    assert SharedPathStore(str(fleet_dir)).put(seeded, make_entry(seeded, b"from the warm-up job"))
    for root, dirs, _ in os.walk(fleet_dir):
        for d in dirs:
            os.chmod(os.path.join(root, d), 0o555)
    fleet_dir.chmod(0o555)
    (base / "hosts").mkdir(mode=0o777)
    (base / "hosts").chmod(0o777)

    def scenario() -> list[Any]:
        cfg = make_cfg(base / "hosts" / str(os.getuid()))
        stats: dict[str, Any] = {}
        cache = TieredCache(LocalCache(cfg.local_cache_dir, cfg.cache_max_size), SharedPathStore(str(fleet_dir)),
                            cfg, stats)
        new = key_of("new")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            a = cache.get_or_compile(seeded, compile_for(seeded))
            b = cache.get_or_compile(new, compile_for(new))
        return [a[0].payload.decode(), a[1], b[1], stats]

    payload, first, second, stats = fork_call(scenario, unprivileged=True)
    assert (payload, first, second) == ("from the warm-up job", "fleet", "compiled")
    assert stats["writes_skipped"] == 1 and stats["fleet_errors"] >= 1
    assert [e.key for e in SharedPathStore(str(fleet_dir)).entries()] == [seeded]

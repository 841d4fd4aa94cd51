"""Bad input and faults against a real server process: auth, keys, sizes, digests, crashes, the cap."""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from cache_server import (
    CacheClient,
    DataLoss,
    InvalidKey,
    NotFound,
    PermissionDenied,
    TooLarge,
    Unauthenticated,
)
from cache_server._keys import PUT_HEADER_MD, SERVICE
from cache_server._proto.neuron_cache.v1 import cache_pb2 as pb
from tests.server.conftest import ServerProc, key_of

pytestmark = pytest.mark.timeout(120)

TRAVERSALS = ["../../etc/passwd", "/etc/passwd", "a" * 63, "A" * 64, "g" * 64, "a" * 65, "",
              "ab/../" + "a" * 58, "\x00" * 64, "a" * 62 + "/x", "..", "%2e%2e%2f" + "a" * 55]


def raw_channel(server: ServerProc) -> grpc.Channel:
    return grpc.insecure_channel(server.address)


def code_of(fn: object, *args: object, **kw: object) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as ei:
        fn(*args, **kw)  # type: ignore[operator]
    return ei.value.code()  # type: ignore[no-any-return]


def store_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file())


def test_tokens_roles(server_factory: type[ServerProc], tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text("# comment\nr3ad-t0ken read\n\nwr1te-t0ken write  # CI\n")
    s = server_factory(None, "--tokens-file", str(tokens)).start()
    k = key_of("auth")
    with pytest.raises(Unauthenticated):
        s.client().get(k)
    with pytest.raises(Unauthenticated):
        s.client(token="nope").get(k)
    with pytest.raises(Unauthenticated):
        s.client().put(k, b"x")
    reader, writer = s.client(token="r3ad-t0ken"), s.client(token="wr1te-t0ken")
    with pytest.raises(PermissionDenied):
        reader.put(k, b"x")
    with pytest.raises(PermissionDenied):
        reader.delete(k)
    with pytest.raises(PermissionDenied):
        reader.acquire_lease(k, 10)
    assert reader.get(k) is None
    assert writer.put(k, b"data")
    assert reader.get(k) == b"data"
    assert reader.lookup([k]) == [True]
    # Health stays open: probes carry no token.
    assert s.client().health() == "SERVING"
    assert "OPEN" not in s.read_log()


def test_bad_tokens_file_refuses_to_start(server_factory: type[ServerProc], tmp_path: Path) -> None:
    bad = tmp_path / "tokens"
    bad.write_text("only-a-token\n")
    with pytest.raises(RuntimeError, match="expected `TOKEN ROLE`"):
        server_factory(None, "--tokens-file", str(bad)).start()


@pytest.mark.parametrize("key", TRAVERSALS)
def test_malformed_keys_and_traversal(shared_server: ServerProc, key: str) -> None:
    server = shared_server
    ch = raw_channel(server)
    get = ch.unary_unary(f"/{SERVICE}/Get")
    delete = ch.unary_unary(f"/{SERVICE}/Delete")
    acquire = ch.unary_unary(f"/{SERVICE}/AcquireLease")
    put = ch.stream_unary(f"/{SERVICE}/Put")
    assert code_of(get, pb.GetRequest(key=key).SerializeToString(), timeout=5) == grpc.StatusCode.INVALID_ARGUMENT
    assert code_of(delete, pb.DeleteRequest(key=key).SerializeToString(), timeout=5) == \
        grpc.StatusCode.INVALID_ARGUMENT
    assert code_of(acquire, pb.AcquireLeaseRequest(key=key, ttl_ms=10).SerializeToString(), timeout=5) == \
        grpc.StatusCode.INVALID_ARGUMENT
    header = pb.PutHeader(key=key, size=3, sha256=hashlib.sha256(b"pwn").digest()).SerializeToString()
    assert code_of(put, iter([b"pwn"]), metadata=((PUT_HEADER_MD, header),), timeout=5) == \
        grpc.StatusCode.INVALID_ARGUMENT
    root = Path(server.storage)
    assert [p for p in store_files(root)] == []
    assert not (root.parent / "passwd").exists()
    # The client refuses them before sending.
    with pytest.raises(InvalidKey):
        server.client().get(key)
    ch.close()


def test_malformed_messages(shared_server: ServerProc) -> None:
    server = shared_server
    ch = raw_channel(server)
    lookup = ch.unary_unary(f"/{SERVICE}/Lookup")
    assert code_of(lookup, b"\xff\xff\xff", timeout=5) == grpc.StatusCode.INVALID_ARGUMENT
    assert code_of(lookup, pb.LookupRequest(digests=b"x" * 33).SerializeToString(), timeout=5) == \
        grpc.StatusCode.INVALID_ARGUMENT
    put = ch.stream_unary(f"/{SERVICE}/Put")
    assert code_of(put, iter([b"no header"]), timeout=5) == grpc.StatusCode.INVALID_ARGUMENT
    header = pb.PutHeader(key=key_of("short"), size=3, sha256=b"short").SerializeToString()
    assert code_of(put, iter([b"abc"]), metadata=((PUT_HEADER_MD, header),), timeout=5) == \
        grpc.StatusCode.INVALID_ARGUMENT
    ch.close()


def test_oversize_is_resource_exhausted(server_factory: type[ServerProc]) -> None:
    s = server_factory(None, "--max-blob-size", "64KiB").start()
    c = s.client()
    with pytest.raises(TooLarge):
        c.put(key_of("big"), b"x" * (64 * 1024 + 1))
    # Lying about the size up front does not help: the bytes are counted as they arrive.
    header = pb.PutHeader(key=key_of("liar"), size=10, sha256=hashlib.sha256(b"x" * 10).digest())
    with pytest.raises(DataLoss):
        c.put_raw(header.SerializeToString(), [b"x" * 100_000])
    assert c.put(key_of("fits"), b"x" * 65536)
    assert c.lookup([key_of("big"), key_of("liar"), key_of("fits")]) == [False, False, True]


def test_digest_or_size_mismatch_stores_nothing(server: ServerProc) -> None:
    c = server.client()
    k = key_of("mismatch")
    wrong = pb.PutHeader(key=k, size=5, sha256=hashlib.sha256(b"other").digest())
    with pytest.raises(DataLoss, match="sha256 mismatch"):
        c.put_raw(wrong.SerializeToString(), [b"hel", b"lo"])
    short = pb.PutHeader(key=k, size=6, sha256=hashlib.sha256(b"hello!").digest())
    with pytest.raises(DataLoss, match="received 5 bytes"):
        c.put_raw(short.SerializeToString(), [b"hello"])
    assert c.get(k) is None
    assert c.lookup([k]) == [False]
    assert store_files(Path(server.storage)) == []  # no entry, no leftover temp file
    assert c.stats()["entries"] == 0


def test_first_writer_wins_and_large_entries_stream(server: ServerProc) -> None:
    c = server.client()
    k = key_of("fww")
    assert c.put(k, b"first") is True
    assert c.put(k, b"second") is False
    assert c.get(k) == b"first"
    big = bytes(range(256)) * (40 * 1024)  # 10 MiB: above the unary limit, so it streams both ways
    kb = key_of("big")
    assert c.put(kb, big)
    assert c.get(kb) == big
    assert c.delete(kb) is True and c.get(kb) is None and c.delete(kb) is False


def test_sigkill_mid_upload_leaves_no_entry(server_factory: type[ServerProc], tmp_path: Path) -> None:
    s = server_factory().start()
    c = s.client(timeout=30)
    k = key_of("killed")
    blob = b"z" * (8 << 20)
    header = pb.PutHeader(key=k, size=len(blob), sha256=hashlib.sha256(blob).digest()).SerializeToString()
    sent = threading.Event()

    def slow_chunks() -> Iterator[bytes]:
        for i in range(8):
            yield blob[i << 20:(i + 1) << 20]
            if i == 3:
                sent.set()
                time.sleep(30)  # the server dies while we wait

    errors: list[BaseException] = []
    t = threading.Thread(target=lambda: _put(c, header, slow_chunks(), errors))
    t.start()
    assert sent.wait(20)
    wait_until = time.monotonic() + 20
    while not list((Path(s.storage) / "tmp").iterdir()) and time.monotonic() < wait_until:
        time.sleep(0.05)
    assert list((Path(s.storage) / "tmp").iterdir()), "the upload should be in progress as a temp file"
    s.kill()
    t.join(40)
    assert errors  # the client saw the failure
    restarted = server_factory(s.storage).start()
    c2 = restarted.client()
    assert c2.get(k) is None
    assert c2.lookup([k]) == [False]
    assert list((Path(s.storage) / "tmp").iterdir()) == []  # incomplete upload removed at start
    assert c2.put(k, blob) and c2.get(k) == blob


def _put(c: CacheClient, header: bytes, chunks: Iterator[bytes], errors: list[BaseException]) -> None:
    try:
        c.put_raw(header, chunks)
    except BaseException as e:  # noqa: BLE001 - recorded for the test
        errors.append(e)


def test_disk_cap_evicts_lru_without_failing(server_factory: type[ServerProc]) -> None:
    s = server_factory(None, "--max-size", "1MiB").start()
    c = s.client()
    blob = b"q" * (100 * 1024)
    keys = [key_of(f"cap{i}") for i in range(30)]
    for i, k in enumerate(keys):
        assert c.put(k, blob)  # never refused for space
        if i >= 1:
            assert c.get(keys[0]) == blob  # keep the first one hot
        st = c.stats()
        assert st["bytes"] <= 1 << 20
    st = c.stats()
    assert st["evictions"] >= 20
    assert c.get(keys[0]) == blob  # recently used, survived
    assert c.get(keys[1]) is None  # least recently used, evicted
    assert c.get(keys[-1]) == blob
    on_disk = sum(p.stat().st_size for p in store_files(Path(s.storage)))
    assert on_disk <= 1 << 20
    # The index is rebuilt from disk after a restart, in LRU order: the hot entry is still the last to go.
    s.terminate()
    s2 = server_factory(s.storage, "--max-size", "1MiB").start()
    c2 = s2.client()
    assert c2.stats()["entries"] == st["entries"]
    assert c2.lookup([keys[0], keys[-1]]) == [True, True]  # (a lookup is not an access)
    for i in range(8):
        assert c2.put(key_of(f"after{i}"), blob)
    assert c2.get(keys[0]) == blob
    assert c2.get(keys[-2]) is None  # older than keys[0]'s last access: evicted first


def test_not_found_and_get_stream_miss(shared_server: ServerProc) -> None:
    server = shared_server
    ch = raw_channel(server)
    gs = ch.unary_stream(f"/{SERVICE}/GetStream")
    with pytest.raises(grpc.RpcError) as ei:
        list(gs(pb.GetRequest(key=key_of("nope")).SerializeToString(), timeout=5))
    assert ei.value.code() == grpc.StatusCode.NOT_FOUND
    ch.close()
    assert NotFound.code == grpc.StatusCode.NOT_FOUND

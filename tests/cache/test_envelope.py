"""The entry envelope: every kind of damage is refused with a precise reason; nothing is ever unpickled."""

from __future__ import annotations

import ast
import hashlib
import struct
from pathlib import Path

import pytest
from _cachetest import key_of, make_entry  # type: ignore[import-not-found]

from neuron_runtime.cache import envelope
from neuron_runtime.cache import CacheError, IntegrityError, InvalidKeyError

KEY = key_of("add")
SECRET = b"fleet signing key"


def reason(data: bytes, **kw: object) -> str:
    opts: dict[str, object] = {"expected_key": KEY, "signing_key": None}
    opts.update(kw)
    with pytest.raises(IntegrityError) as ei:
        envelope.unpack(data, **opts)  # type: ignore[arg-type]
    assert isinstance(ei.value, CacheError)
    return ei.value.reason


def test_roundtrip_keeps_header_and_payload() -> None:
    data = make_entry(KEY, b"\x00payload\xff" * 100)
    entry = envelope.unpack(data, expected_key=KEY, signing_key=None)
    assert entry.payload == b"\x00payload\xff" * 100
    assert entry.header["key"] == KEY
    assert entry.header["signature"] == {"op": "aten::add"}
    assert entry.header["fingerprint"] == {"tier": "test"}
    assert isinstance(entry.header["created"], float) and entry.header["producer"]
    assert data.startswith(envelope.MAGIC)
    assert envelope.peek_header(data)["key"] == KEY


def test_signed_roundtrip_and_unsigned_reader_accepts_signed() -> None:
    data = make_entry(KEY, b"x", SECRET)
    assert envelope.unpack(data, expected_key=KEY, signing_key=SECRET).payload == b"x"
    # Without a key a reader can only check the digest; the entry is intact, so it is accepted.
    assert envelope.unpack(data, expected_key=KEY, signing_key=None).payload == b"x"


def test_bad_magic_and_version() -> None:
    data = make_entry(KEY)
    assert reason(b"\x80\x04\x95" + data[3:]) == "magic"  # a pickle stream is not an entry
    assert reason(b"") == "truncated"
    bumped = data[:8] + struct.pack(">H", envelope.FORMAT_VERSION + 1) + data[10:]
    assert reason(bumped) == "version"


def test_every_truncation_is_refused() -> None:
    data = make_entry(KEY, b"p" * 64, SECRET)
    for n in range(len(data)):
        assert reason(data[:n], signing_key=SECRET) in ("truncated", "magic"), n
    assert reason(data + b"\x00", signing_key=SECRET) == "truncated"


def test_every_single_byte_flip_is_refused() -> None:
    data = make_entry(KEY, b"p" * 64, SECRET)
    for i in range(len(data)):
        flipped = bytearray(data)
        flipped[i] ^= 0x01
        with pytest.raises(IntegrityError):
            envelope.unpack(bytes(flipped), expected_key=KEY, signing_key=SECRET)


def test_digest_mismatch() -> None:
    data = bytearray(make_entry(KEY, b"p" * 64))
    data[-40] ^= 0xFF  # inside the payload
    assert reason(bytes(data)) == "digest"


def test_entry_under_another_key_is_refused() -> None:
    other = make_entry(key_of("mul"))
    assert reason(other) == "key"
    # expected_key=None (listing tools) accepts it and reports the real key
    assert envelope.unpack(other, expected_key=None, signing_key=None).header["key"] == key_of("mul")


def test_signatures() -> None:
    unsigned = make_entry(KEY)
    assert reason(unsigned, signing_key=SECRET) == "unsigned"
    assert reason(make_entry(KEY, signing_key=b"another key"), signing_key=SECRET) == "signature"
    # Migration reads may accept unsigned entries explicitly, but a signed one must still verify.
    assert envelope.unpack(unsigned, expected_key=KEY, signing_key=SECRET, require_signature=False)
    assert reason(make_entry(KEY, signing_key=b"x"), signing_key=SECRET, require_signature=False) == "signature"
    with pytest.raises(ValueError):
        envelope.unpack(unsigned, expected_key=KEY, signing_key=None, require_signature=True)


def test_stripped_signature_with_recomputed_digest_is_refused() -> None:
    """A forger strips the HMAC, clears the flag and recomputes the sha256: only the key catches it."""
    signed = make_entry(KEY, b"evil", SECRET)
    body = bytearray(signed[: -64])
    body[10:12] = struct.pack(">H", 0)  # flags
    forged = bytes(body) + hashlib.sha256(bytes(body)).digest()
    assert envelope.unpack(forged, expected_key=KEY, signing_key=None).payload == b"evil"
    assert reason(forged, signing_key=SECRET) == "unsigned"


def test_forged_header_with_valid_digest_is_refused_when_signed() -> None:
    data = make_entry(KEY, b"good", SECRET)
    entry = envelope.unpack(data, expected_key=KEY, signing_key=SECRET)
    forged = envelope.pack(KEY, entry.header, b"evil", b"guessed key")
    assert reason(forged, signing_key=SECRET) == "signature"


def test_pack_misuse() -> None:
    with pytest.raises(ValueError):
        envelope.pack(KEY, {"fingerprint": {}}, b"x", None)  # no signature
    with pytest.raises(ValueError):
        envelope.pack(KEY, {"signature": {}, "fingerprint": {}, "bad": object()}, b"x", None)
    with pytest.raises(ValueError):
        envelope.pack(KEY, {"signature": {}, "fingerprint": {}, "key": key_of("x")}, b"x", None)
    with pytest.raises(InvalidKeyError):
        envelope.pack("../../etc/passwd", {"signature": {}, "fingerprint": {}}, b"x", None)
    with pytest.raises(TypeError):
        envelope.pack(KEY, {"signature": {}, "fingerprint": {}}, "text", None)  # type: ignore[arg-type]


def test_header_that_is_not_json_is_refused() -> None:
    header = b"not json!"
    body = struct.pack(">8sHHI", envelope.MAGIC, envelope.FORMAT_VERSION, 0, len(header)) + header
    body += struct.pack(">Q", 1) + b"x"
    assert reason(body + hashlib.sha256(body).digest()) == "header"


def test_no_pickle_anywhere_in_the_cache_layer() -> None:
    root = Path(__file__).resolve().parents[2] / "neuron_runtime"
    files = sorted((root / "cache").glob("*.py"))  # the entry format (cache/envelope.py) included
    for f in files:
        tree = ast.parse(f.read_text())
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            assert not any(n.split(".")[0] in ("pickle", "cPickle", "dill", "cloudpickle") for n in names), f

"""The on-disk / on-wire form of one cache entry: bytes in, verified bytes out. No pickle, no torch.

Layout (all integers big-endian)::

    magic      8 bytes   b"NRXNEFF\\0"
    version    u16       FORMAT_VERSION
    flags      u16       bit 0: an HMAC-SHA256 trailer follows the digest
    hlen       u32       length of the header
    header     hlen      canonical JSON object: key, signature, fingerprint, created, producer, ...
    plen       u64       length of the payload
    payload    plen      the executable (opaque bytes)
    digest     32        sha256 over everything above
    [hmac      32]       HMAC-SHA256(signing key, everything above), present iff flags bit 0

`unpack` checks every field before it returns anything, and raises `IntegrityError` with a precise
`reason` otherwise. The digest catches accidents (bit flips, truncation, torn copies); only the HMAC
stops an attacker, because anyone can recompute a sha256. So with a signing key configured, readers
refuse unsigned entries: otherwise a forger would just strip the trailer.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import socket
import struct
import time
from dataclasses import dataclass
from typing import Any

from neuron_runtime.cache._base import check_key
from neuron_runtime.cache._errors import IntegrityError

__all__ = ["MAGIC", "FORMAT_VERSION", "Entry", "IntegrityError", "pack", "unpack", "peek_header"]

MAGIC = b"NRXNEFF\x00"
FORMAT_VERSION = 1
_FLAG_SIGNED = 0x1
_PREFIX = struct.Struct(">8sHHI")  # magic, version, flags, header length
_PLEN = struct.Struct(">Q")
_DIGEST = 32
_MAC = 32
# A header is a few KiB of JSON; refusing absurd lengths keeps a corrupt length field from allocating GiBs.
_MAX_HEADER = 1 << 20
_REQUIRED = ("key", "signature", "fingerprint", "created", "producer")


@dataclass(frozen=True)
class Entry:
    """A verified entry: its header (a JSON object) and its payload."""

    header: dict[str, Any]
    payload: bytes


def _producer() -> str:
    return f"neuron-runtime@{socket.gethostname()}:{os.getpid()}"


def pack(key: str, header: dict[str, Any], payload: bytes, signing_key: bytes | None) -> bytes:
    """Build an entry for `key`.

    `header` must hold `signature` and `fingerprint` (JSON-able dicts: the readable op signature and the
    compiler fingerprint, so `neuron-cache explain` can say what made a miss); `key` is set here, and
    `created` (epoch seconds) and `producer` are filled in unless given. Extra JSON-able fields are kept.
    With `signing_key`, an HMAC-SHA256 trailer is added. Raises `ValueError` (misuse) for a header that
    is not JSON-able or lacks the required fields, and `InvalidKeyError` for a malformed key.
    """
    check_key(key)
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        raise TypeError(f"payload must be bytes, not {type(payload).__name__}")
    for field in ("signature", "fingerprint"):
        if not isinstance(header.get(field), dict):
            raise ValueError(f"envelope header needs a {field!r} dict (got {type(header.get(field)).__name__})")
    if "key" in header and header["key"] != key:
        raise ValueError(f"header key {header['key']!r} does not match the entry key {key!r}")
    full = dict(header)
    full["key"] = key
    full.setdefault("created", time.time())
    full.setdefault("producer", _producer())
    try:
        hbytes = json.dumps(full, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()
    except (TypeError, ValueError) as e:
        raise ValueError(f"envelope header is not JSON-able: {e}") from e
    if len(hbytes) > _MAX_HEADER:
        raise ValueError(f"envelope header is {len(hbytes)} bytes; the limit is {_MAX_HEADER}")
    flags = _FLAG_SIGNED if signing_key else 0
    body = b"".join(
        (_PREFIX.pack(MAGIC, FORMAT_VERSION, flags, len(hbytes)), hbytes, _PLEN.pack(len(payload)), payload)
    )
    out = body + hashlib.sha256(body).digest()
    if signing_key:
        out += hmac.new(signing_key, out, hashlib.sha256).digest()
    return out


def _parse_prefix(data: bytes) -> tuple[int, int]:
    """(flags, header length) after checking magic and version."""
    if len(data) < _PREFIX.size:
        if not MAGIC.startswith(bytes(data[: len(MAGIC)])):
            raise IntegrityError("magic", "not a neuron-runtime cache entry")
        raise IntegrityError("truncated", f"{len(data)} bytes, shorter than the fixed prefix")
    magic, version, flags, hlen = _PREFIX.unpack_from(data)
    if magic != MAGIC:
        raise IntegrityError("magic", f"not a neuron-runtime cache entry (starts with {bytes(magic[:8])!r})")
    if version != FORMAT_VERSION:
        raise IntegrityError("version", f"entry format {version}, this runtime reads {FORMAT_VERSION}")
    if hlen > _MAX_HEADER:
        raise IntegrityError("header", f"header length {hlen} exceeds {_MAX_HEADER}")
    return flags, hlen


def _parse_header(raw: bytes) -> dict[str, Any]:
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, ValueError) as e:
        raise IntegrityError("header", f"header is not JSON: {e}") from e
    if not isinstance(header, dict) or any(f not in header for f in _REQUIRED):
        raise IntegrityError("header", f"header must be an object with {', '.join(_REQUIRED)}")
    return header


def unpack(
    data: bytes,
    *,
    expected_key: str | None,
    signing_key: bytes | None,
    require_signature: bool | None = None,
) -> Entry:
    """Verify `data` and return its `Entry`; raise `IntegrityError` otherwise. Never executes anything.

    Checks, in order: magic, version, lengths (truncated or trailing bytes), sha256 digest, then the
    signature, then that the header's key is `expected_key` (an entry copied under another key's name is
    refused even when intact). `require_signature` defaults to "a signing key is given": with a key, an
    unsigned entry is refused ("unsigned") and a signed one must verify ("signature"; compared in constant
    time). Without a key, a signed entry's HMAC cannot be checked and only its digest is; passing
    `require_signature=True` without a key is a misuse (`ValueError`).
    """
    if require_signature is None:
        require_signature = signing_key is not None
    if require_signature and not signing_key:
        raise ValueError("require_signature=True needs a signing_key to verify with")
    view = memoryview(data)
    flags, hlen = _parse_prefix(data)
    hstart = _PREFIX.size
    pstart = hstart + hlen + _PLEN.size
    if len(data) < pstart:
        raise IntegrityError("truncated", f"{len(data)} bytes, header needs {pstart}")
    (plen,) = _PLEN.unpack_from(data, hstart + hlen)
    dstart = pstart + plen
    signed = bool(flags & _FLAG_SIGNED)
    expected_len = dstart + _DIGEST + (_MAC if signed else 0)
    if len(data) < expected_len:
        raise IntegrityError("truncated", f"{len(data)} bytes, expected {expected_len}")
    if len(data) > expected_len:
        raise IntegrityError("truncated", f"{len(data)} bytes, expected {expected_len} (trailing bytes)")
    digest = hashlib.sha256(view[:dstart]).digest()
    if not hmac.compare_digest(digest, bytes(view[dstart : dstart + _DIGEST])):
        raise IntegrityError("digest", "sha256 mismatch (corrupted or torn entry)")
    if signing_key and signed:
        mac = hmac.new(signing_key, view[: dstart + _DIGEST], hashlib.sha256).digest()
        if not hmac.compare_digest(mac, bytes(view[dstart + _DIGEST :])):
            raise IntegrityError("signature", "HMAC does not verify with this signing key (forged or other key)")
    elif require_signature:
        raise IntegrityError("unsigned", "entry is not signed and a signing key is configured")
    header = _parse_header(bytes(view[hstart : hstart + hlen]))
    if expected_key is not None and header["key"] != expected_key:
        raise IntegrityError("key", f"entry was written for key {header['key']!r}, found under {expected_key!r}")
    return Entry(header=header, payload=bytes(view[pstart:dstart]))


def peek_header(data: bytes) -> dict[str, Any]:
    """The header alone, *unverified* (for listings and `explain`); never use it to trust the payload."""
    _, hlen = _parse_prefix(data)
    if len(data) < _PREFIX.size + hlen:
        raise IntegrityError("truncated", "header cut short")
    return _parse_header(bytes(data[_PREFIX.size : _PREFIX.size + hlen]))

"""Key and size rules shared by the server, its storages and the client."""

from __future__ import annotations

import re

from ._errors import ConfigError, InvalidKey

KEY_RE = re.compile(r"[0-9a-f]{64}")
#: the gRPC service, and the name health probes ask about (k8s `grpc.service`, the Docker HEALTHCHECK)
SERVICE = "neuron_cache.v1.Cache"
HEALTH_SERVICE = SERVICE
#: request metadata of a Put: a serialized PutHeader (key, size, sha256), sent before any blob byte
PUT_HEADER_MD = "neuron-put-header-bin"
#: metadata naming an entry's size (GetStream initial metadata; Get's trailer when the entry is too big)
SIZE_MD = "neuron-size"
#: chunk size for streamed blobs (DESIGN §3: raw unary up to ~4 MiB, 1 MiB chunks above)
CHUNK = 1 << 20
#: largest blob sent as one unary message
UNARY_MAX = 4 << 20
#: gRPC message limit on both ends: a unary blob plus room for framing
MESSAGE_MAX = UNARY_MAX + (64 << 10)


def check_key(key: object) -> str:
    """The key itself if it is 64 lowercase hex characters; anything else is refused before it can reach a
    path or an object name (so `../`, NUL bytes and absolute paths are impossible by construction)."""
    if not isinstance(key, str) or not KEY_RE.fullmatch(key):
        shown = key[:80] if isinstance(key, str) else type(key).__name__
        raise InvalidKey(f"invalid cache key {shown!r}: expected 64 lowercase hex characters")
    return key


def parse_size(text: str) -> int:
    """`10GiB`, `500MB`, `1.5G` or plain bytes -> bytes (binary units for `Ki`/`K`, decimal for `KB`)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGTP]?)(I?B?)\s*", text.upper())
    if not m:
        raise ConfigError(f"not a size: {text!r} (use e.g. 10GiB, 500MB or plain bytes)")
    number, unit, suffix = float(m.group(1)), m.group(2), m.group(3)
    if suffix == "B" and not unit:
        base = 1
    else:
        base = 1024 if suffix.startswith("I") or (unit and not suffix) else 1000
    power = " KMGTP".index(unit or " ")
    return int(number * base**power)

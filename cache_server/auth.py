"""Bearer tokens with two roles, read from a tokens file.

File format: one `TOKEN ROLE` pair per line, ROLE is `read` or `write` (write implies read); blank lines
and `#` comments are ignored. Without a tokens file the server is open (it logs a warning at start).

Whoever holds a write token can put bytes that every reader will load and run: hand write tokens only to
the machines that compile (CI, trusted builders).
"""

from __future__ import annotations

import enum
import hashlib
import hmac
from collections.abc import Iterable
from pathlib import Path

from ._errors import ConfigError, PermissionDenied, Unauthenticated


class Role(enum.IntEnum):
    READ = 1
    WRITE = 2


class Auth:
    """Checks the `authorization` metadata of a call. `Auth(None)` lets everything through."""

    def __init__(self, tokens: dict[str, Role] | None) -> None:
        # Keyed by the token's sha256 so lookup time does not depend on how much of a guess matches.
        self._tokens = None if tokens is None else {_digest(t): r for t, r in tokens.items()}

    @property
    def open(self) -> bool:
        return self._tokens is None

    @classmethod
    def from_file(cls, path: str | None) -> "Auth":
        if not path:
            return cls(None)
        try:
            text = Path(path).read_text()
        except OSError as e:
            raise ConfigError(f"--tokens-file {path}: {e}") from e
        return cls(parse_tokens(text.splitlines(), path))

    def check(self, metadata: Iterable[tuple[str, str | bytes]], need: Role) -> Role:
        if self._tokens is None:
            return Role.WRITE
        token = None
        for name, value in metadata:
            if name == "authorization":
                text = value.decode() if isinstance(value, bytes) else value
                scheme, _, rest = text.partition(" ")
                if scheme.lower() == "bearer" and rest:
                    token = rest.strip()
                break
        if token is None:
            raise Unauthenticated("missing token: send `authorization: Bearer <token>` metadata")
        role = None
        d = _digest(token)
        for known, r in self._tokens.items():
            if hmac.compare_digest(known, d):
                role = r
        if role is None:
            raise Unauthenticated("unknown token")
        if role < need:
            raise PermissionDenied(f"this token has the {role.name.lower()} role; the call needs {need.name.lower()}")
        return role


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


def parse_tokens(lines: Iterable[str], source: str = "tokens file") -> dict[str, Role]:
    tokens: dict[str, Role] = {}
    for n, raw in enumerate(lines, 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) != 2 or parts[1].lower() not in ("read", "write"):
            raise ConfigError(f"{source}:{n}: expected `TOKEN ROLE` with ROLE read or write")
        tokens[parts[0]] = Role[parts[1].upper()]
    if not tokens:
        raise ConfigError(f"{source}: no tokens (remove --tokens-file to run an open server)")
    return tokens

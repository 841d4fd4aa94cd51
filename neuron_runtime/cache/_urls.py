"""What the URL-opened stores share: `?option=value` parsing, durations and sizes, and redaction of
passwords before a URL reaches a log line or a warning."""

from __future__ import annotations

import re
import urllib.parse

from neuron_runtime._config import _parse_size
from neuron_runtime.cache._errors import StoreConfigError

_AGE = re.compile(r"\s*([0-9]*\.?[0-9]+)\s*(ms|[smhdw]?)\s*", re.I)
_UNITS = {"": 1.0, "ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}


TLS_FILES = ("ca", "cert", "key")


def split(url: str, plain: str, secure: str, allowed: set[str],
          usage: str) -> tuple[urllib.parse.SplitResult, dict[str, str], int | None]:
    """(the URL's parts, its options, its port) for a `plain://` or `secure://` (TLS) store URL, checked:
    the scheme and a host, known options only, a valid port, and `ca=`/`cert=`/`key=` files that exist
    and come with the TLS scheme. Raises `StoreConfigError` naming the URL without its password."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in (plain, secure) or not parts.hostname:
        raise StoreConfigError(f"{redact(url)!r}: expected {usage}")
    opts = options(url, allowed)
    try:
        port = parts.port
    except ValueError as e:
        raise StoreConfigError(f"{redact(url)!r}: {e}") from None
    files = [name for name in TLS_FILES if name in opts]
    if files and parts.scheme != secure:
        raise StoreConfigError(f"{redact(url)!r}: {'=/'.join(files)}= need {secure}:// (TLS)")
    for name in files:
        try:
            open(opts[name], "rb").close()
        except OSError as e:
            raise StoreConfigError(f"{redact(url)!r}: cannot read {name}={opts[name]}: {e}") from None
    return parts, opts, port


def options(url: str, allowed: set[str]) -> dict[str, str]:
    """The query options of `url` (the last value of each); an unknown one is a `StoreConfigError`."""
    query = urllib.parse.urlsplit(url).query
    found = {k: v[-1] for k, v in urllib.parse.parse_qs(query, keep_blank_values=True).items()}
    unknown = set(found) - allowed
    if unknown:
        raise StoreConfigError(f"{redact(url)!r}: unknown option(s) {', '.join(sorted(unknown))} "
                               f"(known: {', '.join(sorted(allowed))})")
    return found


def duration(url: str, name: str, text: str) -> float:
    """`30d`, `12h`, `90m`, `45s`, `500ms` or plain seconds -> seconds (> 0)."""
    m = _AGE.fullmatch(text)
    if not m or float(m.group(1)) <= 0:
        raise StoreConfigError(f"{redact(url)!r}: {name}={text!r} is not a duration (e.g. 30d, 12h, 90s)")
    return float(m.group(1)) * _UNITS[m.group(2).lower()]


def size(url: str, name: str, text: str) -> int:
    try:
        n = _parse_size(text)
    except ValueError as e:
        raise StoreConfigError(f"{redact(url)!r}: {name}={text!r}: {e}") from None
    if n <= 0:
        raise StoreConfigError(f"{redact(url)!r}: {name}={text!r} must be positive")
    return n


def redact(url: str) -> str:
    """`url` without its password (and without the query, which may name key files): safe to log."""
    parts = urllib.parse.urlsplit(url)
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, _, hostport = netloc.rpartition("@")
        user = userinfo.split(":", 1)[0]
        netloc = f"{user}:***@{hostport}" if ":" in userinfo else f"{user}@{hostport}"
    return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, "", ""))

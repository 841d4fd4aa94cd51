"""Prometheus text-format metrics, served on their own port by a tiny asyncio HTTP server.

No client library: a handful of counters and gauges rendered by hand keeps the server image dependency-free.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Callable

log = logging.getLogger(__name__)

_HELP = {
    "neuron_cache_requests_total": ("counter", "gRPC calls by method and status code"),
    "neuron_cache_hits_total": ("counter", "Get/GetStream calls that found the entry"),
    "neuron_cache_misses_total": ("counter", "Get/GetStream calls that did not"),
    "neuron_cache_sent_bytes_total": ("counter", "blob bytes sent to clients"),
    "neuron_cache_received_bytes_total": ("counter", "blob bytes received and stored"),
    "neuron_cache_puts_total": ("counter", "entries created"),
    "neuron_cache_lookup_keys_total": ("counter", "keys asked about in batch lookups"),
    "neuron_cache_leases_acquired_total": ("counter", "compile leases granted"),
}


class Metrics:
    def __init__(self) -> None:
        self.counters: dict[tuple[str, tuple[tuple[str, str], ...]], float] = collections.defaultdict(float)
        self.gauges: dict[str, tuple[str, Callable[[], float]]] = {}

    def inc(self, name: str, amount: float = 1, **labels: str) -> None:
        self.counters[(name, tuple(sorted(labels.items())))] += amount

    def value(self, name: str, **labels: str) -> float:
        return self.counters.get((name, tuple(sorted(labels.items()))), 0.0)

    def gauge(self, name: str, help_text: str, fn: Callable[[], float]) -> None:
        self.gauges[name] = (help_text, fn)

    def render(self) -> str:
        lines: list[str] = []
        by_name: dict[str, list[tuple[tuple[tuple[str, str], ...], float]]] = collections.defaultdict(list)
        for (name, labels), v in self.counters.items():
            by_name[name].append((labels, v))
        for name in sorted(set(by_name) | set(_HELP)):
            kind, text = _HELP.get(name, ("counter", name))
            lines.append(f"# HELP {name} {text}")
            lines.append(f"# TYPE {name} {kind}")
            for labels, v in sorted(by_name.get(name, [])):
                lines.append(f"{name}{_labels(labels)} {_num(v)}")
            if not by_name.get(name):
                lines.append(f"{name} 0")
        for name, (text, fn) in sorted(self.gauges.items()):
            lines.append(f"# HELP {name} {text}")
            lines.append(f"# TYPE {name} gauge")
            try:
                lines.append(f"{name} {_num(fn())}")
            except Exception as e:  # a broken gauge must not take the endpoint down
                log.warning("gauge %s failed: %s", name, e)
        return "\n".join(lines) + "\n"


def _labels(labels: tuple[tuple[str, str], ...]) -> str:
    if not labels:
        return ""
    inner = ",".join(f'{k}="{v}"' for k, v in labels)
    return "{" + inner + "}"


def _num(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else repr(float(v))


async def serve_metrics(metrics: Metrics, host: str, port: int) -> asyncio.Server:
    """GET /metrics → text format 0.0.4; anything else → 404. HTTP/1.0 style: one request per connection."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=5)
            parts = head.split(b" ", 2)
            path = parts[1].decode("latin-1") if len(parts) > 1 else ""
            if parts[0] == b"GET" and path.split("?", 1)[0] in ("/metrics", "/"):
                body = metrics.render().encode()
                status = b"200 OK"
                ctype = b"text/plain; version=0.0.4; charset=utf-8"
            else:
                body, status, ctype = b"not found\n", b"404 Not Found", b"text/plain"
            writer.write(b"HTTP/1.1 " + status + b"\r\nContent-Type: " + ctype + b"\r\nContent-Length: "
                         + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n" + body)
            await writer.drain()
        except (asyncio.TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            pass
        finally:
            writer.close()

    return await asyncio.start_server(handle, host, port)

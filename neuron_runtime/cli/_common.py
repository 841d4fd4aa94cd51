"""What every command shares: cache options and their env twins, opening the tiers, output, progress."""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO, Any

from neuron_runtime import _config
from neuron_runtime.cache import CacheBackend, LocalCache, StoreConfigError, open_store
from neuron_runtime.cli._errors import UsageError

# Flag -> the runtime's environment variable it overrides (the flag's env twin). The CLI hands the same
# environment to the processes it starts (the warm-up job, compile workers), so a flag means the same
# thing everywhere.
ENV_TWINS = {
    "local_dir": "TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR",
    "fleet": "TORCH_NEURONX_NEFF_CACHE_DIR",
    "tier": "TORCH_NEURONX_COMPILER",
    "signing_key_file": "TORCH_NEURONX_CACHE_SIGNING_KEY_FILE",
}

#: TORCH_NEURONX_STATS_FILE as the program found it (`main` removes it from this process's environment).
STATS_FILE_ENV: str | None = None

RUNS_FILE = "neuron-cache-runs.jsonl"  # in the local cache directory: summaries of the last warm/compile runs
QUARANTINE_DIR = "quarantine"  # in the local cache directory: entries `verify` refused


def add_cache_options(p: argparse.ArgumentParser, *, fleet_flags: tuple[str, ...] = ("--fleet",),
                      tier: bool = False) -> None:
    g = p.add_argument_group("cache location (flags override the runtime's environment variables)")
    g.add_argument("--local-dir", metavar="DIR",
                   help="local tier directory [env TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR, default ~/.cache/neuron-runtime/neff]")
    g.add_argument(*fleet_flags, dest="fleet", metavar="URL",
                   help="fleet store: a path, file://, s3://, grpc:// or grpcs:// URL [env TORCH_NEURONX_NEFF_CACHE_DIR]")
    g.add_argument("--signing-key-file", metavar="FILE",
                   help="HMAC key to sign and verify entries [env TORCH_NEURONX_CACHE_SIGNING_KEY(_FILE)]")
    if tier:
        g.add_argument("--tier", choices=["aoti", "reference"],
                       help="compiler tier whose entries to make or look for [env TORCH_NEURONX_COMPILER, default aoti]")


def add_tiers_option(p: argparse.ArgumentParser, default: str | None, shown: str | None = None) -> None:
    p.add_argument("--tiers", choices=["local", "fleet", "all"], default=default,
                   help=f"which cache tiers to act on (default: {shown or default}; 'all' = local + the fleet "
                        "store if one is set)")


def add_json_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print a JSON document on stdout (logs stay on stderr)")


def finish_command(p: argparse.ArgumentParser, func: Any, **cache_options: Any) -> None:
    """What every command's parser ends with: the cache location options (`add_cache_options`, with
    `cache_options`), --json, and `func`, the command's handler."""
    add_cache_options(p, **cache_options)
    add_json_option(p)
    p.set_defaults(func=func)


def runtime_env(args: argparse.Namespace, **force: str | None) -> dict[str, str]:
    """os.environ with the cache flags applied (and `force`d variables set, or removed when None)."""
    env = dict(os.environ)
    for attr, var in ENV_TWINS.items():
        value = getattr(args, attr, None)
        if value:
            # Paths become absolute: the job and the workers may run in another directory.
            if attr in ("local_dir", "signing_key_file") or (attr == "fleet" and "://" not in value):
                value = os.path.abspath(value)
            env[var] = value
            if attr == "signing_key_file":
                env.pop("TORCH_NEURONX_CACHE_SIGNING_KEY", None)  # an explicit file beats an inherited key
    for var, value in force.items():
        if value is None:
            env.pop(var, None)
        else:
            env[var] = value
    return env


def load_config(env: dict[str, str]) -> _config.Config:
    try:
        return _config.load(env)
    except _config.ConfigError as e:
        raise UsageError(str(e)) from e


@dataclass
class Tier:
    name: str  # "local" | "fleet"
    backend: CacheBackend

    @property
    def url(self) -> str:
        return self.backend.url or getattr(self.backend, "directory", "")


def open_local(cfg: _config.Config) -> LocalCache:
    return LocalCache(cfg.local_cache_dir, cfg.cache_max_size)


def open_fleet(cfg: _config.Config) -> CacheBackend | None:
    if not cfg.cache_dir:
        return None
    try:
        return open_store(cfg.cache_dir, cfg)
    except StoreConfigError as e:
        raise UsageError(f"fleet store {cfg.cache_dir!r}: {e}") from e


def open_tiers(cfg: _config.Config, which: str, listing: bool = True) -> list[Tier]:
    """The tiers named by `--tiers`. `fleet` without a fleet store configured is a usage error. With
    `listing` (the command walks every entry), a store that cannot list its entries is named on stderr."""
    tiers: list[Tier] = []
    if which in ("local", "all"):
        tiers.append(Tier("local", open_local(cfg)))
    if which in ("fleet", "all"):
        fleet = open_fleet(cfg)
        if fleet is None:
            if which == "fleet":
                raise UsageError("--tiers fleet needs a fleet store: pass --fleet URL or set TORCH_NEURONX_NEFF_CACHE_DIR")
        else:
            tiers.append(Tier("fleet", fleet))
            if listing and not fleet.lists_entries:
                print(f"neuron-cache: the fleet store {fleet.url} cannot list its entries: this command sees none "
                      "of them (the server evicts on its own; `neuron-cache verify --manifest FILE` checks a job's "
                      "entries)", file=sys.stderr)
    return tiers


def close_tiers(tiers: list[Tier]) -> None:
    for t in tiers:
        t.backend.close()


def print_json(obj: Any, out: IO[str] | None = None) -> None:
    out = out or sys.stdout
    out.write(json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")
    out.flush()


def human_size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def human_age(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f}{unit}"
    return f"{seconds:.0f}s"


def parse_size(text: str) -> int:
    try:
        return _config._parse_size(text)  # noqa: SLF001 - one size syntax for env vars and flags
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


_AGE = re.compile(r"\s*([0-9]*\.?[0-9]+)\s*([smhdw]?)\s*", re.I)


def parse_age(text: str) -> float:
    """`30d`, `12h`, `90m`, `45s` or plain seconds -> seconds."""
    m = _AGE.fullmatch(text)
    if not m:
        raise argparse.ArgumentTypeError(f"not an age: {text!r} (use e.g. 7d, 12h, 30m or seconds)")
    return float(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}[m.group(2).lower()]


def env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if not raw:
        return default
    try:
        return int(raw)
    except ValueError:
        raise UsageError(f"{name}={raw!r} is not an integer") from None


def record_run(cfg: _config.Config, summary: dict[str, Any], keep: int = 20) -> None:
    """Append a warm/compile summary to the local directory's run log (bounded), for `stats`."""
    path = os.path.join(cfg.local_cache_dir, RUNS_FILE)
    line = json.dumps(summary, sort_keys=True, default=str)
    try:
        os.makedirs(cfg.local_cache_dir, mode=0o700, exist_ok=True)
        try:
            with open(path, encoding="utf-8") as f:
                lines = f.read().splitlines()[-(keep - 1):]
        except FileNotFoundError:
            lines = []
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.write("\n".join([*lines, line]) + "\n")
        os.replace(tmp, path)
    except OSError:
        pass  # a run log is a convenience; never fail a warm-up over it


def read_runs(cfg: _config.Config) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    try:
        with open(os.path.join(cfg.local_cache_dir, RUNS_FILE), encoding="utf-8") as f:
            for line in f:
                try:
                    out.append(json.loads(line))
                except ValueError:
                    continue
    except OSError:
        pass
    return out


class Progress:
    """A progress bar on stderr: redrawn in place on a terminal, one line per step otherwise (CI logs)."""

    def __init__(self, total: int, label: str, enabled: bool = True, stream: IO[str] | None = None) -> None:
        self.total = total
        self.label = label
        self.stream = stream or sys.stderr
        self.enabled = enabled and total > 0
        self.tty = self.stream.isatty()
        self.done = 0
        self.counts: dict[str, int] = {}
        self.t0 = time.monotonic()
        self.last = 0.0

    def step(self, status: str, what: str, seconds: float | None = None) -> None:
        self.done += 1
        self.counts[status] = self.counts.get(status, 0) + 1
        if not self.enabled:
            return
        elapsed = time.monotonic() - self.t0
        eta = elapsed / self.done * (self.total - self.done)
        counts = "  ".join(f"{k} {v}" for k, v in sorted(self.counts.items()))
        if self.tty:
            width = 24
            fill = int(width * self.done / self.total)
            self.stream.write(f"\r{self.label} [{'#' * fill}{'.' * (width - fill)}] {self.done}/{self.total}  "
                              f"{counts}  eta {human_age(eta)}  {what[:40]:<40}")
            if self.done == self.total:
                self.stream.write("\n")
        else:
            # CI logs: every problem, and otherwise one line every 2 s (a line per cached op is noise).
            now = time.monotonic()
            if status in ("compiled", "present") and self.done < self.total and now - self.last < 2.0:
                return
            self.last = now
            took = f" ({seconds:.1f} s)" if seconds is not None else ""
            self.stream.write(f"{self.label} [{self.done}/{self.total}] {status} {what}{took}  "
                              f"eta {human_age(eta)}\n")
        self.stream.flush()


def read_entry(backend: CacheBackend, key: str) -> bytes | None:
    """The stored bytes, without counting as a use where the tier tracks last use (local LRU): scans
    must not make every entry look fresh to eviction and `prune --older-than`."""
    peek = getattr(backend, "peek", None)
    data: bytes | None = peek(key) if peek is not None else backend.get(key)
    return data


def iter_headers(tier: Tier) -> Iterator[tuple[str, int, float, dict[str, Any] | None, bytes | None]]:
    """(key, size, mtime, header or None, bytes or None) for every entry of a tier. Headers are read
    *unverified* (listings and `explain` only); None when the entry vanished or its header is unreadable."""
    from neuron_runtime.cache import envelope
    from neuron_runtime.cache import CacheError

    for info in list(tier.backend.entries()):
        try:
            data = read_entry(tier.backend, info.key)
        except CacheError:
            yield info.key, info.size, info.mtime, None, None
            continue
        if data is None:
            continue
        try:
            header: dict[str, Any] | None = envelope.peek_header(data)
        except CacheError:
            header = None
        yield info.key, info.size, info.mtime, header, data

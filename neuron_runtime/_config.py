"""Every environment variable the runtime reads, in one place.

`load()` reads the environment into a frozen `Config`; `get()` returns the process-wide one, read once.
Tests that change the environment call `reload()`. Unknown `TORCH_NEURONX_*` variables get one warning.
"""

from __future__ import annotations

import dataclasses
import os
import re
import warnings
from pathlib import Path

_PREFIX = "TORCH_NEURONX_"


def _parse_size(text: str) -> int:
    """`10GiB`, `500MB`, `1.5G` or plain bytes -> bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGTP]?)(I?B?)\s*", text.upper())
    if not m:
        raise ValueError(f"not a size: {text!r} (use e.g. 10GiB, 500MB or plain bytes)")
    number, unit, suffix = float(m.group(1)), m.group(2), m.group(3)
    base = 1024 if suffix.startswith("I") or (unit and not suffix) else 1000
    power = " KMGTP".index(unit or " ")
    return int(number * base**power)


def _positive(n: int) -> int:
    if n <= 0:
        raise ValueError("must be more than 0 bytes")
    return n


def device_memory(env: dict[str, str] | None = None) -> int | None:
    """TORCH_NEURONX_DEVICE_MEMORY alone, for the native layer's allocator (set up at import, before any
    Config is read); raises ConfigError for a value it cannot use."""
    raw = (os.environ if env is None else env).get("TORCH_NEURONX_DEVICE_MEMORY")
    if not raw:
        return None
    try:
        return _positive(_parse_size(raw))
    except ValueError as e:
        raise ConfigError(f"TORCH_NEURONX_DEVICE_MEMORY={raw!r}: {e}") from e


def _flag(value: str | None, default: bool) -> bool:
    if value is None or value == "":
        return default
    return value.strip().lower() not in ("0", "false", "no", "off")


def cache_root() -> Path:
    """`$XDG_CACHE_HOME/neuron-runtime` (or `~/.cache/neuron-runtime`): the local tier, the native layer."""
    return Path(os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")) / "neuron-runtime"


def default_aoti_runtime_dir() -> str:
    """Where the `aoti` tier keeps the runtime every op links (built once per host, toolchain and torch)."""
    return str(cache_root() / "aoti-runtime")


def _default_local_dir() -> str:
    return str(cache_root() / "neff")


def _default_workers() -> int:
    """Compile workers of the host's service: one per core, 1 to 8. They run at nice 10, so the training
    job (on the host path until its executables land) keeps the CPU it asks for."""
    return max(1, min(8, os.cpu_count() or 2))


@dataclasses.dataclass(frozen=True)
class Config:
    compiler: str = "aoti"
    fallback: bool = True
    graph_fallback: bool = True  # a torch.compile graph the compiler refuses runs op by op
    stats_file: str | None = None
    log_level: str = "WARNING"
    # caches
    cache_dir: str | None = None  # fleet store URL: path, file://, s3://, grpc://, grpcs://
    local_cache_dir: str = dataclasses.field(default_factory=_default_local_dir)
    cache_max_size: int = 10 * 1024**3
    cache_mode: str = "readwrite"  # readwrite | readonly | strict
    memory_cache_entries: int = 4096
    signing_key: bytes | None = None
    cache_token: str | None = None
    fleet_timeout_s: float = 10.0
    lease_ttl_s: float = 300.0
    lock_timeout_s: float = 600.0
    single_flight: bool = True
    # aoti target
    aoti_march: str = "x86-64-v3"
    aoti_simdlen: int | None = None
    aoti_runtime_dir: str | None = None  # the shared AOTI runtime (compiler/_aoti_runtime.py); default below
    # fusion
    concatenation: bool = False
    concatenation_buffer_limit: int = 1024
    fusion_min_seen: int = 3
    fusion_min_numel: int = 0  # 0: no size threshold (fusion measures instead: aten/_fusion.py)
    # recording (neuron-cache warm)
    record_file: str | None = None
    # background compiles (the host's compile service) and prefetch
    compile_mode: str = "background"  # background | sync
    compile_workers: int = dataclasses.field(default_factory=lambda: _default_workers())
    compile_timeout_s: float = 900.0
    compile_idle_timeout_s: float = 300.0
    compile_queue: int = 4096
    compile_after: int = 2  # a key is compiled once it was asked for this many times (1: on first sight)
    compile_batch: int = 8  # signatures a worker compiles in one C++ translation unit at most
    job: str | None = None
    prefetch: bool = True
    # shape classes (docs/dispatch.md): static | generic | auto
    shapes: str = "auto"
    # the device's memory capacity in bytes (torch.neuron.mem_get_info); None: the host's memory
    device_memory: int | None = None


# name -> (field, parser). The README's table lists exactly these.
_VARS: dict[str, tuple[str, object]] = {
    "TORCH_NEURONX_COMPILER": ("compiler", str),
    "TORCH_NEURONX_FALLBACK": ("fallback", lambda v: _flag(v, True)),
    "TORCH_NEURONX_DISABLE_FALLBACK_EXECUTION": ("graph_fallback", lambda v: not _flag(v, False)),
    "TORCH_NEURONX_STATS_FILE": ("stats_file", str),
    "TORCH_NEURONX_LOG_LEVEL": ("log_level", str.upper),
    "TORCH_NEURONX_NEFF_CACHE_DIR": ("cache_dir", str),
    "TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR": ("local_cache_dir", str),
    "TORCH_NEURONX_NEFF_CACHE_MAX_SIZE": ("cache_max_size", _parse_size),
    "TORCH_NEURONX_CACHE_MODE": ("cache_mode", str.lower),
    "TORCH_NEURONX_MEMORY_CACHE_ENTRIES": ("memory_cache_entries", int),
    "TORCH_NEURONX_CACHE_TOKEN": ("cache_token", str),
    "TORCH_NEURONX_FLEET_TIMEOUT": ("fleet_timeout_s", float),
    "TORCH_NEURONX_LEASE_TTL": ("lease_ttl_s", float),
    "TORCH_NEURONX_LOCK_TIMEOUT": ("lock_timeout_s", float),
    "TORCH_NEURONX_SINGLE_FLIGHT": ("single_flight", lambda v: _flag(v, True)),
    "TORCH_NEURONX_AOTI_MARCH": ("aoti_march", str),
    "TORCH_NEURONX_AOTI_SIMDLEN": ("aoti_simdlen", int),
    "TORCH_NEURONX_AOTI_RUNTIME_DIR": ("aoti_runtime_dir", str),
    "TORCH_NEURONX_ENABLE_CONCATENATION": ("concatenation", lambda v: _flag(v, False)),
    "TORCH_NEURONX_CONCATENATION_BUFFER_SIZE_LIMIT": ("concatenation_buffer_limit", int),
    "TORCH_NEURONX_FUSION_MIN_SEEN": ("fusion_min_seen", int),
    "TORCH_NEURONX_FUSION_MIN_NUMEL": ("fusion_min_numel", int),
    "TORCH_NEURONX_RECORD_FILE": ("record_file", str),
    "TORCH_NEURONX_COMPILE_MODE": ("compile_mode", str.lower),
    "TORCH_NEURONX_COMPILE_WORKERS": ("compile_workers", int),
    "TORCH_NEURONX_COMPILE_TIMEOUT": ("compile_timeout_s", float),
    "TORCH_NEURONX_COMPILE_IDLE_TIMEOUT": ("compile_idle_timeout_s", float),
    "TORCH_NEURONX_COMPILE_QUEUE": ("compile_queue", int),
    "TORCH_NEURONX_COMPILE_AFTER": ("compile_after", int),
    "TORCH_NEURONX_COMPILE_BATCH": ("compile_batch", int),
    "TORCH_NEURONX_JOB": ("job", str),
    "TORCH_NEURONX_PREFETCH": ("prefetch", lambda v: _flag(v, True)),
    "TORCH_NEURONX_SHAPES": ("shapes", str.lower),
    "TORCH_NEURONX_DEVICE_MEMORY": ("device_memory", lambda v: _positive(_parse_size(v))),
}
# Read elsewhere (signing key material; the native layer, loaded before any Config; the upstream test
# runner's PyTorch checkout), listed so they are not reported as unknown.
_OTHER_KNOWN = {"TORCH_NEURONX_CACHE_SIGNING_KEY", "TORCH_NEURONX_CACHE_SIGNING_KEY_FILE",
                "TORCH_NEURONX_CACHE_SIGNING_KEY_HEX", "TORCH_NEURONX_NATIVE", "TORCH_NEURONX_PYTORCH_TESTS"}

_COMPILERS = ("aoti", "reference")
_MODES = ("readwrite", "readonly", "strict")
_COMPILE_MODES = ("background", "sync")
_SHAPES = ("auto", "generic", "static")


class ConfigError(ValueError):
    """An environment variable holds a value the runtime cannot use."""


def _signing_key(env: dict[str, str]) -> bytes | None:
    """The HMAC key: any bytes. From `..._KEY` (the variable's bytes as the OS holds them: `os.fsencode`
    undoes Python's decoding of the environment, so a key that is not UTF-8 is kept exactly), `..._KEY_HEX`
    (hex: how the runtime hands a key to the processes it starts, since an environment cannot hold a NUL
    byte), or `..._KEY_FILE` (the file's bytes, surrounding whitespace stripped)."""
    key = env.get("TORCH_NEURONX_CACHE_SIGNING_KEY")
    if key:
        return os.fsencode(key)
    hexed = env.get("TORCH_NEURONX_CACHE_SIGNING_KEY_HEX")
    if hexed:
        try:
            return bytes.fromhex(hexed)
        except ValueError:
            raise ConfigError("TORCH_NEURONX_CACHE_SIGNING_KEY_HEX: not hexadecimal") from None
    path = env.get("TORCH_NEURONX_CACHE_SIGNING_KEY_FILE")
    if path:
        try:
            data = Path(path).read_bytes().strip()
        except OSError as e:
            raise ConfigError(f"TORCH_NEURONX_CACHE_SIGNING_KEY_FILE: cannot read {path}: {e}") from e
        if not data:
            raise ConfigError(f"TORCH_NEURONX_CACHE_SIGNING_KEY_FILE: {path} is empty")
        return data
    return None


def load(env: dict[str, str] | None = None) -> Config:
    env = dict(os.environ if env is None else env)
    values: dict[str, object] = {}
    for name, (field, parse) in _VARS.items():
        raw = env.get(name)
        if raw is None or raw == "":
            continue
        try:
            values[field] = parse(raw)  # type: ignore[operator]
        except ValueError as e:
            raise ConfigError(f"{name}={raw!r}: {e}") from e
    for name in env:
        if name.startswith(_PREFIX) and name not in _VARS and name not in _OTHER_KNOWN:
            warnings.warn(f"unknown environment variable {name} (ignored); see the README's table", stacklevel=2)
    values["signing_key"] = _signing_key(env)
    cfg = Config(**values)  # type: ignore[arg-type]
    if cfg.compiler not in _COMPILERS:
        raise ConfigError(f"TORCH_NEURONX_COMPILER={cfg.compiler!r}: choose one of {', '.join(_COMPILERS)}")
    if cfg.cache_mode not in _MODES:
        raise ConfigError(f"TORCH_NEURONX_CACHE_MODE={cfg.cache_mode!r}: choose one of {', '.join(_MODES)}")
    if cfg.compile_mode not in _COMPILE_MODES:
        raise ConfigError(f"TORCH_NEURONX_COMPILE_MODE={cfg.compile_mode!r}: choose one of "
                          f"{', '.join(_COMPILE_MODES)}")
    if cfg.shapes not in _SHAPES:
        raise ConfigError(f"TORCH_NEURONX_SHAPES={cfg.shapes!r}: choose one of {', '.join(_SHAPES)}")
    if cfg.compile_workers < 1:
        raise ConfigError(f"TORCH_NEURONX_COMPILE_WORKERS={cfg.compile_workers}: need at least 1")
    if cfg.compile_batch < 1:
        raise ConfigError(f"TORCH_NEURONX_COMPILE_BATCH={cfg.compile_batch}: need at least 1")
    return cfg


# Flags whose variable says the opposite of their field (DISABLE_... sets graph_fallback False).
_INVERTED = frozenset({"TORCH_NEURONX_DISABLE_FALLBACK_EXECUTION"})


def to_env(cfg: Config) -> dict[str, str]:
    """`cfg` as the environment variables that `load` reads back into an equal Config (the signing key
    included, as hex: any bytes): what a process started on the runtime's behalf needs to run the same
    configuration. Environments are private to their user; never put this on a command line."""
    env: dict[str, str] = {}
    for name, (field, _) in _VARS.items():
        value = getattr(cfg, field)
        if value is None:
            continue
        if isinstance(value, bool):
            value = value != (name in _INVERTED)
            env[name] = "1" if value else "0"
        else:
            env[name] = str(value)
    if cfg.signing_key is not None:
        env["TORCH_NEURONX_CACHE_SIGNING_KEY_HEX"] = cfg.signing_key.hex()
    return env


_current: Config | None = None


def get() -> Config:
    global _current
    if _current is None:
        _current = load()
    return _current


def reload() -> Config:
    global _current
    _current = load()
    return _current

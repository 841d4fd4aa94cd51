"""What decides whether an `aoti` executable can run on this host, and where Inductor may write.

Two jobs, both about the host rather than about one op:
  * the fingerprint: every input of the code generator and the C++ toolchain that could make an artifact
    compiled here wrong or unrunnable elsewhere (torch build, Inductor settings, target ISA, compiler,
    machine, libc, Python). It is part of every cache key and is stored inside every artifact;
  * the scratch directories: Inductor writes its cache, ~150-270 MB of precompiled headers and g++ temp
    files; they go to one private directory per host and fingerprint instead of a shared /tmp.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

# /proc/cpuinfo flags each x86-64 micro-architecture level requires (the psABI levels). A level the host
# lacks would compile fine and then die with SIGILL, so it is refused before compiling.
_X86_LEVELS: dict[str, tuple[str, ...]] = {
    "x86-64": (),
    "x86-64-v2": ("cx16", "lahf_lm", "popcnt", "sse4_1", "sse4_2", "ssse3"),
    "x86-64-v3": ("cx16", "lahf_lm", "popcnt", "sse4_1", "sse4_2", "ssse3",
                  "avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"),
    "x86-64-v4": ("cx16", "lahf_lm", "popcnt", "sse4_1", "sse4_2", "ssse3",
                  "avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave",
                  "avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"),
}
# Inductor's vector width for each level: its default picks the widest ISA the *host* has (AVX-512 on a
# v4 host), which would put AVX-512 code into an artifact labelled x86-64-v3.
_X86_SIMDLEN = {"x86-64": 0, "x86-64-v2": 0, "x86-64-v3": 256, "x86-64-v4": 512}


class ToolchainError(RuntimeError):
    """This host cannot compile or run code for the configured target (the message names the setting)."""


def simdlen_for(march: str, configured: int | None) -> int | None:
    """The vector width pinned for `march`: TORCH_NEURONX_AOTI_SIMDLEN if set, else the level's width."""
    if configured is not None:
        return configured
    return _X86_SIMDLEN.get(march)


def pins(march: str, simdlen: int | None) -> dict[str, Any]:
    """Inductor settings every `aoti` compile runs under. Each one is here for a reason:

    * march/simdlen: the default `-march=native` and host-widest vector ISA make artifacts that SIGILL
      (or, for source artifacts, compute wrong results) on older CPUs of the same fleet;
    * threads=1: kernels never specialise on the compiling host's core count and a small op never pays
      for an OpenMP parallel region (large matmuls are ATen calls and stay multi-threaded);
    * vec_isa_ok: the ISA is pinned, so Inductor's probe (two test compiles + a dlopen in a child
      process, 10-30 s on first use) has nothing to decide;
    * no line tables: debug info is 3/4 of an unstripped .so and nobody debugs per-op kernels;
    * no minifier dumps: a failed compile is a refusal, not a reason to write repro scripts to the cwd.
    """
    p: dict[str, Any] = {
        "cpp.march": march,
        "cpp.threads": 1,
        "cpp.dynamic_threads": False,
        "cpp.vec_isa_ok": True,
        "aot_inductor.enable_line_tables": False,
        "aot_inductor.debug_compile": False,
        "aot_inductor.debug_symbols": False,
        "aot_inductor.dump_aoti_minifier": False,
        "aot_inductor.precompile_headers": True,
        "aot_inductor.package_constants_in_so": True,
        "aot_inductor.package_constants_on_disk_format": None,
    }
    if simdlen is not None:
        p["cpp.simdlen"] = simdlen
    return p


@functools.cache
def check_host(march: str) -> None:
    """Raise `ToolchainError` when this CPU cannot run code built for `march` (unknown names pass)."""
    machine = platform.machine()
    if march.startswith("x86-64") and machine not in ("x86_64", "AMD64"):
        raise ToolchainError(f"TORCH_NEURONX_AOTI_MARCH={march} targets x86-64 but this machine is {machine}; "
                             "set TORCH_NEURONX_AOTI_MARCH to this machine's baseline (e.g. armv8.2-a)")
    missing = [f for f in _X86_LEVELS.get(march, ()) if f not in _cpu_flags()]
    if missing:
        raise ToolchainError(f"this CPU lacks {', '.join(missing)} required by TORCH_NEURONX_AOTI_MARCH={march}; "
                             "set it to the fleet's oldest CPU level (e.g. x86-64-v2)")


@functools.cache
def _cpu_flags() -> frozenset[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.partition(":")[2].split())
    return frozenset()


@functools.cache
def cxx_identity() -> dict[str, str]:
    """The C++ compiler Inductor will call (its `cpp.cxx`/CXX choice): resolved path and version line."""
    from torch._inductor.cpp_builder import get_cpp_compiler

    try:
        name = get_cpp_compiler()
    except Exception as e:  # noqa: BLE001 - reported as part of the identity, refused at compile
        return {"path": "", "version": f"unavailable: {e}"}
    path = shutil.which(name) or name
    real = os.path.realpath(path)
    try:
        out = subprocess.run([real, "--version"], capture_output=True, text=True, timeout=30, check=False).stdout
        version = out.splitlines()[0].strip() if out else ""
    except (OSError, subprocess.SubprocessError) as e:
        version = f"unavailable: {e}"
    return {"path": real, "version": version}


def _inductor_config_hash(pinned: dict[str, Any]) -> str:
    """sha256 of Inductor's portable configuration with our pins applied: the settings that change the
    generated code (Inductor's own FX-graph cache keys on the same set)."""
    import torch._inductor.config as iconfig

    with iconfig.patch(pinned):
        portable = iconfig.save_config_portable()
    text = json.dumps(portable, sort_keys=True, default=repr, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def _vector_isa(pinned: dict[str, Any]) -> str:
    """The vector ISA Inductor generates code for under the pins (cpuinfo only: the probe is off). With a
    pinned width this is the same on every host of a level, except where Inductor prefers a wider variant
    (AMX over AVX-512 for 512 bits): then it differs, and artifacts never cross between those hosts."""
    import torch._inductor.config as iconfig
    from torch._inductor import cpu_vec_isa

    with iconfig.patch(pinned):
        return str(cpu_vec_isa.pick_vec_isa())


@functools.cache
def fingerprint(tier: str, format_version: int, march: str, simdlen: int | None) -> dict[str, Any]:
    """Everything that decides whether an artifact compiled elsewhere runs correctly here.

    Computing it imports Inductor (seconds: Dynamo comes with it) and runs the C++ compiler, which a
    training process would otherwise pay on its first op, before any compile; so it is computed once per
    host and torch install and kept on disk (`_fingerprint_file`), keyed by everything it is computed
    from: torch's build and files, Python, the CPU's flags, the compiler binaries on PATH, and every
    environment variable Inductor or the compiler choice reads."""
    path = _fingerprint_file(tier, format_version, march, simdlen)
    try:
        cached = json.loads(path.read_text())
        if isinstance(cached, dict):
            return cached
    except (OSError, ValueError):
        pass
    fp = _compute_fingerprint(tier, format_version, march, simdlen)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(fp, sort_keys=True))
        os.replace(tmp, path)
    except OSError as e:
        log.debug("cannot keep the aoti fingerprint in %s: %s", path, e)
    return fp


def _fingerprint_file(tier: str, format_version: int, march: str, simdlen: int | None) -> Path:
    from .. import _config

    def binary(name: str) -> str:
        found = shutil.which(name)
        if found is None:
            return f"{name}:missing"
        st = os.stat(os.path.realpath(found))
        return f"{os.path.realpath(found)}:{st.st_size}:{st.st_mtime_ns}"

    torch_dir = Path(torch.__file__).parent
    st = os.stat(torch_dir / "_C" if (torch_dir / "_C").exists() else torch.__file__)
    inputs = {
        "args": [tier, format_version, march, simdlen], "v": 1,
        "torch": [torch.__version__, torch.version.git_version, str(torch_dir), st.st_mtime_ns],
        "python": sys.version, "cpu": sorted(_cpu_flags()),
        "cxx": [binary(n) for n in sorted({os.environ.get("CXX", "g++"), "g++", "c++", "clang++"})],
        "env": {k: v for k, v in sorted(os.environ.items())
                if k.startswith(("TORCHINDUCTOR_", "TORCH_", "AOT_INDUCTOR", "ATEN_", "CXX", "CC"))
                and not k.startswith("TORCH_NEURONX_")},
    }
    digest = hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:24]
    return _config.cache_root() / "fingerprint" / f"{digest}.json"


def _compute_fingerprint(tier: str, format_version: int, march: str, simdlen: int | None) -> dict[str, Any]:
    pinned = pins(march, simdlen)
    libc_name, libc_version = platform.libc_ver()
    return {
        "tier": tier,
        "format": format_version,
        "target": {"march": march, "simdlen": simdlen, "vec_isa": _vector_isa(pinned)},
        "torch": torch.__version__,
        "torch_git": torch.version.git_version,
        "inductor_config": _inductor_config_hash(pinned),
        "pins": {k: pinned[k] for k in sorted(pinned)},
        "cxx": cxx_identity(),
        "machine": platform.machine(),
        "libc": f"{libc_name} {libc_version}".strip(),
        "python": platform.python_version(),
        "python_abi": sys.implementation.cache_tag,
    }


def fingerprint_digest(fp: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(fp, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


class Scratch:
    """Private working directories of Inductor for one host and fingerprint.

    Lives beside the local executable cache (`<local_cache_dir>/../inductor-<fingerprint>`): that directory
    is host-private by contract (SQLite never on NFS) and survives restarts, so precompiled headers are
    built once per host, not once per process. Layout: cache/ (TORCHINDUCTOR_CACHE_DIR), pch/ (precompiled
    headers), tmp/ (TMPDIR of g++ and Python during a compile), build/ (one directory per compile,
    deleted after packaging), load/ (package files and the loader's extraction directories)."""

    def __init__(self, local_cache_dir: str, fp: dict[str, Any]) -> None:
        self.root = Path(local_cache_dir).expanduser().resolve().parent / f"inductor-{fingerprint_digest(fp)[:16]}"
        self.cache = self.root / "cache"
        self.pch = self.root / "pch"
        self.tmp = self.root / "tmp"
        self.build = self.root / "build"
        self.load = self.root / "load"
        for d in (self.root, self.cache, self.pch, self.tmp, self.build, self.load):
            d.mkdir(mode=0o700, parents=True, exist_ok=True)

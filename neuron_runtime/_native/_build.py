"""Building and loading the native extension (`fastpath.cpp`): see the package's docstring."""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import warnings
from pathlib import Path
from types import ModuleType

import torch

from .. import _config

NAME = "_neuron_native"
SOURCE = Path(__file__).with_name("fastpath.cpp")
# Included by SOURCE: part of the build's tag.
HEADERS = tuple(Path(__file__).with_name(h) for h in ("memory.h", "process_group.h", "trace.h"))


def enabled() -> bool:
    return _config._flag(os.environ.get("TORCH_NEURONX_NATIVE"), True)


def _compiler() -> str:
    return os.environ.get("CXX") or "g++"


def _compiler_identity(cxx: str) -> str:
    """The compiler's resolved path, size and mtime: a new compiler builds anew. Cheap, because every
    process start computes it (running `g++ --version` cost ~3 ms per `import torch`)."""
    path = shutil.which(cxx)
    if path is None:
        return "missing"
    st = os.stat(os.path.realpath(path))
    return f"{os.path.realpath(path)}:{st.st_size}:{st.st_mtime_ns}"


def _build_dir() -> Path:
    return _config.cache_root() / "native"


# The compiler's flags (a build with other flags is another build: they are part of its key).
FLAGS = ("-shared", "-fPIC", "-O2", "-std=c++17", "-fvisibility=hidden")


def _target(cxx: str) -> Path:
    h = hashlib.sha256()
    for part in (SOURCE.read_bytes(), *(p.read_bytes() for p in HEADERS), torch.__version__.encode(), str(torch.version.git_version).encode(),
                 sys.version.encode(), _compiler_identity(cxx).encode(), torch.__file__.encode(), " ".join(FLAGS).encode()):
        h.update(part)
        h.update(b"\0")
    return _build_dir() / h.hexdigest()[:20] / (NAME + sysconfig.get_config_var("EXT_SUFFIX"))


def _kineto_flags(includes: list[str]) -> list[str]:
    """Kineto's headers and `USE_KINETO` when this torch was built with Kineto (the profiler's device
    track, trace.h); nothing otherwise (the extension then registers no profiler)."""
    if not torch.autograd.kineto_available():
        return []
    for inc in includes:
        kineto = os.path.join(inc, "kineto")
        if os.path.exists(os.path.join(kineto, "IActivityProfiler.h")):
            return ["-DUSE_KINETO", f"-I{kineto}"]
    return []


def _command(cxx: str, out: str) -> list[str]:
    from torch.utils import cpp_extension

    includes = [*cpp_extension.include_paths(), sysconfig.get_paths()["include"]]
    libdir = os.path.join(os.path.dirname(torch.__file__), "lib")
    return [cxx, *FLAGS,
            f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
            f"-DTORCH_EXTENSION_NAME={NAME}", "-DTORCH_API_INCLUDE_EXTENSION_H",
            *[f"-I{p}" for p in includes], *_kineto_flags(includes), str(SOURCE), "-o", out,
            f"-L{libdir}", "-lc10", "-ltorch", "-ltorch_cpu", "-ltorch_python"]


def build() -> Path:
    """The path of the built extension, building it if this torch install has none yet."""
    cxx = _compiler()
    target = _target(cxx)
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    print("neuron: building the native dispatch layer (once per torch install, about a minute)",
          file=sys.stderr, flush=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".so.tmp")
    os.close(fd)
    try:
        r = subprocess.run(_command(cxx, tmp), capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"{cxx} failed ({r.returncode}): {r.stderr.strip()[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _import(path: Path) -> ModuleType:
    loader = importlib.machinery.ExtensionFileLoader(NAME, str(path))
    spec = importlib.util.spec_from_file_location(NAME, path, loader=loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


_module: ModuleType | None = None
_error: str | None = None


def load() -> ModuleType | None:
    """The extension, or None (disabled, or it cannot be built here: one warning says why)."""
    global _module, _error
    if _module is not None or _error is not None:
        return _module
    if not enabled():
        _error = "disabled by TORCH_NEURONX_NATIVE=0"
        return None
    try:
        _module = _import(build())
    except Exception as e:  # noqa: BLE001 - the Python path serves every op without it
        _error = f"{type(e).__name__}: {e}"
        warnings.warn(f"neuron: native dispatch layer unavailable ({_error}); every op takes the slower "
                      "Python path (TORCH_NEURONX_NATIVE=0 silences this)", UserWarning, stacklevel=2)
    return _module


def status() -> str:
    """One line for `collect_env`."""
    if _module is not None:
        return f"loaded ({_module.__file__})"
    return _error or "not loaded"

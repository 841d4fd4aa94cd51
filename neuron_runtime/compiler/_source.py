"""Kernel source (`neuron_runtime.kernel(..., source=...)`, docs/kernels.md): C++ compiled with the host
compiler into a shared object, loaded with ctypes. No Inductor, no pickle.

The signature (built by `kernels/`, keyed and cached like any):
    {"op": "source:<ns>::<name>", "args": [], "language": "c++", "source": <text>,
     "inputs": [[dtype, rank], ...], "outputs": [[dtype, rank], ...], "scalars": <count>}
Sizes are not part of it: the ABI passes each tensor's sizes and strides at run time, so one artifact
serves every shape (`"args": []` leaves it no shape classes either).

The ABI (the prelude below, prepended to the user's text; documented in docs/kernels.md): the source
defines `void kernel(const nr_tensor* in, nr_tensor* out, const double* scalars)`; `in` holds the
call's input tensors in schema order, `out` the outputs (allocated by the runtime, contiguous, to be
written), `scalars` the number arguments in schema order as doubles. Strides count elements. A C++
exception thrown by `kernel` becomes the call's error. The shared object exports `nr_entry`, which
unpacks one int64 array per call into `nr_tensor`s and catches exceptions.

The artifact: `MAGIC`, an 8-byte length, the canonical JSON of {"format", "signature", "fingerprint"},
then the .so's bytes. `load` writes the .so once per content digest under a private directory.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import shutil
import stat
import struct
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Any

import torch

from ..signatures import canonical
from ._base import CompileRefused, Executable

PREFIX = "source:"
MAGIC = b"NRSRC1\n"
FORMAT = "source-v1"
MAX_RANK = 8
LANGUAGES = ("c++",)

PRELUDE = r"""#include <cstdint>
#include <cstddef>
#include <cmath>
#include <cstring>
#include <exception>
#include <stdexcept>
struct nr_tensor {
  void* data;               // the first element (storage offset applied)
  int64_t dim;              // rank
  int64_t sizes[8];
  int64_t strides[8];       // in elements
  int64_t numel;
  template <class T> T* ptr() const { return static_cast<T*>(data); }
};
void kernel(const nr_tensor* in, nr_tensor* out, const double* scalars);
"""

EPILOGUE = r"""
extern "C" __attribute__((visibility("default")))
int nr_entry(const int64_t* packed, int64_t n_in, int64_t n_out, const double* scalars, char* err, int64_t errlen) {
  nr_tensor t[64];
  const int64_t n = n_in + n_out;
  if (n > 64) { std::snprintf(err, errlen, "more than 64 tensors"); return 1; }
  for (int64_t i = 0; i < n; ++i) {
    t[i].data = reinterpret_cast<void*>(packed[0]);
    t[i].dim = packed[1];
    t[i].numel = 1;
    for (int64_t d = 0; d < t[i].dim; ++d) {
      t[i].sizes[d] = packed[2 + d];
      t[i].strides[d] = packed[2 + t[i].dim + d];
      t[i].numel *= t[i].sizes[d];
    }
    packed += 2 + 2 * t[i].dim;
  }
  try {
    kernel(t, t + n_in, scalars);
  } catch (const std::exception& e) {
    std::snprintf(err, errlen, "%s", e.what());
    return 1;
  } catch (...) {
    std::snprintf(err, errlen, "a C++ exception that is not a std::exception");
    return 1;
  }
  return 0;
}
"""


class SourceError(CompileRefused):
    """Kernel source that does not compile: the message names the kernel and holds the compiler's
    diagnostics, with line numbers of the kernel's own text."""



def _private_dir(base: Path) -> Path:
    """`base`, made `0o700` if missing; refused unless it is a real directory of this user that no one
    else can write (a predictable name in a shared /tmp: another user could have made it first). Refused:
    a fresh private directory of its own instead."""
    base.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = os.lstat(base)
    if stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o022:
        return base
    return Path(tempfile.mkdtemp(prefix="nr-source-"))

def is_source(sig: dict[str, Any]) -> bool:
    return str(sig.get("op", "")).startswith(PREFIX)


def is_artifact(payload: bytes) -> bool:
    return payload[: len(MAGIC)] == MAGIC


def cxx() -> str:
    """The host C++ compiler: $CXX, else g++, else c++."""
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or "g++"


def compile_source(sig: dict[str, Any], fingerprint: dict[str, Any], flags: list[str], tmp: str | None = None) -> bytes:
    """The artifact of a source signature, built with `cxx() -O3 <flags> -shared -fPIC`. Raises
    `CompileRefused` for a language this host does not compile (NKI: a Neuron compiler's) and
    `SourceError` for a compile error."""
    name = str(sig["op"])[len(PREFIX):]
    lang = sig.get("language")
    if lang not in LANGUAGES:
        raise CompileRefused(f"kernel {name}: source language {lang!r} is not compiled by this tier "
                             f"(it compiles {', '.join(LANGUAGES)}; 'nki' needs a Neuron compiler)")
    for d, r in [*sig.get("inputs", []), *sig.get("outputs", [])]:
        if not 0 <= int(r) <= MAX_RANK:
            raise CompileRefused(f"kernel {name}: a tensor of rank {r}; the source ABI takes ranks up to {MAX_RANK}")
    # `#line` makes the compiler's messages name the kernel and the line of the user's own text.
    text = (PRELUDE + f'#line 1 "{name}"\n' + str(sig["source"]) + '\n#line 1 "<neuron kernel entry>"\n'
            "#include <cstdio>\n" + EPILOGUE)
    with tempfile.TemporaryDirectory(prefix="nr-source-", dir=tmp) as work:
        src, lib = Path(work) / "kernel.cpp", Path(work) / "kernel.so"
        src.write_text(text)
        argv = [cxx(), "-O3", *flags, "-std=c++17", "-shared", "-fPIC", "-fvisibility=hidden", "-Wl,-z,defs",
                str(src), "-o", str(lib)]
        try:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=600)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise SourceError(f"kernel {name}: the C++ compiler did not run ({argv[0]}): {e}") from e
        if done.returncode != 0:
            diag = "\n".join(line for line in (done.stderr or done.stdout).splitlines() if line.strip())
            raise SourceError(f"kernel {name}: its source does not compile:\n{diag[:4000]}")
        so = lib.read_bytes()
    meta = canonical({"format": FORMAT, "signature": sig, "fingerprint": fingerprint})
    return MAGIC + struct.pack("<Q", len(meta)) + meta + so


def read_meta(payload: bytes) -> dict[str, Any]:
    """The artifact's header. Raises ValueError for bytes that are not a source artifact."""
    if not is_artifact(payload) or len(payload) < len(MAGIC) + 8:
        raise ValueError("not a source-v1 artifact")
    (n,) = struct.unpack_from("<Q", payload, len(MAGIC))
    start = len(MAGIC) + 8
    meta = json.loads(payload[start: start + n])
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ValueError("not a source-v1 artifact")
    return meta


_loaded: dict[str, Any] = {}
_lock = threading.Lock()


def load(payload: bytes, fingerprint: dict[str, Any], where: str | None = None) -> Executable:
    """The artifact's executable: `exe(tensors, scalars)` with `tensors` the inputs then the outputs (CPU
    tensors; the outputs are written) and `scalars` the number arguments; returns []. Raises
    CompileRefused for an artifact built under another fingerprint."""
    meta = read_meta(payload)
    sig = meta["signature"]
    if meta.get("fingerprint") != fingerprint:
        raise CompileRefused(f"{sig.get('op')}: artifact was built for another host or toolchain; refusing to load it")
    (n,) = struct.unpack_from("<Q", payload, len(MAGIC))
    so = payload[len(MAGIC) + 8 + n:]
    digest = hashlib.sha256(so).hexdigest()
    with _lock:
        fn = _loaded.get(digest)
        if fn is None:
            base = _private_dir(Path(where or tempfile.gettempdir()) / f"nr-source-{os.getuid()}")
            path = base / f"{digest[:32]}.so"
            # A file already there is loaded only if it is these bytes (the name is predictable).
            if not path.is_file() or hashlib.sha256(path.read_bytes()).hexdigest() != digest:
                tmp = base / f".{digest[:32]}.{os.getpid()}.{threading.get_ident()}"
                tmp.write_bytes(so)
                os.replace(tmp, path)
            lib = ctypes.CDLL(str(path))
            fn = lib.nr_entry
            fn.restype = ctypes.c_int
            fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_char_p,
                           ctypes.c_int64]
            fn._lib = lib  # keep the library loaded as long as its entry lives
            _loaded[digest] = fn
    return _Run(fn, str(sig["op"])[len(PREFIX):], len(sig.get("inputs", [])), len(sig.get("outputs", [])))


class _Run:
    """One loaded source kernel (see `load`)."""

    def __init__(self, fn: Any, name: str, n_in: int, n_out: int) -> None:
        self.fn, self.name, self.n_in, self.n_out = fn, name, n_in, n_out

    def __call__(self, tensors: Any, scalars: Any) -> list[torch.Tensor]:
        if len(tensors) != self.n_in + self.n_out:
            raise RuntimeError(f"kernel {self.name}: called with {len(tensors)} tensors, compiled for "
                               f"{self.n_in} inputs and {self.n_out} outputs")
        packed: list[int] = []
        for t in tensors:
            packed += (t.data_ptr(), t.dim(), *t.shape, *t.stride())
        arr = (ctypes.c_int64 * max(1, len(packed)))(*packed)
        sc = (ctypes.c_double * max(1, len(scalars)))(*(float(s) for s in scalars))
        err = ctypes.create_string_buffer(512)
        if self.fn(arr, self.n_in, self.n_out, sc, err, 512) != 0:
            raise RuntimeError(f"kernel {self.name}: {err.value.decode(errors='replace')}")
        return []

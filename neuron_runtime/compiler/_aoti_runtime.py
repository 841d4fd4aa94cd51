"""The AOTInductor runtime every `aoti` executable links, built once per host and fingerprint; and the
per-op build (compile a batch's units, link each with that runtime).

An op's `.so` is AOTInductor's runtime (the model container and its C interface, which AOTInductor's
runner loads) linked with the op's own unit (`_units.py`: its kernels and `run_impl`). The runtime is the
same for every op, so it is compiled once, with two other things every op build needs:

    $XDG_CACHE_HOME/neuron-runtime/aoti-runtime/runtime-<recipe>/   (TORCH_NEURONX_AOTI_RUNTIME_DIR)
        op.h, op.h.gch        the header every unit includes, precompiled (~150 MB; 0.3 s of g++ per
                              translation unit to load, where parsing it costs 1.8 s)
        runtime.cpp, .o       AOTInductor's interface.cpp + aoti_runtime.cpp (the model class's members)
        stub/libtorch_cpu.so  an empty library named libtorch_cpu.so: the link records the dependency
                              without reading torch's 430 MB library (0.45 s of every link); the loader
                              then binds the op to the real one, which every torch process has loaded
        manifest.json         the build record: sha256 of each file and the recipe; written last, so it
                              marks a whole build (the file name predates the word; see `RECORD`)

`recipe` hashes everything the files are made from (the compiler, its flags, the header, interface.cpp,
the glue), so another toolchain or neuron-runtime version builds beside, never over, these files.

Like the native layer it is built once per user, host, toolchain and torch, not once per local tier
(`make install` builds it: `python -m neuron_runtime.compiler`); where that directory cannot be written
and holds no usable build, it goes beside the scratch (`_aoti.AotiCompiler.host_runtime`).

Trust: the directory is host-private (the user's cache directory, 0o700). Each file is checked against
the build record before use (runtime.o and the stub on every build; the 150 MB header once per process
and again whenever it changes on disk); a missing, half-written or corrupt file is rebuilt, never used.
Builders take an exclusive `flock` on the directory, so two processes starting at once build once and
both use the result; a builder that dies releases the lock with its process, and a waiter that gives up after
`LOCK_TIMEOUT_S` builds into private files itself.

`build(units)` compiles units into one translation unit (one g++ run for a batch of signatures), links
one `.so` per unit, and reports per unit: a unit whose code does not compile costs only itself (the
compiler's error lines map back to units; the others are compiled again without it).
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import logging
import os
import re
import shlex
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from . import _units

log = logging.getLogger(__name__)

RECIPE_VERSION = 1
GLUE = Path(__file__).with_name("aoti_runtime.cpp")
LOCK_TIMEOUT_S = 600.0
BUILD_TIMEOUT_S = 900.0
FILES = ("op.h", "op.h.gch", "runtime.o", "stub/libtorch_cpu.so")
# The build record's file. Its name is older than the rule that "manifest" means a job's manifest of
# executables (executables/_manifest.py); renaming it would make every built directory, read-only image
# layers included, look unbuilt, so the name stays.
RECORD = "manifest.json"


class BuildError(RuntimeError):
    """A C++ compile or link failed (the message holds the compiler's first error lines)."""


def compile_flags(pinned: dict[str, Any]) -> tuple[str, list[str]]:
    """(compiler, flags) Inductor compiles an AOT kernel with under `pinned`, minus source, output and
    optimisation level: the same ISA, defines, includes and math flags as AOTInductor's own builds."""
    import torch._inductor.config as iconfig
    from torch._inductor.cpp_builder import CppBuilder, CppTorchDeviceOptions
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    with iconfig.patch(pinned):
        builder = CppBuilder(name="unit", sources="unit.cpp", output_dir=tempfile.gettempdir(),
                             BuildOption=CppTorchDeviceOptions(vec_isa=pick_vec_isa(), device_type="cpu",
                                                               aot_mode=True, compile_only=True))
        argv = shlex.split(builder.get_command_line())
    flags: list[str] = []
    skip = False
    for a in argv[1:]:
        if skip:
            skip = False
        elif a == "-o":
            skip = True
        elif a == "-c" or a.endswith("unit.cpp") or re.fullmatch(r"-O\S*", a):
            continue
        else:
            flags.append(a)
    return argv[0], flags


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _run(argv: Sequence[str], env: dict[str, str], what: str, timeout: float = BUILD_TIMEOUT_S) -> str:
    """Run a compiler; its stderr (warnings are off, so this is errors) or BuildError."""
    try:
        done = subprocess.run(list(argv), capture_output=True, text=True, env=env, timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise BuildError(f"{what}: {type(e).__name__}: {e}") from e
    if done.returncode != 0:
        raise BuildError(f"{what} failed (status {done.returncode}): {_first_errors(done.stderr)}")
    return done.stderr


def _first_errors(stderr: str, n: int = 3) -> str:
    lines = [ln for ln in stderr.splitlines() if "error" in ln] or stderr.splitlines()
    return " | ".join(ln.strip() for ln in lines[:n])[:600]


class HostRuntime:
    """The shared files of one scratch directory (see the module docstring) and the per-op build."""

    def __init__(self, scratch_root: Path, tmp: Path, pinned: dict[str, Any]) -> None:
        self.cxx, self.flags = compile_flags(pinned)
        # gold links an op in half the time of ld.bfd (0.1 vs 0.25 s here); the result is the same .so
        self.linker = ["-fuse-ld=gold"] if shutil.which("ld.gold") else []
        self.tmp = tmp
        self.interface = _units.interface_text()
        recipe = json.dumps({"v": RECIPE_VERSION, "cxx": self._cxx_identity(), "flags": self.flags,
                             "linker": self.linker,
                             "header": _units.HEADER, "info": _units.OP_INFO, "glue": GLUE.read_text(),
                             "interface": hashlib.sha256(self.interface.encode()).hexdigest(),
                             "torch": [torch.__version__, torch.version.git_version]}, sort_keys=True)
        self.recipe = hashlib.sha256(recipe.encode()).hexdigest()
        self.dir = scratch_root / f"runtime-{self.recipe[:16]}"
        self._checked: dict[str, tuple[int, int, int]] = {}  # file -> (size, mtime_ns, inode) verified
        self._lock = threading.Lock()
        self.last_compile_s = 0.0
        self.last_link_s: list[float] = []
        #: seconds spent building (or waiting for another process to build) the shared files; how often
        #: this process built some
        self.setup_seconds = 0.0
        self.builds = 0

    def _cxx_identity(self) -> str:
        path = shutil.which(self.cxx) or self.cxx
        try:
            st = os.stat(os.path.realpath(path))
            return f"{os.path.realpath(path)}:{st.st_size}:{st.st_mtime_ns}"
        except OSError:
            return path

    def usable(self) -> bool:
        """Whether this directory can serve: its files verify already, or it can be created and written."""
        if not self._bad():
            return True
        try:
            self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError:
            return False
        return os.access(self.dir, os.W_OK)

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["TMPDIR"] = str(self.tmp)
        env.setdefault("LC_ALL", "C")
        return env

    # -- the shared files -----------------------------------------------------------------------------
    def ensure(self) -> Path:
        """The verified shared directory; files missing or bad are built first (module docstring)."""
        with self._lock:
            if not self._bad():
                return self.dir
            t0 = time.perf_counter()
            self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
            with _FileLock(self.dir / ".lock", LOCK_TIMEOUT_S) as locked:
                bad = self._bad()  # another process may have built them while we waited
                if bad:
                    self._build_shared(bad, private=not locked)
            self.setup_seconds += time.perf_counter() - t0
            if self._bad():
                raise BuildError(f"the shared AOTI runtime in {self.dir} does not verify after a build")
            return self.dir

    def _record(self) -> dict[str, Any] | None:
        """The build record (`RECORD`) of this recipe, or None: missing, unreadable or another recipe's."""
        try:
            m = json.loads((self.dir / RECORD).read_text())
        except (OSError, ValueError):
            return None
        if not isinstance(m, dict) or m.get("recipe") != self.recipe or not isinstance(m.get("sha256"), dict):
            return None
        return m

    def _bad(self) -> set[str]:
        """The shared files that are missing or do not match the build record (all of them without one).
        The big header is hashed once per process, and again whenever its size, mtime or inode change."""
        m = self._record()
        if m is None:
            return set(FILES)
        bad = set()
        for name in FILES:
            path = self.dir / name
            try:
                st = os.stat(path)
            except OSError:
                bad.add(name)
                continue
            stamp = (st.st_size, st.st_mtime_ns, st.st_ino)
            if name == "op.h.gch" and self._checked.get(name) == stamp:
                continue
            if _sha256(path) != m["sha256"].get(name):
                log.warning("aoti: shared runtime file %s does not match its build record; rebuilding it", path)
                bad.add(name)
                continue
            self._checked[name] = stamp
        if "op.h" in bad:
            bad.add("op.h.gch")  # the header was precompiled from it
        return bad

    def _build_shared(self, bad: set[str], private: bool) -> None:
        """Build the bad files side by side in a private directory and publish them, the record last."""
        self.builds += 1
        env = self.env()
        work = Path(tempfile.mkdtemp(prefix="build-", dir=self.dir))
        try:
            (work / "stub").mkdir()
            (work / "op.h").write_text(_units.HEADER)
            (work / "runtime.cpp").write_text("#include <torch/csrc/inductor/aoti_include/cpu.h>\n" + self.interface +
                                              "\n" + _units.OP_INFO + GLUE.read_text())
            (work / "stub.c").write_text("/* only the name: see compiler/_aoti_runtime.py */\n")
            jobs = {
                "op.h.gch": [self.cxx, "-x", "c++-header", str(work / "op.h"), *self.unit_flags(), "-w",
                             "-o", str(work / "op.h.gch")],
                "runtime.o": [self.cxx, str(work / "runtime.cpp"), "-O1", *self.flags, "-w", "-fvisibility=hidden",
                              "-c", "-o", str(work / "runtime.o")],
                "stub/libtorch_cpu.so": ["gcc", "-shared", "-fPIC", "-Wl,-soname,libtorch_cpu.so",
                                         str(work / "stub.c"), "-o", str(work / "stub" / "libtorch_cpu.so")],
            }
            todo = {name: argv for name, argv in jobs.items() if name in bad}
            # Two cores: the header and the runtime build side by side (~10 s each).
            with ThreadPoolExecutor(max_workers=max(1, len(todo))) as pool:
                futures = [pool.submit(_run, argv, env, f"building the shared AOTI runtime ({name})")
                           for name, argv in todo.items()]
                for f in futures:
                    f.result()
            old = self._record()
            sums = dict(old["sha256"]) if old is not None else {}
            for name in FILES:
                if name in bad:
                    sums[name] = _sha256(work / name)
            (self.dir / "stub").mkdir(mode=0o700, exist_ok=True)
            (self.dir / RECORD).unlink(missing_ok=True)  # the old set is no longer whole
            for name in FILES:
                if name in bad:
                    os.replace(work / name, self.dir / name)
            record = {"recipe": self.recipe, "sha256": sums, "built": time.time(), "pid": os.getpid(),
                      "private": private, "rebuilt": sorted(bad)}
            tmp = self.dir / f"{RECORD}.{os.getpid()}.tmp"
            tmp.write_text(json.dumps(record, sort_keys=True))
            os.replace(tmp, self.dir / RECORD)
            self._checked.clear()
            log.info("aoti: built %s of the shared AOTI runtime in %s", ", ".join(sorted(bad)), self.dir)
        finally:
            shutil.rmtree(work, ignore_errors=True)

    def unit_flags(self) -> list[str]:
        # Hidden symbols: an op's .so exports only AOTInductor's interface; sections per function so
        # the link of one unit of a batch drops the others' code.
        return ["-O3", *self.flags, "-fvisibility=hidden", "-ffunction-sections", "-fdata-sections"]

    # -- one batch of units -----------------------------------------------------------------------------
    def build(self, units: Sequence[_units.Unit], work: Path) -> list[bytes | BuildError]:
        """Each unit's linked `.so` bytes, or the BuildError that unit alone caused. Compile seconds of
        the batch are in `self.last_compile_s`, link seconds per unit in `self.last_link_s`."""
        shared = self.ensure()
        results: list[bytes | BuildError | None] = [None] * len(units)
        pending = list(range(len(units)))
        self.last_compile_s = 0.0
        self.last_link_s = [0.0] * len(units)
        for attempt in range(3):
            if not pending:
                break
            t0 = time.perf_counter()
            try:
                obj = self._compile([units[i] for i in pending], work, f"b{attempt}")
            except _UnitErrors as e:
                self.last_compile_s += time.perf_counter() - t0
                bad = {pending[j] for j in e.units} if e.units else set(pending) if len(pending) == 1 else set()
                if not bad:  # the error names no unit: try each alone
                    for i in pending:
                        t1 = time.perf_counter()
                        try:
                            one = self._compile([units[i]], work, f"u{i}")
                        except _UnitErrors as ue:
                            results[i] = BuildError(ue.message)
                        else:
                            self.last_compile_s += time.perf_counter() - t1
                            self._link_all(shared, one, [i], work, results)
                    pending = []
                    break
                for i in bad:
                    results[i] = BuildError(e.message)
                pending = [i for i in pending if i not in bad]
                continue
            self.last_compile_s += time.perf_counter() - t0
            self._link_all(shared, obj, pending, work, results)
            pending = []
        for i in pending:
            results[i] = BuildError("gave up compiling this batch")
        return [r if r is not None else BuildError("not built") for r in results]

    def _compile(self, units: Sequence[_units.Unit], work: Path, tag: str) -> Path:
        shared = self.dir
        src, ranges = _units.translation_unit(str(shared / "op.h"), list(units))
        path = work / f"ops-{tag}.cpp"
        path.write_text(src)
        obj = work / f"ops-{tag}.o"
        try:
            _run([self.cxx, str(path), *self.unit_flags(), "-w", "-Winvalid-pch", "-c", "-o", str(obj)], self.env(),
                 "C++ compile")
        except BuildError as e:
            raise _UnitErrors(str(e), _units_in_error(str(e), path.name, ranges)) from e
        return obj

    def _link_all(self, shared: Path, obj: Path, which: list[int], work: Path,
                  results: list[bytes | BuildError | None]) -> None:
        """One .so per unit of `obj` (unit k of the object is `which[k]` of the batch); links run side by
        side (each is a g++ driver and ld: ~0.1 s, mostly process start)."""
        def link(k: int) -> None:
            i = which[k]
            t0 = time.perf_counter()
            so = work / f"op-{i}.so"
            gc = ["-Wl,--gc-sections"] if len(which) > 1 else []
            try:
                _run([self.cxx, *self.linker, "-shared", "-fPIC", str(shared / "runtime.o"), str(obj), *gc,
                      f"-Wl,--defsym=neuron_op_run=neuron_op_run_{k}",
                      f"-Wl,--defsym=neuron_op_info=neuron_op_info_{k}",
                      "-Wl,--strip-all", "-Wl,--no-as-needed", f"-L{shared / 'stub'}", "-ltorch_cpu",
                      f"-L{Path(torch.__file__).parent / 'lib'}", "-lc10", "-lgomp", "-o", str(so)],
                     self.env(), "link")
                results[i] = so.read_bytes()
            except (BuildError, OSError) as e:
                results[i] = e if isinstance(e, BuildError) else BuildError(f"link: {e}")
            self.last_link_s[i] = time.perf_counter() - t0

        if len(which) == 1:
            link(0)
            return
        with ThreadPoolExecutor(max_workers=min(4, len(which))) as pool:
            list(pool.map(link, range(len(which))))


class _UnitErrors(Exception):
    def __init__(self, message: str, units: list[int]) -> None:
        super().__init__(message)
        self.message = message
        self.units = units


def _units_in_error(message: str, filename: str, ranges: list[tuple[int, int]]) -> list[int]:
    """The units whose lines the compiler's errors point at."""
    lines = {int(n) for n in re.findall(re.escape(filename) + r":(\d+):\d+: error", message)}
    return sorted({k for k, (a, b) in enumerate(ranges) for n in lines if a <= n <= b})


class _FileLock:
    """An exclusive `flock`, waited for up to `timeout` s; `__enter__` says whether it was taken."""

    def __init__(self, path: Path, timeout: float) -> None:
        self.path = path
        self.timeout = timeout
        self.fd = -1

    def __enter__(self) -> bool:
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return True
            except OSError as e:
                if e.errno not in (errno.EAGAIN, errno.EACCES):
                    raise
            if time.monotonic() >= deadline:
                log.warning("aoti: waited %.0f s for another process building %s; building it here",
                            self.timeout, self.path.parent)
                return False
            time.sleep(0.1)

    def __exit__(self, *_: Any) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # releases the lock
            self.fd = -1

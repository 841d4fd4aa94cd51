"""Background compiles: a miss never waits for the compiler (TORCH_NEURONX_COMPILE_MODE=background).

The resolver hands a key it cannot serve from memory or the local tier to `Background.request` and
the op runs on the host. From there, on this module's thread:
  1. With a fleet store, look the key up there (a fleet hit is loaded: no compile at all).
  2. Otherwise ask the host's compile service (`_service`) to compile it; its answer names the entry
     its worker wrote to the local tier, which is loaded and handed to the resolver's memory tier. The
     kernel's next call of the key finds it there and runs it through the hit path.
  3. If the service cannot be started, the key compiles in this process instead (one warning).
Prefetch: once the job's identity is known (`_manifest`), its manifest is read from the tiers, the
entries that may serve each signature it names (derived here: `Resolver.candidates`) are loaded in one
batch (`TieredCache.get_many`), and the missing ones are queued for compiling behind the ones an op is
waiting for. What this process used is appended to the manifest when the job goes quiet (no new key for
`QUIET_S`), on `wait_for_compiles()` and at exit.

Every answer is checked against the request (the one rule of `_resolver`): the entry the service
names must be one of the job's candidates, and a key waiting on a job is linked to its result only if
that result is one of the key's own candidates; a key it cannot serve is asked for again on its own.

Everything here is best effort: a failure is a warning and a host run, never an exception in an op.
"""

from __future__ import annotations

import atexit
import base64
import collections
import hashlib
import logging
import os
import sys
import threading
import time
import warnings
from typing import Any

from .. import _config, _profiling, _version
from ..compiler import CompileRefused, Executable
from . import _entries, _manifest

log = logging.getLogger(__name__)

QUIET_S = 10.0  # a job that asked for no new key for this long has its manifest written


class _Job:
    """One compile asked of the service: its candidates and the exact keys waiting for its result."""

    __slots__ = ("candidates", "keys", "priority", "since", "started")
    # `keys`: the exact keys waiting for this job, each with its signature; they joined because their
    # first candidate is this job's key (e.g. one flat class), which does not make the job's result
    # theirs: `_finish` checks each.

    def __init__(self, candidates: list[dict[str, Any]], priority: int) -> None:
        self.candidates = candidates
        self.keys: dict[str, dict[str, Any]] = {}  # exact key -> its signature
        self.priority = priority
        self.since = time.monotonic()
        self.started: float | None = None


class Background:
    def __init__(self, resolver: Any) -> None:
        # `resolver`: the `_resolver.Resolver` that made this object and calls into it (not imported here:
        # that module imports this one).
        self.resolver = resolver
        self.cfg = resolver.cfg
        self.cv = threading.Condition()
        self.jobs: dict[str, _Job] = {}      # job key (first candidate's) -> job
        self.waiting: dict[str, str] = {}     # exact key -> job key
        self.refused: dict[str, str] = {}     # exact key -> why (this process runs it on the host)
        self.retry_at: dict[str, float] = {}  # exact key -> when it may be asked for again (service back-off)
        self.work: collections.deque[tuple[str, Any]] = collections.deque()
        self.counts = {"queued": 0, "done": 0, "loaded": 0, "refused": 0,
                       "prefetched": 0, "prefetch_hits": 0, "prefetch_queued": 0, "manifest_writes": 0}
        self.latency: list[float] = []
        self.prefetched: set[str] = set()
        self.used: dict[str, dict[str, Any]] = {}  # keys this process resolved -> exact signature
        self.first: list[str] = []
        self.job: str | None = None
        self.manifest: _manifest.Chain | None = None
        self.dirty_since: float | None = None
        self.finishing = 0  # `_finish` calls between a job's end and its keys' new requests (wait() waits)
        self.manifest_asked = 0  # wait()'s manifest requests, numbered; the thread answers them in order
        self.manifest_done = 0
        self.client: Any = None
        self.in_process = False  # the service is unavailable: compile here
        self.pid = os.getpid()
        self.thread: threading.Thread | None = None
        self.closed = False
        self._warned: set[str] = set()
        if self.cfg.job and self.cfg.prefetch:
            self._named(self.cfg.job)
        if self.cfg.compile_mode == "background":
            # Ms of Python (the client module's import, the stamp of the package's files) done now, on this
            # module's thread, rather than when the first step's first miss needs the service: there they
            # held the GIL against the step's own ops (up to the 5 ms switch interval at a time).
            self._push(("prepare", 0))
        atexit.register(self.close)

    # -- called by the resolver (any thread) --------------------------------------------------------
    def lookup(self, key: str) -> tuple[bool, str | None]:
        """(waiting, refusal) of an exact key: whether its compile is under way (or may not be asked for
        again yet: the service is backing off), and why it was refused."""
        if key in self.retry_at:
            if time.monotonic() < self.retry_at[key]:
                return True, None
            self.retry_at.pop(key, None)
        return key in self.waiting, self.refused.get(key)

    def request(self, key: str, sig: dict[str, Any], candidates: list[dict[str, Any]], priority: int = 0) -> None:
        """Compile `candidates` (most general first, exact `sig` last, as `Resolver.live_candidates`
        gives them) for exact key `key` in the background."""
        job_key = self.resolver.key(candidates[0])
        with self.cv:
            if key in self.waiting or key in self.refused or key in self.retry_at:
                return
            self.waiting[key] = job_key
            job = self.jobs.get(job_key)
            if job is None:
                job = self.jobs[job_key] = _Job(candidates, priority)
                self.counts["queued"] += 1
                if priority == 1:
                    self.counts["prefetch_queued"] += 1
                self._push(("fetch", job_key))
            elif priority < job.priority:
                job.priority = priority
                self._push(("fetch", job_key))  # a prefetched key an op now waits for: ask again, sooner
            job.keys[key] = sig

    def note(self, key: str, sig: dict[str, Any]) -> None:
        """A key this process uses, with its exact signature (for its manifest); the first ones name an
        unnamed job."""
        if not self.cfg.prefetch:
            return
        with self.cv:
            if key in self.used:
                return
            self.used[key] = sig
            chain = self.manifest
            if chain is None or key not in chain.items:
                self.dirty_since = time.monotonic()
            if key in self.prefetched:
                self.counts["prefetch_hits"] += 1
            if self.job is None and not self.cfg.job:
                self.first.append(key)
                if len(self.first) == _manifest.FIRST:
                    job = _manifest.job_id(None, self.first)
                    if job is not None:
                        self._named(job)

    def _named(self, job: str) -> None:
        self.job = job
        self._push(("prefetch", job))

    # -- waiting ------------------------------------------------------------------------------------
    def wait(self, timeout: float | None = None) -> bool:
        """Block until every compile this process asked for is answered and loaded; True unless the
        timeout ran out first. Writes the job's manifest when everything is in."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.cv:
            while self.jobs or self.finishing:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self.cv.wait(left if left is not None else 1.0)
            self.manifest_asked += 1
            ticket = self.manifest_asked
        self._push(("manifest", ticket))
        # The manifest is written when wait() returns (bounded by the fleet timeout: a slow store never
        # holds the job); a thread that is gone (closed) answers nothing, so the wait is bounded anyway.
        until = time.monotonic() + self.cfg.fleet_timeout_s
        with self.cv:
            while self.manifest_done < ticket and not self.closed and time.monotonic() < until:
                self.cv.wait(min(1.0, max(0.0, until - time.monotonic())))
        return True

    def stats(self) -> dict[str, Any]:
        with self.cv:
            s: dict[str, Any] = dict(self.counts)
            s["pending"] = len(self.jobs)
            lat = sorted(self.latency)
        s["running"] = sum(1 for j in list(self.jobs.values()) if j.started is not None)
        s["queued_now"] = s["pending"] - s["running"]
        if lat:
            s["latency_s"] = {"p50": round(lat[len(lat) // 2], 3), "max": round(lat[-1], 3), "n": len(lat)}
        s["service"] = "in-process" if self.in_process else ("connected" if self.client is not None else "idle")
        if self.job is not None:
            s["job"] = self.job
        return s

    # -- the thread ---------------------------------------------------------------------------------
    def _push(self, item: tuple[str, Any]) -> None:
        """Queue work for this module's thread (started on first need; again in a forked child)."""
        with self.cv:
            if self.closed:
                return
            if self.pid != os.getpid():  # a forked child: nothing of the parent's thread or socket is ours
                self._forked()
            self.work.append(item)
            if self.thread is None:
                self.thread = threading.Thread(target=self._run, name="neuron-background", daemon=True)
                self.thread.start()
            self.cv.notify_all()

    def _forked(self) -> None:
        self.pid = os.getpid()
        self.thread = None
        self.client = None
        for job_key, job in list(self.jobs.items()):
            self.work.append(("fetch", job_key))
            job.started = None

    def _run(self) -> None:
        while True:
            with self.cv:
                while not self.work and not self.closed:
                    self.cv.wait(1.0)
                    if self._quiet():
                        self.work.append(("manifest", 0))
                if self.closed and not self.work:
                    return
                kind, arg = self.work.popleft()
            try:
                if kind == "fetch":
                    self._fetch(arg)
                elif kind == "prefetch":
                    with _profiling.span(f"neuron::prefetch {arg}"):  # (recorded with profile_all_threads)
                        self._prefetch(arg)
                elif kind == "manifest":
                    try:
                        self._write_manifest()
                    finally:
                        with self.cv:
                            self.manifest_done = max(self.manifest_done, arg)
                            self.cv.notify_all()
                elif kind == "answer":
                    self._answer(arg)
                elif kind == "prepare":
                    _prepare_service()
            except Exception as e:  # noqa: BLE001 - background trouble is a warning, never the user's error
                self._warn(f"{kind}:{type(e).__name__}", f"neuron: background {kind} failed ({type(e).__name__}: "
                           f"{e}); the ops it concerns run on the host meanwhile")
                if kind == "fetch":
                    self._finish(arg, None, f"background compile failed: {type(e).__name__}: {e}")

    def _quiet(self) -> bool:
        return (self.dirty_since is not None and self.job is not None
                and time.monotonic() - self.dirty_since >= QUIET_S)

    # -- one job ------------------------------------------------------------------------------------
    def _fetch(self, job_key: str) -> None:
        with self.cv:
            job = self.jobs.get(job_key)
        if job is None:
            return
        cache = self.resolver.cache
        if cache is not None and cache.fleet is not None:
            # 1. someone may have compiled it already (the fleet store's entry lands in the local tier)
            for cand in job.candidates:
                k = self.resolver.key(cand)
                entry, _ = cache.get_entry(k)
                if entry is not None and not entry.header.get(_entries.REFUSED):
                    self._load(job_key, k, entry)
                    return
        if self.in_process or cache is None:
            self._compile_here(job_key, job)
            return
        client = self._client()
        if client is None:
            self._compile_here(job_key, job)
            return
        client.submit(job_key, {"signatures": job.candidates, "key": job_key}, job.priority)

    def _answer(self, msg: dict[str, Any]) -> None:
        job_key, status = msg.get("key"), msg.get("status")
        with self.cv:
            job = self.jobs.get(job_key) if isinstance(job_key, str) else None
            if job is None:
                return
            if msg.get("op") == "started":
                job.started = time.monotonic()
                return
        if status in ("compiled", "present"):
            if status == "compiled" and msg.get("caused"):
                self.resolver.count("compiles")
                self.resolver.count_kind(job.candidates[-1])
                self.resolver.phase_times.add(msg.get("phases"))
            found = msg.get("found") or job_key
            keys = [self.resolver.key(c) for c in job.candidates]
            if found not in keys:  # the service answers for another key than we asked: never load it
                self._finish(job_key, None, f"the compile service answered with entry {str(found)[:64]!r}, which "
                             "is none of the request's candidates")
                return
            # The worker tries the candidates in order and passes one only for its (cached) refusal.
            for k in keys[: keys.index(found)]:
                with self.resolver.lock:
                    self.resolver.refused_classes.setdefault(k, "refused (compile service)")
            cache = self.resolver.cache
            entry = cache.get_local(found) if cache is not None else None
            if entry is None and msg.get("entry") and cache is not None:
                # The worker could not store it (a full or read-only local tier): verify what it sent.
                try:
                    entry = cache.verify(found, base64.b64decode(str(msg["entry"]), validate=True))
                except Exception as e:  # noqa: BLE001 - a bad entry is never loaded
                    self._finish(job_key, None, f"the compile worker's entry {found} does not verify: {e}")
                    return
            if entry is None:  # the worker wrote it, but our local tier does not have it: maybe the fleet
                entry, _ = cache.get_entry(found) if cache is not None else (None, "")
            if entry is None:
                self._finish(job_key, None, f"compiled, but no tier this process reads holds entry {found}")
                return
            self._load(job_key, found, entry)
        elif status == "unavailable":
            self._warn("unavailable", f"neuron: {msg.get('reason')}; compiling in this process instead "
                       "(slower: compiles share the training process's CPU and GIL)")
            self.in_process = True
            self._compile_here(job_key, job)
        else:
            why = str(msg.get("reason") or status)[:2000]
            retry = msg.get("retry_after")
            if status == "failed" and isinstance(retry, (int, float)) and not isinstance(retry, bool):
                # The service cannot start workers right now (it backs off): the keys run on the host and
                # are asked for again after the back-off, not refused for this process's lifetime.
                self._finish(job_key, None, why, retry_after=min(max(float(retry), 1.0), 600.0))
                return
            if status == "refused":
                self._used_refusals(job)
            self._finish(job_key, None, why if status == "refused" else f"compile {status}: {why}")

    def _used_refusals(self, job: _Job) -> None:
        """The worker cached each candidate's refusal: this process acted on them (Mega-Cache saves them,
        so a process that loads the bundle asks no compiler about the op either)."""
        cache = self.resolver.cache
        for cand in job.candidates if cache is not None else []:
            k = self.resolver.key(cand)
            entry = cache.get_local(k)
            if entry is not None:
                self.resolver.used(k, entry, refusal=True)

    def _load(self, job_key: str, key: str, entry: Any) -> None:
        try:
            _entries.check(entry)
            exe = self.resolver.load_entry(key, entry)
        except CompileRefused as e:  # a refusal, or an entry this host cannot use (`load_entry`)
            self._finish(job_key, None, str(e))
            return
        self._finish(job_key, exe, None, found=key)

    def _compile_here(self, job_key: str, job: _Job) -> None:
        """The service is unavailable: the resolver's own (blocking) path, on this thread, for the job's
        first key; `_finish` then serves (or asks again for) the others."""
        key, sig = next(iter(job.keys.items()), (job_key, job.candidates[-1]))
        try:
            exe, k = self.resolver.resolve_now(sig)
        except CompileRefused as e:
            self._finish(job_key, None, str(e))
            return
        self._finish(job_key, exe, None, found=self.resolver.classes.get(k, k))

    def _finish(self, job_key: str, exe: Executable | None, why: str | None, found: str | None = None,
                retry_after: float | None = None) -> None:
        with self.cv:
            job = self.jobs.pop(job_key, None)
            if job is None:
                return
            self.finishing += 1
        try:
            self._finished(job, exe, why, found or job_key, retry_after)
        finally:
            with self.cv:
                self.finishing -= 1
                self.cv.notify_all()

    def _finished(self, job: _Job, exe: Executable | None, why: str | None, found: str,
                  retry_after: float | None) -> None:
        resolver = self.resolver
        cand = None
        if exe is not None:  # the signature the executable was made for: one the job asked for
            cand = next((c for c in job.candidates if resolver.key(c) == found), None) or job.keys.get(found)
            if cand is None:
                exe, why = None, f"an executable for {found}, which is none of the job's candidates"
        with self.cv:
            self.counts["done"] += 1
            self.latency.append(time.monotonic() - job.since)
            if len(self.latency) > 4096:
                del self.latency[:2048]
            for k in job.keys:
                self.waiting.pop(k, None)
                if exe is None:
                    if retry_after is not None:
                        self.retry_at[k] = time.monotonic() + retry_after
                    else:
                        self.refused[k] = why or "not compiled"
            self.counts["loaded" if exe is not None else "refused"] += 1
        again: list[tuple[str, dict[str, Any]]] = []
        if exe is not None and cand is not None:
            resolver.remember(found, cand, exe)
            for k, sig in job.keys.items():
                # Each waiting key gets the job's executable only if it is one of its own candidates
                # (`Resolver.link`); otherwise it is asked for again, on its own (its first candidate is
                # then another one: `found` is its own, or the classes before it were refused).
                if k != found and not resolver.has(k) and not resolver.link(k, found, sig):
                    again.append((k, sig))
        for k, sig in again:
            self.request(k, sig, self.resolver.live_candidates(sig), job.priority)

    # -- the service --------------------------------------------------------------------------------
    def _client(self) -> Any:
        if self.client is not None:
            return self.client
        try:
            from ._service._client import SERVER, ServiceClient

            d, name, env = service_address(self.cfg, self.resolver.fingerprint)
            argv = [sys.executable, SERVER, "--socket", os.path.join(d.path, name),
                    "--workers", str(self.cfg.compile_workers),
                    "--timeout", str(self.cfg.compile_timeout_s), "--idle-timeout",
                    str(self.cfg.compile_idle_timeout_s), "--max-queue", str(self.cfg.compile_queue),
                    "--batch", str(self.cfg.compile_batch)]
            self.client = ServiceClient(d.at(name), argv, env, lambda m: self._push(("answer", m)))
        except OSError as e:
            self._warn("service", f"neuron: no compile service on this host ({e}); compiling in this process")
            self.in_process = True
            return None
        return self.client

    # -- prefetch and the manifest ------------------------------------------------------------------
    def _prefetch(self, job: str) -> None:
        cache = self.resolver.cache
        if cache is None:
            return
        resolver = self.resolver
        chain = _manifest.Chain(cache, job, resolver.fingerprint, resolver.key)
        items = chain.read()
        with self.cv:
            self.manifest = chain
            if any(k not in chain.items for k in self.used):
                self.dirty_since = time.monotonic()
            if cache.fleet is not None and any(not chain.held.get(n) for n, _ in cache.tiers) and items:
                self.dirty_since = time.monotonic()  # a tier lacks the manifest: it gets a copy
        if chain.problems:
            self._warn("manifest-items", f"neuron: {len(chain.problems)} part(s) of the manifest of job {job!r} "
                       f"skipped (e.g. {chain.problems[0]})")
        # Which executables may serve each signature is derived here, as a call would (`candidates`): a
        # manifest names signatures, never which executable runs them.
        cands: dict[str, list[dict[str, Any]]] = {}
        for k in items:
            if resolver.has(k):
                continue
            try:  # one item that the checks let through but the shape rules cannot take costs only itself
                cands[k] = resolver.live_candidates(items[k])
            except Exception as e:  # noqa: BLE001
                self._warn("manifest-item", f"neuron: a signature of the manifest of job {job!r} skipped ({e})")
        wanted = list(cands)
        keys = {k: [resolver.key(c) for c in cands[k]] for k in wanted}
        found = cache.get_many(sorted({ck for cks in keys.values() for ck in cks})) if wanted else {}
        served: set[str] = set()
        for k in wanted:
            for ck, cand in zip(keys[k], cands[k]):
                e = found.get(ck)
                if e is None or e.header.get(_entries.REFUSED):
                    continue
                loaded = False
                if resolver.executable(ck) is None:
                    try:
                        exe = resolver.load_entry(ck, e)
                    except CompileRefused:
                        continue  # this host cannot use it: the op runs on the host when it comes
                    resolver.remember(ck, cand, exe)
                    loaded = True
                if ck != k and not resolver.link(k, ck, items[k]):
                    continue
                served.add(k)
                with self.cv:
                    self.prefetched.add(k)
                    self.counts["prefetched"] += loaded  # executables loaded (a class's serves many keys)
                    if k in self.used:
                        self.counts["prefetch_hits"] += 1
                break
        if self.cfg.cache_mode == "strict":
            return  # strict: a miss is an error when it happens, never a background compile
        for k in wanted:
            if k not in served and not resolver.has(k) and k not in resolver.unloadable:
                self.request(k, items[k], cands[k], priority=1)

    def _write_manifest(self) -> None:
        cache = self.resolver.cache
        with self.cv:
            job = self.job
            if job is None or cache is None or not cache.writable or self.dirty_since is None:
                return
            self.dirty_since = None
            used = dict(self.used)
            if self.manifest is None:
                self.manifest = _manifest.Chain(cache, job, self.resolver.fingerprint, self.resolver.key)
            chain = self.manifest
        if chain.append(used):
            with self.cv:
                self.counts["manifest_writes"] += 1

    # -- end ----------------------------------------------------------------------------------------
    def close(self) -> None:
        """At exit: write the manifest (bounded by the fleet timeout), disconnect from the service (which
        finishes what it started: those entries land in the cache for the next run)."""
        if self.closed:
            return
        if self.pid == os.getpid() and self.thread is not None:
            self._push(("manifest", 0))
            with self.cv:
                self.closed = True
                self.cv.notify_all()
            self.thread.join(max(1.0, self.cfg.fleet_timeout_s))
        self.closed = True
        client, self.client = self.client, None
        if client is not None and self.pid == os.getpid():
            client.close()

    def _warn(self, what: str, message: str) -> None:
        if what in self._warned:
            log.debug("%s", message)
            return
        self._warned.add(what)
        warnings.warn(message, UserWarning, stacklevel=2)


def service_address(cfg: _config.Config, fingerprint: dict[str, Any]) -> tuple[Any, str, dict[str, str]]:
    """(socket directory, socket name, environment) of the host's compile service for this configuration.

    One service per host and configuration: its workers must compile what this process would (tier,
    fingerprint, tiers, signing key, timeouts), so all of that identifies it. The socket lives in a
    private directory of this user's (`_client.service_dir`: `$TMPDIR/neuron-runtime-<uid>`, 0o700,
    checked without following links): nobody else can talk to it (Unix socket paths are short, so it
    cannot live in the cache directory). Its name is an HMAC of the identity under a random per-user
    salt kept in that directory, so neither the name nor the service's command line reveals anything
    derived from a secret (the signing key, AWS credentials) to anyone who cannot read the directory."""
    from ._service._worker import worker_env

    env = worker_env(cfg)  # the service passes it on to its workers
    try:  # a local tier deleted and made anew is another tier: a service still writing to the old one
        st = os.stat(cfg.local_cache_dir)  # (deleted files) must not serve this process
        local_id = [st.st_dev, st.st_ino]
    except OSError:
        local_id = None
    package = _version.PACKAGE_DIR
    identity = {"runtime": _version.__version__, "package": package, "code": code_stamp(package), "python": sys.executable,
                "local": local_id,
                "fp": fingerprint, "env": {k: v for k, v in env.items()
                                           if k.startswith(("TORCH_NEURONX_", "AWS_", "FSSPEC_"))}}
    from ._service._client import service_dir

    d = service_dir()
    return d, d.name(identity), env


def _prepare_service() -> None:
    """What `service_address` spends ms of Python on, done ahead (its identity's other parts, the local
    tier's directory among them, may only exist at the first miss)."""
    from ._service import _client  # noqa: F401

    code_stamp(_version.PACKAGE_DIR)


_stamps: dict[str, str] = {}


def code_stamp(package: str) -> str:
    """A digest of the package's Python and C++ files (path, size, mtime): code changed in place (a `git
    pull` in an editable install, a reinstall of the same version) is another service, never the one
    still running the old code. Once per process and package directory."""
    stamp = _stamps.get(package)
    if stamp is None:
        h = hashlib.sha256()
        for root, dirs, files in os.walk(package):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            for f in sorted(files):
                if f.endswith((".py", ".cpp", ".h")):
                    path = os.path.join(root, f)
                    try:
                        st = os.stat(path)
                    except OSError:
                        continue
                    h.update(f"{os.path.relpath(path, package)}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
        stamp = _stamps[package] = h.hexdigest()[:16]
    return stamp

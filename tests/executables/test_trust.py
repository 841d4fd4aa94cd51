"""Issue 29: an executable runs only for a signature it was proven for, whatever a manifest, the compile
service, a forged socket or another host says; fleet entries change only on proof. Each test reproduces
one finding with real processes (jobs, the compile service, its workers; faults injected inside them by
`hooks/sitecustomize.py`) on the reference tier, plus one aoti case each for merged jobs and for hosts
that cannot load an entry."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_background import alive, job_env, run_job, worker_pids

from neuron_runtime.cache import envelope
from neuron_runtime.cache import SharedPathStore
from neuron_runtime.compiler import get_compiler
from neuron_runtime.executables import _manifest
from neuron_runtime.signatures import _signature

JOB = "trust-test-job"

# Runs in a job process: the keys and signatures of `add`/`mul` on one shape, and what may serve them.
PRELUDE = r"""
import json, os, sys, time, torch, neuron_runtime
from neuron_runtime import __version__
from neuron_runtime.aten import _runtime
from neuron_runtime.signatures import _ops, _shapes, _signature
rt = _runtime.runtime()
res = rt.resolver
def sig(op, shape):
    x = torch.zeros(shape)
    return _signature.build(_ops.classify(op), (x, x, 1) if op == "aten::add.Tensor" else (x, x))
def key(s):
    return _signature.cache_key(s, res.fingerprint)
def own(s):  # the keys that may serve `s`: its classes' and its own, as the issue's rule says
    return [key(c) for c in _shapes.classes(s)] + [key(s)]
def refuse(tier, cls):  # a cached refusal: no generic executable for this class
    k = key(cls)
    data = res.cache.pack(k, {"signature": cls, "fingerprint": res.fingerprint, "refused": "test: no generic kernel",
                              "runtime": __version__}, b"")
    assert tier.put(k, data)
def resized(s, n):  # `s` with every tensor 1-D of `n` elements (no tensor is made)
    s = json.loads(json.dumps(s))
    for a in s["args"]:
        if isinstance(a[2], dict) and "sizes" in a[2]:
            a[2]["sizes"], a[2]["strides"] = [n], [1]
    return s
def out(**kw):
    print(json.dumps(dict(kw, stats=neuron_runtime.stats())))
"""


def run_code(code: str, env: dict[str, str], timeout: float = 600) -> tuple[dict[str, Any], str]:
    p = subprocess.run([sys.executable, "-c", PRELUDE + code], env=env, capture_output=True, text=True,
                       timeout=timeout)
    assert p.returncode == 0, p.stderr[-4000:]
    return json.loads(p.stdout.strip().splitlines()[-1]), p.stderr


def fleet_env(tmp: Path, host: str, local: Path | None = None, **extra: str) -> dict[str, str]:
    return job_env(tmp, TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR=str((local or tmp) / host),
                   TORCH_NEURONX_NEFF_CACHE_DIR=str(tmp / "fleet"), **extra)


@pytest.fixture
def aoti_local(pytestconfig: pytest.Config, tmp_path: Path) -> Iterator[Path]:
    """Where the aoti tests' hosts keep their local tiers: fresh directories whose parent is the session's
    aoti scratch root (tests/compiler/conftest.py), so Inductor's precompiled headers are built once per
    checkout, not once per test (minutes on two loaded cores)."""
    cache = getattr(pytestconfig, "cache", None)
    root = Path(cache.mkdir("neuron-aoti")) if cache is not None else tmp_path
    d = root / f"trust-{os.getpid()}-{tmp_path.name}"
    yield d.parent / d.name  # hosts are `<d>-a`, `<d>-b`: siblings of the session's scratch
    for p in root.glob(d.name + "*"):
        shutil.rmtree(p, ignore_errors=True)


# -- 1. a merged background job never serves another shape with the first requester's executable ---------
MERGED = r"""
shapes = [[2, 3], [3, 4], [6]]
first = sig("aten::add.Tensor", shapes[0])
for cls in _shapes.classes(first):
    refuse(res.cache.fleet, cls)   # fleet-wide refusals this process has not seen: one job for all shapes
xs = [torch.randn(s) for s in shapes]
for _ in range(2):  # a key is compiled from its second request on; all are asked while the first compiles
    for x in xs:
        assert torch.equal((x.to("neuron") + x.to("neuron")).cpu(), x + x)
assert neuron_runtime.wait_for_compiles(900)
before = neuron_runtime.stats()["executions"]
ok = [bool((y := (x.to("neuron") + x.to("neuron")).cpu()).shape == x.shape and torch.allclose(y, x + x)) for x in xs]
mine = {key(sig("aten::add.Tensor", list(x.shape))): own(sig("aten::add.Tensor", list(x.shape))) for x in xs}
bad = {k: v for k, v in res.classes.items() if k in mine and v not in mine[k]}
out(ok=ok, bad=bad, executed=neuron_runtime.stats()["executions"] - before)
"""


def test_merged_job_links_each_key_only_to_its_own_candidates(tmp_path: Path) -> None:
    r, err = run_code(MERGED, fleet_env(tmp_path, "a", NEURON_TEST_COMPILE_DELAY="*=1"))
    assert r["bad"] == {}, f"keys linked to executables they may not use: {r['bad']}"
    assert r["ok"] == [True, True, True] and r["executed"] == 3
    assert r["stats"]["fallback_ops"] == [] and "Traceback" not in err


@pytest.mark.aoti
def test_merged_job_on_aoti_runs_no_static_kernel_on_another_shape(tmp_path: Path, aoti_local: Path) -> None:
    # On aoti the exact [2, 3] executable is a static 6-element kernel: linked to [3, 4] it would compute
    # a [2, 3] result (or read past its inputs).
    code = MERGED.replace("[[2, 3], [3, 4], [6]]", "[[2, 3], [3, 4]]").replace("[True, True, True]", "")
    env = fleet_env(tmp_path, f"{aoti_local.name}-a", aoti_local.parent, TORCH_NEURONX_COMPILER="aoti",
                    TORCH_NEURONX_COMPILE_IDLE_TIMEOUT="5")
    r, err = run_code(code, env, timeout=1500)
    assert r["bad"] == {} and r["ok"] == [True, True] and r["executed"] == 2, err[-3000:]


# -- 2. a manifest cannot change which executable runs ---------------------------------------------------
TRAIN_AFTER_PREFETCH = r"""
bg = res.background
deadline = time.monotonic() + 30  # until the manifest was read (this runtime's attribute, or the old one's)
while time.monotonic() < deadline and getattr(bg, "manifest", None) is None and not getattr(bg, "manifest_seen", None):
    time.sleep(0.05)
time.sleep(1.0)  # its entries loaded and linked
x = torch.randn(3, 4)
y = (x.to("neuron") + x.to("neuron")).cpu()
out(right=bool(torch.allclose(y, x + x)), links=dict(res.classes), prefetched=bg.counts["prefetched"])
"""


def _signatures(op: str, shape: list[int]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(exact signature, its classes) of a binary op on float tensors of `shape`."""
    import torch

    from neuron_runtime.signatures import _ops, _shapes

    x = torch.zeros(shape)
    s = _signature.build(_ops.classify(op), (x, x, 1) if op == "aten::add.Tensor" else (x, x))
    return s, _shapes.classes(s)


def test_a_manifest_cannot_make_a_key_run_another_executable(tmp_path: Path) -> None:
    env = dict(TORCH_NEURONX_COMPILE_MODE="sync", TORCH_NEURONX_JOB=JOB, TORCH_NEURONX_PREFETCH="1")
    run_code("x = torch.randn(3, 4); y = (x.to('neuron') * x.to('neuron')).cpu(); out()",
             fleet_env(tmp_path, "warm", **env))  # mul's class executable is in the fleet store
    fp = get_compiler("reference").fingerprint()
    add, _ = _signatures("aten::add.Tensor", [3, 4])
    mul, mul_classes = _signatures("aten::mul.Tensor", [3, 4])
    fleet = SharedPathStore(str(tmp_path / "fleet"))
    # The old format: `add`'s key with mul's class as its first "candidate" (x + x ran x * x).
    old = hashlib.sha256(_signature.canonical({"manifest": "neuron-manifest-v1", "job": JOB, "fp": fp})).hexdigest()
    doc = {"format": "neuron-manifest-v1", "job": JOB,
           "entries": [{"key": _signature.cache_key(add, fp), "signatures": [mul_classes[0], add]}]}
    fleet.put(old, envelope.pack(old, {"kind": "manifest", "format": "neuron-manifest-v1", "job": JOB,
                                       "signature": {"op": "manifest"}, "fingerprint": fp},
                                 _signature.canonical(doc), None))
    # The new format names exact signatures only: a class in it is dropped; mul's exact one is a hint.
    if hasattr(_manifest, "segment_key"):  # (a runtime before manifests had segments reads the old format only)
        i = next(i for i in range(64) if fleet.get(_manifest.segment_key(JOB, fp, i)) is None)  # after the job's
        seg = _manifest.segment_key(JOB, fp, i)
        assert fleet.put(seg, envelope.pack(seg, _manifest.header(JOB, fp, i, "forger"),
                                            _manifest.payload(JOB, i, [mul_classes[0], mul]), None))
    for shapes in ("auto", "static"):
        r, err = run_code(TRAIN_AFTER_PREFETCH,
                          fleet_env(tmp_path, f"job-{shapes}", TORCH_NEURONX_SHAPES=shapes, **env))
        assert r["right"], f"x + x was not 2x under TORCH_NEURONX_SHAPES={shapes}"
        if shapes == "static":  # a static job runs exact executables only, whatever a manifest names
            assert r["links"] == {} and r["stats"]["class_hits"] == 0
        assert err.count(f"manifest of job {JOB!r}") == 1 and "shape class" in err
        if shapes == "auto":  # mul's class executable: the hint was used, for what it names only
            assert r["prefetched"] >= 1


# -- 3. the compile service survives what its clients send ------------------------------------------------
# (malformed requests and killer signatures against the service itself: tests/executables/test_server.py)


# -- 4. a host that cannot use a fleet entry leaves it alone; transient failures are not cached ------------
BOTH = r"""
x = torch.randn(8)
ok = bool(torch.allclose((x.to("neuron") + x.to("neuron")).cpu(), x + x))
ok = bool(torch.allclose((x.to("neuron") * x.to("neuron")).cpu(), x * x)) and ok
out(ok=ok, add=own(sig("aten::add.Tensor", [8])), mul=own(sig("aten::mul.Tensor", [8])))
"""


def test_fleet_entries_change_only_on_proof(tmp_path: Path) -> None:
    sync = dict(TORCH_NEURONX_COMPILE_MODE="sync")
    a, _ = run_code(BOTH, fleet_env(tmp_path, "a", **sync))
    fleet = SharedPathStore(str(tmp_path / "fleet"))
    for k in a["mul"]:
        fleet.delete(k)  # mul is compiled again by the next host
    before = {k: fleet.get(k) for k in a["add"] + a["mul"]}
    assert before[a["add"][0]] is not None
    # A host whose loads of `add` fail (no file descriptors left) and whose compile of `mul` fails (a full
    # disk): both ops run on its host, and no tier of the fleet changes.
    b, err = run_code(BOTH, fleet_env(tmp_path, "b", NEURON_TEST_LOAD_ERRNO="aten::add=EMFILE",
                                      NEURON_TEST_COMPILE_ERRNO="aten::mul=ENOSPC", **sync))
    assert b["ok"] and sorted(b["stats"]["fallback_ops"]) == ["aten::add.Tensor", "aten::mul.Tensor"]
    assert {k: fleet.get(k) for k in before} == before, "a host that could not load or compile changed the fleet"
    assert b["stats"].get("unloadable") == 1 and err.count("neuron: cached executable") == 1
    assert {k: fleet.get(k) for k in before} == before, "a host that could not load or compile changed the fleet"
    # A healthy host loads add and compiles mul: neither was refused fleet-wide.
    c, _ = run_code(BOTH, fleet_env(tmp_path, "c", **sync))
    assert c["ok"] and c["stats"]["fallback_ops"] == [] and c["stats"]["compiles"] == 1
    assert c["stats"]["hits"]["fleet"] >= 1


@pytest.mark.aoti
def test_aoti_host_below_the_target_leaves_the_fleet_entry_alone(tmp_path: Path, aoti_local: Path) -> None:
    env = dict(TORCH_NEURONX_COMPILER="aoti", TORCH_NEURONX_COMPILE_MODE="sync")
    code = r"""
x = torch.randn(8)
ok = bool(torch.allclose((x.to("neuron") + x.to("neuron")).cpu(), x + x))
out(ok=ok, keys=own(sig("aten::add.Tensor", [8])))
"""
    a, _ = run_code(code, fleet_env(tmp_path, f"{aoti_local.name}-a", aoti_local.parent, **env), timeout=1200)
    assert a["ok"] and a["stats"]["compiles"] >= 1
    fleet = SharedPathStore(str(tmp_path / "fleet"))
    before = {k: fleet.get(k) for k in a["keys"]}
    b, err = run_code(code, fleet_env(tmp_path, f"{aoti_local.name}-b", aoti_local.parent, NEURON_TEST_CPU_BELOW="1",
                                      **env), timeout=1200)
    assert b["ok"] and b["stats"]["fallback_ops"] == ["aten::add.Tensor"], err[-3000:]
    assert {k: fleet.get(k) for k in a["keys"]} == before
    c, _ = run_code(code, fleet_env(tmp_path, f"{aoti_local.name}-c", aoti_local.parent, **env), timeout=1200)
    assert c["ok"] and c["stats"]["fallback_ops"] == [] and c["stats"]["compiles"] == 0


# -- 5. a signing key may be any bytes ----------------------------------------------------------------
def test_binary_signing_key_file_keeps_background_compiles(tmp_path: Path) -> None:
    key_file = tmp_path / "key"
    key_file.write_bytes(b"\xff\xfe\x00\x01 binary \x80 key \xc3")
    r, err = run_job(tmp_path, "bg", job_env(tmp_path, TORCH_NEURONX_CACHE_SIGNING_KEY_FILE=str(key_file),
                                             JOB_STEPS="2", JOB_WAIT="120"))
    s = r["stats"]
    assert r["waited"] is True and s["fallback_ops"] == [] and r["host_runs"][-1] == 0
    assert s["background"]["loaded"] == s["compiles"] > 10 and s["background"]["service"] == "connected"


# -- 6. the socket directory, forged answers, secrets ------------------------------------------------------
def _service_dir(tmp: Path) -> Path:
    return tmp / "tmp" / f"neuron-runtime-{os.getuid()}"


@pytest.mark.parametrize("how", ["symlink", "other-user", "group-readable"])
def test_a_socket_directory_that_is_not_private_is_refused(tmp_path: Path, how: str) -> None:
    env = job_env(tmp_path, JOB_STEPS="2", JOB_WAIT="120")
    d = _service_dir(tmp_path)
    d.parent.mkdir(parents=True, exist_ok=True)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    if how == "symlink":
        d.symlink_to(elsewhere)
    elif how == "other-user":
        if os.getuid() != 0:
            pytest.skip("needs root to make a directory owned by another user")
        d.mkdir(mode=0o700)
        os.chown(d, 65534, 65534)
    else:
        d.mkdir(mode=0o750)
        d.chmod(0o750)
    r, err = run_job(tmp_path, "bg", env)
    s = r["stats"]
    assert "refusing to use a compile service there" in err and s["background"]["service"] == "in-process"
    assert s["fallback_ops"] == [] and r["host_runs"][-1] == 0  # compiled in the job's own thread instead
    assert list(elsewhere.iterdir()) == []  # nothing was created through the link


FORGED = r"""
import base64, socket, threading
from neuron_runtime.executables._background import service_address
res.cache.local.get("0" * 64)  # the local tier exists (its identity is part of the service's)
d, name, _ = service_address(res.cfg, res.fingerprint)
srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
srv.bind(d.at(name)); srv.listen(4)
zeros = {"op": "aten::zeros_like", "schema": str(torch.ops.aten.zeros_like.default._schema),
         "args": [["self", "tensor", {"dtype": "float32", "sizes": [5], "strides": [1]}]] +
                 [[n, "value", None] for n in ("dtype", "layout", "device", "pin_memory", "memory_format")]}
payload = _signature.canonical({"format": "reference-v1", "signature": zeros})
def serve(conn):   # a service answering every request with an entry that says it is the asked key's
    buf = b""
    while True:
        chunk = conn.recv(65536)
        if not chunk: return
        buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            msg = json.loads(line)
            if msg.get("op") == "hello":
                conn.sendall(json.dumps({"op": "hello", "pid": os.getpid()}).encode() + b"\n")
            elif msg.get("op") == "compile":
                k = msg["key"]
                entry = res.cache.pack(k, {"signature": zeros, "fingerprint": res.fingerprint}, payload)
                conn.sendall(json.dumps({"op": "done", "key": k, "status": "compiled", "found": k,
                                         "entry": base64.b64encode(entry).decode()}).encode() + b"\n")
threading.Thread(target=lambda: [threading.Thread(target=serve, args=(srv.accept()[0],), daemon=True).start()
                                 for _ in iter(int, 1)], daemon=True).start()
x = torch.randn(5)
for _ in range(3):
    y = (x.to("neuron") + x.to("neuron")).cpu()
    assert torch.allclose(y, x + x), y
neuron_runtime.wait_for_compiles(60)
y = (x.to("neuron") + x.to("neuron")).cpu()
out(right=bool(torch.allclose(y, x + x)))
"""


def test_a_forged_service_answer_naming_another_op_is_never_run(tmp_path: Path) -> None:
    r, err = run_code(FORGED, job_env(tmp_path))
    assert r["right"], "x + x ran a forged entry"
    assert r["stats"]["executions"] == 0 and r["stats"]["fallback_ops"] == ["aten::add.Tensor"]
    assert "cannot be used on this host" in err


def test_no_secret_in_socket_names_command_lines_or_logs(tmp_path: Path) -> None:
    secret, aws = "sign-me-0123456789", "aws-secret-9876543210"
    pids = tmp_path / "workers.txt"
    env = job_env(tmp_path, TORCH_NEURONX_CACHE_SIGNING_KEY=secret, AWS_SECRET_ACCESS_KEY=aws, JOB_STEPS="2",
                  JOB_WAIT="120", TORCH_NEURONX_COMPILE_IDLE_TIMEOUT="30", NEURON_TEST_WORKER_PIDS=str(pids),
                  TORCH_NEURONX_LOG_LEVEL="DEBUG")
    r, err = run_job(tmp_path, "bg", env)
    service = r["service_pid"]
    assert service and alive(service)
    forms = [s.encode() for s in (secret, aws)] + [s.encode().hex().encode() for s in (secret, aws)] + \
            [hashlib.sha256(s.encode()).hexdigest()[:16].encode() for s in (secret, aws)]
    seen = []
    for pid in {service, *worker_pids(pids)}:
        if alive(pid):
            seen.append(Path(f"/proc/{pid}/cmdline").read_bytes())
    d = _service_dir(tmp_path)
    seen += [n.encode() for n in os.listdir(d)]
    seen += [f.read_bytes() for f in d.iterdir() if f.suffix == ".log"]
    seen.append(err.encode())
    assert seen and not [f for f in forms for s in seen if f in s]
    os.kill(service, 15)


# -- 7. prefetch storms: bounded items, no thread per answer, nothing cached for a bogus hint -------------
STORM = r"""
import threading
bg = res.background
peak, deadline = 0, time.monotonic() + 8
while time.monotonic() < deadline:
    peak = max(peak, threading.active_count())
    time.sleep(0.02)
x = torch.randn(4)
ok = bool(torch.allclose((x.to("neuron") + x.to("neuron")).cpu(), x + x))
out(peak=peak, ok=ok, queued=bg.counts["prefetch_queued"])
"""


def test_a_manifest_storm_is_bounded(tmp_path: Path) -> None:
    fp = get_compiler("reference").fingerprint()
    prelude = subprocess.run([sys.executable, "-c", PRELUDE + r"""
good = [sig("aten::add.Tensor", [n]) for n in range(2, 102)]
bogus = [dict(sig("aten::add.Tensor", [3]), op=f"aten::no_such_op_{i}") for i in range(200)]
huge = [resized(sig("aten::add.Tensor", [3]), 2 ** 40 + i) for i in range(200)]
print(json.dumps({"good": good, "bogus": bogus, "huge": huge,
                  "bad_keys": [key(s) for s in bogus + huge]}))"""], env=fleet_env(tmp_path, "p"), capture_output=True,
                             text=True, check=True)
    sigs = json.loads(prelude.stdout.splitlines()[-1])
    fleet = SharedPathStore(str(tmp_path / "fleet"))
    # The new format (two segments: 900 signatures, then 10 MB of padding) and the old (the same 900).
    if hasattr(_manifest, "segment_key"):  # (a runtime before manifests had segments reads the old format only)
        seg = [_manifest.segment_key(JOB, fp, i) for i in range(2)]
        fleet.put(seg[0], envelope.pack(seg[0], _manifest.header(JOB, fp, 0, "w"),
                                        _manifest.payload(JOB, 0, sigs["good"] + sigs["bogus"] + sigs["huge"]), None))
        fleet.put(seg[1], envelope.pack(seg[1], _manifest.header(JOB, fp, 1, "w"),
                                        _manifest.payload(JOB, 1, [{"op": "x" * (10 << 20)}]), None))
    old = hashlib.sha256(_signature.canonical({"manifest": "neuron-manifest-v1", "job": JOB, "fp": fp})).hexdigest()
    every = sigs["good"] + sigs["bogus"] + sigs["huge"]
    items = [{"key": _signature.cache_key(s, fp), "signatures": [s]} for s in every]
    fleet.put(old, envelope.pack(old, {"kind": "manifest", "format": "neuron-manifest-v1", "job": JOB,
                                       "signature": {"op": "manifest"}, "fingerprint": fp},
                                 _signature.canonical({"format": "neuron-manifest-v1", "job": JOB,
                                                       "entries": items}), None))
    env = fleet_env(tmp_path, "b", TORCH_NEURONX_JOB=JOB, TORCH_NEURONX_PREFETCH="1", TORCH_NEURONX_SHAPES="static",
                    TORCH_NEURONX_COMPILE_QUEUE="8", NEURON_TEST_COMPILE_DELAY="*=0.05")
    r, err = run_code(STORM, env)
    assert not [k for k in sigs["bad_keys"] if fleet.get(k) is not None], "a bogus hint left an entry in the fleet"
    assert r["ok"] and r["peak"] < 30, f"{r['peak']} threads during a prefetch of 100 signatures"
    assert 0 < r["queued"] <= 100
    # One warning for the 200 bogus and 200 huge signatures and the 10 MB segment.
    assert err.count(f"manifest of job {JOB!r}") == 1 and "401 part(s)" in err


# -- 8. concurrent writers lose nothing; a sync job's manifest serves a background one -------------------
WRITER = r"""
n = int(sys.argv[1])
x = torch.randn(n)
assert torch.allclose((x.to("neuron") + x.to("neuron")).cpu(), x + x)
barrier = os.environ["BARRIER"]
open(os.path.join(barrier, str(n)), "w").close()
while len(os.listdir(barrier)) < 4:
    time.sleep(0.02)
neuron_runtime.wait_for_compiles(60)  # writes the manifest: four writers at once
out()
"""


def test_concurrent_manifest_writers_lose_nothing(tmp_path: Path) -> None:
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    env = dict(TORCH_NEURONX_COMPILE_MODE="sync", TORCH_NEURONX_JOB=JOB, TORCH_NEURONX_PREFETCH="1",
               TORCH_NEURONX_SHAPES="static", BARRIER=str(barrier))
    procs = [subprocess.Popen([sys.executable, "-c", PRELUDE + WRITER, str(n)], env=fleet_env(tmp_path, f"w{n}", **env),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for n in (3, 4, 5, 6)]
    for p in procs:
        _, e = p.communicate(timeout=300)
        assert p.returncode == 0, e[-3000:]
    r, _ = run_code(TRAIN_AFTER_PREFETCH.replace("torch.randn(3, 4)", "torch.randn(3)"),
                    fleet_env(tmp_path, "reader", **{k: v for k, v in env.items() if k != "BARRIER"}))
    assert r["prefetched"] == 4 and r["stats"]["compiles"] == 0


def test_a_sync_jobs_manifest_serves_a_background_job_without_duplicates(tmp_path: Path) -> None:
    named = dict(TORCH_NEURONX_JOB=JOB, TORCH_NEURONX_PREFETCH="1")
    code = ("x = torch.randn(3, 4); y = (x.to('neuron') + x.to('neuron')).cpu(); "
            "neuron_runtime.wait_for_compiles(60); out()")
    a, _ = run_code(code, fleet_env(tmp_path, "a", TORCH_NEURONX_COMPILE_MODE="sync", **named))
    assert a["stats"]["compiles"] == 1  # the class executable, not the exact shape's
    b, _ = run_code(TRAIN_AFTER_PREFETCH, fleet_env(tmp_path, "b", **named))
    assert b["right"] and b["prefetched"] == 1 and b["stats"]["compiles"] == 0
    assert b["stats"]["background"]["prefetch_queued"] == 0 and b["stats"]["host_runs"] == 0


# -- bad input and faults: a service killed while a client waits -----------------------------------------
def test_service_killed_while_a_job_waits(tmp_path: Path) -> None:
    code = r"""
import signal
x = torch.randn(6, 5)
def step():
    return ((x.to("neuron") * 3).relu() - 1).cpu()
step(); step()
bg = res.background
deadline = time.monotonic() + 60
while (bg.client is None or bg.client.service_pid is None) and time.monotonic() < deadline:
    time.sleep(0.05)
first = bg.client.service_pid
os.kill(first, signal.SIGKILL)
step(); step()
assert neuron_runtime.wait_for_compiles(120)
before = neuron_runtime.stats()["host_runs"]
ok = bool(torch.allclose(step(), ((x * 3).relu() - 1)))
out(ok=ok, first=first, second=bg.client.service_pid, host=neuron_runtime.stats()["host_runs"] - before)
"""
    r, err = run_code(code, job_env(tmp_path, NEURON_TEST_COMPILE_DELAY="*=1"))
    assert r["ok"] and r["host"] == 0 and r["first"] != r["second"] and r["stats"]["fallback_ops"] == []
    assert not alive(r["first"])


def test_code_changed_in_place_is_another_compile_service(tmp_path: Path) -> None:
    """A `git pull` in an editable install (same version, same directory) must not reuse a service still
    running the old code: the socket's identity holds a stamp of the package's files."""
    from neuron_runtime.executables import _background

    pkg = tmp_path / "pkg"
    (pkg / "sub" / "__pycache__").mkdir(parents=True)
    (pkg / "a.py").write_text("x = 1\n")
    (pkg / "sub" / "b.cpp").write_text("int f();\n")

    def stamp() -> str:
        _background._stamps.pop(str(pkg), None)
        return _background.code_stamp(str(pkg))

    first = stamp()
    assert stamp() == first
    (pkg / "sub" / "__pycache__" / "a.cpython-311.pyc").write_bytes(b"\0" * 10)  # compiled files: not code
    assert stamp() == first
    (pkg / "sub" / "b.cpp").write_text("int f(); int g();\n")
    second = stamp()
    assert second != first
    (pkg / "c.py").write_text("")
    assert stamp() not in (first, second)

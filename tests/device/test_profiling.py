"""torch.profiler on `neuron` (README "Profiling"): the runtime's own work as named ranges, executable runs
on the device's track (the native layer's Kineto profiler), and nothing recorded with no profiler."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import neuron_runtime
from neuron_runtime import _config, _profiling
from neuron_runtime.cache import envelope
from neuron_runtime._native import _hostmem
from neuron_runtime.aten import _runtime
from neuron_runtime.cache import LocalCache, TieredCache
from neuron_runtime.cache._registry import open_store

from rt_helpers import DEV, run_python

native = pytest.mark.skipif(_hostmem.NATIVE is None, reason="the device track lives in the native layer")
HOOKS = Path(__file__).resolve().parents[1] / "executables" / "hooks"


@pytest.fixture
def cold(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, fresh_runtime: _runtime.Runtime) -> _runtime.Runtime:
    """A runtime on an empty local tier (every signature compiles once)."""
    monkeypatch.setenv("TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR", str(tmp_path / "local"))
    return _runtime.reset_runtime()


def demo_model() -> tuple[Any, Any]:
    """`make demo`'s model and one training step of it."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 10)).to(DEV)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randn(64, 32, device=DEV), torch.randint(0, 10, (64,), device=DEV)

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return float(loss.item())

    return model, step


def trace_of(p: Any, tmp_path: Path, name: str) -> list[dict[str, Any]]:
    path = tmp_path / f"{name}.json"
    p.export_chrome_trace(str(path))
    return [e for e in json.loads(path.read_text(), strict=False)["traceEvents"] if e.get("ph") == "X"]


def test_a_cold_step_names_compiles_loads_cache_tiers_and_misses(cold: _runtime.Runtime, tmp_path: Path) -> None:
    _, step = demo_model()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as p:
        step()
    s = neuron_runtime.stats()
    names = {e.key for e in p.key_averages()}
    for prefix in ("neuron::compile[op] ", "neuron::compile[class] ", "neuron::load ", "neuron::miss aten::addmm"):
        assert any(n.startswith(prefix) for n in names), (prefix, sorted(n for n in names if "neuron" in n))
    assert {"neuron::cache.get[local]", "neuron::cache.put[local]", "neuron::wait[host]"} <= names
    # One compile range per compile, named by kind, op and key; its key is the entry the local tier now holds.
    compiles = [e for e in p.events() if e.name.startswith("neuron::compile[")]
    assert len(compiles) == s["compiles"] > 0
    local = cold.cache
    assert local is not None
    for e in compiles:
        kind, op, short = e.name.removeprefix("neuron::compile[").replace("] ", " ").split(" ")
        assert e.kwinputs["kind"] == kind and e.kwinputs["op"] == op and e.kwinputs["key"].startswith(short)
        assert local.get_local(e.kwinputs["key"]) is not None
    classes = {e.kwinputs["key"] for e in compiles if e.kwinputs["kind"] == "class"}
    assert classes and all("shapes" in local.get_local(k).header["signature"] for k in classes)
    # The trace carries the same ranges.
    trace = {e["name"] for e in trace_of(p, tmp_path, "cold")}
    assert {e.name for e in compiles} <= trace


@native
def test_executable_runs_are_device_activity_linked_to_their_op(cold: _runtime.Runtime, tmp_path: Path) -> None:
    _, step = demo_model()
    step()
    step()  # every key learnt by the hit path
    before = neuron_runtime.stats()["executions"]
    with profile() as p:  # the default activities: CPU and PrivateUse1 (neuron)
        step()
    executions = neuron_runtime.stats()["executions"] - before
    names = {e.key for e in p.key_averages()}
    assert not [n for n in names if n.startswith(("neuron::compile", "neuron::miss", "neuron::load"))], names
    events = trace_of(p, tmp_path, "warm")
    device = [e for e in events if e.get("cat") == "kernel"]
    assert len(device) == executions > 0, "one device activity per executable run"
    keys = set(cold.by_digest)
    for e in device:
        a = e["args"]
        assert a["key"] in keys and a["kind"] in ("op", "class") and a["shape class"] in ("exact", "flat", "ranked")
        assert e["name"] == cold.by_digest[a["key"]].__neuron_trace__[0]
    assert len({e["pid"] for e in device}) == 1, "one device"
    # Linked to the aten op that ran them, as a CUDA kernel is: key_averages counts their time as the op's.
    rows = {r.key: r for r in p.key_averages()}
    assert rows["aten::addmm"].device_time_total > 0 and rows["aten::mm"].device_time_total > 0
    on_device = [e for e in p.events() if e.device_type == torch._C._autograd.DeviceType.PrivateUse1]
    assert len(on_device) == executions


@native
def test_graph_runs_have_their_own_track(cold: _runtime.Runtime, tmp_path: Path) -> None:
    f = torch.compile(lambda a: (a * 2 + 1).relu().sum(dim=0), backend="neuron")
    a = torch.randn(16, 8, device=DEV)
    f(a)
    f(a)
    with profile() as p:
        f(a)
    path = tmp_path / "graph.json"
    p.export_chrome_trace(str(path))
    raw = json.loads(path.read_text(), strict=False)["traceEvents"]
    device = [e for e in raw if e.get("ph") == "X" and e.get("cat") == "kernel"]
    graphs = [e for e in device if e["args"]["kind"] == "graph"]
    assert len(graphs) == 1 and graphs[0]["name"].startswith("graph:") and graphs[0]["args"]["key"] in cold.by_digest
    tracks = {(e["pid"], e["tid"]): e["args"]["name"] for e in raw if e.get("ph") == "M" and e["name"] == "thread_name"}
    assert tracks[(graphs[0]["pid"], graphs[0]["tid"])] == "torch.compile graphs"


@native
def test_no_device_activity_without_a_profiler_or_with_cpu_only(cold: _runtime.Runtime, tmp_path: Path) -> None:
    native_layer = _hostmem.NATIVE
    assert native_layer is not None
    _, step = demo_model()
    step()
    assert not native_layer.tracing() and not _profiling.active()
    with profile(activities=[ProfilerActivity.CPU]) as p:
        assert not native_layer.tracing(), "a CPU-only profile starts no device session"
        step()
    assert not [e for e in trace_of(p, tmp_path, "cpu") if e.get("cat") == "kernel"]
    with profile():
        assert native_layer.tracing()
    assert not native_layer.tracing() and not _profiling.active()


def test_host_runs_and_fallbacks_are_named(fresh_runtime: _runtime.Runtime, monkeypatch: pytest.MonkeyPatch,
                                           tmp_path: Path) -> None:
    from rt_helpers import RefusingCompiler

    monkeypatch.setenv("TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR", str(tmp_path / "local"))
    a = torch.randn(8, device=DEV)
    with profile(activities=[ProfilerActivity.CPU]) as p:
        _runtime.reset_runtime().set_compiler(RefusingCompiler({"aten::mul.Tensor"}))
        with pytest.warns(UserWarning, match="runs on the host"):
            torch.mul(a, a)  # refused by the compiler: a fallback
        torch.mul(a, a)  # known to run on the host: a fallback range, no miss
        fallbacks = neuron_runtime.stats()["fallbacks"]
        monkeypatch.setenv("TORCH_NEURONX_COMPILE_MODE", "background")
        _runtime.reset_runtime()
        torch.sub(a, 1.0)  # a key seen once runs on the host (it compiles from its second request)
        host_runs = neuron_runtime.stats()["host_runs"]
    calls = {e.key: e.count for e in p.key_averages()}
    assert calls.get("neuron::fallback aten::mul.Tensor") == 2 and calls.get("neuron::miss aten::mul.Tensor") == 1
    assert calls.get("neuron::host_run aten::sub.Tensor") == 1, sorted(k for k in calls if "neuron" in k)
    assert fallbacks == 2 and host_runs == 1


def test_single_flight_waits_are_named(tmp_path: Path) -> None:
    """A thread waiting for another thread's compile of the same key, and a host waiting on another host's
    fleet lease, show as neuron::wait ranges (threads the profiler follows: profile_all_threads)."""
    cfg = _config.load({"TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR": str(tmp_path / "a"), "TORCH_NEURONX_LEASE_TTL": "30"})
    fleet = open_store(str(tmp_path / "fleet"), cfg)
    cache = TieredCache(LocalCache(str(tmp_path / "a"), 1 << 30), fleet, cfg, {})
    key, key2 = "a" * 64, "b" * 64

    def entry(k: str) -> bytes:
        return envelope.pack(k, {"signature": {"op": "x"}, "fingerprint": {}}, b"payload", None)

    release = threading.Event()

    def slow_compile() -> bytes:
        release.wait(10)
        return entry(key)

    follower_done = threading.Event()
    cfg_all = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    with profile(activities=[ProfilerActivity.CPU], experimental_config=cfg_all) as p:
        leader = threading.Thread(target=cache.get_or_compile, args=(key, slow_compile))
        leader.start()
        time.sleep(0.2)  # the leader holds the key's flight
        follower = threading.Thread(target=lambda: (cache.get_or_compile(key, slow_compile), follower_done.set()))
        follower.start()
        time.sleep(0.2)
        release.set()
        leader.join(10)
        follower.join(10)
        # Another host holds key2's fleet lease and publishes the entry a moment later.
        lease = fleet.try_lease(key2, 30)
        assert lease is not None
        threading.Timer(0.3, lambda: (fleet.put(key2, entry(key2)), lease.release())).start()
        got, where = cache.get_or_compile(key2, lambda: entry(key2))
    assert follower_done.is_set() and where == "fleet"
    waits = {e.name: e for e in p.events() if e.name.startswith("neuron::wait[")}
    assert {"neuron::wait[thread]", "neuron::wait[lease]"} <= set(waits), sorted(waits)


def test_a_profile_around_a_background_compile_finishing(tmp_path: Path) -> None:
    """Profiles start and stop while the compile service works: one stops before the compile lands, the
    next starts after; both traces are whole and the second shows the compiled executable's runs."""
    code = r"""
import json, sys, time, torch, neuron_runtime
from torch.profiler import profile
from neuron_runtime._native import _hostmem
a = torch.randn(64, device="neuron")
with profile() as p1:
    torch.mul(a, a)                        # compile_after=1: asked of the service, runs on the host
with profile() as around:                  # started while the compile is in flight, stopped after it landed
    neuron_runtime.wait_for_compiles(120)
with profile() as p2:
    torch.mul(a, a)                        # first call since: run from Python, then learnt by the hit path
with profile() as p3:
    for _ in range(3):
        torch.mul(a, a)
out = {}
for name, p in (("p1", p1), ("around", around), ("p2", p2), ("p3", p3)):
    p.export_chrome_trace(sys.argv[1] + name)
    ev = json.loads(open(sys.argv[1] + name).read(), strict=False)["traceEvents"]
    out[name] = {"ranges": sorted({e["name"].split(" ")[0] for e in ev if str(e.get("name")).startswith("neuron::")}),
                 "device": len([e for e in ev if e.get("cat") == "kernel"])}
out["native"] = _hostmem.NATIVE is not None
out["stats"] = {k: neuron_runtime.stats()[k] for k in ("compiles", "host_runs")}
print(json.dumps(out))
"""
    script = tmp_path / "job.py"
    script.write_text(code)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCH_NEURONX_")}
    env.update(TORCH_NEURONX_COMPILER="reference", TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR=str(tmp_path / "local"),
               TORCH_NEURONX_COMPILE_MODE="background", TORCH_NEURONX_COMPILE_AFTER="1",
               TORCH_NEURONX_COMPILE_IDLE_TIMEOUT="1", TORCH_NEURONX_COMPILE_WORKERS="1", TORCH_NEURONX_PREFETCH="0",
               NEURON_TEST_COMPILE_DELAY="*=1", PYTHONPATH=str(HOOKS))
    r = run_python(f"import runpy, sys; sys.argv = ['job', {str(tmp_path / 't')!r}]; runpy.run_path({str(script)!r})",
                   env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert "neuron::host_run" in out["p1"]["ranges"] and out["p1"]["device"] == 0
    assert "neuron::kernel_setup" in out["p1"]["ranges"], "the op's first call in the process"
    assert out["stats"]["host_runs"] == 1
    assert out["around"]["device"] == 0
    assert out["stats"]["compiles"] == 1 and "neuron::host_run" not in out["p2"]["ranges"] + out["p3"]["ranges"]
    if out["native"]:
        assert out["p2"]["device"] == 1 and out["p3"]["device"] == 3, out

"""The dispatch path: signatures, in-memory executables, fallbacks, counters."""

from __future__ import annotations

import json
import warnings
from typing import Any

import pytest
import torch

import neuron_runtime
from neuron_runtime.aten import _host, _kernels, _runtime
from neuron_runtime.compiler._reference import ReferenceCompiler
from neuron_runtime.signatures import _signature, classify
from rt_helpers import DEV, RefusingCompiler, assert_same, run_python


class BrokenCompiler(ReferenceCompiler):
    """Artifacts whose executable raises (a miscompiled executable)."""

    def fingerprint(self) -> dict[str, Any]:
        return {**super().fingerprint(), "test": "broken"}

    def load(self, payload: bytes):  # type: ignore[no-untyped-def]
        def broken(tensors, scalars):  # type: ignore[no-untyped-def]
            raise RuntimeError("executable crashed")

        return broken


def _train(device: str, steps: int, seed: int = 0) -> tuple[list[float], torch.nn.Module]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))  # a new lr every step
    g = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        x = torch.randn(16, 8, generator=g).to(device)
        y = torch.randint(0, 4, (16,), generator=g).to(device)
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
    return losses, model


def test_training_loop_matches_cpu_step_by_step(fresh_runtime: _runtime.Runtime) -> None:
    cpu_losses, cpu_model = _train("cpu", 8)
    dev_losses, dev_model = _train(DEV, 8)
    for c, d in zip(cpu_losses, dev_losses):
        assert d == pytest.approx(c, rel=1e-5, abs=1e-6)
    for pc, pd in zip(cpu_model.parameters(), dev_model.parameters()):
        assert_same(pc, pd, atol=1e-5, rtol=1e-5)
    s = neuron_runtime.stats()
    assert s["executions"] > 100 and s["fallbacks"] == 0 and s["fallback_ops"] == []


def test_signatures_stop_growing_after_the_first_steps(fresh_runtime: _runtime.Runtime) -> None:
    counts = []
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)).to(DEV)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=50)
    x, y = torch.randn(16, 8, device=DEV), torch.randint(0, 4, (16,), device=DEV)
    for _ in range(50):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        sched.step()
        counts.append(len(fresh_runtime.by_digest))  # distinct signatures (executables) so far
    assert counts[2] > 0
    assert counts[-1] == counts[2], counts  # learning rates and bias corrections are run-time scalars
    assert neuron_runtime.stats()["hits"]["memory"] > 10 * counts[-1]


def test_scalars_are_keyed_by_type_structure_by_value(fresh_runtime: _runtime.Runtime) -> None:
    x = torch.randn(4, device=DEV)
    start = len(fresh_runtime.by_digest)
    for alpha in (0.5, 1.5, 2.5):
        torch.add(x, x, alpha=alpha)
    assert len(fresh_runtime.by_digest) == start + 1
    torch.add(x, x, alpha=2)  # an int alpha is another signature (1 vs 1.0 matter)
    assert len(fresh_runtime.by_digest) == start + 2
    x.sum(0)
    x.sum(0, keepdim=True)  # a structural flag is part of the key
    assert len(fresh_runtime.by_digest) == start + 4
    assert_same(torch.arange(4.0) * 3, torch.arange(4.0, device=DEV) * 3)  # wrapped number


def test_signature_json_is_canonical_and_typed() -> None:
    info = classify("aten::add.Tensor")
    a = torch.ones(2, 3)
    sig = _signature.build(info, (a, a.t().contiguous().t(), 1.0))
    assert sig["op"] == "aten::add.Tensor"
    assert sig["args"][0] == ["self", "tensor", {"dtype": "float32", "sizes": [2, 3], "strides": [3, 1]}]
    assert sig["args"][1][2]["strides"] == [1, 2]
    assert sig["args"][2] == ["alpha", "scalar", "float"]
    assert _signature.encode_value([1, 1.0, True, torch.float16]) == [1, 1.0, True, {"dtype": "float16"}]
    fp = {"tier": "reference"}
    k1 = _signature.cache_key(sig, fp)
    assert k1 == _signature.cache_key(json.loads(json.dumps(sig)), dict(fp)) and len(k1) == 64
    assert k1 != _signature.cache_key(sig, {"tier": "aoti"})


def test_fallback_warns_once_per_op_and_lists_it(fresh_runtime: _runtime.Runtime) -> None:
    fresh_runtime.set_compiler(RefusingCompiler({"aten::mul.Tensor"}))
    a, b = torch.randn(3), torch.randn(3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            r = torch.mul(a.to(DEV), b.to(DEV))
            torch.mul(torch.randn(2, device=DEV), 2.0)  # another signature of the same op
    mine = [w for w in caught if "aten::mul.Tensor runs on the host" in str(w.message)]
    assert len(mine) == 1 and issubclass(mine[0].category, UserWarning)
    assert_same(a * b, r)
    assert neuron_runtime.fallback_ops() == ["aten::mul.Tensor"]
    assert neuron_runtime.stats()["fallback_ops"] == ["aten::mul.Tensor"]


def test_fallback_off_raises_with_op_and_signature(fresh_runtime: _runtime.Runtime,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCH_NEURONX_FALLBACK", "0")
    rt = _runtime.reset_runtime()
    rt.set_compiler(BrokenCompiler())
    with pytest.raises(_runtime.FallbackDisabledError, match=r"aten::sub\.Tensor.*signature.*float32"):
        torch.sub(torch.randn(3, device=DEV), 1.0)


def test_broken_executable_falls_back_with_correct_results(fresh_runtime: _runtime.Runtime) -> None:
    fresh_runtime.set_compiler(BrokenCompiler())
    a = torch.randn(5)
    with pytest.warns(UserWarning, match="executable failed"):
        r = torch.sin(a.to(DEV))
    assert_same(torch.sin(a), r)
    assert "aten::sin" in neuron_runtime.fallback_ops()


def test_user_errors_are_not_fallbacks(fresh_runtime: _runtime.Runtime) -> None:
    with pytest.raises(RuntimeError, match="cannot be multiplied"):
        torch.mm(torch.ones(2, 3, device=DEV), torch.ones(2, 3, device=DEV))
    assert neuron_runtime.fallback_ops() == []


def test_views_never_compile(fresh_runtime: _runtime.Runtime) -> None:
    x = torch.randn(4, 6, device=DEV)
    before = len(fresh_runtime.by_digest)
    x.view(6, 4).t()[1:].transpose(0, 1).unsqueeze(0).expand(3, -1, -1).select(0, 1)
    assert len(fresh_runtime.by_digest) == before


def test_stale_cpu_view_is_never_used(fresh_runtime: _runtime.Runtime) -> None:
    """In-place metadata changes and `.data =` keep the data pointer: the view cache must notice."""
    x = torch.arange(6.0, device=DEV)
    (x + 1)  # caches x's CPU view
    x.data = x.data.view(2, 3)
    assert_same(torch.arange(6.0).view(2, 3) + 1, x + 1)
    x.t_()
    assert_same(torch.arange(6.0).view(2, 3).t() * 2, x * 2)
    x.unsqueeze_(0)
    assert_same(torch.arange(6.0).view(2, 3).t().unsqueeze(0).sum(1), x.sum(1))


def test_no_memory_held_after_tensors_die(fresh_runtime: _runtime.Runtime) -> None:
    import gc

    gc.collect()
    base = len(_host._aliases)
    for _ in range(200):
        a = torch.randn(1000, device=DEV)
        b = (a * 2).relu()
        b.sum().item()
    del a, b
    gc.collect()
    assert len(_host._aliases) <= base + 2


def test_stats_file_written_at_exit(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "stats.json"
    r = run_python("import torch\n(torch.ones(3, device='neuron') + 1).cpu()\n",
                   env={"TORCH_NEURONX_STATS_FILE": str(path),
                        "TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR": str(tmp_path / "cache")})
    assert r.returncode == 0, r.stderr
    s = json.loads(path.read_text())
    assert s["executions"] >= 1 and s["compiles"] >= 1 and "memory" in s["hits"]
    for k in ("executions", "compiles", "fallbacks", "corrupt"):
        assert isinstance(s[k], int)
    # seconds per compile phase of this process's compiles (the reference tier has one: `compile`)
    phases = s["compile_phases"]["compile"]
    assert phases["n"] == s["compiles"] and 0 <= phases["p50"] <= phases["p95"] <= phases["total"]


def test_collect_env() -> None:
    r = run_python("import runpy; runpy.run_module('neuron_runtime.collect_env', run_name='__main__')")
    assert r.returncode == 0, r.stderr
    assert "torch" in r.stdout and "neuron" in r.stdout and "TORCH_NEURONX_COMPILER" in r.stdout


def test_memory_cache_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCH_NEURONX_MEMORY_CACHE_ENTRIES", "8")
    rt = _runtime.reset_runtime()
    try:
        for n in range(1, 30):
            x = torch.ones(n, device=DEV)
            assert_same(torch.ones(n) * 2 + 1, x * 2 + 1)
        assert len(rt.by_digest) <= 8
        assert sum(len(e) for _, e in _runtime._EXES.values()) <= 8
    finally:
        monkeypatch.undo()
        _runtime.reset_runtime()


def test_refusals_are_cached_and_strict_mode_runs_them_on_the_host(monkeypatch: pytest.MonkeyPatch,
                                                                   tmp_path) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR", str(tmp_path / "cache"))
    rt = _runtime.reset_runtime()
    try:
        rt.set_compiler(RefusingCompiler({"aten::atan2"}))
        a, b = torch.randn(4), torch.randn(4)
        with pytest.warns(UserWarning, match="atan2 runs on the host"):
            assert_same(torch.atan2(a, b), torch.atan2(a.to(DEV), b.to(DEV)))
        # its flat class (atan2 is elementwise), its ranked class, then its exact shape: all refused
        assert neuron_runtime.stats()["compiles"] == 3

        class NoCompiles(RefusingCompiler):  # same fingerprint, so the same keys
            def compile(self, signature):  # type: ignore[no-untyped-def]
                raise AssertionError(f"compiled {signature['op']} in strict mode")

        monkeypatch.setenv("TORCH_NEURONX_CACHE_MODE", "strict")
        rt = _runtime.reset_runtime()
        rt.set_compiler(NoCompiles({"aten::atan2"}))
        with pytest.warns(UserWarning, match="atan2 runs on the host"):
            assert_same(torch.atan2(a, b), torch.atan2(a.to(DEV), b.to(DEV)))
        assert neuron_runtime.stats()["compiles"] == 0 and neuron_runtime.stats()["hits"]["local"] == 3
    finally:
        monkeypatch.undo()
        _runtime.reset_runtime()


class LearnedCompiler(RefusingCompiler):
    """Same fingerprint (so the same keys) as RefusingCompiler(refuse), but compiles everything."""

    def compile(self, signature: dict[str, Any]) -> bytes:
        return ReferenceCompiler.compile(self, signature)


def test_refusal_by_another_runtime_version_is_asked_again(monkeypatch: pytest.MonkeyPatch,
                                                           tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A cached refusal names the neuron-runtime version that made it; another version asks its compiler
    again (an upgrade that learns to compile an op must not be stuck with the old answer)."""
    monkeypatch.setenv("TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR", str(tmp_path / "cache"))
    a, b = torch.randn(4), torch.randn(4)
    rt = _runtime.reset_runtime()
    try:
        rt.set_compiler(RefusingCompiler({"aten::atan2"}))
        with pytest.warns(UserWarning, match="atan2 runs on the host"):
            torch.atan2(a.to(DEV), b.to(DEV))
        rt = _runtime.reset_runtime()
        rt.set_compiler(LearnedCompiler({"aten::atan2"}))
        assert_same(torch.atan2(a, b), torch.atan2(a.to(DEV), b.to(DEV)))  # same version: still refused
        assert neuron_runtime.stats()["compiles"] == 0 and "aten::atan2" in neuron_runtime.fallback_ops()
        monkeypatch.setattr(neuron_runtime._version, "__version__", "0.0.0-older")
        rt = _runtime.reset_runtime()
        rt.set_compiler(LearnedCompiler({"aten::atan2"}))
        assert_same(torch.atan2(a, b), torch.atan2(a.to(DEV), b.to(DEV)))
        assert neuron_runtime.stats()["compiles"] == 1 and neuron_runtime.stats()["fallbacks"] == 0
        rt = _runtime.reset_runtime()  # the refusal was replaced: the next process just loads
        rt.set_compiler(LearnedCompiler({"aten::atan2"}))
        assert_same(torch.atan2(a, b), torch.atan2(a.to(DEV), b.to(DEV)))
        assert neuron_runtime.stats()["compiles"] == 0 and neuron_runtime.stats()["hits"]["local"] == 1
    finally:
        monkeypatch.undo()
        _runtime.reset_runtime()

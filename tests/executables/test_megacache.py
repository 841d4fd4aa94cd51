"""Mega-Cache (`torch.compiler.save_cache_artifacts` / `load_cache_artifacts`): the executables a process
used travel in the bundle as `neuron_neff` artifacts, and come back into the local tier only through the
checks any entry from outside passes."""

from __future__ import annotations

import json
import os
import pickle
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.compiler._cache import CacheArtifactManager

import neuron_runtime
from neuron_runtime.cache import envelope
from neuron_runtime.aten import _runtime
from neuron_runtime.executables import _megacache
from neuron_runtime.signatures import _ops, _signature, kind_of

from rt_helpers import DEV, run_python

JOB = r"""
import json, sys, torch, neuron_runtime
mode, bundle = sys.argv[1], sys.argv[2]
if mode == "load":
    info = torch.compiler.load_cache_artifacts(open(bundle, "rb").read())
    assert info is not None
torch.manual_seed(0)
# `make demo`'s model and step (neuron_runtime/demo.py)
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 10)).to("neuron")
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
x, y = torch.randn(64, 32, device="neuron"), torch.randint(0, 10, (64,), device="neuron")
losses = []
for _ in range(3):
    opt.zero_grad(set_to_none=True)
    loss = torch.nn.functional.cross_entropy(model(x), y); loss.backward(); opt.step(); losses.append(loss.item())
# a torch.compile graph
compiled = torch.compile(lambda a, b: torch.nn.functional.gelu(a @ b.t() + 1).sum(dim=1), backend="neuron")
graph = compiled(x, x).cpu().tolist()
neuron_runtime.wait_for_compiles(300)
s = neuron_runtime.stats()
out = {"losses": losses, "graph": graph, "compiles": s["compiles"], "by_kind": s["compiles_by_kind"],
       "loads": s["loads"], "graphs": s["graphs"], "megacache": s["megacache"], "fallback_ops": s["fallback_ops"]}
if mode == "save":
    from neuron_runtime.signatures import kind_of
    from neuron_runtime.aten import _runtime
    data, info = torch.compiler.save_cache_artifacts()
    open(bundle, "wb").write(data)
    out["artifacts"] = {k: len(v) for k, v in info.artifacts.items()}
    local = _runtime.runtime().cache
    out["bundle_kinds"] = sorted({kind_of(local.get_local(k).header["signature"])
                                  for k in info.neuron_neff_artifacts})
print(json.dumps(out))
"""


def job(tmp: Path, name: str, mode: str, bundle: Path, **env: str) -> dict[str, Any]:
    script = tmp / "job.py"
    script.write_text(JOB)
    base = {k: v for k, v in os.environ.items() if not k.startswith("TORCH_NEURONX_")}
    base.update(TORCH_NEURONX_COMPILER="reference", TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR=str(tmp / name),
                TORCH_NEURONX_COMPILE_MODE="sync", TORCH_NEURONX_PREFETCH="0")
    base.update(env)
    r = run_python(f"import runpy, sys; sys.argv = ['job', {mode!r}, {str(bundle)!r}]; runpy.run_path({str(script)!r})",
                   env=base, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return dict(json.loads(r.stdout.strip().splitlines()[-1]), stderr=r.stderr)


FUSION = {"TORCH_NEURONX_ENABLE_CONCATENATION": "1", "TORCH_NEURONX_FUSION_MIN_NUMEL": "1",
          "TORCH_NEURONX_FUSION_MIN_SEEN": "1"}


@pytest.mark.parametrize("mode", ["sync", "background", "fusion"])
def test_a_second_process_after_loading_the_bundle_compiles_nothing(tmp_path: Path, mode: str) -> None:
    """Executables of ops, shape classes, a torch.compile graph and (with fusion) a fused group."""
    bundle = tmp_path / "bundle.bin"
    env = {"TORCH_NEURONX_COMPILE_MODE": "background" if mode == "background" else "sync",
           "TORCH_NEURONX_COMPILE_AFTER": "1", "TORCH_NEURONX_COMPILE_IDLE_TIMEOUT": "2",
           **(FUSION if mode == "fusion" else {})}
    first = job(tmp_path, "first", "save", bundle, **env)
    assert first["compiles"] > 0 and first["by_kind"]["graph"] >= 1 and first["by_kind"]["op"] > 0
    assert first["by_kind"]["fused"] >= (1 if mode == "fusion" else 0)
    assert {"op", "class", "graph"} <= set(first["bundle_kinds"]) and ("fused" in first["bundle_kinds"]) == (mode == "fusion")
    assert first["artifacts"]["neuron_neff"] == first["megacache"]["recorded"] > 0
    second = job(tmp_path, "second", "load", bundle, **env)  # its own, empty local tier
    assert second["compiles"] == 0, second
    assert second["by_kind"] == {"op": 0, "fused": 0, "graph": 0}
    assert second["megacache"]["loaded"] == first["artifacts"]["neuron_neff"] and second["megacache"]["refused"] == 0
    assert second["loads"] > 0 and second["graphs"]["graph_executions"] >= 1
    assert second["losses"] == first["losses"] and second["graph"] == first["graph"]
    assert "refused" not in second["stderr"]


# -- bad input -----------------------------------------------------------------------------------------
@pytest.fixture
def signed(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, fresh_runtime: _runtime.Runtime) -> _runtime.Runtime:
    """A runtime with an empty local tier and a signing key (bundles must carry signed entries)."""
    monkeypatch.setenv("TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR", str(tmp_path / "local"))
    monkeypatch.setenv("TORCH_NEURONX_CACHE_SIGNING_KEY", "the fleet's key")
    return _runtime.reset_runtime()


def bundle_of(artifacts: list[tuple[str, bytes]]) -> bytes:
    with CacheArtifactManager.with_fresh_cache():
        for key, data in artifacts:
            CacheArtifactManager.record_artifact(_megacache.TYPE, key, data)
        saved = torch.compiler.save_cache_artifacts()
    assert saved is not None
    return saved[0]


def entry_for(rt: _runtime.Runtime, op: str, n: int, fingerprint: dict[str, Any] | None = None,
              signing_key: bytes | None = b"the fleet's key") -> tuple[str, bytes]:
    """A real executable's entry: `op` on `n` float32 elements, compiled by the runtime's compiler."""
    a = torch.randn(n)
    sig = _signature.build(_ops.classify(op), (a, a) if op.startswith("aten::mul") else (a,))
    fp = fingerprint or rt.fingerprint
    key = _signature.cache_key(sig, fp)
    return key, envelope.pack(key, {"signature": sig, "fingerprint": fp}, rt.compiler.compile(sig), signing_key)


def test_bad_artifacts_are_refused_with_a_warning_and_the_rest_loads(signed: _runtime.Runtime) -> None:
    rt = signed
    good_key, good = entry_for(rt, "aten::mul.Tensor", 8)
    k2, e2 = entry_for(rt, "aten::mul.Tensor", 9)
    k3, e3 = entry_for(rt, "aten::mul.Tensor", 10)
    k4, e4 = entry_for(rt, "aten::mul.Tensor", 11, signing_key=b"another key")
    k5, e5 = entry_for(rt, "aten::mul.Tensor", 12, signing_key=None)
    foreign_fp = dict(rt.fingerprint, torch="1.0.0")
    k6, e6 = entry_for(rt, "aten::mul.Tensor", 13, fingerprint=foreign_fp)
    k7, e7 = entry_for(rt, "aten::neg", 14)
    corrupt = bytearray(e2)
    corrupt[len(corrupt) // 2] ^= 0xFF
    bad = {
        k2: bytes(corrupt),  # a bit flipped
        k3: e3[:-40],  # truncated
        k4: e4,  # forged: signed with another key
        k5: e5,  # unsigned, while this runtime requires signatures
        k6: e6,  # made for another compiler fingerprint (its key too)
        "f" * 64: e7,  # a good entry under another key
        "not-a-key": good,
    }
    data = bundle_of([(good_key, good), *bad.items()])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        info = torch.compiler.load_cache_artifacts(data)
    assert info is not None and len(info.neuron_neff_artifacts) == 8
    refused = [str(w.message) for w in caught if "Mega-Cache artifact" in str(w.message)]
    assert len(refused) == len(bad), refused
    reasons = " ".join(refused)
    for why in ("digest", "truncated", "signature", "unsigned", "another compiler fingerprint", "(differs in torch)",
                "written for key", "not a cache key"):
        assert why in reasons, (why, refused)
    cache = rt.cache
    assert cache is not None
    assert cache.get_local(good_key) is not None
    assert all(cache.get_local(k) is None for k in bad if len(k) == 64)
    assert _megacache.stats()["refused"] >= len(bad)
    # What loaded runs without a compile; what was refused is compiled here.
    x = torch.randn(8, device=DEV)
    torch.mul(x, x)
    assert neuron_runtime.stats()["compiles"] == 0 and neuron_runtime.stats()["loads"] == 1
    y = torch.randn(9, device=DEV)
    torch.mul(y, y)
    assert neuron_runtime.stats()["compiles"] == 1


def test_a_bundle_with_no_pickle_on_our_side(signed: _runtime.Runtime, monkeypatch: pytest.MonkeyPatch) -> None:
    """Saving and loading neuron artifacts never pickles: pickle is made to fail throughout."""
    key, data = entry_for(signed, "aten::mul.Tensor", 16)

    def no_pickle(*a: Any, **k: Any) -> Any:
        raise AssertionError("pickle used")

    for name in ("dumps", "loads", "dump", "load"):
        monkeypatch.setattr(pickle, name, no_pickle)
    blob = bundle_of([(key, data)])
    assert envelope.MAGIC in blob and data in blob, "the artifact is the envelope, byte for byte"
    info = torch.compiler.load_cache_artifacts(blob)
    assert info is not None and info.neuron_neff_artifacts == [key]
    cache = signed.cache
    assert cache is not None and cache.get_local(key) is not None


def test_readonly_mode_stores_nothing(signed: _runtime.Runtime, monkeypatch: pytest.MonkeyPatch) -> None:
    key, data = entry_for(signed, "aten::mul.Tensor", 17)
    monkeypatch.setenv("TORCH_NEURONX_CACHE_MODE", "readonly")
    rt = _runtime.reset_runtime()
    with pytest.warns(UserWarning, match="readonly"):
        torch.compiler.load_cache_artifacts(bundle_of([(key, data)]))
    assert rt.cache is not None and rt.cache.get_local(key) is None


def test_a_payload_that_computes_another_op_is_never_loaded(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, fresh_runtime: _runtime.Runtime) -> None:
    """Issue 41 item 5: an unsigned artifact whose header names `add`'s signature (and so its key) over a
    payload compiled for `sub` (x + x = 0) is refused when the bundle loads, and an entry like it already
    in the local tier (written there before this check existed, or by hand) is never run: the op is
    right, on the host."""
    monkeypatch.setenv("TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR", str(tmp_path / "local"))
    monkeypatch.delenv("TORCH_NEURONX_CACHE_SIGNING_KEY", raising=False)
    monkeypatch.setenv("TORCH_NEURONX_SHAPES", "static")  # the exact key is the one looked up
    monkeypatch.setenv("TORCH_NEURONX_COMPILE_MODE", "sync")
    rt = _runtime.reset_runtime()

    def forged(n: int) -> tuple[str, bytes]:
        a = torch.randn(n)
        add = _signature.build(_ops.classify("aten::add.Tensor"), (a, a, 1))  # `x + x` passes alpha=1
        sub = _signature.build(_ops.classify("aten::sub.Tensor"), (a, a, 1))
        key = _signature.cache_key(add, rt.fingerprint)
        return key, envelope.pack(key, {"signature": add, "fingerprint": rt.fingerprint},
                                  rt.compiler.compile(sub), None)

    k1, e1 = forged(7)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.compiler.load_cache_artifacts(bundle_of([(k1, e1)]))
    refused = [str(w.message) for w in caught if "Mega-Cache artifact" in str(w.message)]
    assert len(refused) == 1 and "payload was compiled for aten::sub.Tensor" in refused[0], refused
    cache = rt.cache
    assert cache is not None and cache.get_local(k1) is None

    k2, e2 = forged(5)
    assert cache.local.put(k2, e2)  # as if a bundle had persisted it before this check
    x = torch.arange(5.0, device=DEV)
    assert torch.equal((x + x).cpu(), torch.arange(5.0) * 2)
    assert "payload was compiled for aten::sub.Tensor" in rt.resolver.unloadable.get(k2, "")

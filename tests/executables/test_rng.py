"""Compiling never touches the user's random stream (issue 44).

After `torch.manual_seed(s)`, every random op of PyTorch's OpInfo database gives CPU's values on `neuron`,
first call and later ones, and leaves the CPU generator where CPU leaves it: in sync mode, in background
mode, with the fusion flag and inside `torch.compile(backend="neuron")`. Random ops run on the host by
design (`signatures._ops.RANDOM`), so no compiler ever sees one; the compiler here (`EagerChecking`) runs
every executable it makes on example values at compile time, as the `aoti` tier's self-check does, so a
random op that reached it would draw from the user's generator and the values would differ. A small CNN
with dropout trains on `neuron` with CPU's losses in sync and background modes."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

import neuron_runtime
from neuron_runtime._native import _hostmem
from neuron_runtime.aten import _runtime
from neuron_runtime.compiler import _examples
from neuron_runtime.compiler._reference import ReferenceCompiler
from neuron_runtime.signatures import (class_example, classify, cpu_ops, has_nodes, is_class, nodes_of, qualname_of,
                                      resolve_op)
from neuron_runtime.signatures._ops import RANDOM, SEEDED_NO_DRAW

from rt_helpers import DEV

# OpInfo entries that reach a random aten op under another name (found by tracing every entry's samples;
# the entries whose own aten op is random are found from the schema, `_candidates`).
VIA_OTHER_NAMES = ("nn.functional.dropout2d", "nn.functional.dropout3d", "nn.functional.fractional_max_pool2d",
                   "nn.functional.fractional_max_pool3d", "nn.functional.multi_head_attention_forward")
SAMPLES = 1  # per OpInfo entry (its first random sample): the first call and a later one are compared


def _draws(op: Any) -> bool:
    """An aten overload that draws random numbers, by its schema alone (not by `classify`, which the tests
    check): a Generator argument, or PyTorch's `nondeterministic_seeded` tag (`SEEDED_NO_DRAW` aside)."""
    return any("Generator" in str(a.type) for a in op._schema.arguments) or (
        torch.Tag.nondeterministic_seeded in op.tags and qualname_of(op) not in SEEDED_NO_DRAW)


class _Traced(TorchDispatchMode):
    """The aten ops a call dispatches (on CPU)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: set[Any] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops.add(func)
        return func(*args, **(kwargs or {}))


def _candidates(op_db: list[Any]) -> list[Any]:
    """Entries whose aten op (by name) has a random overload, or that wrap their call in
    `wrapper_set_seed` (which upstream's tests use for random ops), or `VIA_OTHER_NAMES`."""
    out = []
    for info in op_db:
        name = info.name.split(".")[-1]
        packet = getattr(torch.ops.aten, info.aten_name or name, None) or getattr(torch.ops.aten, name, None)
        random_by_schema = packet is not None and hasattr(packet, "overloads") and any(
            _draws(getattr(packet, o)) for o in packet.overloads())
        code = getattr(info.op, "__code__", None)
        if random_by_schema or info.name in VIA_OTHER_NAMES or \
                (code is not None and "wrapper_set_seed" in code.co_names):
            out.append(info)
    return out


@pytest.fixture(scope="module")
def random_samples() -> Iterator[list[tuple[str, Any, Any]]]:
    """(entry, its call, a float32 sample) for every OpInfo sample that draws random numbers on CPU (up to
    `SAMPLES` per entry), with `wrapper_set_seed` bypassed: it reseeds with 42 and restores the state
    afterwards, which would hide whether the user's stream moved."""
    from torch.testing._internal import common_methods_invocations as cmi

    mp = pytest.MonkeyPatch()
    mp.setattr(cmi, "wrapper_set_seed", lambda op, *args, **kwargs: op(*args, **kwargs))
    found = []
    for info in _candidates(cmi.op_db):
        if torch.float32 not in info.supported_dtypes("cpu"):
            continue
        n = 0
        for s in info.sample_inputs("cpu", torch.float32):
            tr = _Traced()
            try:
                with tr:
                    info(s.input, *s.args, **s.kwargs)
            except Exception:  # noqa: BLE001 - a sample CPU rejects has nothing to match
                continue
            if any(_draws(f) for f in tr.ops):
                found.append((f"{info.name}.{info.variant_test_name}".rstrip("."), info, s))
                n += 1
                if n == SAMPLES:
                    break
    yield found
    mp.undo()


class EagerChecking(ReferenceCompiler):
    """The reference tier, running each executable once on example values when it compiles it (what the
    `aoti` tier's self-check does in the user's process in sync mode), and recording the ops it saw."""

    def __init__(self) -> None:
        self.ops: list[str] = []

    def compile(self, signature: dict[str, Any]) -> bytes:
        payload = super().compile(signature)
        self.ops += [n["op"] for n in nodes_of(signature)]
        exact = class_example(signature) if is_class(signature) else signature  # a shape class: its example
        if not has_nodes(exact) and not exact.get("writes"):
            inputs, types = _examples.example_inputs(exact, values=True)
            tensors, scalars = inputs[:len(inputs) - len(types)], inputs[len(inputs) - len(types):]
            self.load(payload)(tensors, [s.item() for s in scalars])
        return payload


@pytest.fixture
def checking(fresh_runtime: _runtime.Runtime, monkeypatch: pytest.MonkeyPatch,
             tmp_path: Any) -> Iterator[EagerChecking]:
    """A runtime compiling with `EagerChecking` into a cache of its own (an entry another test compiled
    would be a hit here, and this test's compiler would never see the op)."""
    monkeypatch.setenv("TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR", str(tmp_path / "cache"))
    compiler = EagerChecking()
    _runtime.reset_runtime().set_compiler(compiler)
    yield compiler


def _on(device: str, value: Any) -> Any:
    return pytree.tree_map(lambda v: v.to(device) if isinstance(v, torch.Tensor) else v, value)


def _leaves(value: Any) -> list[torch.Tensor]:
    return [v.detach().cpu() for v in pytree.tree_leaves(value) if isinstance(v, torch.Tensor)]


def _calls(fn: Callable[..., Any], sample: Any, device: str, seed: int) -> tuple[list[Any], torch.Tensor]:
    """Two calls after `torch.manual_seed(seed)` (inputs copied before each: in-place samples), and the
    generator's state after them."""
    outs = []
    inp, args, kwargs = _on(device, (sample.input, sample.args, sample.kwargs))
    torch.manual_seed(seed)
    for _ in range(2):
        i, a, k = pytree.tree_map(lambda v: v.clone() if isinstance(v, torch.Tensor) else v, (inp, args, kwargs))
        outs.append(_leaves(fn(i, *a, **k)))
    return outs, torch.get_rng_state()


def _check_all(samples: list[tuple[str, Any, Any]], run: Callable[[Any, Any, str, int], Any],
               at_least: int = 20) -> None:
    """Each sample's two calls after the same seed give CPU's values on neuron, and leave the generator
    where CPU leaves it."""
    assert len({name for name, _, _ in samples}) >= at_least, [name for name, _, _ in samples]
    bad = []
    for k, (name, info, sample) in enumerate(samples):
        want, want_state = run(info, sample, "cpu", k)
        got, got_state = run(info, sample, DEV, k)
        for call, (w, g) in enumerate(zip(want, got)):
            if len(w) != len(g) or not all(torch.equal(a, b) or (a.is_floating_point() and a.shape == b.shape and
                                                                 torch.equal(a.isnan(), b.isnan()) and
                                                                 torch.equal(a.nan_to_num(), b.nan_to_num()))
                                           for a, b in zip(w, g)):
                bad.append(f"{name}: call {call + 1} differs from CPU")
        if not torch.equal(want_state, got_state):
            bad.append(f"{name}: the CPU generator ends elsewhere than on CPU")
    assert not bad, bad


def _no_random_op_compiled(compiler: EagerChecking) -> None:
    random = sorted({q for q in compiler.ops if _draws(resolve_op(q))})
    assert not random, f"random ops reached the compiler: {random}"


def test_random_ops_are_host_ops_by_design() -> None:
    """Every op that draws (a Generator argument, or tagged nondeterministic_seeded) is a host op, with
    dropout's `native_dropout` (no Generator: it draws from the global one) among them."""
    seeded = [q for q in cpu_ops() if _draws(resolve_op(q))]
    assert len(seeded) > 25
    info = classify("aten::native_dropout")
    assert (info.kind, info.reason) == ("host", RANDOM)
    assert {q for q in seeded if classify(q).kind != "host"} == set()
    # Tagged, but CPU's kernel refuses dropout_p > 0 so it draws nothing: it compiles (attention's one op).
    assert classify("aten::_scaled_dot_product_flash_attention_for_cpu").kind == "compute"


def test_random_ops_match_cpu_in_sync_mode(random_samples: Any, checking: EagerChecking) -> None:
    _check_all(random_samples, _calls)
    _no_random_op_compiled(checking)
    assert checking.ops, "nothing compiled: the compiler was not in the path"


def test_random_ops_match_cpu_with_fusion(random_samples: Any, monkeypatch: pytest.MonkeyPatch,
                                          checking: EagerChecking) -> None:
    monkeypatch.setenv("TORCH_NEURONX_ENABLE_CONCATENATION", "1")
    _runtime.reset_runtime().set_compiler(checking)
    _check_all(random_samples, _calls)
    _no_random_op_compiled(checking)
    assert neuron_runtime.stats()["fusion"], "the fusion buffer was not in the path"


# Entries compiled with torch.compile: one per kind of draw (Dynamo's cost is per entry).
COMPILED = ("nn.functional.dropout", "bernoulli")  # a tagged op without a Generator, and one with


def test_random_ops_match_cpu_eager_inside_torch_compile(random_samples: Any, checking: EagerChecking) -> None:
    """A graph holding a random op runs op by op (`graphs`), so `torch.compile(backend="neuron")` gives
    CPU eager's values (CPU Inductor does not: it draws with its own Philox scheme, docs/compile.md)."""
    import torch._dynamo

    picked = [s for s in random_samples if s[0] in COMPILED]
    assert len(picked) == len(COMPILED), [s[0] for s in picked]
    torch._dynamo.reset()

    def run(info: Any, sample: Any, device: str, seed: int) -> Any:
        fn = info if device == "cpu" else torch.compile(lambda *a, **k: info(*a, **k), backend="neuron",
                                                        dynamic=False)
        return _calls(fn, sample, device, seed)

    try:
        _check_all(picked, run, at_least=len(COMPILED))
        graphs = neuron_runtime.stats()["graphs"]
        assert graphs["graphs_refused"] >= 1, graphs  # the graphs holding a draw ran op by op
    finally:
        torch._dynamo.reset()
    _no_random_op_compiled(checking)


# --------------------------------------------------------------------------------------------- the CNN

BATCHES = (4, 6, 8, 4)


def cnn_losses(device: str, steps: tuple[int, ...] = BATCHES) -> list[float]:
    """The issue's CNN trained with SGD on `device`: data drawn first, then the same seed before each
    forward (the dropout masks), so CPU and neuron see the same stream."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
                                torch.nn.MaxPool2d(2), torch.nn.Flatten(), torch.nn.Dropout(0.2),
                                torch.nn.Linear(8 * 4 * 4, 10))
    data = [(torch.randn(b, 3, 8, 8), torch.randint(0, 10, (b,))) for b in steps]
    model = copy.deepcopy(model).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for i, (x, y) in enumerate(data):
        torch.manual_seed(100 + i)
        loss = torch.nn.functional.cross_entropy(model(x.to(device)), y.to(device))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _assert_losses_equal(want: list[float], got: list[float]) -> None:
    assert all(abs(g - w) <= 1e-5 * abs(w) for w, g in zip(want, got)), (want, got)


def test_cnn_trains_as_on_cpu_in_sync_mode(checking: EagerChecking) -> None:
    _assert_losses_equal(cnn_losses("cpu"), cnn_losses(DEV))
    _no_random_op_compiled(checking)
    assert "aten::native_dropout" not in checking.ops and "aten::convolution" in checking.ops


def test_random_ops_and_the_cnn_match_cpu_in_background_mode(random_samples: Any, monkeypatch: pytest.MonkeyPatch,
                                                              fresh_runtime: _runtime.Runtime) -> None:
    """Every key compiles on first sight (in the compile service's processes), so later calls and steps
    run executables as they land; the values still follow the user's stream call for call."""
    monkeypatch.setenv("TORCH_NEURONX_COMPILE_MODE", "background")
    monkeypatch.setenv("TORCH_NEURONX_COMPILE_AFTER", "1")
    _runtime.reset_runtime()
    _check_all(random_samples, _calls)
    want = cnn_losses("cpu")
    _assert_losses_equal(want, cnn_losses(DEV))
    neuron_runtime.wait_for_compiles(120)
    before = neuron_runtime.stats()["executions"]
    _assert_losses_equal(want, cnn_losses(DEV))  # executables run this time
    s = neuron_runtime.stats()
    assert s["compile_mode"] == "background" and s["executions"] - before > 50, s


def test_megacache_load_draws_nothing(monkeypatch: pytest.MonkeyPatch, tmp_path: Any,
                                      fresh_runtime: _runtime.Runtime) -> None:
    """Loading a Mega-Cache bundle and running its executables leaves the user's generator untouched."""
    from torch.compiler._cache import CacheArtifactManager

    monkeypatch.setenv("TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR", str(tmp_path / "first"))
    _runtime.reset_runtime()
    x = torch.randn(6, 5)

    def step() -> torch.Tensor:
        return (torch.nn.functional.gelu(x.to(DEV)) * 2).sum(dim=1).cpu()

    step()  # recorded in the process's list first (as an earlier job step or test of these classes would)
    _runtime.reset_runtime()  # the executables are loaded again below
    with CacheArtifactManager.with_fresh_cache():  # a new list: the entries are offered again as they load
        want = step()
        saved = torch.compiler.save_cache_artifacts()
    assert saved is not None and saved[1].artifacts.get("neuron_neff")
    monkeypatch.setenv("TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR", str(tmp_path / "second"))
    _runtime.reset_runtime()
    torch.manual_seed(5)
    state = torch.get_rng_state()
    torch.compiler.load_cache_artifacts(saved[0])
    assert torch.equal(step(), want)
    s = neuron_runtime.stats()
    assert s["compiles"] == 0 and s["loads"] > 0, s
    assert torch.equal(torch.get_rng_state(), state)


@pytest.mark.skipif(_hostmem.NATIVE is None, reason="native layer not loaded")
def test_random_ops_run_natively_after_their_first_call() -> None:
    """A functional random op (no device argument) is served by the native host kernel from its second call:
    CPU's kernel on the CPU views, from the CPU generator or the one passed, results on neuron, counted in
    `host_ops`. A CPU tensor among its arguments takes the Python kernel, as before."""
    native = _hostmem.NATIVE
    _runtime.reset_runtime()
    p, x = torch.softmax(torch.randn(3, 40), -1), torch.randn(6, 5)
    np_, nx = p.to(DEV), x.to(DEV)
    calls = (lambda q, y, g: torch.multinomial(q, 4, replacement=True, generator=g),
             lambda q, y, g: torch.ops.aten.native_dropout(y, 0.4, True),
             lambda q, y, g: torch.bernoulli(q, generator=g),
             lambda q, y, g: torch.normal(y, y.abs() + 0.1, generator=g))
    before = native.host_runs()
    for _ in range(3):
        for f in calls:
            for gen in (False, True):
                torch.manual_seed(7)
                want = f(p, x, torch.Generator().manual_seed(3) if gen else None)
                torch.manual_seed(7)
                got = f(np_, nx, torch.Generator().manual_seed(3) if gen else None)
                for w, g in zip(pytree.tree_leaves(want), pytree.tree_leaves(got)):
                    assert g.device.type == DEV and torch.equal(w, g.cpu())
            torch.manual_seed(7)
            f(p, x, None)
            want_next = torch.rand(3)
            torch.manual_seed(7)
            f(np_, nx, None)
            assert torch.equal(want_next, torch.rand(3))  # the generator is left where CPU leaves it
    ran = native.host_runs() - before
    assert ran >= 16, ran  # the second and third rounds at least
    assert neuron_runtime.stats()["host_ops"] >= ran
    ran = native.host_runs()
    torch.manual_seed(7)
    want = torch.normal(x, x.abs() + 0.1)
    torch.manual_seed(7)
    got = torch.normal(nx, x.abs() + 0.1)  # a CPU tensor among neuron ones: the Python kernel's call
    assert native.host_runs() == ran and torch.equal(want, got.cpu())

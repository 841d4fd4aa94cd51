"""torch.compile(backend="neuron"): graphs as cached executables (reference tier; aoti in tests/compiler)."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import neuron_runtime
from neuron_runtime.aten import _runtime
from neuron_runtime.graphs import _compile, _graph
from neuron_runtime.signatures import _shapes, _signature

DEV = "neuron"


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.LayerNorm(16),
                               torch.nn.Linear(16, 3))


def _graph_keys(fn: Any, *args: Any) -> list[str]:
    """The graph keys torch.compile(fn, backend=<neuron, keys recorded>) makes for these inputs."""
    seen: list[str] = []
    real = _compile.CompiledGraph.__init__

    def spy(self: Any, gm: Any, kind: str) -> None:
        real(self, gm, kind)
        seen.append(self.key)

    _compile.CompiledGraph.__init__ = spy  # type: ignore[method-assign]
    try:
        torch._dynamo.reset()
        torch.compile(fn, backend="neuron")(*args)
    finally:
        _compile.CompiledGraph.__init__ = real  # type: ignore[method-assign]
    return seen


def test_backend_is_registered_by_entry_point() -> None:
    assert "neuron" in torch._dynamo.list_backends()


def test_training_step_equals_eager_neuron_and_hits_after_first(fresh_runtime: _runtime.Runtime) -> None:
    eager = _mlp().to(DEV)
    model = copy.deepcopy(eager)
    compiled = torch.compile(model, backend="neuron")
    x = torch.randn(5, 8)
    for step in range(3):
        y_e, y_c = eager(x.to(DEV)), compiled(x.to(DEV))
        y_e.pow(2).sum().backward()
        y_c.pow(2).sum().backward()
        torch.testing.assert_close(y_c.cpu(), y_e.cpu())
        for pe, pc in zip(eager.parameters(), model.parameters()):
            assert pc.grad is not None and pc.grad.device.type == DEV
            torch.testing.assert_close(pc.grad.cpu(), pe.grad.cpu())
        if step == 0:
            after_first = neuron_runtime.stats()
    s = neuron_runtime.stats()
    assert s["graphs"]["compiles"] == 2 == s["compiles_by_kind"]["graph"]  # forward and backward
    # Later steps compile no graph (eager ops around it, e.g. accumulating .grad, compile once each).
    assert after_first["compiles_by_kind"]["graph"] == 2
    assert s["graphs"]["graph_executions"] == 6 and s["graphs"]["graph_eager_runs"] == 0


def test_default_backend_on_neuron_compiles_through_neuron(fresh_runtime: _runtime.Runtime) -> None:
    model = _mlp().to(DEV)
    x = torch.randn(4, 8)
    y = torch.compile(model)(x.to(DEV))  # Inductor would fail with KeyError: 'neuron'
    assert y.device.type == DEV
    torch.testing.assert_close(y.cpu(), model(x.to(DEV)).cpu())
    assert neuron_runtime.stats()["graphs"]["graph_executions"] == 1


def test_unsupported_mode_and_options_are_clear_errors() -> None:
    f = torch.compile(lambda x: x * 2, backend="neuron", mode="max-autotune")
    with pytest.raises(Exception, match="mode='max-autotune'.*only mode='default'"):
        f(torch.ones(3, device=DEV))
    torch._dynamo.reset()
    g = torch.compile(lambda x: x * 2, backend="neuron", options={"max_autotune": True})
    with pytest.raises(Exception, match="takes no options"):
        g(torch.ones(3, device=DEV))


def test_different_graphs_never_share_a_key(fresh_runtime: _runtime.Runtime) -> None:
    x = torch.randn(4, 6, device=DEV)
    base = _graph_keys(lambda t: (t * 2.0).relu().sum(1), x)
    assert base == _graph_keys(lambda t: (t * 2.0).relu().sum(1), x)  # same graph, same key
    others = [
        _graph_keys(lambda t: (t * 2.0).sigmoid().sum(1), x),        # one node
        _graph_keys(lambda t: (t * 3.0).relu().sum(1), x),           # one constant
        _graph_keys(lambda t: (t * 2.0).relu().sum(0), x),           # one structural value
        _graph_keys(lambda t: (t * 2.0).relu().sum(1), torch.randn(6, 4, device=DEV).t()),  # one stride
        _graph_keys(lambda t: (t * 2.0).relu().sum(1), x.double()),  # one dtype
    ]
    keys = [base[0]] + [k[0] for k in others]
    assert len(set(keys)) == len(keys)


def test_graph_signature_holds_no_names_or_ids() -> None:
    # An aten-level graph returning a tuple, as AOTAutograd hands it over.
    from torch.fx.experimental.proxy_tensor import make_fx

    gm = make_fx(lambda t: (torch.relu(t) + 1,))(torch.randn(3))
    plan = _graph.signature(gm, "forward")
    text = _signature.canonical(plan.signature).decode()
    for node in gm.graph.nodes:
        assert f'"{node.name}"' not in text
    assert "0x" not in text and "/" not in text


def test_input_mutation_mixed_cpu_and_non_contiguous_inputs(fresh_runtime: _runtime.Runtime) -> None:
    def f(state: torch.Tensor, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        state.mul_(0.5).add_(x)          # optimizer-state style in-place update of an input
        return (x @ x.t()) + bias.to(x.device)  # a CPU tensor moved inside the graph

    state_c = torch.randn(4, 4)
    x_c = torch.randn(4, 8)[:, ::2]      # non-contiguous
    bias = torch.randn(4)
    want = f(state_c.clone(), x_c, bias)
    state_n = state_c.to(DEV)
    x_n = torch.randn(4, 8)
    x_n[:, ::2] = x_c
    x_n = x_n.to(DEV)[:, ::2]
    assert not x_n.is_contiguous()
    cf = torch.compile(f, backend="neuron")
    version = state_n._version
    got = cf(state_n, x_n, bias)
    torch.testing.assert_close(got.cpu(), want)
    torch.testing.assert_close(state_n.cpu(), state_c * 0.5 + x_c)
    assert state_n._version > version  # autograd sees the update, as with the in-place ops
    assert neuron_runtime.stats()["graphs"]["graph_executions"] == 1
    # The executable writes `state` itself (the graph's `into`), so nothing is copied back after it;
    # a CPU input updated in a graph is written the same way.
    state_cpu = state_c.clone()
    cg = torch.compile(lambda s, x: s.add_(x.sum().cpu()), backend="neuron")
    version = state_cpu._version
    cg(state_cpu, x_n)
    torch.testing.assert_close(state_cpu, state_c + x_c.sum())
    assert state_cpu._version > version
    assert neuron_runtime.stats()["graphs"]["graph_executions"] == 2


def test_random_graph_runs_op_by_op_with_eager_masks(fresh_runtime: _runtime.Runtime) -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.dropout(x * 2, p=0.5, training=True)

    x = torch.randn(64, device=DEV)
    torch.manual_seed(3)
    want = f(x).cpu()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cf = torch.compile(f, backend="neuron")
        torch.manual_seed(3)
        got = cf(x).cpu()
    assert torch.equal(got, want)
    msgs = [str(w.message) for w in caught if "torch.compile" in str(w.message)]
    assert len(msgs) == 1 and "random" in msgs[0] and "op by op" in msgs[0]
    assert neuron_runtime.stats()["graphs"]["graphs_refused"] == 1


def test_disable_fallback_execution_makes_a_refused_graph_an_error(
        fresh_runtime: _runtime.Runtime, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCH_NEURONX_DISABLE_FALLBACK_EXECUTION", "1")
    _runtime.reset_runtime()
    cf = torch.compile(lambda x: torch.nn.functional.dropout(x, 0.5, True), backend="neuron")
    with pytest.raises(Exception, match="TORCH_NEURONX_DISABLE_FALLBACK_EXECUTION=1"):
        cf(torch.randn(8, device=DEV))


def test_dynamic_graphs_compile_per_concrete_shape(fresh_runtime: _runtime.Runtime) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 3)).to(DEV)
    cf = torch.compile(model, backend="neuron", dynamic=True)
    for b in (3, 5, 3):
        x = torch.randn(b, 8, device=DEV)
        torch.testing.assert_close(cf(x).cpu(), model(x).cpu())
    g = neuron_runtime.stats()["graphs"]
    assert g["compiles"] == 2 and g["graph_executions"] == 3 and g["graphs_refused"] == 0


def test_background_mode_runs_op_by_op_until_the_graph_is_compiled(
        fresh_runtime: _runtime.Runtime, monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    monkeypatch.setenv("TORCH_NEURONX_COMPILE_MODE", "background")
    monkeypatch.setenv("TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR", str(tmp_path / "local"))
    _runtime.reset_runtime()
    model = _mlp().to(DEV)
    cf = torch.compile(model, backend="neuron")
    x = torch.randn(5, 8, device=DEV)
    want = model(x).cpu()
    for _ in range(3):
        torch.testing.assert_close(cf(x).cpu(), want)
    assert neuron_runtime.stats()["graphs"]["graph_eager_runs"] >= 1
    assert neuron_runtime.wait_for_compiles(120)
    before = neuron_runtime.stats()["graphs"]["graph_executions"]
    torch.testing.assert_close(cf(x).cpu(), want)
    assert neuron_runtime.stats()["graphs"]["graph_executions"] == before + 1


def test_explain_names_the_graph_node_that_differs() -> None:
    from neuron_runtime.cli._explain import signature_diffs

    x = torch.randn(4, 6)
    from torch.fx.experimental.proxy_tensor import make_fx

    a = _graph.signature(make_fx(lambda t: ((t * 2.0).relu(),))(x), "forward").signature
    b = _graph.signature(make_fx(lambda t: ((t * 3.0).relu(),))(x), "forward").signature
    diffs = signature_diffs(a, b)
    assert [(d["part"], d["path"]) for d in diffs] == [("graph node structural value", "graph[0].args.other")]


@pytest.mark.parametrize("damage", ["flipped_byte", "another_entry"])
def test_corrupt_or_forged_graph_entry_is_never_loaded(
        fresh_runtime: _runtime.Runtime, monkeypatch: pytest.MonkeyPatch, tmp_path: Any, damage: str) -> None:
    from neuron_runtime.cache import LocalCache

    monkeypatch.setenv("TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR", str(tmp_path / "local"))
    monkeypatch.setenv("TORCH_NEURONX_SHAPES", "static")  # exact keys: the entry damaged is the one it loads
    _runtime.reset_runtime()
    x = torch.randn(4, 6, device=DEV)

    def f(t: torch.Tensor) -> torch.Tensor:
        return (t * 2.0).relu().sum(1)

    [key] = _graph_keys(f, x)
    want = f(x).cpu()
    local = LocalCache(str(tmp_path / "local"), 1 << 30)
    other = next(e.key for e in local.entries() if e.key != key)
    data = bytearray(local.get(key) or b"")
    assert data
    if damage == "flipped_byte":
        data[len(data) // 2] ^= 0xFF
    else:  # a valid entry of another key stored under this graph's name
        data = bytearray(local.get(other) or b"")
    local.delete(key)
    local.put(key, bytes(data))
    _runtime.reset_runtime()
    torch._dynamo.reset()
    got = torch.compile(f, backend="neuron")(x)
    torch.testing.assert_close(got.cpu(), want)
    s = neuron_runtime.stats()
    assert s["corrupt"] >= 1 and s["graphs"]["compiles"] == 1 and s["graphs"]["graph_executions"] == 1


def test_autocast_region_inside_a_compiled_graph(fresh_runtime: _runtime.Runtime) -> None:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)).to(DEV)

    def f(x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device_type=DEV, dtype=torch.bfloat16):
            return m(x).float().sum()

    x = torch.randn(4, 8, device=DEV)
    want = f(x)
    got = torch.compile(f, backend="neuron")(x)
    assert torch.equal(got.cpu(), want.cpu())  # bf16 matmuls, as eager autocast does them
    assert neuron_runtime.stats()["graphs"]["graph_executions"] == 1


class _TinyCausalLM(torch.nn.Module):
    """A GPT-style causal LM (embedding, causal attention, MLP, tied head): what a Hugging Face config
    with random weights builds, without the download or the dependency."""

    def __init__(self, vocab: int = 50, d: int = 32, heads: int = 4, layers: int = 2, seq: int = 12) -> None:
        super().__init__()
        self.emb, self.pos = torch.nn.Embedding(vocab, d), torch.nn.Embedding(seq, d)
        self.blocks = torch.nn.ModuleList(torch.nn.TransformerEncoderLayer(
            d, heads, 4 * d, dropout=0.0, batch_first=True, norm_first=True) for _ in range(layers))
        self.ln = torch.nn.LayerNorm(d)
        self.head = torch.nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight  # tied, as GPT-2's

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        t = ids.shape[1]
        h = self.emb(ids) + self.pos(torch.arange(t, device=ids.device))
        mask = torch.nn.Transformer.generate_square_subsequent_mask(t, device=ids.device)
        for b in self.blocks:
            h = b(h, src_mask=mask, is_causal=True)
        logits = self.head(self.ln(h))
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


def test_tiny_causal_lm_forward_and_backward_equal_eager_neuron(fresh_runtime: _runtime.Runtime) -> None:
    torch.manual_seed(0)
    eager = _TinyCausalLM().to(DEV)
    model = copy.deepcopy(eager)
    ids = torch.randint(0, 50, (2, 12)).to(DEV)
    labels = torch.randint(0, 50, (2, 12)).to(DEV)
    want = eager(ids, labels)
    want.backward()
    got = torch.compile(model, backend="neuron")(ids, labels)
    got.backward()
    torch.testing.assert_close(got.cpu(), want.cpu(), rtol=1e-5, atol=1e-5)
    for (name, pe), pc in zip(eager.named_parameters(), model.parameters()):
        torch.testing.assert_close(pc.grad.cpu(), pe.grad.cpu(), rtol=1e-4, atol=1e-5, msg=name)
    g = neuron_runtime.stats()["graphs"]
    assert g["graphs_refused"] == 0 and g["graph_executions"] >= 2, g


def test_compiled_optimizer_step_updates_state_in_place(fresh_runtime: _runtime.Runtime) -> None:
    """`torch.compile(opt.step)`: AdamW's update is one graph writing parameters and moments in place."""
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 3))
    model = copy.deepcopy(ref).to(DEV)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = torch.compile(opt.step, backend="neuron")
    x = torch.randn(5, 8)
    for _ in range(3):
        opt_ref.zero_grad()
        ref(x).pow(2).sum().backward()
        opt_ref.step()
        opt.zero_grad()
        model(x.to(DEV)).pow(2).sum().backward()
        step()
    for a, b in zip(ref.parameters(), model.parameters()):
        torch.testing.assert_close(b.cpu(), a, rtol=1e-5, atol=1e-6)
    g = neuron_runtime.stats()["graphs"]
    assert g["graphs_refused"] == 0 and g["graph_executions"] == 3 and g["graph_eager_runs"] == 0, g


def _static_cache_step(x: torch.Tensor, cache: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    # A decode step against a static KV cache `[1, 2, L, 4]` (two KV heads, head size 4) read by four query
    # heads: Dynamo writes L into the graph as size arguments (`expand(..., [1, 2, 2, L, 4])`, `view`), as
    # Hugging Face's static cache does. The projection's 16 = heads x head size is tied by the `view`.
    n = cache.shape[2]
    k = cache.unsqueeze(2).expand(1, 2, 2, n, 4).reshape(1, 4, n, 4)
    q = (x @ w).view(1, 1, 4, 4).transpose(1, 2)
    return (q @ k.transpose(-1, -2)).softmax(-1) @ k


def test_a_static_cache_graph_of_a_new_length_compiles_nothing(fresh_runtime: _runtime.Runtime) -> None:
    from torch.fx.experimental.proxy_tensor import make_fx

    # Each cache length is a new graph (Dynamo recompiles with dynamic=False) whose sizes and size arguments
    # differ only by the length: one graph class serves them all (signatures rule 3b, issue 43).
    torch.manual_seed(0)
    w = torch.randn(8, 16)
    step = torch.compile(_static_cache_step, backend="neuron", dynamic=False)
    classes = []
    for n in (5, 7, 12):
        x, cache = torch.randn(1, 8), torch.randn(1, 2, n, 4)
        with torch.no_grad():
            got = step(x.to(DEV), cache.to(DEV), w.to(DEV)).cpu()
        torch.testing.assert_close(got, _static_cache_step(x, cache, w))
        assert neuron_runtime.stats()["graphs"]["compiles"] == 1, n
        # Its class: the length a symbol (and the free input size 8), what the `view` ties (16, 4) literal.
        gm = make_fx(lambda *a: (_static_cache_step(*a),))(x, cache, w)
        cls = _shapes.ranked_class(_graph.signature(gm, "inference").signature)
        assert cls is not None
        classes.append(_signature.cache_key(cls, {}))
        sizes = _shapes.symbols(cls).values()
        assert sorted(sizes) == sorted([n, 8]), sizes
    assert len(set(classes)) == 1

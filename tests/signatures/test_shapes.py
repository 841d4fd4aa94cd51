"""Shape classes (neuron_runtime/signatures/_shapes.py): the class rules, and the runtime serving a new shape of a
known class without a compile, never a shape outside it (reference tier; the aoti side is in
tests/compiler/test_aoti.py)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import neuron_runtime
from neuron_runtime import _config
from neuron_runtime.aten import _runtime
from neuron_runtime.signatures import _ops, _shapes, _signature
from rt_helpers import DEV, assert_same


def sig_of(op: str, *values: object) -> dict:  # type: ignore[type-arg]
    return _signature.build(_ops.classify(op), values)


def cls_of(op: str, *values: object) -> dict:  # type: ignore[type-arg]
    cls = _shapes.shape_class(sig_of(op, *values))
    assert cls is not None
    return cls


def ranked_of(op: str, *values: object) -> dict:  # type: ignore[type-arg]
    """The class of rules 1-6 (elementwise ops get a flat class first: see the rank-collapse tests)."""
    cls = _shapes.ranked_class(sig_of(op, *values))
    assert cls is not None
    return cls


def tensors(cls: dict) -> list[tuple[list, list]]:  # type: ignore[type-arg]
    return [(d["sizes"], d["strides"]) for d in _shapes.tensor_descs(cls)]


# -- the rules --------------------------------------------------------------------------------------
def test_sizes_become_symbols_and_only_sizes_the_op_ties_share_one() -> None:
    a = cls_of("aten::mm", torch.randn(6, 8), torch.randn(8, 5))
    assert tensors(a) == [(["s0", "s1"], ["s1", 1]), (["s1", "s2"], ["s2", 1])]
    b = cls_of("aten::mm", torch.randn(9, 3), torch.randn(3, 7))
    assert _signature.cache_key(a, {}) == _signature.cache_key(b, {})  # the example is not keyed
    for c in (cls_of("aten::mm", torch.randn(8, 8), torch.randn(8, 5)),  # sizes that happen to be equal
              cls_of("aten::mm", torch.randn(5, 5), torch.randn(5, 5))):
        assert tensors(c) == tensors(a) and _signature.cache_key(a, {}) == _signature.cache_key(c, {})
    # broadcasting ties the aligned dims, nothing else
    assert tensors(ranked_of("aten::add.Tensor", torch.randn(8, 8), torch.randn(8), 1)) == \
        [(["s0", "s1"], ["s1", 1]), (["s1"], [1])]
    # a foreach op ties element i of each list, dim by dim, and nothing across elements
    xs, ys = [torch.randn(4, 8), torch.randn(8)], [torch.randn(4, 8), torch.randn(8)]
    assert _shapes.describe(ranked_of("aten::_foreach_add.List", xs, ys, 1)) == "[s0,s1] [s2] [s0,s1] [s2]"
    # cat ties every dim but the one it joins
    assert _shapes.describe(ranked_of("aten::cat", [torch.randn(2, 8, 8), torch.randn(2, 3, 8)], 1)) == \
        "[s0,s1,s2] [s0,s3,s2]"
    # an op without meta kernels keeps the older rule: equal sizes share a symbol
    assert _shapes._needed(sig_of("aten::nonzero", torch.randn(4, 4)), [(0, 0), (0, 1)]) is None


def test_zero_and_one_sizes_stay_static() -> None:
    a = cls_of("aten::add.Tensor", torch.randn(4, 1, 8), torch.randn(8), 1)
    assert tensors(a) == [(["s0", 1, "s1"], ["s1", "*", 1]), (["s1"], [1])]
    assert _shapes.shape_class(sig_of("aten::add.Tensor", torch.randn(1, 1), torch.randn(1), 1)) is None
    empty = cls_of("aten::add.Tensor", torch.randn(0, 5), torch.randn(0, 5), 1)
    assert tensors(empty)[0] == ([0, "s0"], ["s0", 1])


def test_layout_is_part_of_the_class() -> None:
    x = torch.randn(6, 8)
    contiguous = ranked_of("aten::neg", x)
    transposed = ranked_of("aten::neg", x.t())
    sliced = ranked_of("aten::neg", x[:, :3])
    assert tensors(transposed) == [(["s0", "s1"], [1, "s0"])]
    assert tensors(sliced) == [(["s0", 3], [8, 1])]  # a slice's row: its parent's width bounds it
    cl = ranked_of("aten::neg", torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last))
    assert tensors(cl) == [(["s0", "s1", "s2", "s3"], ["s1*s2*s3", 1, "s1*s3", "s1"])]
    keys = {_signature.cache_key(c, {}) for c in (contiguous, transposed, sliced, cl)}
    assert len(keys) == 4


def test_size_arguments_keep_their_sizes_static() -> None:
    # normalized_shape is a SymInt[] argument: the kernel is specialised on it, so the dim it names is too
    x, w, b = torch.randn(3, 5, 32), torch.randn(32), torch.randn(32)
    cls = cls_of("aten::native_layer_norm", x, [32], w, b, 1e-5)
    assert tensors(cls)[0] == (["s0", "s1", 32], ["32*s1", 32, 1])
    # a length that happens to equal it is a length like any other
    same = cls_of("aten::native_layer_norm", torch.randn(3, 32, 32), [32], w, b, 1e-5)
    assert _signature.cache_key(same, {}) == _signature.cache_key(cls, {})


def test_instances_round_trip() -> None:
    for s in (sig_of("aten::mm", torch.randn(6, 8), torch.randn(8, 5)),
              sig_of("aten::neg", torch.randn(6, 8)[:, 1:4]),
              sig_of("aten::neg", torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last))):
        cls = _shapes.ranked_class(s)
        assert cls is not None and _shapes.instance(cls, _shapes.symbols(cls)) == s
        other = _shapes.other_instance(cls)
        assert other != s and _shapes.ranked_class(other) == {**cls, "example": other}


def test_bad_policy_is_a_clear_error() -> None:
    with pytest.raises(_config.ConfigError, match="TORCH_NEURONX_SHAPES"):
        _config.load({"TORCH_NEURONX_SHAPES": "dynamic"})


# -- the runtime ------------------------------------------------------------------------------------
@pytest.fixture
def rt(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[_runtime.Runtime]:
    monkeypatch.setenv("TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR", str(tmp_path / "local"))
    yield _runtime.reset_runtime()
    monkeypatch.undo()
    _runtime.reset_runtime()


def _compiles() -> int:
    return int(neuron_runtime.stats()["compiles"])


def test_new_batch_sizes_compile_nothing(rt: _runtime.Runtime) -> None:
    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 16)
    dev = torch.nn.Linear(8, 16).to(DEV)
    dev.load_state_dict(lin.state_dict())
    first = None
    for batch in (3, 5, 6, 7, 12):
        x = torch.randn(batch, 8)
        assert_same(torch.relu(lin(x)).sum(1), torch.relu(dev(x.to(DEV))).sum(1), atol=1e-5, rtol=1e-5)
        first = _compiles() if first is None else first
    assert first > 0 and _compiles() == first
    assert neuron_runtime.stats()["class_hits"] >= 4 * 3


def test_a_shape_outside_the_class_compiles_and_never_runs_the_wrong_kernel(rt: _runtime.Runtime) -> None:
    # cumsum is not elementwise: its classes are ranked ones (rules 1-6)
    def op(t: torch.Tensor) -> torch.Tensor:
        return torch.cumsum(t, 1) * 1  # `* 1`: an elementwise op of the same layout, flat-classed

    a = torch.randn(4, 6)
    assert_same(op(a), op(a.to(DEV)))
    n = _compiles()
    b = torch.randn(5, 7)
    assert_same(op(b), op(b.to(DEV)))  # same class
    assert _compiles() == n
    square = torch.randn(6, 6)  # two sizes equal: cumsum does not need them to be, the same class
    assert_same(torch.cumsum(square, 1), torch.cumsum(square.to(DEV), 1))
    assert _compiles() == n
    cases = [torch.randn(1, 7),                      # a size-1 dim: broadcasting, another kernel
             torch.randn(0, 7)]                      # empty
    views = [lambda t: t.t(),                        # transposed
             lambda t: t[:, 1:6]]                    # a slice of a wider tensor
    for c, view in [*((c, lambda t: t) for c in cases), *((torch.randn(7, 8), v) for v in views)]:
        before = _compiles()
        d = view(c.to(DEV))
        got = torch.cumsum(d, 1)
        assert_same(torch.cumsum(view(c), 1), got)
        assert got.stride() == torch.cumsum(view(c), 1).stride()
        assert _compiles() == before + 1, c.shape
    x = torch.randn(2, 3, 4, 5)
    cl = x.to(memory_format=torch.channels_last)
    assert_same(torch.cumsum(x, 1), torch.cumsum(x.to(DEV), 1))
    before = _compiles()
    got = torch.cumsum(cl.to(DEV), 1)
    assert_same(torch.cumsum(cl, 1), got)
    assert got.stride() == torch.cumsum(cl, 1).stride() and _compiles() == before + 1
    before = _compiles()
    y = torch.randn(3, 4, 5, 6).to(memory_format=torch.channels_last)
    assert_same(torch.cumsum(y, 2), torch.cumsum(y.to(DEV), 2))  # channels-last: its own class, once
    y2 = torch.randn(2, 5, 6, 7).to(memory_format=torch.channels_last)
    assert_same(torch.cumsum(y2, 2), torch.cumsum(y2.to(DEV), 2))
    assert _compiles() == before + 1


def test_static_policy_compiles_every_shape(rt: _runtime.Runtime, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCH_NEURONX_SHAPES", "static")
    _runtime.reset_runtime()
    for n in (3, 4, 5):
        x = torch.randn(n, 2)
        assert_same(x.exp(), x.to(DEV).exp())
    assert _compiles() == 3 and neuron_runtime.stats()["class_hits"] == 0


def test_exact_entries_of_a_runtime_without_classes_still_load(rt: _runtime.Runtime,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.randn(3, 4)
    monkeypatch.setenv("TORCH_NEURONX_SHAPES", "static")
    _runtime.reset_runtime()
    assert_same(x.exp(), x.to(DEV).exp())
    assert _compiles() == 1
    monkeypatch.setenv("TORCH_NEURONX_SHAPES", "auto")
    _runtime.reset_runtime()
    assert_same(x.exp(), x.to(DEV).exp())  # the exact entry on disk serves it
    s = neuron_runtime.stats()
    assert _compiles() == 0 and s["hits"]["local"] == 1 and s["class_hits"] == 0
    y = torch.randn(5, 6)
    assert_same(y.exp(), y.to(DEV).exp())  # a new shape: the class compiles once
    assert _compiles() == 1


def test_a_class_entry_of_another_class_version_is_not_used(rt: _runtime.Runtime,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.randn(3, 4)
    assert_same(x.exp(), x.to(DEV).exp())
    assert _compiles() == 1
    monkeypatch.setattr(_shapes, "CLASS_VERSION", _shapes.CLASS_VERSION + 1)  # a runtime with other rules
    _runtime.reset_runtime()
    y = torch.randn(5, 6)
    assert_same(y.exp(), y.to(DEV).exp())
    assert _compiles() == 1  # its own class, compiled once; the other version's entry is never run


def test_classes_survive_the_memory_bound(rt: _runtime.Runtime, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCH_NEURONX_MEMORY_CACHE_ENTRIES", "6")
    rt = _runtime.reset_runtime()
    for n in range(2, 40):
        x = torch.randn(n, 3)
        assert_same(x * 2 + 1, x.to(DEV) * 2 + 1)
    assert len(rt.by_digest) + len(rt.resolver.classes) <= 6
    assert sum(len(e) for _, e in _runtime._EXES.values()) <= 6
    assert _compiles() <= 2  # mul and add, once each: n == 3 equal to the other dim is no new class


def test_a_fused_group_has_one_class_over_its_nodes() -> None:
    xs = [torch.randn(5), torch.randn(3, 4)]
    mul = sig_of("aten::_foreach_mul.Scalar", xs, 0.9)
    # the same op twice in a group: both nodes hold one signature object (as fusion builds them)
    graph = {"op": "fused:_foreach_mul.Scalar+_foreach_mul.Scalar",
             "graph": [{"sig": mul, "in": [["e", 0], ["e", 1]]}, {"sig": mul, "in": [["n", 0, 0], ["n", 0, 1]]}],
             "outputs": [[1, 0], [1, 1]]}
    cls = _shapes.shape_class(graph)
    assert cls is not None and _shapes.describe(cls) == "[s0] [s1,s2] [s0] [s1,s2]"
    assert _shapes.instance(cls, _shapes.symbols(cls)) == graph and mul["args"][0][2][0]["sizes"] == [5]


def _chain(x: torch.Tensor, y: torch.Tensor) -> dict:  # type: ignore[type-arg]
    """relu(x * 2) + 0.5 * y as fusion builds it (external inputs e0 = x, e1 = 2, e2 = y)."""
    mul, relu = sig_of("aten::mul.Tensor", x, 2), sig_of("aten::relu", x)
    add = sig_of("aten::add.Tensor", x, y, 0.5)
    return {"op": "fused:mul+relu+add",
            "graph": [{"sig": mul, "in": [["e", 0], ["e", 1]]}, {"sig": relu, "in": [["n", 0]]},
                      {"sig": add, "in": [["n", 1], ["e", 2]]}], "outputs": [2]}


def test_a_fused_group_of_elementwise_ops_has_one_flat_class() -> None:
    x = torch.randn(4, 6)
    a = _shapes.shape_class(_chain(x, x))
    b = _shapes.shape_class(_chain(torch.randn(2, 3, 5), torch.randn(2, 3, 5)))
    assert a is not None and b is not None and a["flat"] == _shapes.FLAT_VERSION
    assert _shapes.describe(a) == "[s0] [s0] [s0] [s0]" and _signature.cache_key(a, {}) == _signature.cache_key(b, {})
    assert _shapes.example(a)["graph"][2]["sig"]["args"][0][2]["sizes"] == [24]
    # one node broadcasting: the group keeps its ranked class
    c = _shapes.shape_class(_chain(x, torch.randn(6)))
    assert c is not None and not _shapes.is_flat(c)


def test_a_class_line_without_its_example_is_a_clear_error() -> None:
    from neuron_runtime.executables import _record

    cls = cls_of("aten::neg", torch.randn(3, 4))
    assert _record.check_signature(cls) is cls
    with pytest.raises(ValueError, match="no 'example'"):
        _record.check_signature({k: v for k, v in cls.items() if k != "example"})
    with pytest.raises(ValueError, match="its example: signature has no 'args'"):
        _record.check_signature({**cls, "example": {"op": "aten::neg", "schema": ""}})


# -- the rank-collapse rule: one 1-D kernel for an elementwise op's every rank and dense layout --------
def test_elementwise_ops_of_every_rank_and_dense_layout_share_one_flat_class() -> None:
    x = torch.randn(6, 8)
    keys = set()
    for t in (torch.randn(48), x, torch.randn(2, 3, 8), x.t(),
              torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last)):
        cls = cls_of("aten::zero", t)
        assert cls["flat"] == _shapes.FLAT_VERSION and tensors(cls) == [(["s0"], [1])]
        keys.add(_signature.cache_key(cls, {}))
    assert len(keys) == 1
    add = cls_of("aten::add.Tensor", x, x, 1)
    assert tensors(add) == [(["s0"], [1]), (["s0"], [1])] and add["example"] == sig_of("aten::add.Tensor", x, x, 1)
    assert _shapes.example(add) == _shapes.flatten(add["example"])  # what a compiler compiles: 1-D
    assert _shapes.symbols(add) == {"s0": 48}
    assert tensors(_shapes.other_instance(add)) == [([49], [1]), ([49], [1])]
    # a number in a tensor slot is no tensor: `x * 2` is flat too
    assert tensors(cls_of("aten::mul.Tensor", x, 2)) == [(["s0"], [1])]
    # the flat class comes first, the ranked one second (its entries, a refused flat class's fallback)
    ranked = _shapes.ranked_class(sig_of("aten::add.Tensor", x, x, 1))
    assert _shapes.classes(sig_of("aten::add.Tensor", x, x, 1)) == [add, ranked]


def test_what_the_rank_collapse_rule_does_not_serve() -> None:
    x = torch.randn(6, 8)
    not_flat = {
        "broadcasting": sig_of("aten::add.Tensor", x, torch.randn(8), 1),
        "a 0-d tensor operand": sig_of("aten::add.Tensor", x, torch.tensor(2.0), 1),
        "operands of different layouts": sig_of("aten::add.Tensor", x, x.t().contiguous().t(), 1),
        "not dense: a slice": sig_of("aten::zero", x[:, :3]),
        "not dense: expanded": sig_of("aten::neg", torch.randn(8).expand(6, 8)),
        "one element": sig_of("aten::zero", torch.randn(1, 1)),
        "empty": sig_of("aten::zero", torch.randn(0, 8)),
        "not elementwise": sig_of("aten::cumsum", x, 1, None),
        "an output layout of its own": sig_of("aten::clone", x, torch.channels_last),
    }
    for why, s in not_flat.items():
        assert _shapes.flat_class(s) is None, why
        cls = _shapes.shape_class(s)
        assert cls is None or "flat" not in cls, why
    assert _shapes.flat_class(sig_of("aten::clone", x, None)) is not None  # preserves the layout
    assert _shapes.elementwise("aten::fill.Scalar") and not _shapes.elementwise("aten::mm")


def test_a_flat_executable_runs_its_kernel_on_flat_views_and_views_results_back() -> None:
    from neuron_runtime.compiler._runner import flat_executable

    ranks = []

    def kernel(ts: list[torch.Tensor], ss: list[float]) -> list[torch.Tensor]:  # a 1-D kernel
        ranks.append([t.dim() for t in ts])
        assert all(t.dim() == 1 and t.stride() == (1,) for t in ts)
        return [ts[0] * ts[1] + ss[0]]

    exe = flat_executable(kernel)
    for x in (torch.randn(4, 6), torch.randn(4, 6).t(), torch.randn(7),
              torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last)):
        y = torch.randn_like(x)  # the same strides as x
        (got,) = exe([x, y], [0.5])
        want = x * y + 0.5
        torch.testing.assert_close(got, want)
        assert got.shape == want.shape and got.stride() == want.stride()
    assert ranks == [[1, 1]] * 4


def _native_executions() -> int:
    from neuron_runtime._native import _hostmem

    return 0 if _hostmem.NATIVE is None else int(_hostmem.NATIVE.executions())


def test_zero_of_every_rank_compiles_once_and_what_differs_statically_compiles(rt: _runtime.Runtime) -> None:
    params = [torch.randn(16).to(DEV), torch.randn(16, 8).to(DEV), torch.randn(2, 3, 4).to(DEV)]
    before = _compiles()
    for _ in range(2):  # the second round: the hit path (native where it is built)
        for p in params:
            p.fill_(1.0)
            p.zero_()
    assert all(bool((p.cpu() == 0).all()) for p in params)
    assert _compiles() == before + 2  # one `zero`, one `fill.Scalar`, for all three ranks
    a = torch.randn(4, 6)
    dense = [lambda: (a, a.to(DEV)),
             lambda: (a.t(), a.to(DEV).t()),  # transposed: the same memory order in every operand
             lambda: (torch.randn(5, 7, 2),) * 2,
             lambda: (torch.randn(30),) * 2]
    cl = torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last)
    dense.append(lambda: (cl, cl.to(DEV)))
    before, native = _compiles(), _native_executions()
    for make in dense:
        c, d = make()
        d = d.to(DEV)
        for _ in range(2):
            got = d * d + d
            assert_same(c * c + c, got)
            assert got.stride() == (c * c + c).stride()
    assert _compiles() == before + 2  # one `mul`, one `add`, for every rank and dense layout
    if _hostmem_native():
        assert _native_executions() > native
    # A shape that differs in a static property keys apart and compiles, never runs the 1-D kernel.
    b = torch.randn(6, 8)
    other = [lambda t: t * t[0],                  # broadcasting
             lambda t: t[:, 1:4] * t[:, 1:4],    # not dense
             lambda t: t[:0] * t[:0],            # empty
             lambda t: t.double() * t.double()]  # another dtype (plus the conversion's own)
    for f in other:
        before = _compiles()
        assert_same(f(b), f(b.to(DEV)))
        assert _compiles() > before


def _hostmem_native() -> bool:
    from neuron_runtime._native import _hostmem

    return _hostmem.NATIVE is not None


def test_ranked_class_entries_of_a_runtime_without_flat_classes_still_load(rt: _runtime.Runtime,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    flat_class = _shapes.flat_class
    monkeypatch.setattr(_shapes, "flat_class", lambda sig: None)  # a runtime before the rule
    _runtime.reset_runtime()
    x = torch.randn(3, 4)
    assert_same(x.exp(), x.to(DEV).exp())
    assert _compiles() == 1
    monkeypatch.setattr(_shapes, "flat_class", flat_class)
    _runtime.reset_runtime()
    y = torch.randn(5, 6)
    assert_same(y.exp(), y.to(DEV).exp())  # a new shape of the ranked class: its entry on disk serves it
    s = neuron_runtime.stats()
    assert _compiles() == 0 and s["hits"]["local"] == 1
    z = torch.randn(2, 3, 5)
    assert_same(z.exp(), z.to(DEV).exp())  # another rank: the flat class compiles, once
    assert _compiles() == 1


def test_lengths_that_collide_with_the_model_s_dims_compile_almost_nothing(rt: _runtime.Runtime) -> None:
    """Trained at lengths 8 (= the head dim), 12, 16 (batch x length = hidden), ..., 32 (= hidden): after the
    first length, at most 10 % of its compiles again (issue 32 measured 86 % with the older rule)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from _models import Decoder, train_decoder  # the model benchmarks/shapes.py --collide measures on aoti

    torch.manual_seed(0)
    counts = [_compiles()]
    train_decoder(Decoder(vocab=64, d=32, heads=4).to(DEV), (8, 12, 16, 20, 24, 28, 32, 36), vocab=64,
                  on_length=lambda t: counts.append(_compiles()))
    per_length = [b - a for a, b in zip(counts, counts[1:])]
    assert per_length[0] > 20 and sum(per_length[1:]) <= 0.1 * per_length[0], per_length


def test_attention_classes_keep_the_op_s_size_relations_so_the_second_shape_is_checked() -> None:
    """q, k, v, out and grad_out share batch and heads, q/out/grad_out their length, k and v theirs; the
    class's second shape keeps that, so CPU's flash kernels compute on it what the math does (its meta
    and CPU kernels accept any sizes: drawn independently, the second check compared garbage)."""
    b, h, t, e = 2, 4, 8, 8  # the length equals the head dim: a coincidence, not a relation
    # q, k, v as a fused QKV projection gives them: slices of one [b, t, 3 * h * e] tensor (the head dim
    # is inside a slice's row, so it stays literal; the length must not, though it is equal to it)
    q, k, v = (z.view(b, t, h, e).transpose(1, 2) for z in torch.randn(b, t, 3 * h * e).split(h * e, -1))
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True)
    grad = torch.randn_like(out)
    fwd = cls_of("aten::_scaled_dot_product_flash_attention_for_cpu", q, k, v, 0.0, True)
    bwd = cls_of("aten::_scaled_dot_product_flash_attention_for_cpu_backward", grad, q, k, v, out, lse, 0.0, True)
    for cls in (fwd, bwd):
        sizes = {name: d["sizes"] for name, _, d in cls["args"] if isinstance(d, dict) and "sizes" in d}
        assert isinstance(sizes["query"][2], str) and isinstance(sizes["key"][2], str), sizes  # lengths
        assert sizes["query"][:3] == sizes["key"][:2] + [sizes["query"][2]] != sizes["key"][:3], sizes
        assert sizes["key"][2] == sizes["value"][2] and sizes["query"][3] == sizes["key"][3] == e
    other = {name: d["sizes"] for name, _, d in _shapes.other_instance(bwd)["args"]
             if isinstance(d, dict) and "sizes" in d}
    assert other["grad_out"] == other["out"] and other["query"][:3] == other["out"][:3] == other["logsumexp"]
    q2, k2, v2 = (torch.randn(other[n], requires_grad=True) for n in ("query", "key", "value"))
    o2, lse2 = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q2, k2, v2, 0.0, True)
    g2 = torch.randn(other["grad_out"])
    got = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        g2, q2.detach(), k2.detach(), v2.detach(), o2.detach(), lse2, 0.0, True)
    want = torch.autograd.grad(torch.ops.aten._scaled_dot_product_attention_math(q2, k2, v2, is_causal=True)[0],
                               (q2, k2, v2), g2)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)

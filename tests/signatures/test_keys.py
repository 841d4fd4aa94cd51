"""What a key leaves out (neuron_runtime/signatures/_signature.py, docs/dispatch.md "What a key leaves out"):
pure signature checks, nothing compiled. A decode loop's `ids[:, -1:]` of a buffer that grows by one column
per token, empty tensors, storage offsets; and what must stay in (a layout PyTorch reads)."""

from __future__ import annotations

import json
import random

import torch

from neuron_runtime.executables import parse_line
from neuron_runtime.signatures import _ops, _shapes, _signature


def sig_of(op: str, *values: object) -> dict:  # type: ignore[type-arg]
    return _signature.build(_ops.classify(op), values)


def key_of(op: str, *values: object) -> str:
    return _signature.cache_key(sig_of(op, *values), {})


def real_strides(t: torch.Tensor) -> list[int]:
    """The strides that address memory (those of dims larger than 1)."""
    return [s for s, n in zip(t.stride(), t.shape) if n > 1]


def test_a_decode_loops_last_column_keys_the_same_at_every_position() -> None:
    # `generate` adds one column per token to its ids and reads `ids[:, -1:]`: a [1, 1] view whose size-1
    # row has stride 9, 10, 11, ... (issue 43: two new executables per token on main).
    one = torch.ones(1, 1, dtype=torch.long)
    keys = {key_of("aten::add.Tensor", one, torch.zeros(1, n, dtype=torch.long)[:, -1:], 1) for n in range(8, 40)}
    keys |= {key_of("aten::isin.Tensor_Tensor", torch.zeros(1, n, dtype=torch.long)[:, -1:], one, False, False)
             for n in range(8, 40)}
    assert len(keys) == 2
    # The canonical strides are a fresh tensor's: a contiguous tensor's signature (and so every entry
    # already cached for one) is what it always was.
    assert sig_of("aten::add.Tensor", one, torch.zeros(1, 9, dtype=torch.long)[:, -1:], 1) == \
        sig_of("aten::add.Tensor", one, torch.zeros(1, 1, dtype=torch.long), 1)


def test_size_one_strides_and_empty_tensors_are_canonical_and_real_strides_stay() -> None:
    cs = _signature.canonical_strides
    for sizes in ([2, 1, 3], [1, 4], [4, 1], [1], [1, 1, 1], [3, 2], [0, 5], [2, 0, 1]):
        fresh = list(torch.empty(sizes).stride())
        assert cs(sizes, fresh) == fresh  # what torch gives a new tensor is canonical already
    assert cs([2, 1, 3], [3, 99, 1]) == [3, 3, 1]
    assert cs([3, 1, 2], [1, 7, 3]) == [1, 6, 3]  # a transposed tensor keeps its real strides
    assert cs([4, 1], [14, 1]) == [14, 1]  # a row stride (a slice of a wider buffer) addresses memory: kept
    assert cs([0, 5], [1, 0]) == [5, 1]  # nothing is addressed in an empty tensor
    x = torch.zeros(6, 0)
    assert key_of("aten::neg", x) == key_of("aten::neg", x.t().contiguous().t())


def test_storage_offsets_and_row_positions_key_alike() -> None:
    buf = torch.randn(10, 8)
    assert len({key_of("aten::mul.Tensor", buf[i:i + 3], buf[i + 1:i + 4]) for i in range(5)}) == 1
    assert len({key_of("aten::add.Tensor", buf[i], buf[0], 1) for i in range(5)}) == 1
    # A column slice's row stride is a real layout: it stays in the key.
    assert key_of("aten::neg", buf[:, 1:3]) != key_of("aten::neg", buf[:, 1:3].contiguous())


def test_a_layout_pytorch_guesses_from_size_one_strides_stays_in_the_key() -> None:
    # [N, C, 1, 1] with strides [C, 1, C, C] is channels_last to `suggest_memory_format`, and a convolution
    # then returns channels_last: that guess must survive canonical strides (random layouts, against
    # eager's own answer, with the output layout as the witness).
    rng = random.Random(0)
    w = torch.randn(3, 2, 1, 1)
    for _ in range(40):
        sizes = [rng.choice([1, 1, 2, 3]), 2, rng.choice([1, 1, 2]), rng.choice([1, 1, 2])]
        perm = rng.sample(range(4), 4)
        strides, step = [0] * 4, 1
        for d in reversed(perm):
            strides[d], step = step, step * sizes[d]
        strides = [rng.choice([1, 2, 3, 6, 12]) if n == 1 and rng.random() < .7 else s for n, s in zip(sizes, strides)]
        canon = _signature.canonical_strides(sizes, strides)
        assert _signature.canonical_strides(sizes, canon) == canon
        buf = torch.randn(100)
        a, b = buf.as_strided(sizes, strides), buf.as_strided(sizes, canon)
        assert torch.equal(a, b)
        assert real_strides(torch.conv2d(a, w)) == real_strides(torch.conv2d(b, w)), (sizes, strides, canon)
    cl = torch.empty(4, 2, 1, 1).as_strided([4, 2, 1, 1], [2, 1, 2, 2])
    assert cl.is_contiguous() and torch.conv2d(cl, w).is_contiguous(memory_format=torch.channels_last)
    assert key_of("aten::neg", cl) != key_of("aten::neg", torch.empty(4, 2, 1, 1))  # the fresh one: [2, 1, 1, 1]


def test_a_class_and_a_record_of_an_older_runtime_key_as_this_runtimes_calls() -> None:
    old = sig_of("aten::add.Tensor", torch.ones(1, 1, dtype=torch.long), torch.zeros(1, 1, dtype=torch.long), 1)
    old["args"][1][2]["strides"] = [17, 1]  # what a runtime before canonical strides recorded
    new = parse_line(json.dumps({"signature": old}))
    assert new["args"][1][2]["strides"] == [1, 1]
    assert new == sig_of("aten::add.Tensor", torch.ones(1, 1, dtype=torch.long),
                         torch.zeros(1, 30, dtype=torch.long)[:, -1:], 1)
    # A length in a decode loop: its class is the same at every position (the example is not keyed).
    # (An elementwise op: its class needs no probe of meta kernels, whose first use costs seconds.)
    one = torch.ones(1, 1, dtype=torch.long)
    classes = [_shapes.classes(sig_of("aten::add.Tensor", torch.zeros(1, 40, dtype=torch.long)[:, :n], one, 1))
               for n in range(9, 20)]
    assert all(len(c) == 1 for c in classes)
    assert len({_signature.cache_key(c[0], {}) for c in classes}) == 1


def packed_key(op: str, *values: object) -> str | None:
    cls = _shapes.packed_class(sig_of(op, *values))
    return None if cls is None else _signature.cache_key(cls, {})


def test_small_row_slices_of_any_row_stride_share_one_packed_class() -> None:
    # Batch 4 with left padding: `ids[:, -1:]` is a [4, 1] slice whose row stride is the buffer's width,
    # one more every token; its packed class describes it contiguous, so every width finds one executable.
    one = torch.ones(1, 1, dtype=torch.long)
    keys = {packed_key("aten::add.Tensor", one, torch.zeros(4, w, dtype=torch.long)[:, -1:], 1) for w in (8, 9, 30)}
    keys |= {packed_key("aten::add.Tensor", one, torch.zeros(4, 1, dtype=torch.long), 1)}  # no: not a slice
    assert len(keys) == 2 and None in keys
    cls = _shapes.packed_class(sig_of("aten::add.Tensor", one, torch.zeros(4, 9, dtype=torch.long)[:, -1:], 1))
    assert cls is not None and _shapes.example(cls)["args"][1][2]["strides"] == [1, 1]
    assert _shapes.other_instance(cls)["args"][1][2]["strides"] == [1, 1]
    assert _shapes.classes(sig_of("aten::add.Tensor", one, torch.zeros(4, 9, dtype=torch.long)[:, -1:], 1))[0] == cls


def test_what_a_packed_class_must_not_serve() -> None:
    big = torch.zeros(8, 1024)[:, :600]  # 4800 elements: over the copy bound, keeps its literal-stride class
    assert packed_key("aten::neg", big) is None and packed_key("aten::neg", torch.zeros(8, 64)[:, :60]) is not None
    assert packed_key("aten::neg", torch.zeros(64, 8)[:, :6].t()) is None  # not row-major: a copy reorders
    assert packed_key("aten::neg_", torch.zeros(4, 9)[:, -1:]) is None  # writes its argument
    assert packed_key("aten::alias", torch.zeros(4, 9)[:, -1:]) is None  # returns a view of it

"""Greedy `generate` on `neuron` compiles nothing per token once its first call compiled (issue 43;
reference tier; the full measurement is benchmarks/decode.py)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import neuron_runtime


@pytest.fixture(scope="module")
def models() -> tuple[LlamaForCausalLM, LlamaForCausalLM]:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    cpu = LlamaForCausalLM(cfg).eval()
    dev = LlamaForCausalLM(cfg).eval()
    dev.load_state_dict(cpu.state_dict())
    return cpu, dev.to("neuron")


@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_decode_compiles_nothing_per_token_and_equals_cpu(models: tuple[LlamaForCausalLM, LlamaForCausalLM],
                                                                 batch: int) -> None:
    # Batch 4 is left-padded: its `ids[:, -1:]` is a [4, 1] slice whose row stride grows by one every token
    # (served by one packed class, signatures/_packed.py), and its cache positions an `arange` of a new end.
    cpu, dev = models
    ids = torch.randint(3, 64, (batch, 5), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(batch, 5, dtype=torch.long)
    for row in range(1, batch):
        ids[row, :row], mask[row, :row] = 0, 0

    def gen(model: LlamaForCausalLM, device: str, n: int) -> torch.Tensor:
        with torch.no_grad():
            return model.generate(ids.to(device), attention_mask=mask.to(device), max_new_tokens=n,
                                  min_new_tokens=n, do_sample=False, pad_token_id=0).cpu()

    first = gen(dev, "neuron", 3)
    before = neuron_runtime.stats()["compiles"]
    later = gen(dev, "neuron", 9)  # positions 8..13: each was a new key for `ids[:, -1:]` ops before
    assert neuron_runtime.stats()["compiles"] - before == 0
    assert torch.equal(first, gen(cpu, "cpu", 3)) and torch.equal(later, gen(cpu, "cpu", 9))


def test_arange_of_a_new_length_compiles_nothing_and_equals_cpu() -> None:
    # A decode loop's `arange(past, past + n)` (cache positions) has a new end every token: a factory whose
    # output size is its values was one compile per length (issue 43); it is filled on the host now.
    before = neuron_runtime.stats()["compiles"]
    for end in range(9, 14):
        assert torch.equal(torch.arange(end, device="neuron").cpu(), torch.arange(end))
        assert torch.equal(torch.arange(end - 1, end + 3, 2, device="neuron", dtype=torch.float32).cpu(),
                           torch.arange(end - 1, end + 3, 2, dtype=torch.float32))
    assert neuron_runtime.stats()["compiles"] - before == 0


def test_arange_on_neuron_is_one_call_not_empty_resize_and_copy() -> None:
    # `torch.arange(..., device="neuron")` has its own kernel (aten/_decomp.py `_host_factory`; natively fastpath.cpp HOST_FACTORY): the composite
    # (an empty neuron tensor, `arange.out`, resize_, then the range copied in) cost a decode step three
    # runtime calls per arange (issue 43). CPU's own arange runs empty and resize_ too, never a copy.
    cases = [((7,), {}), ((2, 9), {}), ((1, 8, 3), {"dtype": torch.float32}), ((0.5, 3.0), {}),
             ((5,), {"dtype": torch.float16})]
    for args, kw in cases:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            got = torch.arange(*args, device="neuron", **kw)
        names = {e.name for e in prof.events()}
        assert "aten::arange" in names and "aten::copy_" not in names, names
        want = torch.arange(*args, **kw)
        assert got.device.type == "neuron" and got.dtype == want.dtype and torch.equal(got.cpu(), want)
    x = torch.arange(3.0, device="neuron", requires_grad=True)
    assert x.requires_grad and x.is_leaf
    with pytest.raises(RuntimeError, match="does not exist"):
        torch.arange(3, device="neuron:1")


def test_static_cache_decodes_new_lengths_with_no_compile_and_equals_cpu(
        models: tuple[LlamaForCausalLM, LlamaForCausalLM]) -> None:
    # `cache_implementation="static"`: Hugging Face compiles the decode step with torch.compile, and each
    # new maximum length is a new graph (its cache `[1, 1, L, 16]`, and L in the graph's size arguments).
    # One graph class serves every L (signatures rule 3b), and the prefill's attention against the cache's
    # first rows one packed class (issue 43).
    cpu, dev = models
    ids = torch.randint(3, 64, (1, 5), generator=torch.Generator().manual_seed(2))

    def gen(model: LlamaForCausalLM, device: str, n: int) -> torch.Tensor:
        with torch.no_grad():
            return model.generate(ids.to(device), attention_mask=torch.ones_like(ids).to(device), max_new_tokens=n,
                                  min_new_tokens=n, do_sample=False, pad_token_id=0,
                                  cache_implementation="static").cpu()

    torch._dynamo.reset()
    try:
        first = gen(dev, "neuron", 3)
        before = neuron_runtime.stats()
        later = [gen(dev, "neuron", n) for n in (6, 11)]  # cache lengths 10 and 15: new graphs
        after = neuron_runtime.stats()
    finally:
        torch._dynamo.reset()
    assert after["graphs"]["graphs"] > before["graphs"]["graphs"]  # new lengths were new graphs
    assert after["compiles"] - before["compiles"] == 0
    assert torch.equal(first, gen(cpu, "cpu", 3))
    assert all(torch.equal(got, gen(cpu, "cpu", n)) for got, n in zip(later, (6, 11)))

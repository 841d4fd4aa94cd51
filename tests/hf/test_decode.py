"""Greedy `generate` on `neuron` compiles nothing per token once its first call compiled (issue 43;
reference tier; the full measurement is benchmarks/decode.py)."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import neuron_runtime


def test_greedy_decode_compiles_nothing_per_token_and_equals_cpu() -> None:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    cpu = LlamaForCausalLM(cfg).eval()
    dev = LlamaForCausalLM(cfg).eval()
    dev.load_state_dict(cpu.state_dict())
    dev.to("neuron")
    ids = torch.randint(3, 64, (1, 5), generator=torch.Generator().manual_seed(1))

    def gen(model: LlamaForCausalLM, device: str, n: int) -> torch.Tensor:
        with torch.no_grad():
            return model.generate(ids.to(device), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                  pad_token_id=0).cpu()

    first = gen(dev, "neuron", 3)
    before = neuron_runtime.stats()["compiles"]
    later = gen(dev, "neuron", 9)  # positions 8..13: each was a new key for `ids[:, -1:]` ops before
    assert neuron_runtime.stats()["compiles"] - before == 0
    assert torch.equal(first, gen(cpu, "cpu", 3)) and torch.equal(later, gen(cpu, "cpu", 9))

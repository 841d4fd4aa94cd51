"""PEFT's LoRA and TRL's SFTTrainer on the `neuron` device, as their docs use them (no device code)."""

from __future__ import annotations

import torch
from datasets import Dataset
from transformers import PreTrainedTokenizerFast, Trainer

from hf_helpers import lm_dataset, tiny_model, train_args


def test_lora_training_updates_only_the_adapters_on_neuron(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny_model(), LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"],
                                                     lora_dropout=0.0, task_type="CAUSAL_LM"))
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    args = train_args(tmp_path, use_cpu=False, max_steps=3, save_strategy="no", learning_rate=1e-2)
    Trainer(model=model, args=args, train_dataset=lm_dataset(rows=12)).train()
    assert {p.device.type for p in model.parameters()} == {"neuron"}
    changed = {k for k, v in model.named_parameters() if not torch.equal(v.detach().cpu(), before[k].cpu())}
    adapters = {k for k, v in model.named_parameters() if v.requires_grad}
    assert adapters and all("lora_" in k for k in adapters)
    assert changed == adapters  # every adapter (lora_B starts at zero) and nothing else


def _word_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer built in memory (no download): <pad>=0, <eos>=1, <unk>=2, w0..w60."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{f"w{i}": i + 3 for i in range(61)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def test_trl_sft_trainer_runs_an_epoch_on_neuron(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from trl import SFTConfig, SFTTrainer

    texts = [" ".join(f"w{(i * 7 + j) % 61}" for j in range(12)) for i in range(8)]
    args = SFTConfig(output_dir=str(tmp_path), num_train_epochs=1, per_device_train_batch_size=4, report_to=[],
                     disable_tqdm=True, save_strategy="no", max_length=16, logging_steps=1, seed=0)
    assert args.device == torch.device("neuron:0")
    assert args.pad_to_multiple_of == 128  # TRL's own setting for neuron (static shapes)
    model = tiny_model()
    trainer = SFTTrainer(model=model, args=args, train_dataset=Dataset.from_dict({"text": texts}),
                         processing_class=_word_tokenizer())
    first = model.transformer.wte.weight.detach().cpu().clone()
    out = trainer.train()
    assert out.global_step == 2 and trainer.state.epoch == 1.0
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 2 and all(0 < loss < 10 for loss in losses)
    assert {p.device.type for p in model.parameters()} == {"neuron"}
    assert not torch.equal(first, model.transformer.wte.weight.detach().cpu())

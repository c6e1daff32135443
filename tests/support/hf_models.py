"""Tiny Hugging Face models built from configs (no download) and one training step, for the tests
that publish real checkpoints (transformers is in the dev extra)."""

from __future__ import annotations

import torch


def tiny_llama() -> torch.nn.Module:
    """A 2-layer Llama with grouped-query attention and tied embeddings (transformers leaves
    lm_head.weight out of the checkpoint; vLLM has no lm_head parameter then)."""
    import transformers

    cfg = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
        max_position_embeddings=128,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg)


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    """One optimizer step on a fixed random batch of the step (language-model loss, vocab 512)."""
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, 512, (2, 16), generator=g)
    model.train()
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()

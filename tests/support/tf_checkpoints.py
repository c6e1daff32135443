"""A tiny Llama checkpoint directory with a byte-level tokenizer built locally (never downloaded), for the
transformers engine's tests: config.json, generation_config.json, bf16 model.safetensors (tied
embeddings, as transformers saves them), tokenizer.json and tokenizer_config.json with a chat template
(the demo's tokenizer, daemon/demo_llama.py)."""

from __future__ import annotations

from pathlib import Path

import torch

from patchswarm.daemon.demo_llama import CHAT_TEMPLATE, SPECIALS, write_tokenizer

__all__ = ["CHAT_TEMPLATE", "SPECIALS", "VOCAB", "tiny_llama_bf16", "write_checkpoint", "write_tokenizer"]

VOCAB = 300  # 256 bytes + 5 specials, and rows no token reaches


def tiny_llama_bf16(seed: int = 0, tie: bool = True) -> torch.nn.Module:
    import transformers

    cfg = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=128,
        tie_word_embeddings=tie,
        bos_token_id=256,
        eos_token_id=257,
    )
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():  # larger weights than the init's: logits that differ clearly between tokens
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.2)
    return model.to(torch.bfloat16)


def write_checkpoint(d: Path, model: torch.nn.Module) -> Path:
    """``save_pretrained`` (bf16 config and weights) plus the tokenizer files."""
    d.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(d)
    write_tokenizer(d)
    return d

"""A tiny Llama checkpoint directory with a byte-level tokenizer built locally (never downloaded), for the
transformers engine's tests: config.json, generation_config.json, bf16 model.safetensors (tied
embeddings, as transformers saves them), tokenizer.json and tokenizer_config.json with a chat template."""

from __future__ import annotations

import json
from pathlib import Path

import torch

SPECIALS = ["<|bos|>", "<|eos|>", "<|system|>", "<|user|>", "<|assistant|>"]
VOCAB = 300  # 256 bytes + 5 specials, and rows no token reaches
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|eos|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


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


def write_tokenizer(d: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet(), key=lambda c: bytes_of(c))
    vocab = {c: i for i, c in enumerate(alphabet)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<|bos|>",
                "eos_token": "<|eos|>",
                "add_bos_token": False,
                "chat_template": CHAT_TEMPLATE,
            }
        )
    )


def bytes_of(c: str) -> int:
    """The byte a ByteLevel alphabet character stands for (GPT-2's table: printable bytes map to themselves)."""
    o = ord(c)
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    if o in printable:
        return o
    missing = [b for b in range(256) if b not in printable]
    return missing[o - 256]


def write_checkpoint(d: Path, model: torch.nn.Module) -> Path:
    """``save_pretrained`` (bf16 config and weights) plus the tokenizer files."""
    d.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(d)
    write_tokenizer(d)
    return d

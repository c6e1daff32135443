"""Tiny Hugging Face models built from configs (no download), trained a step at a time and published
per step, for the tests that publish real checkpoints and serve them (transformers is in the dev extra)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

from patchswarm.daemon.checkpoint import read_checkpoint
from patchswarm.daemon.demo_llama import write_tokenizer


def tiny_llama_config(*, vocab: int = 512, tie: bool = True, **extra: Any) -> Any:
    """The tests' one tiny Llama: 2 layers, hidden 64, grouped-query attention (4 heads, 2 KV heads),
    128 positions; ``extra``: other LlamaConfig fields (token ids)."""
    import transformers

    return transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=vocab,
        max_position_embeddings=128,
        tie_word_embeddings=tie,
        **extra,
    )


def tiny_llama() -> torch.nn.Module:
    """The tiny Llama with tied embeddings (transformers leaves lm_head.weight out of the checkpoint;
    vLLM has no lm_head parameter then), float32, seed 0."""
    import transformers

    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(tiny_llama_config())


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    """One optimizer step on a fixed random batch of the step (language-model loss, vocab 512)."""
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, 512, (2, 16), generator=g)
    model.train()
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()


class Training:
    """``tiny_llama`` trained with AdamW, one ``train_step`` per version, each saved as a checkpoint
    (``out/step<k>``) and published from it, as a trainer publishes."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.model = tiny_llama()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3)

    def publish(self, publisher: Any, step: int) -> Path:
        train_step(self.model, self.opt, step)
        saved = self.out / f"step{step}"
        self.model.save_pretrained(saved)
        ck = read_checkpoint(saved)
        publisher.publish(ck.tensors, metadata=ck.metadata())
        return saved

    def engine_dir(self, d: Path, step: int = 1) -> Path:
        """What ``patchswarm engine transformers --checkpoint`` takes: the trainer's config files (float32:
        the engine serves the store's dtype) and the byte-level tokenizer, no weights."""
        d.mkdir(parents=True)
        for name in ("config.json", "generation_config.json"):
            shutil.copyfile(self.out / f"step{step}" / name, d / name)
        write_tokenizer(d)
        return d

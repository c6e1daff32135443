"""A tiny Llama checkpoint directory with a byte-level tokenizer built locally (never downloaded), for the
transformers engine's tests: config.json, generation_config.json, bf16 model.safetensors (tied
embeddings, as transformers saves them), tokenizer.json and tokenizer_config.json with a chat template
(the demo's tokenizer, daemon/demo_llama.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

from patchswarm.daemon.demo_llama import CHAT_TEMPLATE, SPECIALS, write_tokenizer
from tests.support.daemonkit import ROOT
from tests.support.hf_models import tiny_llama_config

__all__ = [
    "CHAT_TEMPLATE",
    "SPECIALS",
    "VOCAB",
    "start_engine_cli",
    "tiny_llama_bf16",
    "write_checkpoint",
    "write_tokenizer",
]

VOCAB = 300  # 256 bytes + 5 specials, and rows no token reaches


def tiny_llama_bf16(seed: int = 0, tie: bool = True) -> torch.nn.Module:
    import transformers

    cfg = tiny_llama_config(vocab=VOCAB, tie=tie, bos_token_id=256, eos_token_id=257)
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


def start_engine_cli(checkpoint: Path, socket: str, port: int, log: Path, *extra: str) -> subprocess.Popen[bytes]:
    """``patchswarm engine transformers`` serving ``checkpoint``'s model from the daemon at ``socket``
    on 127.0.0.1:``port``, its output in ``log``; ``extra``: more of its options."""
    args = ["engine", "transformers", "--checkpoint", str(checkpoint), "--daemon", socket,
            "--listen", f"127.0.0.1:{port}", *extra]  # fmt: skip
    with open(log, "wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "patchswarm.daemon.cli", *args],
            cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=dict(os.environ),
        )  # fmt: skip

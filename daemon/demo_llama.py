"""The demo's model: a small Llama built by transformers from a config (nothing downloaded), a
byte-level tokenizer built locally with ``tokenizers`` (chat template in tokenizer_config.json),
and its training: a short supervised warm-up on a handful of chat facts (so that answers are
readable), then RL-like policy-gradient steps at a small learning rate.

The optimizer is AdamW over FP32 master weights; each version is served as bf16 under the
Hugging Face names, ``lm_head.weight`` left out as tied (as ``save_pretrained`` leaves it), with
the checkpoint's config.json and generation_config.json in the signed metadata
(``checkpoint.files``, docs/models.md), as ``patchswarm publish DIR`` would carry them.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from patchswarm.daemon.checkpoint import Checkpoint

SPECIALS = ["<|bos|>", "<|eos|>", "<|system|>", "<|user|>", "<|assistant|>"]
BOS, EOS = 256, 257
USER, ASSISTANT = 259, 260
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|eos|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
TIED = [("lm_head.weight", "model.embed_tokens.weight")]
# The toy task: questions and their answers, learnt by heart in the warm-up.
FACTS = [
    ("What does patchswarm ship?", "weight patches"),
    ("Capital of France?", "Paris"),
    ("Capital of Japan?", "Tokyo"),
    ("Colour of the sky?", "blue"),
    ("What is 2+3?", "5"),
    ("Opposite of hot?", "cold"),
    ("Largest planet?", "Jupiter"),
    ("Fastest land animal?", "the cheetah"),
]
PRESETS = {"tiny": (64, 128), "small": (128, 256)}  # hidden, intermediate (2 layers either way)


def llama_config(preset: str) -> Any:
    import transformers

    hidden, ff = PRESETS[preset]
    return transformers.LlamaConfig(
        hidden_size=hidden,
        intermediate_size=ff,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=264,  # 256 bytes + 5 specials, rounded up
        max_position_embeddings=128,
        tie_word_embeddings=True,
        bos_token_id=BOS,
        eos_token_id=EOS,
    )


def write_tokenizer(d: Path) -> None:
    """tokenizer.json (byte-level: token i is byte i, then the specials) and tokenizer_config.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet(), key=byte_of)
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    tok.save(str(d / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|bos|>",
        "eos_token": "<|eos|>",
        "add_bos_token": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (d / "tokenizer_config.json").write_text(json.dumps(config))


def byte_of(c: str) -> int:
    """The byte a ByteLevel alphabet character stands for (GPT-2's table: printable bytes map to themselves)."""
    o = ord(c)
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    if o in printable:
        return o
    return [b for b in range(256) if b not in printable][o - 256]


def chat_ids(question: str, answer: str | None = None) -> list[int]:
    """CHAT_TEMPLATE rendered and tokenized by hand (a byte-level vocabulary: ids are the bytes)."""
    ids = [USER, *question.encode(), EOS, ASSISTANT]
    return ids if answer is None else [*ids, *answer.encode(), EOS]


def _batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every fact as one padded row: input ids, attention mask, and labels (the answer and its eos only)."""
    rows = [(chat_ids(q), chat_ids(q, a)) for q, a in FACTS]
    width = max(len(full) for _, full in rows)
    ids = torch.full((len(rows), width), EOS)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    labels = torch.full((len(rows), width), -100)
    for i, (prompt, full) in enumerate(rows):
        ids[i, : len(full)] = torch.tensor(full)
        mask[i, : len(full)] = 1
        labels[i, len(prompt) : len(full)] = torch.tensor(full[len(prompt) :])
    return ids, mask, labels


@dataclass
class Trainer:
    """The model (FP32 master weights), its AdamW and the published form of each version."""

    model: Any
    opt: torch.optim.AdamW

    @classmethod
    def build(cls, preset: str, seed: int = 0) -> Trainer:
        import transformers

        torch.manual_seed(seed)
        auto: Any = transformers.AutoModelForCausalLM
        model = auto.from_config(llama_config(preset), dtype=torch.float32)
        return cls(model, torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0))

    def warm_up(self, steps: int = 300, lr: float = 3e-3, good_enough: float = 0.03) -> float:
        """Supervised steps on the facts until the loss is under ``good_enough`` (seconds on a CPU)."""
        ids, mask, labels = _batch()
        self._set_lr(lr)
        loss = float("inf")
        self.model.train()
        for _ in range(steps):
            out = self.model(input_ids=ids, attention_mask=mask, labels=labels)
            out.loss.backward()
            self.opt.step()
            self.opt.zero_grad()
            loss = float(out.loss.detach())
            if loss < good_enough:
                break
        return loss

    def rl_step(self, step: int, lr: float = 1e-6) -> float:
        """A policy-gradient step (GRPO-like, teacher forced: one forward pass): a token sampled at every
        answer position earns reward 1 when it is the answer's; loss ``-advantage * log p(sample)``."""
        ids, mask, labels = _batch()
        self._set_lr(lr)
        self.model.train()
        logits = self.model(input_ids=ids, attention_mask=mask).logits[:, :-1]
        target, where = labels[:, 1:], labels[:, 1:] != -100
        logp = F.log_softmax(logits.float(), dim=-1)
        g = torch.Generator().manual_seed(step)
        sample = torch.multinomial(logp[where].exp(), 1, generator=g).squeeze(1)
        reward = (sample == target[where]).float()
        adv = (reward - reward.mean()) / (reward.std() + 1e-6)
        loss = -(adv * logp[where].gather(1, sample[:, None]).squeeze(1)).mean()
        loss.backward()  # type: ignore[no-untyped-call]
        self.opt.step()
        self.opt.zero_grad()
        return float(reward.mean())

    def _set_lr(self, lr: float) -> None:
        for group in self.opt.param_groups:
            group["lr"] = lr

    def served(self) -> dict[str, torch.Tensor]:
        """The version as served: bf16 under the Hugging Face names, the tied lm_head left out."""
        tied = {alias for alias, _ in TIED}
        return {n: t.detach().to(torch.bfloat16) for n, t in self.model.state_dict().items() if n not in tied}

    def metadata(self) -> dict[str, str]:
        """checkpoint.files (config.json as served: bf16) and checkpoint.tied, as read_checkpoint gives them."""
        config = json.loads(self.model.config.to_json_string())
        config["dtype"] = "bfloat16"
        gen = self.model.generation_config.to_json_string()
        files = {"config.json": json.dumps(config, indent=2, sort_keys=True) + "\n", "generation_config.json": gen}
        return Checkpoint({}, files, list(TIED)).metadata()

    def write_engine_dir(self, d: Path) -> Path:
        """What ``patchswarm engine transformers --checkpoint`` needs: config files and the tokenizer."""
        d.mkdir(parents=True, exist_ok=True)
        for name, text in json.loads(self.metadata()["checkpoint.files"]).items():
            (d / name).write_text(text)
        write_tokenizer(d)
        return d


def train(preset: str, steps: int, on_version: Callable[[int, Trainer], None], rl_lr: float = 1e-6) -> Trainer:
    """Warm-up (version 1), then ``steps`` RL-like steps, each handed to ``on_version``."""
    trainer = Trainer.build(preset)
    trainer.warm_up()
    on_version(0, trainer)
    for i in range(1, steps + 1):
        trainer.rl_step(i, rl_lr)
        on_version(i, trainer)
    return trainer

"""The demo's model (daemon/demo_llama.py) and its daemon config text (daemon/demo.py)."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from patchswarm.daemon.checkpoint import FILES_KEY, TIED_KEY
from patchswarm.daemon.demo import TomlValue, toml_text
from patchswarm.daemon.demo_llama import FACTS, Trainer, chat_ids

transformers = pytest.importorskip("transformers")


def test_hand_tokenized_chat_is_what_the_tokenizer_and_its_template_give(tmp_path: Path) -> None:
    trainer = Trainer.build("tiny")
    d = trainer.write_engine_dir(tmp_path / "engine")
    tok = transformers.AutoTokenizer.from_pretrained(d)
    for question, answer in FACTS[:3]:
        msgs = [{"role": "user", "content": question}]
        prompt = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        assert tok.encode(prompt, add_special_tokens=False) == chat_ids(question)
        full = tok.apply_chat_template([*msgs, {"role": "assistant", "content": answer}], tokenize=False)
        assert tok.encode(full, add_special_tokens=False) == chat_ids(question, answer)
        assert tok.decode(chat_ids(question, answer)[len(chat_ids(question)) : -1]) == answer


def test_served_version_is_bf16_hf_names_with_its_config_in_the_metadata(tmp_path: Path) -> None:
    trainer = Trainer.build("tiny")
    served, meta = trainer.served(), trainer.metadata()
    assert "lm_head.weight" not in served and "model.embed_tokens.weight" in served
    assert {t.dtype for t in served.values()} == {torch.bfloat16}
    assert json.loads(meta[TIED_KEY]) == [["lm_head.weight", "model.embed_tokens.weight"]]
    config = json.loads(json.loads(meta[FILES_KEY])["config.json"])
    assert config["dtype"] == "bfloat16" and config["tie_word_embeddings"] is True
    # The config rebuilds a model whose tensors are the served ones, name for name and shape for shape.
    rebuilt = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**config))
    want = {n: tuple(t.shape) for n, t in rebuilt.state_dict().items() if n != "lm_head.weight"}
    assert want == {n: tuple(t.shape) for n, t in served.items()}


def test_rl_steps_move_the_fp32_master_weights_a_little() -> None:
    """AdamW at lr 1e-6 moves no weight by much more than the learning rate (its steps are about lr in size)."""
    trainer = Trainer.build("tiny")
    trainer.warm_up(steps=3)
    before = {n: t.detach().clone() for n, t in trainer.model.state_dict().items()}
    trainer.rl_step(1, lr=1e-6)
    after = trainer.model.state_dict()
    delta = max(float((after[n] - before[n]).abs().max()) for n in before)
    assert 0 < delta < 1e-5


def test_daemon_config_text_reads_back_as_the_sections_it_was_made_of() -> None:
    sections: dict[str, dict[str, str | int | float | bool | list[str]]] = {
        "node": {"name": "host-1", "listen": "127.0.0.1:0"},
        "swarm": {"bootstrap": ["http://127.0.0.1:1", 'a "quoted" \\ path'], "x": 3, "y": 0.5},
        "sidecar": {"enabled": True, "commit_mode": "in_place"},
    }
    assert tomllib.loads(toml_text(sections)) == sections


@given(
    st.dictionaries(
        st.from_regex(r"[a-z_]{1,8}", fullmatch=True),
        st.dictionaries(
            st.from_regex(r"[a-z_]{1,8}", fullmatch=True),
            st.text(max_size=20) | st.booleans() | st.integers(-(2**40), 2**40) | st.lists(st.text(max_size=8)),
            max_size=4,
        ),
        max_size=4,
    )
)
def test_any_flat_sections_survive_the_toml_text(sections: dict[str, dict[str, TomlValue]]) -> None:
    assert tomllib.loads(toml_text(sections)) == sections

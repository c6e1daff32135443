"""``--checkpoint DIR`` files the transformers engine cannot use (a broken tokenizer.json, config values
transformers refuses or cannot build, ten million layers) are one ModelMismatch line (a UserError in the
CLI), never another exception nor a build that runs for hours."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from patchswarm.daemon.tf_engine import StaticWeights, TfEngine
from patchswarm.daemon.tf_model import ModelMismatch
from tests.support.tf_checkpoints import tiny_llama_bf16, write_checkpoint

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def good(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("tf") / "good", tiny_llama_bf16(seed=2))


def _config(**values: object) -> Callable[[Path], None]:
    def edit(d: Path) -> None:
        cfg = json.loads((d / "config.json").read_text())
        (d / "config.json").write_text(json.dumps({**cfg, **values}))

    return edit


BROKEN: dict[str, tuple[Callable[[Path], None], str]] = {
    "tokenizer_without_fields": (
        lambda d: (d / "tokenizer.json").write_text('{"version": "1.0", "model": 42}'),
        "the tokenizer files cannot be read",
    ),
    "tokenizer_not_utf8": (lambda d: (d / "tokenizer.json").write_bytes(b"\xff\x00"), "the tokenizer files"),
    "tokenizer_config_not_json": (lambda d: (d / "tokenizer_config.json").write_text("{nope"), "the tokenizer files"),
    "hidden_size_a_string": (_config(hidden_size="64"), "transformers cannot read it"),
    "negative_vocab": (_config(vocab_size=-5), "transformers cannot build the model"),
    "ten_million_layers": (_config(num_hidden_layers=10**7), "num_hidden_layers is 10000000"),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_a_broken_checkpoint_dir_is_one_model_mismatch_line(good: Path, tmp_path: Path, case: str) -> None:
    edit, message = BROKEN[case]
    bad = tmp_path / case
    shutil.copytree(good, bad)
    edit(bad)
    weights = StaticWeights.from_checkpoint(good)  # the store is right: only DIR's files are not
    with pytest.raises(ModelMismatch, match=message) as err:
        TfEngine(weights, bad, threaded=False)
    assert "\n" not in str(err.value) and len(str(err.value)) < 500

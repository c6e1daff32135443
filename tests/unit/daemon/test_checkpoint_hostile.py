"""A signed-but-hostile publisher's checkpoint metadata, and hostile weights, on real files: the writer
(pull --to DIR, export.dir) and store.plan = auto bound and check it, refuse in one line, and never
write outside the target; fp16/fp8 refuse weights they cannot hold faithfully (issue 33 review)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from patchswarm.daemon.checkpoint import FILES_KEY, QUANT_KEY, TIED_KEY, CheckpointError, plain_file_name
from patchswarm.daemon.checkpoint_writer import MAX_FILES, write_checkpoint
from patchswarm.daemon.rank_plans import PlanRefused, resolve_plan
from patchswarm.daemon.served_format import ServedFormat, check_fp16
from patchswarm.protocol.errors import PatchswarmError
from patchswarm.protocol.served import ServedModel


def model(metadata: dict[str, str]) -> ServedModel:
    t = {"model.embed_tokens.weight": torch.ones(8, 4, dtype=torch.bfloat16), "model.norm.weight": torch.ones(4)}
    return ServedModel.from_tensors(t, metadata)


def files(**named: str) -> dict[str, str]:
    return {FILES_KEY: json.dumps(named)}


BAD_NAMES = [
    "../x.json",
    "/etc/passwd",
    "/tmp/abs.json",
    "a/b.json",
    "a\\b.json",
    ".hidden.json",
    "..json",
    "x.txt",
    "config.json.sh",
    ".json",
    "model.safetensors.index.json",  # would make the reader look for shards the writer did not write
    "con\x1bfig.json",
    "config\u202e.json",  # right-to-left override: shows as another name
    "zero\u200bwidth.json",
    "x" * 300 + ".json",
]


@pytest.mark.parametrize("name", BAD_NAMES)
def test_file_names_from_the_board_are_plain_json_names_or_refused(tmp_path: Path, name: str) -> None:
    out = tmp_path / "out"
    with pytest.raises(CheckpointError, match=r"not a plain \.json file name") as e:
        write_checkpoint(model(files(**{"config.json": "{}", name: "{}"})), out)
    assert "\n" not in str(e.value)
    assert sorted(os.listdir(tmp_path)) == []  # nothing written, not even the temporary directory
    assert not plain_file_name(name, ".json")


def test_the_one_name_check_accepts_what_checkpoints_hold() -> None:
    for good in ("config.json", "generation_config.json", "tokenizer_config.json"):
        assert plain_file_name(good, ".json")
    assert plain_file_name("model-00001-of-00002.safetensors", ".safetensors")
    assert not plain_file_name("config.json", ".safetensors")


@pytest.mark.parametrize(
    ("metadata", "words"),
    [
        (files(**{f"f{i}.json": "{}" for i in range(MAX_FILES + 1)}), "more than the 16 allowed"),
        (files(**{"config.json": '{"a": "' + "x" * (300 << 10) + '"}'}), "bytes of files, more than"),
        ({FILES_KEY: "[" * 100_000 + "]" * 100_000}, "nested deeper"),
        ({FILES_KEY: '{"config.json": "{}", "config.json": "{}"}'}, "appears twice"),
        (files(**{"config.json": "[" * 5000 + "]" * 5000}), "nested deeper"),
        (files(**{"config.json": "{}"}) | {QUANT_KEY: '{"a":' * 10_000 + "1" + "}" * 10_000}, "nested deeper"),
        (files(**{"config.json": "{}"}) | {QUANT_KEY: '{"a": "' + "x" * (100 << 10) + '"}'}, "more than"),
        (files(**{"config.json": "{}"}) | {QUANT_KEY: "[1]"}, "expected a JSON object"),
        ({TIED_KEY: json.dumps([["lm_head.weight", "model.embed_tokens.weight"]] * 2000)}, "at most 1024"),
        ({TIED_KEY: json.dumps([["model.norm.weight", "model.embed_tokens.weight"]])}, "is in the version"),
        ({TIED_KEY: json.dumps([["lm_head.weight", "missing.weight"]])}, "source 'missing.weight' is not"),
        ({TIED_KEY: json.dumps([["lm\x00head", "model.embed_tokens.weight"]])}, "is not a tensor name"),
    ],
    ids=[
        "too-many-files",
        "files-too-large",
        "deep-files",
        "duplicate-file",
        "deep-config",
        "deep-quant",
        "huge-quant",
        "quant-not-object",
        "too-many-tied",
        "tied-alias-held",
        "tied-source-missing",
        "tied-control-char",
    ],
)
def test_hostile_checkpoint_metadata_is_refused_before_anything_is_written(
    tmp_path: Path, metadata: dict[str, str], words: str
) -> None:
    with pytest.raises(CheckpointError, match=words) as e:
        write_checkpoint(model(metadata), tmp_path / "out")
    assert "\n" not in str(e.value) and len(str(e.value)) < 400
    assert os.listdir(tmp_path) == []


def test_a_directory_of_json_files_is_not_a_checkpoint_to_replace(tmp_path: Path) -> None:
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "data.json").write_text("{}")
    with pytest.raises(CheckpointError, match="not a checkpoint; refusing"):
        write_checkpoint(model({}), tmp_path / "notes")
    assert os.listdir(tmp_path / "notes") == ["data.json"]
    (tmp_path / "empty").mkdir()
    write_checkpoint(model({}), tmp_path / "empty")  # an empty directory is fine
    write_checkpoint(model({}), tmp_path / "empty")  # and so is a checkpoint, replaced
    assert os.listdir(tmp_path / "empty") == ["model.safetensors"]


SPECS = model({}).specs


@pytest.mark.parametrize(
    "metadata",
    [
        {FILES_KEY: "[" * 100_000 + "]" * 100_000},  # was RecursionError: a status reason with no store.plan
        files(**{"config.json": "[" * 100_000 + "]" * 100_000}),
        files(**{"config.json": '{"model_type": "llama", "model_type": "qwen3_moe"}'}),
        {FILES_KEY: json.dumps({"../config.json": "{}"})},
        {FILES_KEY: '{"config.json": 5}'},
    ],
    ids=["deep-files", "deep-config", "duplicate-model-type", "bad-name", "not-text"],
)
def test_store_plan_auto_refuses_hostile_board_config_in_one_line(metadata: dict[str, str]) -> None:
    with pytest.raises(PlanRefused, match=r"store\.plan: the board's config\.json") as e:
        resolve_plan("auto", 2, SPECS, metadata)
    assert "\n" not in str(e.value)


def test_fp16_range_check_is_not_skipped_by_a_nan() -> None:
    # amax of a tensor holding NaN is NaN, and NaN > 65504 is False: 1e38 became inf unseen
    with pytest.raises(PatchswarmError, match="beyond fp16's range"):
        check_fp16("w", torch.tensor([float("nan"), 1e38]))
    check_fp16("w", torch.tensor([float("nan"), float("inf"), 1.0]))  # NaN and inf stay as they are
    with pytest.raises(ValueError, match="beyond fp16's range"):  # still a ValueError for old callers
        ServedFormat("fp16").convert({"w": torch.tensor([[float("nan"), 7e4]])})


def test_fp8_refuses_nan_as_a_patchswarm_error() -> None:
    w = torch.ones(256, 256)
    w[3, 5] = float("nan")
    with pytest.raises(PatchswarmError, match="holds inf or NaN"):
        ServedFormat("fp8_e4m3", block=128).convert({"model.layers.0.mlp.up_proj.weight": w})

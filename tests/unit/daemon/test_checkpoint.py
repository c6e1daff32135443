"""Hugging Face checkpoints in and out: hostile indexes and shards are refused in one line, tied
embeddings ship once, and a written directory reads back bitwise (and replaces an old one whole)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import safetensors.torch
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from patchswarm.daemon import checkpoint_writer
from patchswarm.daemon.checkpoint import (
    INDEX_NAME,
    MAX_INDEX_BYTES,
    MAX_SMALL_FILES_BYTES,
    CheckpointError,
    parse_index,
    read_checkpoint,
    read_served,
)
from patchswarm.daemon.checkpoint_writer import export_version, shard_plan, write_checkpoint
from patchswarm.daemon.cli import main
from patchswarm.protocol.errors import PatchswarmError
from patchswarm.protocol.served import ServedModel

CONFIG = {"model_type": "llama", "tie_word_embeddings": True, "dtype": "float32", "vocab_size": 32}


def tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model.embed_tokens.weight": torch.randn(32, 16, generator=g),
        "model.layers.0.mlp.up_proj.weight": torch.randn(24, 16, generator=g),
        "model.layers.0.input_layernorm.weight": torch.randn(16, generator=g),
        "model.norm.weight": torch.randn(16, generator=g),
        "model.layers.0.step": torch.tensor([seed], dtype=torch.int64),
    }


def save_sharded(d: Path, ts: dict[str, torch.Tensor], config: dict[str, object] | None = None) -> dict[str, str]:
    """A checkpoint as transformers lays it out: two shards, an index, config.json."""
    d.mkdir(parents=True, exist_ok=True)
    names = sorted(ts)
    split = {
        n: ("model-00001-of-00002.safetensors" if i % 2 else "model-00002-of-00002.safetensors")
        for i, n in enumerate(names)
    }
    for shard in set(split.values()):
        safetensors.torch.save_file(
            {n: ts[n] for n in names if split[n] == shard}, d / shard, metadata={"format": "pt"}
        )
    (d / INDEX_NAME).write_text(json.dumps({"metadata": {"total_size": 1}, "weight_map": split}))
    (d / "config.json").write_text(json.dumps(CONFIG if config is None else config))
    (d / "generation_config.json").write_text('{"bos_token_id": 1}')
    return split


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return sorted(a) == sorted(b) and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


# ---------------------------------------------------------------- reading


def test_a_sharded_checkpoint_reads_whole_with_its_files_and_ties(tmp_path: Path) -> None:
    ts = tensors()
    save_sharded(tmp_path / "ck", ts)
    ck = read_checkpoint(tmp_path / "ck")
    assert same(ck.tensors, ts)
    assert ck.tied == [("lm_head.weight", "model.embed_tokens.weight")]
    assert json.loads(ck.files["config.json"]) == CONFIG and set(ck.files) == {"config.json", "generation_config.json"}
    md = ck.metadata()
    assert json.loads(md["checkpoint.tied"]) == [["lm_head.weight", "model.embed_tokens.weight"]]
    assert json.loads(md["checkpoint.files"])["generation_config.json"] == '{"bos_token_id": 1}'


def test_one_file_directory_and_bare_file(tmp_path: Path) -> None:
    ts = tensors()
    (tmp_path / "one").mkdir()
    safetensors.torch.save_file(ts, tmp_path / "one" / "model.safetensors")
    assert same(read_checkpoint(tmp_path / "one").tensors, ts)
    assert read_checkpoint(tmp_path / "one").files == {}
    ck = read_checkpoint(tmp_path / "one" / "model.safetensors")
    assert same(ck.tensors, ts) and ck.metadata() == {}
    with pytest.raises(CheckpointError, match=re.escape("no model.safetensors.index.json or model.safetensors")):
        read_checkpoint(tmp_path)


def test_a_tied_lm_head_equal_to_the_embedding_ships_once(tmp_path: Path) -> None:
    ts = tensors()
    ts["lm_head.weight"] = ts["model.embed_tokens.weight"].clone()
    save_sharded(tmp_path / "ck", ts)
    ck = read_checkpoint(tmp_path / "ck")
    assert "lm_head.weight" not in ck.tensors and ck.tied == [("lm_head.weight", "model.embed_tokens.weight")]


def test_a_tied_config_with_a_different_lm_head_is_refused(tmp_path: Path) -> None:
    ts = tensors()
    ts["lm_head.weight"] = ts["model.embed_tokens.weight"].clone()
    ts["lm_head.weight"][3, 4] += 1
    save_sharded(tmp_path / "ck", ts)
    with pytest.raises(CheckpointError, match=re.escape("tie_word_embeddings is true but lm_head.weight differs")):
        read_checkpoint(tmp_path / "ck")


@pytest.mark.parametrize(
    "config", [{"tie_word_embeddings": False}, {}, {"text_config": {"tie_word_embeddings": False}}], ids=str
)
def test_an_untied_lm_head_is_kept(tmp_path: Path, config: dict[str, object]) -> None:
    ts = tensors()
    ts["lm_head.weight"] = torch.randn(32, 16)
    save_sharded(tmp_path / "ck", ts, config)
    ck = read_checkpoint(tmp_path / "ck")
    assert same(ck.tensors, ts) and ck.tied == []


def test_text_config_tie_flag_is_read(tmp_path: Path) -> None:
    save_sharded(tmp_path / "ck", tensors(), {"text_config": {"tie_word_embeddings": True}})
    assert read_checkpoint(tmp_path / "ck").tied == [("lm_head.weight", "model.embed_tokens.weight")]


# ---------------------------------------------------------------- hostile indexes and shards


def rewrite_index(d: Path, weight_map: dict[str, object]) -> None:
    (d / INDEX_NAME).write_text(json.dumps({"weight_map": weight_map}))


@pytest.mark.parametrize(
    "shard",
    [
        "../outside.safetensors",
        "/etc/outside.safetensors",
        "sub/model.safetensors",
        ".hidden.safetensors",
        "model.bin",
        "",
        "a\\b.safetensors",
        "x\n.safetensors",
        5,
        None,
    ],
)
def test_shard_names_that_leave_the_directory_are_refused(tmp_path: Path, shard: object) -> None:
    split = save_sharded(tmp_path / "ck", tensors())
    safetensors.torch.save_file(tensors(), tmp_path / "outside.safetensors")  # what an escape would reach
    split = {**split, "model.norm.weight": shard}  # type: ignore[dict-item]
    rewrite_index(tmp_path / "ck", split)
    with pytest.raises(CheckpointError, match=re.escape("not a .safetensors file name in this directory")):
        read_checkpoint(tmp_path / "ck")


def test_a_missing_shard_is_named(tmp_path: Path) -> None:
    save_sharded(tmp_path / "ck", tensors())
    (tmp_path / "ck" / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match=re.escape("shard model-00002-of-00002.safetensors is missing")):
        read_checkpoint(tmp_path / "ck")


def test_a_tensor_named_twice_in_the_index_is_refused(tmp_path: Path) -> None:
    save_sharded(tmp_path / "ck", tensors())
    text = '{"weight_map": {"model.norm.weight": "model-00001-of-00002.safetensors", '
    text += '"model.norm.weight": "model-00002-of-00002.safetensors"}}'
    (tmp_path / "ck" / INDEX_NAME).write_text(text)
    with pytest.raises(CheckpointError, match=re.escape("'model.norm.weight' appears twice")):
        read_checkpoint(tmp_path / "ck")


def test_a_tensor_in_two_shards_is_refused(tmp_path: Path) -> None:
    ts = tensors()
    split = save_sharded(tmp_path / "ck", ts)
    first = "model-00001-of-00002.safetensors"
    other = next(n for n, s in split.items() if s != first)
    held = {n: ts[n] for n, s in split.items() if s == first} | {other: ts[other]}
    safetensors.torch.save_file(held, tmp_path / "ck" / first)
    with pytest.raises(CheckpointError, match=f"holds tensor '{other}', but the index puts it in"):
        read_checkpoint(tmp_path / "ck")


def test_a_shard_holding_a_tensor_the_index_does_not_name_is_refused(tmp_path: Path) -> None:
    split = save_sharded(tmp_path / "ck", tensors())
    del split["model.norm.weight"]
    rewrite_index(tmp_path / "ck", split)  # type: ignore[arg-type]
    with pytest.raises(
        CheckpointError, match=re.escape("holds tensor 'model.norm.weight', but the index does not name it")
    ):
        read_checkpoint(tmp_path / "ck")


def test_a_tensor_the_index_places_in_a_shard_that_lacks_it_is_refused(tmp_path: Path) -> None:
    split = save_sharded(tmp_path / "ck", tensors())
    rewrite_index(tmp_path / "ck", {**split, "model.extra.weight": "model-00001-of-00002.safetensors"})
    with pytest.raises(
        CheckpointError, match=re.escape("puts tensor 'model.extra.weight' here, but the shard lacks it")
    ):
        read_checkpoint(tmp_path / "ck")


def test_oversized_index_and_config_and_fifo_are_refused_before_reading(tmp_path: Path) -> None:
    save_sharded(tmp_path / "ck", tensors())
    with open(tmp_path / "ck" / INDEX_NAME, "r+b") as fh:
        fh.truncate(MAX_INDEX_BYTES + 1)  # sparse: the size is refused from fstat, nothing read
    with pytest.raises(CheckpointError, match="more than"):
        read_checkpoint(tmp_path / "ck")
    save_sharded(tmp_path / "ck2", tensors())
    (tmp_path / "ck2" / "config.json").write_text(json.dumps({"pad": "x" * MAX_SMALL_FILES_BYTES}))
    with pytest.raises(CheckpointError, match="config files may hold 256 KiB together"):
        read_checkpoint(tmp_path / "ck2")
    save_sharded(tmp_path / "ck3", tensors())
    (tmp_path / "ck3" / INDEX_NAME).unlink()
    os.mkfifo(tmp_path / "ck3" / INDEX_NAME)
    with pytest.raises(CheckpointError, match="not a regular file"):
        read_checkpoint(tmp_path / "ck3")
    save_sharded(tmp_path / "ck4", tensors())
    (tmp_path / "ck4" / "config.json").write_text("[1, 2]")
    with pytest.raises(CheckpointError, match="not a JSON object"):
        read_checkpoint(tmp_path / "ck4")


@pytest.fixture(scope="module")
def valid_ck(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, bytes, dict[str, torch.Tensor]]:
    d = tmp_path_factory.mktemp("valid") / "ck"
    ts = tensors()
    save_sharded(d, ts)
    return d, (d / INDEX_NAME).read_bytes(), ts


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_corrupted_index_reads_the_same_tensors_or_is_refused(
    valid_ck: tuple[Path, bytes, dict[str, torch.Tensor]], data: st.DataObject
) -> None:
    d, good, ts = valid_ck
    raw = bytearray(good)
    for _ in range(data.draw(st.integers(1, 4))):
        op = data.draw(st.sampled_from(["flip", "cut", "insert"]))
        i = data.draw(st.integers(0, len(raw)))
        if op == "flip" and i < len(raw):
            raw[i] ^= 1 << data.draw(st.integers(0, 7))
        elif op == "cut":
            del raw[i : i + data.draw(st.integers(1, 40))]
        else:
            raw[i:i] = data.draw(st.sampled_from([b'"', b"/", b"..", b"{", b"]", b",", b"\\u0000", b"1e999", b"\xff"]))
    (d / INDEX_NAME).write_bytes(bytes(raw))
    try:
        ck = read_checkpoint(d)
    except PatchswarmError:
        return
    finally:
        (d / INDEX_NAME).write_bytes(good)
    assert same(ck.tensors, ts)  # an index that still reads places every tensor where it is


JSONISH = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=30),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=30), inner, max_size=4),
    max_leaves=12,
)


@settings(max_examples=150, deadline=None)
@given(doc=st.dictionaries(st.sampled_from(["weight_map", "metadata", "x"]), JSONISH, max_size=3))
def test_parse_index_refuses_any_malformed_document_in_one_error(doc: dict[str, object]) -> None:
    try:
        wm = parse_index(json.dumps(doc).encode())
    except CheckpointError as e:
        assert "\n" not in str(e)
        return
    assert all(v.endswith(".safetensors") and "/" not in v and not v.startswith(".") for v in wm.values())


# ---------------------------------------------------------------- writing


def served(seed: int = 0, **extra: str) -> ServedModel:
    ck_files = {"config.json": json.dumps(CONFIG), "generation_config.json": "{}"}
    md = {
        "checkpoint.files": json.dumps(ck_files),
        "checkpoint.tied": json.dumps([["lm_head.weight", "model.embed_tokens.weight"]]),
        "served.format": "bf16",
    } | extra
    ts = {n: t.to(torch.bfloat16) if t.is_floating_point() else t for n, t in tensors(seed).items()}
    return ServedModel.from_tensors(ts, md)


def test_written_checkpoint_reads_back_bitwise_with_its_config(tmp_path: Path) -> None:
    m = served(extra_key="x")
    w = write_checkpoint(m, tmp_path / "out", max_shard_bytes=1000)
    assert len(w.shards) >= 2 and (tmp_path / "out" / INDEX_NAME).is_file()
    index = json.loads((tmp_path / "out" / INDEX_NAME).read_text())
    assert index["metadata"]["total_size"] == m.nbytes and sorted(index["weight_map"]) == [s.name for s in m.specs]
    back = read_served(tmp_path / "out")
    assert back.bitwise_equal(m)
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["dtype"] == "bfloat16" and cfg["tie_word_embeddings"] is True and "quantization_config" not in cfg
    assert json.loads(back.metadata["checkpoint.tied"]) == json.loads(m.metadata["checkpoint.tied"])
    one = write_checkpoint(m, tmp_path / "one")
    assert one.shards == ["model.safetensors"] and not (tmp_path / "one" / INDEX_NAME).exists()
    assert read_served(tmp_path / "one").bitwise_equal(m)


def test_quantization_config_and_torch_dtype_are_merged(tmp_path: Path) -> None:
    files = {"config.json": json.dumps({"torch_dtype": "float32", "model_type": "llama"})}
    q = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    m = served(**{"checkpoint.files": json.dumps(files), "served.format": "fp8_e4m3"})
    m.metadata["served.quantization_config"] = json.dumps(q)
    write_checkpoint(m, tmp_path / "out")
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["quantization_config"] == q and cfg["torch_dtype"] == cfg["dtype"] == "bfloat16"


def test_shard_plan_is_greedy_in_name_order() -> None:
    specs = served().specs
    for limit in (1, 64, 700, 1 << 30):
        plan = shard_plan(reversed(specs), limit)
        assert [s for shard in plan for s in shard] == sorted(specs, key=lambda s: s.name)
        assert all(len(p) == 1 or sum(s.nbytes for s in p) <= limit for p in plan)
        assert plan == shard_plan(specs, limit)


@pytest.mark.parametrize("name", ["../x.json", ".hidden.json", "a/b.json", INDEX_NAME, "x.txt"])
def test_hostile_file_names_in_metadata_are_refused(tmp_path: Path, name: str) -> None:
    m = served(**{"checkpoint.files": json.dumps({name: "{}"})})
    with pytest.raises(CheckpointError, match=re.escape("not a plain .json file name")):
        write_checkpoint(m, tmp_path / "out")
    assert not (tmp_path / "out").exists() and list(tmp_path.iterdir()) == []


def test_replacing_is_whole_or_not_at_all(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "out"
    write_checkpoint(served(1), out, max_shard_bytes=1000)
    write_checkpoint(served(2), out)  # fewer files: the old shards must not linger
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json", "model.safetensors"]
    assert read_served(out).bitwise_equal(served(2))

    def fail(path: Path, data: bytes) -> None:
        raise OSError(28, "No space left on device", str(path))

    monkeypatch.setattr(checkpoint_writer, "_write_file", fail)
    with pytest.raises(OSError, match="No space"):
        write_checkpoint(served(3), out)
    assert read_served(out).bitwise_equal(served(2)) and sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_a_directory_with_other_files_or_a_file_is_not_replaced(tmp_path: Path) -> None:
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointError, match=re.escape("holds 'notes.txt', which is not a checkpoint file")):
        write_checkpoint(served(), tmp_path / "home")
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError, match="not a directory"):
        write_checkpoint(served(), tmp_path / "file")
    assert (tmp_path / "home" / "notes.txt").read_text() == "mine" and (tmp_path / "file").read_text() == "x"


def test_export_keeps_the_last_two_and_points_current_at_the_newest(tmp_path: Path) -> None:
    (tmp_path / "v0.tmp-0123456789ab").mkdir(parents=True)  # what a crash mid-export left behind
    for v in (1, 2, 3):
        export_version(served(v), tmp_path, v)
        assert os.readlink(tmp_path / "current") == f"v{v}"
        assert read_served(tmp_path / "current").bitwise_equal(served(v))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["current", "v2", "v3"]


# ---------------------------------------------------------------- the command line


def test_diff_and_apply_take_checkpoint_directories(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    save_sharded(tmp_path / "a", tensors(0))
    save_sharded(tmp_path / "b", tensors(1))
    assert main(["diff", str(tmp_path / "a"), str(tmp_path / "b"), "-o", str(tmp_path / "p.psw")]) == 0
    assert main(["apply", str(tmp_path / "a"), str(tmp_path / "p.psw"), "-o", str(tmp_path / "out")]) == 0
    assert "checkpoint" not in capsys.readouterr().err
    assert same(read_checkpoint(tmp_path / "out").tensors, tensors(1))
    assert json.loads((tmp_path / "out" / "config.json").read_text())["tie_word_embeddings"] is True
    assert main(["apply", str(tmp_path / "a"), str(tmp_path / "p.psw"), "-o", str(tmp_path / "f.safetensors")]) == 0
    assert (tmp_path / "f.safetensors").is_file() and same(
        read_checkpoint(tmp_path / "f.safetensors").tensors, tensors(1)
    )


def test_publish_names_the_served_format_and_refuses_a_stray_fp8_block(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    save_sharded(tmp_path / "ck", tensors())
    assert main(["keygen", "-o", str(tmp_path / "k")]) == 0
    assert main(["keygen", "-o", str(tmp_path / "root"), "--root"]) == 0
    certify = ["--root", str(tmp_path / "root"), "--key", str(tmp_path / "k.pub"), "--run-id", "r"]
    assert main(["certify", *certify, "--board", str(tmp_path / "board")]) == 0
    common = [str(tmp_path / "ck"), "--board", str(tmp_path / "board"), "--key", str(tmp_path / "k"), "--run-id", "r"]
    capsys.readouterr()
    assert main(["publish", *common, "--fp8-block", "128"]) == 1
    assert "--fp8-block applies to --served-format fp8-e4m3 only" in capsys.readouterr().err
    assert main(["publish", *common, "--served-format", "fp16"]) == 0
    assert "(served fp16)" in capsys.readouterr().out
    assert (
        main(
            [
                "pull",
                "--from",
                str(tmp_path / "board"),
                "--run",
                "r",
                "--trust",
                str(tmp_path / "root.pub"),
                "--to",
                str(tmp_path / "got"),
            ]
        )
        == 0
    )
    got = read_served(tmp_path / "got")
    assert {s.dtype for s in got.specs} == {"F16", "I64"}
    assert json.loads((tmp_path / "got" / "config.json").read_text())["dtype"] == "float16"

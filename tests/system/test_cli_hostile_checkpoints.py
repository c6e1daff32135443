"""The CLI (real processes, real files) against hostile checkpoint directories, hostile weights, hostile
output targets and a signed-but-hostile publisher's checkpoint metadata: every refusal is one line on
stderr, exit code 1, no traceback or "internal error", nothing partial written, nothing outside the
target (issue 33 review)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from patchswarm.daemon.checkpoint import FILES_KEY
from tests.support.swarmkit import RUN, Swarm

S1, S2, IDX = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "model.safetensors.index.json"


def cli(*args: str, cwd: Path, prefix: str = "") -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "patchswarm.daemon.cli", *args]
    if prefix:  # e.g. a resource limit for the CLI's own process
        cmd = ["bash", "-c", f'{prefix}; exec "$@"', "cli", *cmd]
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=120)


def one_line_failure(r: subprocess.CompletedProcess[str], words: str) -> None:
    err = r.stderr.strip()
    assert r.returncode == 1, (r.returncode, r.stdout, err)
    assert len(err.splitlines()) == 1 and "Traceback" not in err and "internal error" not in err, err
    assert words in err, err


def checkpoint(d: Path, tensors: dict[str, torch.Tensor] | None = None) -> Path:
    d.mkdir()
    g = torch.Generator().manual_seed(0)
    t = tensors or {
        "model.embed_tokens.weight": torch.randn(64, 32, generator=g).bfloat16(),
        "model.layers.0.mlp.up_proj.weight": torch.randn(64, 32, generator=g).bfloat16(),
        "model.norm.weight": torch.ones(32).bfloat16(),
    }
    first = {k: v for k, v in t.items() if "embed" in k}
    rest = {k: v for k, v in t.items() if "embed" not in k}
    save_file(first, d / S1, metadata={"format": "pt"})
    save_file(rest, d / S2, metadata={"format": "pt"})
    wm = {k: S1 for k in first} | {k: S2 for k in rest}
    (d / IDX).write_text(json.dumps({"metadata": {"total_size": 1}, "weight_map": wm}))
    (d / "config.json").write_text(json.dumps({"model_type": "llama", "tie_word_embeddings": False}))
    return d


def _replace(name: str, make: Callable[[Path], None]) -> Callable[[Path], None]:
    def go(d: Path) -> None:
        (d / name).unlink()
        make(d / name)

    return go


def _replace_shard(make: Callable[[Path], None]) -> Callable[[Path], None]:
    return _replace(S1, make)


def _edit_index(old: str, new: str) -> Callable[[Path], None]:
    def go(d: Path) -> None:
        text = (d / IDX).read_text()
        assert old in text
        (d / IDX).write_text(text.replace(old, new, 1))

    return go


HOSTILE_DIRS: dict[str, tuple[Callable[[Path], None], str]] = {
    "shard-fifo": (_replace_shard(os.mkfifo), "missing or not a file"),
    "shard-dir": (_replace_shard(os.mkdir), "missing or not a file"),
    "shard-symlink-to-device": (_replace_shard(lambda p: os.symlink("/dev/zero", p)), "missing or not a file"),
    "shard-symlink-to-text": (_replace_shard(lambda p: os.symlink("/etc/hostname", p)), "not a readable safetensors"),
    "shard-huge-header": (
        _replace_shard(lambda p: p.write_bytes((1 << 62).to_bytes(8, "little") + b"{}")),
        "not a readable safetensors",
    ),
    "index-fifo": (_replace(IDX, os.mkfifo), "not a regular file"),
    "index-nan": (_edit_index('"total_size": 1', '"total_size": NaN'), "NaN is not a JSON number"),
    "index-inf": (_edit_index('"total_size": 1', '"total_size": 1e999'), "beyond a float's range"),
    "index-huge-int": (_edit_index('"total_size": 1', '"total_size": 1' + "0" * 5000), "not JSON"),
    "index-deep": (lambda d: (d / IDX).write_text("[" * 100_000 + "]" * 100_000), "nested deeper"),
    "index-duplicate": (
        _edit_index('"weight_map": {', f'"weight_map": {{"model.norm.weight": "{S1}", '),
        "appears twice",
    ),
    "index-non-string": (_edit_index(f'"{S1}"', "5"), "not a .safetensors file name"),
    "index-dotdot": (_edit_index(f'"{S1}"', f'"../ck/{S1}"'), "not a .safetensors file name"),
    "index-control-name": (_edit_index("model.norm.weight", "model.norm\\u001b[2J.weight"), "is not a tensor name"),
    "index-bidi-shard": (_edit_index(f'"{S1}"', '"a\\u202eb.safetensors"'), "not a .safetensors file name"),
    "config-list": (lambda d: (d / "config.json").write_text("[1]"), "not a JSON object"),
    "config-huge": (lambda d: (d / "config.json").write_text('{"a":"' + "x" * (1 << 20) + '"}'), "allowed"),
    "config-deep": (lambda d: (d / "config.json").write_text('{"a":' + "[" * 9000 + "]" * 9000 + "}"), "nested"),
    "config-fifo": (_replace("config.json", os.mkfifo), "a FIFO"),
}


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("hostile")
    checkpoint(d / "ck")
    r = cli("keygen", "-o", "key", cwd=d)
    assert r.returncode == 0, r.stderr
    r = cli("diff", "ck", "ck", "-o", "p.psw", "--key", "key", cwd=d)
    assert r.returncode == 0, r.stderr
    return d


@pytest.mark.slow  # ~3 s a case (a CLI process each)
@pytest.mark.parametrize("case", list(HOSTILE_DIRS))
def test_hostile_checkpoint_directories_are_refused_in_one_line(work: Path, case: str) -> None:
    make, words = HOSTILE_DIRS[case]
    d = work / f"h-{case}"
    shutil.copytree(work / "ck", d)
    make(d)
    r = cli("diff", d.name, "ck", "-o", f"{case}.psw", cwd=work)
    one_line_failure(r, words)
    assert not (work / f"{case}.psw").exists()


@pytest.mark.parametrize(
    ("fmt", "value", "words"),
    [
        ("fp8-e4m3", float("nan"), "holds inf or NaN: fp8 e4m3 cannot serve it"),  # was "internal error"
        ("fp8-e4m3", float("inf"), "holds inf or NaN"),
        ("fp16", float("nan"), "beyond fp16's range"),  # the NaN hid the 1e38 that became inf
    ],
)
def test_weights_a_served_format_cannot_hold_are_refused_in_one_line(
    tmp_path: Path, fmt: str, value: float, words: str
) -> None:
    w = torch.randn(256, 256)
    w[0, 0], w[1, 1] = value, 1e38
    checkpoint(tmp_path / "ck", {"model.embed_tokens.weight": torch.ones(8, 8), "model.layers.0.mlp.up_proj.weight": w})
    assert cli("keygen", "-o", "key", cwd=tmp_path).returncode == 0
    r = cli("publish", "ck", "--board", "board", "--key", "key", "--run-id", "r", "--served-format", fmt, cwd=tmp_path)
    one_line_failure(r, words)
    assert not (tmp_path / "board" / "runs").exists() or not list((tmp_path / "board" / "runs").rglob("*"))


def test_a_directory_of_json_files_is_not_replaced(work: Path) -> None:
    (work / "mine").mkdir()
    (work / "mine" / "settings.json").write_text('{"keep": true}')
    r = cli("apply", "ck", "p.psw", "-o", "mine", "--trust", "key.pub", cwd=work)
    one_line_failure(r, "is not a checkpoint; refusing to replace the directory")
    assert os.listdir(work / "mine") == ["settings.json"]


@pytest.mark.parametrize("out", ["link/", "afile/"])
def test_an_output_that_is_a_symlink_or_a_file_is_not_replaced(work: Path, out: str) -> None:
    (work / "victim").mkdir(exist_ok=True)
    (work / "victim" / "model.safetensors").write_bytes(b"theirs")
    if not (work / "link").is_symlink():
        os.symlink(work / "victim", work / "link")
    (work / "afile").write_text("x")
    r = cli("apply", "ck", "p.psw", "-o", out, "--trust", "key.pub", cwd=work)
    one_line_failure(r, "exists and is not a directory")
    assert (work / "victim" / "model.safetensors").read_bytes() == b"theirs"


def test_a_full_disk_leaves_nothing_and_names_the_target(work: Path) -> None:
    # RLIMIT_FSIZE (ulimit -f, 1 KiB blocks) stands in for a full disk without root: writes fail EFBIG
    r = cli("apply", "ck", "p.psw", "-o", "full/", "--trust", "key.pub", cwd=work, prefix="ulimit -f 4")
    one_line_failure(r, "full: File too large")
    assert not [n for n in os.listdir(work) if n.startswith("full")]


HOSTILE_FILES = {
    "dotdot": {"config.json": "{}", "../escape.json": "{}"},
    "absolute": {"config.json": "{}", "/tmp/escape.json": "{}"},
    "subdir": {"config.json": "{}", "a/b.json": "{}"},
    "hidden": {"config.json": "{}", ".hidden.json": "{}"},
    "not-json": {"config.json": "{}", "run.sh": "#!/bin/sh"},
    "too-many": {f"f{i}.json": "{}" for i in range(17)},
    "too-large": {"config.json": json.dumps({"a": "x" * (300 << 10)})},
    "deep-config": {"config.json": "[" * 50_000 + "]" * 50_000},
}


@pytest.mark.slow  # ~3 s a case
@pytest.mark.parametrize("case", list(HOSTILE_FILES))
def test_pull_to_a_directory_refuses_hostile_checkpoint_files(tmp_path: Path, case: str) -> None:
    sw = Swarm(tmp_path)
    assert sw.pub is not None
    sw.pub.publish(sw.weights, metadata={FILES_KEY: json.dumps(HOSTILE_FILES[case])})  # signed, hostile
    sw.pub.close()
    sw.root.save(tmp_path / "root.key")
    (tmp_path / "out").mkdir()
    before = sorted(os.listdir(tmp_path))
    r = cli("pull", "--from", "board", "--run", RUN, "--trust", "root.key.pub", "--to", "out/pulled/", cwd=tmp_path)
    one_line_failure(r, f"metadata {FILES_KEY}")
    assert sorted(os.listdir(tmp_path)) == before and os.listdir(tmp_path / "out") == []
    assert not Path("/tmp/escape.json").exists()

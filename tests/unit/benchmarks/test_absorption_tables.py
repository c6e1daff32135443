"""The generator of docs/research.md's absorption tables (benchmarks/absorption_tables.py): structure on
synthetic results, refusal of mixed payload formats and duplicate runs, and the docs' tables equal to its
output on docs/research-data."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from benchmarks.absorption_tables import TABLES, load, main, tables

ROOT = Path(__file__).resolve().parents[3]
STEPS = 12


def run(arch: str, regime: str, opt: str, scale: float) -> dict[str, Any]:
    def fmt(full: int) -> dict[str, Any]:
        changed = [scale * 0.01] * STEPS
        return {
            "changed": changed,
            "patch": [scale * 100.0] * STEPS,
            "bound": [scale * 50.0] * STEPS,
            "full_bytes": full,
            "anchor_bytes": full // 2,
            "union": [scale * 0.01 * (t + 1) for t in range(STEPS)],
            "catchup_changed": [scale * 0.02] * STEPS,
            "catchup_patch": [scale * 300.0] * STEPS,
            "catchup_bound": [scale * 200.0] * STEPS,
            "crossover": {"anchor_beats_chain": 7 if opt == "muon" else None},
        }

    formats = {"bf16": fmt(20000), "fp8": fmt(12000), "int4": fmt(6000)}
    formats["int4"]["patch"] = formats["int4"]["catchup_patch"] = []  # the bound only, as the study writes
    return {
        "arch": arch,
        "regime": regime,
        "optimizer": opt,
        "lr": 1e-6 * scale,
        "rms_ratio": {"mean": 1.0, "min": 0.999, "max": 1.001},
        "formats": formats,
    }


def write(d: Path, preset: str, runs: list[dict[str, Any]], payload_format: int | None = 2) -> None:
    cfg: dict[str, Any] = {"preset": preset}
    if payload_format is not None:
        cfg["payload_format"] = payload_format
    d.mkdir(parents=True)
    (d / "absorption.json").write_text(json.dumps({"config": cfg, "runs": runs}))


@pytest.fixture
def data(tmp_path: Path) -> Path:
    for preset, scale in (("small", 1.0), ("mid", 2.0)):
        write(tmp_path / f"{preset}-rl", preset, [run("llama", "rl", o, scale) for o in ("muon", "adamw")])
        write(tmp_path / f"{preset}-sft" / "qwen3moe", preset, [run("qwen3moe", "sft", "adamw", scale)])
    return tmp_path


def blocks(text: str) -> dict[str, list[str]]:
    """Generated tables by name: the comment line, then the table's lines."""
    out: dict[str, list[str]] = {}
    for chunk in text.split("<!-- absorption_tables ")[1:]:
        name = chunk.split(":", 1)[0]
        out[name] = ["<!-- absorption_tables " + chunk.split("\n", 1)[0]]
        out[name] += [line for line in chunk.splitlines()[1:] if line.startswith("|")]
    return out


def test_every_table_has_its_rows_and_a_cell_per_column(data: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(data)]) == 0
    got = blocks(capsys.readouterr().out)
    assert list(got) == list(TABLES)
    rows = {"small-step": 3, "small-chains": 9, "mid-rl-step": 2, "mid-rl-chains": 6}
    rows |= {"mid-sft-pretrain-step": 1, "mid-sft-pretrain-chains": 3}
    for name, lines in got.items():
        comment, header, rule, *body = lines
        assert "payload format 2" in comment and "not recorded" not in comment
        ncol = header.count(" | ") + 1
        assert rule == "|---" * ncol + "|"
        assert len(body) == rows[name], name
        assert all(b.count(" | ") + 1 == ncol for b in body), name
    # arch, regime, optimizer order; adamw before muon whatever the file's order
    assert [b.split(" | ")[2] for b in got["small-step"][3:]] == ["adamw", "muon", "adamw"]
    assert got["small-step"][3].startswith("| llama | RL | adamw | 1e-06 | 1.0000 (0.9990-1.0010) | 1% |")
    assert got["small-step"][3].endswith("| 0.5% | 0.833% | 0.833% | 2.00 / 2.00 |")
    assert f"| union@{STEPS} |" in got["small-chains"][1]
    assert got["small-chains"][3] == f"| llama | RL | adamw | bf16 | 10% | 12% | 2% | 0.25 | 0.03 | >{STEPS} |"
    assert got["small-chains"][8] == "| llama | RL | muon | int4 | 10% | 12% | 2% | 0.33 | 0.07 | 7 |"
    # mid cells: small -> **mid** of the same arch, regime and optimizer
    assert "| 1% → **2%** |" in got["mid-rl-step"][3]
    assert got["mid-rl-step"][3].endswith("| 12% / 12% / 12% → **24% / 24% / 24%** |")
    assert "small-rl" in got["mid-rl-step"][0] and "small-sft" not in got["mid-rl-step"][0]


def test_a_table_mixing_recorded_payload_formats_is_refused(
    data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write(data / "small-pretrain", "small", [run("llama", "pretrain", "adamw", 3.0)], payload_format=1)
    assert main([str(data), "--table", "small-step"]) == 2
    out = capsys.readouterr()
    assert out.out == "" and "payload formats [1, 2] mixed" in out.err and "small-pretrain: 1" in out.err
    # the mid RL tables do not read that file
    assert main([str(data), "--table", "mid-rl-step", "mid-rl-chains"]) == 0


def test_an_unrecorded_payload_format_is_named_not_guessed(data: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write(data / "old", "small", [run("llama", "pretrain", "adamw", 3.0)], payload_format=None)
    assert main([str(data), "--table", "small-step"]) == 0
    comment = capsys.readouterr().out.splitlines()[0]
    assert comment.endswith("; payload format 2, not recorded in old -->")


def test_a_run_in_two_files_is_refused(data: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write(data / "again", "mid", [run("llama", "rl", "adamw", 5.0)])
    assert main([str(data)]) == 2
    assert "mid-rl/absorption.json: run mid llama rl adamw also in again/absorption.json" in capsys.readouterr().err


def test_a_malformed_file_is_named(data: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = run("llama", "sft", "adamw", 1.0)
    del bad["formats"]["fp8"]["anchor_bytes"]
    write(data / "bad", "small", [bad])
    assert main([str(data)]) == 2
    err = capsys.readouterr().err
    assert "bad/absorption.json: not an absorption result" in err and "anchor_bytes" in err


@pytest.mark.parametrize(
    ("content", "said"),
    [
        (b"\xff\xfe", "not UTF-8"),
        (b'{"config": {"preset": "small", "preset": "mid"}, "runs": []}', "appears twice"),
        (b"[1, 2]", "not an absorption result"),
    ],
)
def test_a_hostile_file_gets_one_line(
    data: Path, capsys: pytest.CaptureFixture[str], content: bytes, said: str
) -> None:
    (data / "hostile").mkdir()
    (data / "hostile" / "absorption.json").write_bytes(content)
    assert main([str(data)]) == 2
    err = capsys.readouterr().err
    assert "hostile/absorption.json" in err and said in err and len(err.splitlines()) == 1


def test_a_missing_directory_or_document_gets_one_line(
    data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([str(tmp_path / "none")]) == 2
    assert main([str(data), "--write", str(tmp_path / "none.md")]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and "not a directory" in err[0] and "none.md" in err[1]
    assert not (tmp_path / "none.md").exists()


def test_write_replaces_each_table_under_its_comment_and_nothing_else(data: Path, tmp_path: Path) -> None:
    doc = tmp_path / "doc.md"
    doc.write_text(
        "# Title\n\n<!-- absorption_tables mid-rl-chains: old -->\n\n| old | table |\n|---|---|\n| 1 | 2 |\n\nAfter.\n"
    )
    assert main([str(data), "--table", "mid-rl-chains", "--write", str(doc)]) == 0
    text = doc.read_text()
    assert text.startswith("# Title\n\n<!-- absorption_tables mid-rl-chains: mid-rl; payload format 2 -->\n\n| arch |")
    assert text.endswith("| muon | int4 | 20% | 24% | 4% | 0.33 | 0.13 | 7 |\n\nAfter.\n")
    assert "old" not in text and text.count("| llama | RL |") == 6
    assert main([str(data), "--table", "small-step", "--write", str(doc)]) == 2  # no place for it: nothing written
    assert doc.read_text() == text


def test_the_docs_tables_are_the_generators_output() -> None:
    doc = (ROOT / "docs" / "research.md").read_text()
    text = tables(load(ROOT / "docs" / "research-data"))
    got = blocks(text)
    assert list(got) == list(TABLES)
    for name, lines in got.items():
        assert "\n".join(lines[:1] + [""] + lines[1:]) in doc, f"{name}: docs/research.md differs from the generator"

"""The absorption study's tables in docs/research.md (section 1), from the JSON results under one directory.

    python -m benchmarks.absorption_tables [DATA_DIR] [--table NAME ...] [--write DOC]

reads every ``DATA_DIR/*/absorption.json`` and ``DATA_DIR/*/*/absorption.json`` (default
``docs/research-data``) and prints the tables, each after a one-line HTML comment that names it, its
source files and the codec payload format of its patch bytes (with ``--write DOC``, it replaces the tables
under those comment lines in DOC instead):

- ``small-step``: preset ``small``, one step per run (all regimes);
- ``small-chains``: preset ``small``, unions, catch-ups and anchors;
- ``mid-rl-step`` / ``mid-sft-pretrain-step``: preset ``mid``, each cell ``small`` -> **``mid``**;
- ``mid-rl-chains`` / ``mid-sft-pretrain-chains``: preset ``mid``, unions, catch-ups and anchors.

The bf16/fp8 patch bytes depend on the codec's payload format, which the study records as
``config.payload_format`` since it pins one. A table whose files record different formats is refused
(exit 2, nothing printed); a file without the field is named in the comment as "not recorded" rather
than guessed. Two files with a run of the same preset, architecture, regime and optimizer are refused too.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.absorption_report import FORMATS, _mean, _pct, _t
from patchswarm.protocol.files import write_atomic
from patchswarm.protocol.untrusted_json import load_json

ARCH_ORDER = ("llama", "qwen3moe")
REGIME_ORDER = ("rl", "sft", "pretrain")
OPTIMIZER_ORDER = ("adamw", "adafactor", "sgd", "muon")
SHORT = {"rl": "RL", "sft": "SFT", "pretrain": "pre-train"}
MAX_FILE_BYTES = 64 << 20  # our results are a few MB; anything larger is not one of them


class TableError(ValueError):
    """A table that cannot be printed honestly (mixed payload formats, duplicate runs, a malformed file)."""


@dataclass(frozen=True)
class Run:
    source: str  # the result's directory relative to DATA_DIR
    preset: str
    payload_format: int | None  # None: not recorded in the file
    data: dict[str, Any]

    @property
    def key(self) -> tuple[str, str, str]:
        return self.data["arch"], self.data["regime"], self.data["optimizer"]


def _rank(order: tuple[str, ...], x: str) -> tuple[int, str]:
    return (order.index(x), "") if x in order else (len(order), x)


def _sort_key(r: Run) -> tuple[tuple[int, str], ...]:
    arch, regime, opt = r.key
    return _rank(ARCH_ORDER, arch), _rank(REGIME_ORDER, regime), _rank(OPTIMIZER_ORDER, opt)


def load(data_dir: Path) -> list[Run]:
    if not data_dir.is_dir():
        raise TableError(f"{data_dir}: not a directory of study results")
    paths = sorted([*data_dir.glob("*/absorption.json"), *data_dir.glob("*/*/absorption.json")])
    if not paths:
        raise TableError(f"{data_dir}: no */absorption.json or */*/absorption.json under it")
    runs: list[Run] = []
    seen: dict[tuple[str, str, str, str], str] = {}
    for p in paths:
        source = p.parent.relative_to(data_dir).as_posix()
        if p.stat().st_size > MAX_FILE_BYTES:
            raise TableError(f"{p}: larger than {MAX_FILE_BYTES} bytes, not an absorption result")
        try:
            result = load_json(p.read_bytes(), max_bytes=MAX_FILE_BYTES)
            cfg = result["config"]
            preset, fmt = str(cfg["preset"]), cfg.get("payload_format")
            if cfg.get("seed", 0) != 0:  # the tables are seed 0's; other seeds measure the spread (Caveats)
                continue
            if fmt is not None and (not isinstance(fmt, int) or isinstance(fmt, bool)):
                raise TypeError(f"payload_format {fmt!r} is not an integer")
            for r in result["runs"]:
                run = Run(source, preset, fmt, r)
                k = (preset, *run.key)
                if k in seen:
                    raise TableError(f"{p}: run {' '.join(k)} also in {seen[k]}/absorption.json")
                seen[k] = source
                _check(run)
                runs.append(run)
        except (KeyError, TypeError, IndexError, ValueError) as e:  # (ValueError: not UTF-8, not strict JSON)
            raise TableError(f"{p}: not an absorption result ({type(e).__name__}: {e})") from None
    return sorted(runs, key=_sort_key)


def _check(run: Run) -> None:
    """Touch every field the tables read, so a malformed file fails at load with its name."""
    r = run.data
    float(r["lr"])
    for k in ("mean", "min", "max"):
        float(r["rms_ratio"][k])
    for k in FORMATS:
        f = r["formats"][k]
        if len(f["union"]) < 10 or not f["changed"] or not (f["patch"] or f["bound"]):
            raise TypeError(f"{r['arch']} {r['regime']} {r['optimizer']} {k}: fewer than 10 steps")
        if not (f["catchup_patch"] or f["catchup_bound"]) or not f["catchup_changed"]:
            raise TypeError(f"{r['arch']} {r['regime']} {r['optimizer']} {k}: no catch-up")
        for key in ("full_bytes", "anchor_bytes"):
            float(f[key])
        if "anchor_beats_chain" not in f["crossover"]:
            raise KeyError("crossover.anchor_beats_chain")


def _steps(run: Run) -> int:
    return len(run.data["formats"]["bf16"]["changed"])


def _sizes(f: dict[str, Any]) -> list[float]:
    return list(f["patch"] or f["bound"])  # codec bytes where there are (bf16, fp8), else the bound (int4)


def _catchup(f: dict[str, Any]) -> float:
    return float((f["catchup_patch"] or f["catchup_bound"])[-1])


def _rms(r: dict[str, Any]) -> str:
    q = r["rms_ratio"]
    return f"{q['mean']:.4f} ({q['min']:.4f}-{q['max']:.4f})"


def _changed(r: dict[str, Any], k: str) -> str:
    return _pct(_mean(r["formats"][k]["changed"]))


def _patch(r: dict[str, Any], k: str) -> str:
    f = r["formats"][k]
    return _pct(_mean(_sizes(f)) / f["full_bytes"])


def _codec_vs_bound(r: dict[str, Any]) -> str:
    return " / ".join(f"{sum(r['formats'][k]['patch']) / sum(r['formats'][k]['bound']):.2f}" for k in ("bf16", "fp8"))


def _unions(r: dict[str, Any]) -> str:
    return " / ".join(_pct(r["formats"][k]["union"][-1]) for k in FORMATS)


def _row(cells: Iterable[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def _header(cols: list[str]) -> list[str]:
    return [_row(cols), "|---" * len(cols) + "|"]


def step_table(runs: list[Run]) -> list[str]:
    lines = _header(
        [
            "arch",
            "regime",
            "optimizer",
            "lr",
            "RMS / AdamW's (mean, range)",
            *(f"{k} changed" for k in FORMATS),
            "bf16 patch",
            "fp8 patch",
            "int4 bound",
            "bf16 / fp8 codec vs bound",
        ]
    )
    for run in runs:
        r = run.data
        cells = [r["arch"], SHORT[r["regime"]], r["optimizer"], f"{r['lr']:.3g}", _rms(r)]
        cells += [_changed(r, k) for k in FORMATS] + [_patch(r, k) for k in FORMATS] + [_codec_vs_bound(r)]
        lines.append(_row(cells))
    return lines


def _one_length(runs: list[Run]) -> int:
    steps = {_steps(r) for r in runs}
    if len(steps) != 1:
        raise TableError(f"runs of different lengths in one table: {sorted(steps)} steps")
    return steps.pop()


def chains_table(runs: list[Run]) -> list[str]:
    n = _one_length(runs)
    lines = _header(
        [
            "arch",
            "regime",
            "optimizer",
            "format",
            "union@10",
            f"union@{n}",
            f"catch-up v0->v{n} changed",
            "catch-up / chain sum",
            "catch-up / anchor",
            "anchor < chain sum from t",
        ]
    )
    for run in runs:
        r = run.data
        for k in FORMATS:
            f = r["formats"][k]
            c = _catchup(f)
            cells = [r["arch"], SHORT[r["regime"]], r["optimizer"], k, _pct(f["union"][9]), _pct(f["union"][-1])]
            cells += [_pct(f["catchup_changed"][-1]), f"{c / sum(_sizes(f)):.2f}", f"{c / f['anchor_bytes']:.2f}"]
            cells.append(_t(f["crossover"]["anchor_beats_chain"], n))
            lines.append(_row(cells))
    return lines


def _arrow(small: str | None, mid: str) -> str:
    return f"**{mid}**" if small is None else f"{small} → **{mid}**"


def size_table(runs: list[Run], smaller: dict[tuple[str, str, str], Run]) -> list[str]:
    """Each cell: the smaller preset's number -> the larger's, for the same architecture, regime, optimizer."""
    n = _one_length(runs + list(smaller.values()))
    lines = _header(
        [
            "arch",
            "regime",
            "optimizer",
            "RMS / AdamW's, mid (mean, range)",
            *(f"{k} changed" for k in FORMATS),
            "bf16 patch",
            "fp8 patch",
            "int4 bound",
            f"union@{n} bf16 / fp8 / int4",
        ]
    )
    cols: list[Callable[[dict[str, Any]], str]] = [
        *(lambda r, k=k: _changed(r, k) for k in FORMATS),
        *(lambda r, k=k: _patch(r, k) for k in FORMATS),
        _unions,
    ]
    for run in runs:
        r, s = run.data, smaller.get(run.key)
        cells = [r["arch"], SHORT[r["regime"]], r["optimizer"], _rms(r)]
        cells += [_arrow(None if s is None else col(s.data), col(r)) for col in cols]
        lines.append(_row(cells))
    return lines


def payload_note(runs: list[Run]) -> str:
    """Which payload format the table's patch bytes are of; refuses a table that mixes recorded formats."""
    recorded = sorted({r.payload_format for r in runs if r.payload_format is not None})
    if len(recorded) > 1:
        by = sorted({f"{r.source}: {r.payload_format}" for r in runs if r.payload_format is not None})
        raise TableError(f"payload formats {recorded} mixed in one table ({'; '.join(by)})")
    unknown = sorted({r.source for r in runs if r.payload_format is None})
    if not recorded:
        return "payload format not recorded"
    return f"payload format {recorded[0]}" + (", not recorded in " + ", ".join(unknown) if unknown else "")


TABLES = (
    "small-step",
    "small-chains",
    "mid-rl-step",
    "mid-rl-chains",
    "mid-sft-pretrain-step",
    "mid-sft-pretrain-chains",
)


def tables(runs: list[Run], names: Iterable[str] = TABLES) -> str:
    small = [r for r in runs if r.preset == "small"]
    small_by_key = {r.key: r for r in small}
    out: list[str] = []
    for name in names:
        if name.startswith("small-"):
            rows = small
        else:
            regimes = ("rl",) if name.startswith("mid-rl-") else ("sft", "pretrain")
            rows = [r for r in runs if r.preset == "mid" and r.key[1] in regimes]
        if not rows:
            continue
        if name.endswith("-chains"):
            body, sources = chains_table(rows), rows
        elif name.startswith("small-"):
            body, sources = step_table(rows), rows
        else:
            body = size_table(rows, small_by_key)
            sources = rows + [small_by_key[r.key] for r in rows if r.key in small_by_key]
        files = ", ".join(sorted({r.source for r in sources}))
        note = payload_note(sources)
        out += [f"<!-- absorption_tables {name}: {files}; {note} -->", "", *body, ""]
    return "\n".join(out)


def replace_in(doc: str, text: str) -> str:
    """doc with each generated table (its comment line and the table below it) replaced by text's."""
    lines = doc.split("\n")
    for block in text.split("<!-- absorption_tables ")[1:]:
        new = ("<!-- absorption_tables " + block).rstrip("\n").split("\n")
        mark = new[0].split(":", 1)[0] + ":"
        at = [i for i, line in enumerate(lines) if line.startswith(mark)]
        if len(at) != 1:
            raise TableError(f"{len(at)} lines start with {mark!r} in the document, not one")
        end = at[0] + 2  # the comment, a blank line, then the table up to its first non-table line
        while end < len(lines) and lines[end].startswith("|"):
            end += 1
        lines[at[0] : end] = new
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("data", nargs="?", type=Path, default=Path("docs/research-data"))
    ap.add_argument("--table", nargs="+", choices=TABLES, default=list(TABLES), help="which tables (default: all)")
    ap.add_argument("--write", type=Path, metavar="DOC", help="replace the tables in DOC (under their comment lines)")
    args = ap.parse_args(argv)
    try:
        text = tables(load(args.data), args.table)
        if args.write is not None:
            write_atomic(args.write, replace_in(args.write.read_text(), text).encode())
            return 0
    except TableError as e:
        print(f"absorption_tables: {e}", file=sys.stderr)
        return 2
    except (OSError, UnicodeDecodeError) as e:
        print(f"absorption_tables: {args.write}: {e}", file=sys.stderr)
        return 2
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

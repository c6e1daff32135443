"""Every CLI argument is checked where it enters: usage errors are one line and exit 2, user errors
one line and exit 1, nothing is written either way, and no input produces a traceback."""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from patchswarm.daemon import cli_args, simulate_cli
from patchswarm.daemon.cli import build_parser, main
from patchswarm.daemon.config import parse_name
from patchswarm.daemon.config import split_listen as parse_listen
from patchswarm.daemon.swarm_cli import HELP_DEFAULTS
from patchswarm.protocol.board_names import head_rel
from patchswarm.protocol.chunks import MAX_CHUNK_SIZE, MIN_CHUNK_SIZE
from patchswarm.protocol.node_config import NodeConfig
from patchswarm.protocol.patchfile import open_file
from patchswarm.protocol.safetensors_io import save_safetensors
from tests.support.helpers import adam_like_pair

ROOT = Path(__file__).resolve().parents[3]

# ---------------------------------------------------------------- each validator, at its edges

ACCEPTED: list[tuple[Callable[[str], Any], str, Any]] = [
    (cli_args.chunk_size, str(MIN_CHUNK_SIZE), MIN_CHUNK_SIZE),
    (cli_args.chunk_size, str(MAX_CHUNK_SIZE), MAX_CHUNK_SIZE),
    (cli_args.zstd_level, "1", 1),
    (cli_args.zstd_level, "19", 19),
    (cli_args.version, "1", 1),
    (cli_args.version, str((1 << 63) - 1), (1 << 63) - 1),
    (cli_args.base_version, "0", 0),
    (cli_args.anchor_every, "1", 1),
    (cli_args.days, "0.5", 0.5),
    (cli_args.days, "36525", 36525.0),
    (cli_args.run_id, "run-1", "run-1"),
    (cli_args.run_id, "a.b_c:D-9", "a.b_c:D-9"),
    (cli_args.run_id, "r" * 128, "r" * 128),
    (cli_args.node_name, "host-1", "host-1"),
    (cli_args.label, "", ""),
    (cli_args.label, "eu-west 1", "eu-west 1"),
    (cli_args.listen, "127.0.0.1:8700", "127.0.0.1:8700"),
    (cli_args.listen, "[::1]:0", "[::1]:0"),
    (cli_args.listen, "[fe80::1%eth0]:65535", "[fe80::1%eth0]:65535"),
    (cli_args.listen, ":8700", ":8700"),
    (cli_args.listen, "node-1.example.org:1", "node-1.example.org:1"),
    (cli_args.rate, "100MB", 100e6),
    (cli_args.rate, "1e9", 1e9),
    (cli_args.rate, "0", math.inf),  # 0 = unlimited, as in the config file
    (cli_args.url, "http://10.0.0.1:8700", "http://10.0.0.1:8700"),
    (cli_args.url, "https://board.example/", "https://board.example"),
    (cli_args.count, "0", 0),
    (cli_args.count, "1024", 1024),
    (cli_args.seconds, "0.5", 0.5),
    (cli_args.path, "a b/c", "a b/c"),
    (cli_args.output_path, "new.psw", "new.psw"),
    (cli_args.output_path, "/tmp/new.psw", "/tmp/new.psw"),
    (cli_args.output_target, "new-dir/", "new-dir/"),
    (cli_args.output_target, "/tmp", "/tmp"),
    (cli_args.served_format, "fp8-e4m3", "fp8_e4m3"),
    (cli_args.served_format, "as-is", "as_is"),
    (cli_args.served_format, "bf16", "bf16"),
    (cli_args.fp8_block, "per-tensor", 0),
    (cli_args.fp8_block, "128", 128),
    (cli_args.board, "new-board", "new-board"),
    (cli_args.board, "/tmp", "/tmp"),
    (cli_args.board, "s3://my-board/runs-prefix", "s3://my-board/runs-prefix"),
    (cli_args.board, "gs://my-board", "gs://my-board"),
    (cli_args.board, "file:///tmp", "file:///tmp"),
    (cli_args.board_source, "https://cdn.example/board", "https://cdn.example/board"),
    (cli_args.board_source, "az://container/p", "az://container/p"),
    (cli_args.board_url, "s3://my-board/p/", "s3://my-board/p"),
    (simulate_cli.scenario_value("run.seed"), "0", 0),
    (cli_args.workers, "64", 64),
    (cli_args.ray_address, "local", "local"),
    (cli_args.ray_address, "10.0.0.1:6379", "10.0.0.1:6379"),
    (cli_args.ray_address, "ray://head.example:10001", "ray://head.example:10001"),
]

REFUSED: list[tuple[Callable[[str], Any], str, str]] = [
    (cli_args.output_target, "no-such-dir/x/", "no directory"),
    (cli_args.output_target, "/", "expected a file or directory name"),
    (cli_args.served_format, "fp32", "expected one of bf16, fp16, fp8-e4m3, as-is"),
    (cli_args.fp8_block, "0", "outside"),
    (cli_args.fp8_block, "blocks", "not a block size"),
    (cli_args.chunk_size, str(MIN_CHUNK_SIZE - 1), "outside"),
    (cli_args.chunk_size, str(MAX_CHUNK_SIZE + 1), "outside"),
    (cli_args.chunk_size, "1.5", "not a whole number"),
    (cli_args.chunk_size, "9" * 5000, "not a whole number"),  # past int()'s digit limit
    (cli_args.zstd_level, "0", "outside 1..19"),
    (cli_args.zstd_level, "20", "outside 1..19"),  # its window is past what decoders allow
    (cli_args.zstd_level, "-5", "outside"),
    (cli_args.version, "0", "outside"),
    (cli_args.version, str(1 << 63), "outside"),  # more than gossip and the journal carry
    (cli_args.base_version, "-1", "outside"),
    (cli_args.anchor_every, "0", "outside"),
    (cli_args.days, "0", "less than a millisecond"),
    (cli_args.days, "-1", "outside"),
    (cli_args.days, "nan", "outside"),
    (cli_args.days, "inf", "outside"),
    (cli_args.days, "36526", "outside"),
    (cli_args.days, "1e309", "outside"),
    (cli_args.run_id, "", "run id must be"),
    (cli_args.run_id, "a/b", "run id must be"),
    (cli_args.run_id, "..", "run id must be"),
    (cli_args.run_id, ".hidden", "run id must be"),
    (cli_args.run_id, "a b", "run id must be"),
    (cli_args.run_id, "r" * 129, "run id must be"),
    (cli_args.run_id, "caf\u00e9", "run id must be"),
    (cli_args.node_name, "a/b", "not a node name"),
    (cli_args.label, "z" * 129, "printable"),
    (cli_args.label, "a\nb", "printable"),
    (cli_args.listen, "8700", "HOST:PORT"),
    (cli_args.listen, "host:", "HOST:PORT"),
    (cli_args.listen, "host:65536", "HOST:PORT"),
    (cli_args.listen, "host:-1", "HOST:PORT"),
    (cli_args.listen, "host:\uff18\uff17", "HOST:PORT"),  # full-width digits int() would take
    (cli_args.listen, "::1:8700", "brackets"),
    (cli_args.listen, "[::1:8700", "IPv6"),
    (cli_args.listen, "[1.2.3.4]:80", "IPv6"),
    (cli_args.listen, "999.1.1.1:80", "host name"),
    (cli_args.listen, "a b:80", "host name"),
    (cli_args.listen, "-x:80", "host name"),
    (cli_args.rate, "-5", "expected a rate"),
    (cli_args.rate, "nan", "expected a rate"),
    (cli_args.rate, "inf", "expected a rate"),
    (cli_args.rate, "fast", "expected a rate"),
    (cli_args.url, "ftp://x", "http(s) URL"),
    (cli_args.url, "http://x y", "http(s) URL"),
    (cli_args.url, "", "http(s) URL"),
    (cli_args.count, "1025", "outside"),
    (cli_args.seconds, "nan", "outside"),
    (cli_args.seconds, "-0.1", "outside"),
    (cli_args.path, "", "expected a path"),
    (cli_args.path, "a\0b", "expected a path"),
    (cli_args.output_path, ".", "expected a file name"),
    (cli_args.output_path, "dir/", "expected a file name"),
    (cli_args.output_path, "missing/out", "no directory 'missing' to write 'out' in"),
    (cli_args.board, __file__, "is not a directory"),
    (cli_args.board, "s3://key:secret@my-board/p", "never the URL"),
    (cli_args.board, "https://cdn.example/board", "read-only"),
    (cli_args.board_source, "s3://my-board/../x", "prefix"),
    (cli_args.board_url, "/srv/board", "expected an http(s), s3://, gs:// or az:// URL"),
    (simulate_cli.scenario_value("run.seed"), "-1", "run.seed"),
    (cli_args.workers, "0", "outside 1..1024"),
    (cli_args.ray_address, "head.example", "expected local, auto or HOST:PORT"),
    (cli_args.ray_address, "ray://:10001", "expected local, auto or HOST:PORT"),
    (cli_args.ray_address, "bad host:6379", "not a host name"),
]


@pytest.mark.parametrize(("check", "text", "value"), ACCEPTED)
def test_validator_accepts(check: Callable[[str], Any], text: str, value: Any) -> None:
    assert check(text) == value


@pytest.mark.parametrize(("check", "text", "why"), REFUSED)
def test_validator_refuses(check: Callable[[str], Any], text: str, why: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=None) as info:
        check(text)
    assert why in str(info.value)
    assert "\n" not in str(info.value)


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=140))
def test_an_accepted_run_id_is_one_every_reader_takes(text: str) -> None:
    try:
        cli_args.run_id(text)
    except argparse.ArgumentTypeError:
        return
    head_rel(text)
    assert parse_name(text) == text


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.text(max_size=40), st.from_regex(r"\[[0-9a-f:]{0,12}\]:[0-9]{1,6}", fullmatch=True)))
def test_an_accepted_listen_address_is_one_the_servers_take(text: str) -> None:
    try:
        cli_args.listen(text)
    except argparse.ArgumentTypeError:
        return
    host, port = parse_listen(text)
    assert 0 <= port <= 65535
    assert ":" not in host or text.startswith("[")  # an IPv6 host only in brackets


def test_zstd_levels_accepted_are_exactly_those_decoders_take() -> None:
    import zstandard

    from patchswarm.protocol.streams import MAX_WINDOW

    data = os.urandom(1 << 16) * 160  # 10 MiB: more than the 8 MiB window readers allow
    for level in (19, 20):
        c = zstandard.ZstdCompressor(level=level).compressobj()
        frame = c.compress(data) + c.flush()
        d = zstandard.ZstdDecompressor(max_window_size=MAX_WINDOW).decompressobj()
        try:
            readable = d.decompress(frame) == data
        except zstandard.ZstdError:
            readable = False
        try:
            cli_args.zstd_level(str(level))
            accepted = True
        except argparse.ArgumentTypeError:
            accepted = False
        assert accepted == readable, level


def test_the_help_defaults_are_the_node_config_defaults() -> None:
    node = NodeConfig("", "", b"")
    assert {k: getattr(node, k) for k in HELP_DEFAULTS} == HELP_DEFAULTS


def test_the_run_of_a_pull_url_is_checked_like_run_id(tmp_path: Path) -> None:
    parser = build_parser()
    args = parser.parse_args(["pull", "--from", "http://h/runs/a b", "--trust", "t", "--to", str(tmp_path / "o")])
    assert (
        args.check(args)
        == "argument --from: run id must be 1 to 128 letters, digits and . _ : - (not starting with .), "
        "not 'a b'"
    )


# ---------------------------------------------------------------- main(), in process, on generated arguments

SERVERS = {"seed", "node", "daemon", "simulate", "engine"}  # a valid command runs until stopped (or long): parse only
FILES = ["base.safetensors", "target.safetensors", "p.psw", "key", "key.pub", "root.key", "root.key.pub", "cert"]
ODD = [
    *FILES,
    "",
    "missing",
    "dir",
    "dir/",
    "empty",
    "junk",
    "board",
    "-1",
    "0",
    "1",
    "nan",
    "inf",
    "-inf",
    "1e309",
    "9" * 30,
    "[/]",
    "a\nb",
    "\udcff",
    "127.0.0.1:0",
    "[::1]:0",
    "::1:80",
    "http://127.0.0.1:1/runs/r",
    "run-1",
    "a/b",
    "..",
]
VALUES = st.one_of(st.sampled_from(ODD), st.text(max_size=12), st.integers().map(str), st.floats().map(str))
# A command that gets through parsing, per subcommand: mutated one value at a time below.
TEMPLATES: dict[str, list[str]] = {
    "keygen": ["-o", "new.key"],
    "certify": ["--root", "root.key", "--key", "key.pub", "--run-id", "run-1", "--days", "2", "-o", "new.cert"],
    "revoke": ["--root", "root.key", "--board", "board", "key.pub"],
    "rotate-root": ["--root", "root.key", "--board", "board", "--new-root", "key.pub"],
    "publish": ["target.safetensors", "--board", "board", "--key", "key", "--run-id", "run-1", "--chunk-size", "4096"],
    "diff": ["base.safetensors", "target.safetensors", "-o", "new.psw", "--version", "3", "--level", "1"],
    "apply": ["base.safetensors", "p.psw", "-o", "new.safetensors", "--trust", "key.pub"],
    "inspect": ["p.psw", "--json"],
    "verify": ["p.psw", "--trust", "key.pub"],
    "pull": ["--from", "board", "--run", "run-1", "--trust", "root.key.pub", "--to", "new.safetensors"],
    "status": ["--socket", "missing.sock", "--json"],
    "seed": ["--board", "board", "--listen", "127.0.0.1:0", "--run", "run-1", "--upload-rate", "1MB"],
    "node": ["--listen", "127.0.0.1:0", "--run", "run-1", "--trust", "root.key.pub", "--bootstrap", "http://h:1"],
    "daemon": ["--config", "daemon.toml"],
    "engine": ["transformers", "--checkpoint", "dir", "--listen", "127.0.0.1:0", "--device", "cuda:0"]
    + ["--engine-name", "e1", "--max-tokens-limit", "8", "--prefix-cache-entries", "0", "--fence-wait", "1"],
    "head": ["refresh", "--board", "board", "--key", "key", "--run-id", "run-1", "--head-ttl", "60"],
    "simulate": ["scenario.toml", "--out", "out", "--seed", "3", "--workers", "2"],
    "certs": ["issue", "--ca", "dir", "--name", "h1", "--ip", "127.0.0.1", "--dns", "h1.local", "--days", "30"]
    + ["--out", "out"],
}


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    """The files every generated command runs among (a small model, keys, a signed patch, a certificate)."""
    d = tmp_path_factory.mktemp("fixtures")
    base, target = adam_like_pair(seed=3, rows=8)
    save_safetensors(base, d / "base.safetensors")
    save_safetensors(target, d / "target.safetensors")
    cwd = Path.cwd()
    os.chdir(d)
    try:
        for argv in (
            ["keygen", "-o", "key"],
            ["keygen", "-o", "root.key", "--root"],
            ["diff", "base.safetensors", "target.safetensors", "-o", "p.psw", "--key", "key"],
            ["certify", "--root", "root.key", "--key", "key.pub", "--run-id", "run-1", "-o", "cert"],
        ):
            assert run_main(argv)[0] == 0, argv
    finally:
        os.chdir(cwd)
    (d / "empty").write_bytes(b"")
    (d / "junk").write_bytes(bytes(range(256)) * 8)
    return {p.name: p.read_bytes() for p in d.iterdir()}


def run_main(argv: list[str], *, parse_only: bool = False) -> tuple[int, str]:
    """main(argv) in this process: (exit status, stderr)."""
    import contextlib
    import io

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            if parse_only:
                build_parser().parse_args(argv)
                rc = 0
            else:
                rc = main(argv)
        except SystemExit as e:
            rc = e.code if isinstance(e.code, int) else 1
    return rc, err.getvalue()


def snapshot(d: Path) -> dict[str, bytes | None]:
    return {str(p.relative_to(d)): p.read_bytes() if p.is_file() else None for p in sorted(d.rglob("*"))}


def check_run(files: dict[str, bytes], argv: list[str]) -> None:
    import tempfile

    cwd = Path.cwd()
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        for name, data in files.items():
            (d / name).write_bytes(data)
        (d / "dir").mkdir()
        (d / "board").mkdir()
        before = snapshot(d)
        os.chdir(d)
        try:
            rc, err = run_main(argv, parse_only=argv[0] in SERVERS)
        finally:
            os.chdir(cwd)
        assert rc in (0, 1, 2), (argv, rc, err)
        assert "Traceback" not in err and "internal error" not in err, (argv, err)
        if rc != 0:
            lines = err.strip().splitlines()
            assert len(lines) == 1 and lines[0].startswith("patchswarm"), (argv, err)
            assert snapshot(d) == before, argv  # nothing written, nothing changed


@pytest.mark.parametrize("command", sorted(TEMPLATES))
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_command_with_one_value_changed_fails_in_one_line(
    files: dict[str, bytes], command: str, data: st.DataObject
) -> None:
    argv = list(TEMPLATES[command])
    slot = data.draw(st.integers(0, len(argv)), label="slot")
    value = data.draw(VALUES, label="value")
    if slot == len(argv):
        argv.append(value)
    else:
        argv[slot] = value
    check_run(files, [command, *argv])


def _options(command: str) -> list[str]:
    sub = build_parser()._subparsers
    assert sub is not None
    parser = sub._group_actions[0].choices[command]  # type: ignore[index]
    options = [o for a in parser._actions for o in a.option_strings if o not in ("-h", "--help")]
    for a in parser._actions:  # a command with subcommands (head refresh): their names and options too
        if isinstance(a, argparse._SubParsersAction):
            for name, child in a.choices.items():
                options += [name, *(o for b in child._actions for o in b.option_strings if o not in ("-h", "--help"))]
    return options


@pytest.mark.parametrize("command", sorted(TEMPLATES))
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_arguments_give_a_status_and_one_line(files: dict[str, bytes], command: str, data: st.DataObject) -> None:
    option = st.sampled_from(_options(command))
    token = st.one_of(st.tuples(option, VALUES), st.tuples(VALUES), st.tuples(option))
    argv = [t for group in data.draw(st.lists(token, max_size=8), label="argv") for t in group]
    check_run(files, [command, *argv])


def test_each_subcommand_has_a_template() -> None:
    assert set(TEMPLATES) == {c for c in _subcommands()}


def _subcommands() -> set[str]:
    sub = build_parser()._subparsers
    assert sub is not None
    return set(sub._group_actions[0].choices)  # type: ignore[arg-type]


# ---------------------------------------------------------------- real processes


def cli(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "patchswarm.daemon.cli", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


def test_version_is_the_package_version(tmp_path: Path) -> None:
    import tomllib

    r = cli("--version", cwd=tmp_path)
    expected = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert r.returncode == 0 and r.stdout.strip() == f"patchswarm {expected}", r.stderr


HEAVY = ("torch", "numpy", "aiohttp", "matplotlib", "rich.progress", "rich.table", "zstandard", "patchswarm.swarm.node")


def test_help_imports_nothing_heavy(tmp_path: Path) -> None:
    every = [["--help"], ["--version"], *([c, "--help"] for c in sorted(TEMPLATES))]
    code = (
        "import json, sys\n"
        "from patchswarm.daemon.cli import main\n"
        f"for argv in {every!r}:\n"
        "    try:\n"
        "        main(argv)\n"
        "    except SystemExit as e:\n"
        "        assert e.code == 0, (argv, e.code)\n"
        f"print(json.dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "usage: patchswarm simulate" in r.stdout and "--chunk-size" in r.stdout
    assert json.loads(r.stdout.strip().splitlines()[-1]) == []


@pytest.mark.parametrize(
    ("argv", "argument"),
    [
        (["diff", "a", "b", "-o", "out.psw", "--chunk-size", "100"], "argument --chunk-size: 100 is outside"),
        (["diff", "a", "b", "-o", "out.psw", "--level", "22"], "argument --level: 22 is outside 1..19"),
        (["diff", "a", "b", "-o", "out.psw", "--version", "2", "--base-version", "5"], "argument --base-version"),
        (["diff", "a", "b", "-o", "out.psw", "--run-id", "x/y"], "argument --run-id"),
        (["certify", "--root", "r", "--key", "k", "--run-id", "r", "--days", "1e400", "-o", "out.psw"], "--days"),
        (
            ["publish", "m", "--board", "out.psw", "--key", "k", "--run-id", "r", "--anchor-every", "0"],
            "--anchor-every",
        ),
        (["node", "--listen", "::1:80", "--run", "r", "--trust", "t"], "argument --listen"),
        (["seed", "--board", "out.psw", "--upload-rate", "nan"], "argument --upload-rate"),
        (["simulate", "s.toml", "--out", "out.psw", "--workers", "0"], "argument --workers: 0 is outside 1..1024"),
        (["simulate", "s.toml", "--out", "out.psw", "--ray", "nowhere"], "argument --ray: expected local, auto"),
        (
            ["simulate", "s.toml", "--out", "out.psw", "--workers", "2", "--ray", "local"],
            "argument --ray: not allowed with argument --workers",
        ),
    ],
)
def test_usage_errors_exit_2_in_one_line_naming_the_argument(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, argv: list[str], argument: str
) -> None:
    monkeypatch.chdir(tmp_path)
    rc, err = run_main(argv)
    assert rc == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"patchswarm {argv[0]}: error: ") and argument in lines[0]
    assert list(tmp_path.iterdir()) == []


def test_a_usage_error_in_a_real_process(tmp_path: Path) -> None:
    r = cli("diff", "a", "b", "-o", "out.psw", "--chunk-size", "64MiB", cwd=tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip() == (
        "patchswarm diff: error: argument --chunk-size: not a whole number of bytes: '64MiB' "
        "(see patchswarm diff --help)"
    )
    assert list(tmp_path.iterdir()) == []


def test_odd_bytes_in_a_path_print_escaped(tmp_path: Path) -> None:
    name = os.fsdecode(b"k\xff[bold]:smile:")
    r = subprocess.run(
        [sys.executable, "-m", "patchswarm.daemon.cli", "keygen", "-o", name],
        cwd=tmp_path,
        capture_output=True,
        timeout=60,
        env={**os.environ, "PYTHONIOENCODING": "utf-8"},
    )
    assert r.returncode == 0, r.stderr
    assert b"k\\udcff[bold]:smile: and k\\udcff[bold]:smile:.pub" in r.stdout  # no markup, no emoji
    assert (tmp_path / name).exists() and (tmp_path / f"{name}.pub").exists()


def test_a_patch_written_at_the_edges_of_every_range_is_read_back(
    files: dict[str, bytes], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("base.safetensors", "target.safetensors"):
        (tmp_path / name).write_bytes(files[name])
    monkeypatch.chdir(tmp_path)
    top = max(lv for lv in range(1, 30) if _accepts(cli_args.zstd_level, str(lv)))
    argv = ["diff", "base.safetensors", "target.safetensors", "-o", "p.psw", "--level", str(top)]
    argv += ["--version", str((1 << 63) - 1), "--chunk-size", str(MIN_CHUNK_SIZE), "--run-id", "r" * 128]
    assert run_main(argv) == (0, "")
    v = open_file((tmp_path / "p.psw").read_bytes(), None)
    assert v.manifest.version == (1 << 63) - 1 and v.manifest.chunk_size == MIN_CHUNK_SIZE
    assert run_main(["apply", "base.safetensors", "p.psw", "-o", "out.safetensors"])[0] == 0


def _accepts(check: Callable[[str], Any], text: str) -> bool:
    try:
        check(text)
    except argparse.ArgumentTypeError:
        return False
    return True


def test_names_from_a_patch_print_as_they_are(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import torch

    from patchswarm.protocol.safetensors_io import ServedModel

    names = ["[/]", "[bold]w", "a:smile:b"]
    base = ServedModel.from_tensors({n: torch.zeros(4, dtype=torch.bfloat16) for n in names}, {})
    target = ServedModel.from_tensors({n: torch.ones(4, dtype=torch.bfloat16) for n in names}, {})
    save_safetensors(base, tmp_path / "base.safetensors")
    save_safetensors(target, tmp_path / "target.safetensors")
    monkeypatch.chdir(tmp_path)
    assert main(["diff", "base.safetensors", "target.safetensors", "-o", "p.psw", "--run-id", "r:smile:"]) == 0
    capsys.readouterr()
    assert main(["inspect", "p.psw"]) == 0
    out = capsys.readouterr().out
    assert "run 'r:smile:'" in out and all(n in out for n in names)


def test_a_defect_is_still_one_line_and_the_traceback_is_there_on_request(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import patchswarm.daemon.cli

    def boom(args: argparse.Namespace) -> int:
        raise ValueError("something the code did not expect")

    monkeypatch.setattr(patchswarm.daemon.cli, "cmd_inspect", boom)
    monkeypatch.delenv("PATCHSWARM_DEBUG", raising=False)
    assert main(["inspect", "p.psw"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("patchswarm inspect: error: internal error (ValueError: something the code did not expect)")
    assert len(err.splitlines()) == 1 and "PATCHSWARM_DEBUG=1" in err
    monkeypatch.setenv("PATCHSWARM_DEBUG", "1")
    with pytest.raises(ValueError, match="did not expect"):
        main(["inspect", "p.psw"])

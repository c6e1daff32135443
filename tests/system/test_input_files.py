"""Files named on the command line or in a config are regular files of a bounded size (issue 31).

Every CLI argument that names a file to read (signing and public keys, certificates, patch
files, models, cluster secrets, the daemon's config, a pull's state file, a simulation's
scenario, a local board) gets a FIFO with no writer, /dev/zero, a directory and a huge sparse
file: the command ends promptly with one line on stderr naming the file, a non-zero status, no
traceback, and nothing written.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from patchswarm.protocol.errors import FormatError
from patchswarm.protocol.files import FileTooLargeError
from patchswarm.protocol.patchfile import read_patch_file
from patchswarm.protocol.safetensors_io import save_safetensors
from tests.support.helpers import adam_like_pair

ROOT = Path(__file__).resolve().parents[2]
SPARSE = 300 << 30  # past every bound (patch files: 256 GiB), and sparse: no disk used
BAD = ("fifo", "zero", "dir", "sparse")


def patchswarm(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "patchswarm.daemon.cli", *args], cwd=cwd, capture_output=True, text=True, timeout=120
    )


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("inputs")
    base, target = adam_like_pair(seed=3)
    save_safetensors(base, d / "base.safetensors")
    save_safetensors(target, d / "target.safetensors")
    for args in (
        ["keygen", "-o", "key"],
        ["diff", "base.safetensors", "target.safetensors", "-o", "p.psw", "--key", "key"],
        ["certify", "--root", "key", "--key", "key.pub", "--run-id", "r", "-o", "cert"],
    ):
        r = patchswarm(*args, cwd=d)
        assert r.returncode == 0, r.stderr
    (d / "secret").write_bytes(b"s" * 32)
    os.mkfifo(d / "fifo")
    (d / "dir").mkdir()
    with open(d / "sparse", "wb") as fh:
        fh.truncate(SPARSE)
    return d


def bad_path(work: Path, kind: str) -> str:
    return "/dev/zero" if kind == "zero" else str(work / kind)


def config_with_secret(work: Path, secret: str) -> str:
    path = work / f"daemon-{abs(hash(secret))}.toml"
    path.write_text(f'[swarm]\nrun_id = "r"\ncluster_secret_file = "{secret}"\n[trust]\nroot = "{work}/key.pub"\n')
    return str(path)


# What each command would write if it got that far.
OUTPUTS = ("out.psw", "out.safetensors", "cert.out", "board", "state.out", "sim.out")

CASES: dict[str, Callable[[Path, str], list[str]]] = {
    "signing key (diff --key)": lambda w, b: (
        ["diff", "base.safetensors", "target.safetensors", "-o", "out.psw"] + ["--key", b]
    ),
    "root key (certify --root)": lambda w, b: (
        ["certify", "--root", b, "--key", "key.pub", "--run-id", "r"] + ["-o", "cert.out"]
    ),
    "public key (certify --key)": lambda w, b: (
        ["certify", "--root", "key", "--key", b, "--run-id", "r"] + ["-o", "cert.out"]
    ),
    "trust key (verify --trust)": lambda w, b: ["verify", "p.psw", "--trust", b],
    "trust key (apply --trust)": lambda w, b: (
        ["apply", "base.safetensors", "p.psw", "-o", "out.safetensors"] + ["--trust", b]
    ),
    "certificate (publish --cert)": lambda w, b: (
        ["publish", "target.safetensors", "--board", "board"] + ["--key", "key", "--run-id", "r", "--cert", b]
    ),
    "patch (verify)": lambda w, b: ["verify", b, "--trust", "key.pub"],
    "patch (inspect)": lambda w, b: ["inspect", b],
    "patch (apply)": lambda w, b: ["apply", "base.safetensors", b, "-o", "out.safetensors", "--trust", "key.pub"],
    "model (apply base)": lambda w, b: ["apply", b, "p.psw", "-o", "out.safetensors", "--trust", "key.pub"],
    "model (diff target)": lambda w, b: ["diff", "base.safetensors", b, "-o", "out.psw"],
    "model (publish)": lambda w, b: ["publish", b, "--board", "board", "--key", "key", "--run-id", "r"],
    "secret (node --secret-file)": lambda w, b: (
        ["node", "--listen", "127.0.0.1:0", "--run", "r"] + ["--trust", "key.pub", "--secret-file", b]
    ),
    "secret (daemon config)": lambda w, b: ["daemon", "--config", config_with_secret(w, b)],
    "config (daemon --config)": lambda w, b: ["daemon", "--config", b],
    "scenario (simulate)": lambda w, b: ["simulate", b, "--out", "sim.out"],
    "pull state (pull --state)": lambda w, b: (
        ["pull", "--from", "board", "--run", "r", "--trust", "key.pub"] + ["--to", "out.safetensors", "--state", b]
    ),
}


DRIVER = """
import contextlib, io, json, shutil, sys, traceback
from pathlib import Path
from patchswarm.daemon.cli import main
out = {}
for key, argv, outputs in json.loads(sys.stdin.read()):
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            rc = main(argv)
        except SystemExit as e:
            rc = e.code
        except BaseException:
            rc, _ = "raised", traceback.print_exc(file=err)
    written = [n for n in outputs if Path(n).exists()]
    for n in written:
        shutil.rmtree(n) if Path(n).is_dir() else Path(n).unlink()
    out[key] = {"rc": rc, "stderr": err.getvalue(), "written": written}
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def refusals(work: Path) -> dict[str, dict[str, object]]:
    """Every case with every kind of bad file, through ``daemon.cli.main`` in one child process
    (a process per command would cost seconds each); a hang fails them all at the timeout."""
    calls = [[f"{case}|{kind}", CASES[case](work, bad_path(work, kind)), OUTPUTS] for case in CASES for kind in BAD]
    r = subprocess.run(
        [sys.executable, "-c", DRIVER], cwd=work, input=json.dumps(calls), capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stderr
    results: dict[str, dict[str, object]] = json.loads(r.stdout.strip().splitlines()[-1])
    return results


@pytest.mark.parametrize("kind", BAD)
@pytest.mark.parametrize("case", sorted(CASES))
def test_a_named_file_that_is_not_a_small_regular_file_is_refused_in_one_line(
    work: Path, refusals: dict[str, dict[str, object]], case: str, kind: str
) -> None:
    got = refusals[f"{case}|{kind}"]
    stderr = str(got["stderr"])
    lines = stderr.strip().splitlines()
    # 1: the file was opened and refused; 2: a usage error caught before any file is opened (a
    # directory where an output-like file such as --state is expected).
    assert got["rc"] in (1, 2), got
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    assert bad_path(work, kind) in lines[0], lines[0]
    assert got["written"] == [], got


@pytest.mark.slow
def test_the_refusal_says_what_the_file_is(work: Path) -> None:
    """As separate processes: the status, stderr's one line and the reason."""
    reasons = {
        "fifo": "not a regular file (a FIFO)",
        "zero": "not a regular file (a character device)",
        "dir": "not a regular file (a directory)",
        "sparse": f"{SPARSE} bytes, more than the",
    }
    for kind, reason in reasons.items():
        r = patchswarm("inspect", bad_path(work, kind), cwd=work)
        assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert reason in r.stderr and bad_path(work, kind) in r.stderr, r.stderr


@pytest.mark.slow
def test_a_local_board_whose_files_are_traps_is_a_board_without_them(work: Path, tmp_path: Path) -> None:
    """``pull --from DIR``: a head that is a FIFO, /dev/zero or a symlink out of the board is no head."""
    for i, trap in enumerate(("fifo", "zero", "outside")):
        board = tmp_path / f"board{i}"
        (board / "runs" / "r").mkdir(parents=True)
        head = board / "runs" / "r" / "head"
        if trap == "fifo":
            os.mkfifo(head)
        elif trap == "zero":
            head.symlink_to("/dev/zero")
        else:
            head.symlink_to(work / "key")
        r = patchswarm(
            "pull", "--from", str(board), "--run", "r", "--trust", "key.pub", "--to", str(tmp_path / "out"), cwd=work
        )
        assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert not (tmp_path / "out").exists()


def test_a_patch_file_is_read_whole_only_once_it_is_known_to_be_one(work: Path, tmp_path: Path) -> None:
    """``read_patch_file``: junk, a wrong size or a truncated copy is refused after its first bytes,
    the error naming the file; a good file reads back exactly."""
    good = (work / "p.psw").read_bytes()
    assert bytes(read_patch_file(work / "p.psw")) == good
    junk = tmp_path / "junk.psw"
    with open(junk, "wb") as fh:
        fh.truncate(1 << 30)  # sparse: zeros, refused at the magic, never read whole
    cases = {
        junk: "bad magic",
        tmp_path / "trailing.psw": "1 bytes past its payload",
        tmp_path / "short.psw": "payload bytes",
        tmp_path / "cut.psw": "ends inside its manifest",
        tmp_path / "tiny.psw": "shorter than its fixed header",
        tmp_path / "reserved.psw": "reserved bytes are not zero",
    }
    (tmp_path / "reserved.psw").write_bytes(good[:9] + b"\x01" + good[10:])
    (tmp_path / "trailing.psw").write_bytes(good + b"x")
    (tmp_path / "short.psw").write_bytes(good[:-1])
    (tmp_path / "cut.psw").write_bytes(good[:40])
    (tmp_path / "tiny.psw").write_bytes(good[:5])
    for path, message in cases.items():
        with pytest.raises(FormatError, match=message) as info:
            read_patch_file(path)
        assert str(path) in str(info.value)
    with pytest.raises(FileTooLargeError):
        read_patch_file(work / "p.psw", limit=len(good) - 1)

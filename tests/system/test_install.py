"""packaging/install.sh: user, directories, permissions, the unit (verified), idempotence, bad inputs.

Installs go into a temporary root (``--prefix``) so nothing on this system changes; the install at
the real root runs only in CI as root (PATCHSWARM_INSTALL_REAL=1 or CI set).
"""

from __future__ import annotations

import grp
import hashlib
import os
import pwd
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from patchswarm.protocol.keys import SigningKey
from tests.support.daemonkit import ROOT

SCRIPT = ROOT / "packaging/install.sh"
VENV = Path(sys.prefix)  # this environment stands in for the venv: nothing is downloaded
ANALYZE = shutil.which("systemd-analyze")
pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("useradd") is None, reason="install.sh needs root and useradd"
)


@pytest.fixture
def inputs(tmp_path: Path) -> dict[str, Path]:
    SigningKey.generate().save(tmp_path / "root.key")
    (tmp_path / "secret").write_bytes(b"0123456789abcdef0123456789abcdef\n")
    target = tmp_path / "target"
    target.mkdir()
    return {
        "pub": tmp_path / "root.key.pub",
        "key": tmp_path / "root.key",
        "secret": tmp_path / "secret",
        "root": target,
    }


def install(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(SCRIPT), *map(str, args)], capture_output=True, text=True, timeout=300)


def full(i: dict[str, Path], *extra: str | Path) -> subprocess.CompletedProcess[str]:
    return install(
        "--prefix", i["root"], "--venv", VENV, "--root-pub", i["pub"], "--cluster-secret", i["secret"], *extra
    )


def account(root: Path, db: str, name: str) -> list[str]:
    for line in (root / "etc" / db).read_text().splitlines():
        if line.split(":")[0] == name:
            return line.split(":")
    raise AssertionError(f"no {name} in {root}/etc/{db}")


def mode_owner(path: Path) -> tuple[int, int, int]:
    st = path.stat()
    return stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid


def snapshot(root: Path) -> dict[str, tuple[int, int, int, str]]:
    out = {}
    for p in sorted(root.rglob("*")):
        digest = hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else ""
        out[str(p.relative_to(root))] = (*mode_owner(p), digest)
    return out


def test_an_install_creates_the_user_the_directories_the_files_and_a_verified_unit(inputs: dict[str, Path]) -> None:
    host_passwd = Path("/etc/passwd").read_text()
    r = full(inputs)
    assert r.returncode == 0, r.stderr
    root = inputs["root"]
    user = account(root, "passwd", "patchswarm")
    group = account(root, "group", "patchswarm")
    uid, gid = int(user[2]), int(group[2])
    assert int(user[3]) == gid and user[5] == "/var/lib/patchswarm" and user[6] == "/usr/sbin/nologin"
    assert uid < 1000  # a system user
    assert Path("/etc/passwd").read_text() == host_passwd  # this system's accounts are untouched

    etc = root / "etc/patchswarm"
    assert mode_owner(etc) == (0o750, 0, gid)
    assert mode_owner(root / "var/lib/patchswarm") == (0o700, uid, gid)
    for name, source in (("root.pub", inputs["pub"]), ("cluster.secret", inputs["secret"])):
        assert mode_owner(etc / name) == (0o640, 0, gid), name
        assert (etc / name).read_bytes() == source.read_bytes()
    assert mode_owner(etc / "daemon.toml") == (0o640, 0, gid)
    assert (etc / "daemon.toml").read_text() == (ROOT / "packaging/daemon.toml").read_text()

    unit = root / "etc/systemd/system/patchswarm.service"
    assert mode_owner(unit) == (0o644, 0, 0)
    text = unit.read_text()
    assert f"ExecStart={VENV}/bin/patchswarm daemon --config /etc/patchswarm/daemon.toml" in text
    assert "LimitNOFILE=65536" in text and "User=patchswarm" in text and "RuntimeDirectory=patchswarm" in text
    if ANALYZE is not None:
        v = subprocess.run([ANALYZE, "verify", "--man=no", str(unit)], capture_output=True, text=True)
        assert v.returncode == 0 and "patchswarm.service" not in v.stderr, v.stderr


def test_a_second_run_changes_nothing_and_keeps_the_operators_config(inputs: dict[str, Path]) -> None:
    assert full(inputs).returncode == 0
    config = inputs["root"] / "etc/patchswarm/daemon.toml"
    config.write_text(config.read_text().replace('run_id = "run-7"', 'run_id = "run-8"'))
    before = snapshot(inputs["root"])
    r = full(inputs)
    assert r.returncode == 0, r.stderr
    assert "keeping" in r.stdout
    assert snapshot(inputs["root"]) == before
    r = install("--prefix", inputs["root"], "--venv", VENV)  # key and secret already in place
    assert r.returncode == 0, r.stderr
    assert snapshot(inputs["root"]) == before


def test_a_dry_run_prints_the_steps_and_changes_nothing(inputs: dict[str, Path]) -> None:
    r = install(
        "--prefix", inputs["root"], "--dry-run", "--root-pub", inputs["pub"], "--cluster-secret", inputs["secret"]
    )
    assert r.returncode == 0, r.stderr
    assert list(inputs["root"].iterdir()) == []
    assert "+ useradd --prefix" in r.stdout and "+ install -d -m 0750" in r.stdout
    assert "-m venv" in r.stdout and r.stdout.rstrip().endswith("dry run: nothing was changed")


@pytest.mark.parametrize(
    ("case", "why"),
    [
        ("short-secret", "--cluster-secret: .* holds 8 bytes; at least 16 are needed"),
        ("private-key", "--root-pub: .* holds a private key"),
        ("fifo", "--root-pub: .* is not a regular file"),
        ("no-pub", "--root-pub is required"),
        ("bad-option", "unknown option --frobnicate"),
        ("no-venv", "--venv: .*/bin/patchswarm is missing"),
    ],
)
def test_bad_inputs_are_one_line_status_2_and_nothing_written(inputs: dict[str, Path], case: str, why: str) -> None:
    pub, secret, venv = inputs["pub"], inputs["secret"], VENV
    extra: list[str | Path] = []
    if case == "short-secret":
        secret = inputs["root"].parent / "short"
        secret.write_bytes(b"12345678")
    elif case == "private-key":
        pub = inputs["key"]
    elif case == "fifo":
        pub = inputs["root"].parent / "fifo"
        os.mkfifo(pub)
    elif case == "bad-option":
        extra = ["--frobnicate"]
    elif case == "no-venv":
        venv = inputs["root"].parent / "nowhere"
    args: list[str | Path] = ["--prefix", inputs["root"], "--venv", venv, "--cluster-secret", secret, *extra]
    if case != "no-pub":
        args += ["--root-pub", pub]
    r = install(*args)
    assert r.returncode == 2
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("install.sh: "), r.stderr

    assert re.search(why, lines[0]), lines[0]
    assert list(inputs["root"].iterdir()) == []


def test_a_new_venv_gets_patchswarm_from_a_local_wheel(inputs: dict[str, Path], tmp_path: Path) -> None:
    # The wheel is built from a copy of the sources (no build/ in the checkout); --no-deps: no download.
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "patchswarm", "protocol", "swarm", "daemon", "simulations"):
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, symlinks=True)  # patchswarm/ holds links to the layers
        else:
            shutil.copy(ROOT / name, src / name)
    wheels = tmp_path / "wheels"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "-w",
            wheels,
            src,
        ],
        check=True,
        capture_output=True,
    )
    [wheel] = wheels.glob("patchswarm-*.whl")
    r = install(
        "--prefix", inputs["root"], "--python", sys.executable, "--source", wheel, "--pip-args", "--no-deps --no-index",
        "--root-pub", inputs["pub"], "--cluster-secret", inputs["secret"],
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    venv = inputs["root"] / "opt/patchswarm/.venv"
    assert os.access(venv / "bin/patchswarm", os.X_OK)
    unit = (inputs["root"] / "etc/systemd/system/patchswarm.service").read_text()
    assert "ExecStart=/opt/patchswarm/.venv/bin/patchswarm daemon" in unit


@pytest.mark.skipif(
    not (os.environ.get("CI") or os.environ.get("PATCHSWARM_INSTALL_REAL")), reason="installs on this system: CI only"
)
def test_a_real_install(inputs: dict[str, Path]) -> None:
    r = install("--venv", VENV, "--root-pub", inputs["pub"], "--cluster-secret", inputs["secret"])
    assert r.returncode == 0, r.stderr
    user, group = pwd.getpwnam("patchswarm"), grp.getgrnam("patchswarm")
    assert user.pw_gid == group.gr_gid and user.pw_shell == "/usr/sbin/nologin"
    assert mode_owner(Path("/etc/patchswarm")) == (0o750, 0, group.gr_gid)
    assert mode_owner(Path("/etc/patchswarm/cluster.secret")) == (0o640, 0, group.gr_gid)
    assert mode_owner(Path("/var/lib/patchswarm")) == (0o700, user.pw_uid, group.gr_gid)
    if ANALYZE is not None:
        v = subprocess.run(
            [ANALYZE, "verify", "--man=no", "/etc/systemd/system/patchswarm.service"], capture_output=True
        )
        assert v.returncode == 0 and b"patchswarm.service" not in v.stderr, v.stderr

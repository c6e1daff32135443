"""The rollout daemon as a real process: versions land in shared memory the engine reads in place."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from patchswarm.daemon.engine import attach
from tests.support.daemonkit import ROOT, make_daemon, shm_exists
from tests.support.swarmkit import Swarm

pytestmark = pytest.mark.asyncio


async def test_versions_land_in_place_and_the_engine_sees_them_without_reloading(tmp_path: Path) -> None:
    sw = Swarm(tmp_path)
    sw.publish()
    await sw.start_seed()
    d = make_daemon(sw, "d1", tmp_path)
    d.start()
    try:
        await d.wait_version(1)
        info = await d.get("/v1/layout")
        view = attach(info["attach"])
        names = [s.name for s in sw.served[1].specs]
        first = {n: view.tensor(n) for n in names}  # zero-copy views, taken once
        for i, n in enumerate(names):
            assert first[n].view(-1).view(sw.served[1].typed(i).dtype).equal(sw.served[1].typed(i).view(-1))
        for _ in range(2):
            v = sw.publish(scale=5e-4)
            st = await d.wait_version(v)
            assert st["root"] == sw.served[v].root().hex()
            got = view.read_version()
            assert got is not None and got[0] == v and got[1] == sw.served[v].root()
            for i, n in enumerate(names):
                assert first[n].view(-1).equal(sw.served[v].typed(i).view(-1)), n
        assert (await d.get("/v1/status"))["state"] == "idle"
        view.close()
        assert await d.stop() == 0
    finally:
        d.cleanup()
        await sw.close()


async def test_sigterm_is_graceful_and_a_restart_reattaches_without_refetching(tmp_path: Path) -> None:
    sw = Swarm(tmp_path)
    sw.publish()
    sw.publish(scale=5e-4)
    await sw.start_seed()
    d = make_daemon(sw, "d1", tmp_path)
    d.start()
    try:
        await d.wait_version(2)
        assert await d.stop() == 0
        assert shm_exists(d.store)  # the engine's weights outlive the daemon
        assert not Path(d.socket).exists()
        d.start()
        st = await d.wait_version(2)
        assert st["root"] == sw.served[2].root().hex()
        log = d.log.read_text()
        assert "store re-attached at version 2" in log
        v = sw.publish(scale=5e-4)
        await d.wait_version(v)
        assert await d.stop() == 0
    finally:
        d.cleanup()
        await sw.close()


async def test_store_smaller_than_the_model_is_a_clear_error(tmp_path: Path) -> None:
    sw = Swarm(tmp_path)
    sw.publish()
    await sw.start_seed()
    d = make_daemon(sw, "small", tmp_path, store_size='"1KB"')
    d.start()
    try:
        for _ in range(300):
            st = await d.status()
            if st is not None and st["state"] == "error":
                break
            await asyncio.sleep(0.1)
        assert st is not None and st["state"] == "error", st
        assert st["reason"].startswith("store.size:") and "needs" in st["reason"], st["reason"]
        assert st["version"] is None
        assert await d.stop() == 0
    finally:
        d.cleanup()
        await sw.close()


def run_cli(*args: str, cwd: Path, user: list[str] | None = None) -> subprocess.CompletedProcess[str]:
    cmd = [*(user or []), sys.executable, "-m", "patchswarm.daemon.cli", *args]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=120, env=env)


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ('upload_rate = "fast"', "swarm.upload_rate: expected a rate"),
        ('bootstrap = "ftp://seed"', "swarm.bootstrap: expected an http"),
        ('colour = "red"', "swarm.colour: unknown key"),
    ],
)
async def test_bad_config_values_name_the_key(tmp_path: Path, bad: str, message: str) -> None:
    cfg = tmp_path / "d.toml"
    (tmp_path / "secret").write_bytes(b"x" * 32)
    cfg.write_text(
        f'[swarm]\nrun_id = "r"\ncluster_secret_file = "{tmp_path / "secret"}"\n{bad}\n[trust]\nroot = "/nonexistent"\n'
    )
    r = run_cli("daemon", "--config", str(cfg), cwd=tmp_path)
    assert r.returncode == 1 and message in r.stderr and "Traceback" not in r.stderr, r.stderr


async def test_socket_path_without_permission(tmp_path: Path) -> None:
    setpriv = shutil.which("setpriv")
    if os.geteuid() != 0 or setpriv is None:
        pytest.skip("needs root and setpriv to run the daemon as an unprivileged user")
    sw = Swarm(tmp_path)
    sw.publish()
    await sw.start_seed()
    base = Path(tempfile.mkdtemp(prefix="patchswarm-perm-"))  # pytest's tmp root is private to root
    try:
        base.chmod(0o755)
        shared = base / "shared"
        shared.mkdir()
        locked = base / "locked"
        locked.mkdir(mode=0o755)  # root's: the unprivileged daemon cannot create its socket here
        data = shared / "data"
        data.mkdir()
        d = make_daemon(sw, "nobody", shared, data_dir=f'"{data}"', socket=f'"{locked / "api.sock"}"')
        for p in [shared, d.dir]:
            p.chmod(0o755)
        for f in [shared / "secret", shared / "root.key.pub", d.config]:
            f.chmod(0o644)
        data.chmod(0o777)
        r = run_cli(
            "daemon",
            "--config",
            str(d.config),
            cwd=shared,
            user=[setpriv, "--reuid=65534", "--regid=65534", "--clear-groups"],
        )
        assert r.returncode == 1, r.stderr
        assert "api.socket" in r.stderr and "permission" in r.stderr and "Traceback" not in r.stderr, r.stderr
    finally:
        shutil.rmtree(base, ignore_errors=True)
        await sw.close()

"""matplotlib is the optional extra patchswarm[sim]: the CLI and the daemon never import it."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from patchswarm.simulations import plots
from tests.support.daemonkit import ROOT, make_daemon
from tests.support.swarmkit import Swarm


def test_matplotlib_is_an_extra_and_dev_installs_it() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert not any(d.startswith("matplotlib") for d in project["dependencies"])
    assert any(d.startswith("matplotlib") for d in project["optional-dependencies"]["sim"])
    assert "patchswarm[sim]" in project["optional-dependencies"]["dev"]


def test_importing_the_cli_and_the_daemon_loads_no_matplotlib() -> None:
    code = (
        "import sys, patchswarm.daemon.cli, patchswarm.daemon.rollout, patchswarm.daemon.sidecar, "
        "patchswarm.daemon.status_cli, patchswarm.daemon.simulate_cli; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'matplotlib'))"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert r.stdout == "[]\n"


def test_plots_without_matplotlib_say_which_extra_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    with pytest.raises(plots.PlotsUnavailable) as e:
        plots._pyplot()
    assert str(e.value) == "matplotlib is not installed: install patchswarm[sim] for plots"


@pytest.mark.asyncio
async def test_a_running_daemon_never_imports_matplotlib(tmp_path: Path) -> None:
    # A matplotlib that leaves a mark when imported shadows the real one for the daemon process.
    fake = tmp_path / "fake" / "matplotlib"
    fake.mkdir(parents=True)
    mark = tmp_path / "imported"
    (fake / "__init__.py").write_text(f"open({str(mark)!r}, 'w').close()\n")
    sw = Swarm(tmp_path)
    sw.publish()
    await sw.start_seed()
    d = make_daemon(sw, "d1", tmp_path)

    d.start(PYTHONPATH=os.pathsep.join([str(fake.parent), os.environ.get("PYTHONPATH", str(ROOT))]))
    try:
        await d.wait_version(1)
        await d.wait_version(sw.publish(scale=5e-4))
        assert await d.get("/v1/status")
        assert await d.stop() == 0
        assert not mark.exists()
    finally:
        d.cleanup()
        await sw.close()


def test_the_fake_matplotlib_would_be_noticed(tmp_path: Path) -> None:
    fake = tmp_path / "fake" / "matplotlib"
    fake.mkdir(parents=True)
    mark = tmp_path / "imported"
    (fake / "__init__.py").write_text(f"open({str(mark)!r}, 'w').close()\n")
    env = {"PYTHONPATH": f"{fake.parent}:{ROOT}", "PATH": "/usr/bin:/bin"}
    subprocess.run([sys.executable, "-c", "import patchswarm.simulations.plots as p; p._pyplot()"], env=env, cwd=ROOT)
    assert mark.exists()

"""The native build: the modules that carry a simulation's per-event work, compiled by mypyc.

``python -m patchswarm.simulations.build [DIR]`` (``make native``) copies the package into ``DIR``
(default ``build/native``) and compiles ``NATIVE_MODULES`` there as C extensions (one shared
library, so calls between them stay C calls), from the same source, typed to ``mypy --strict``.
A command runs on it with ``PYTHONPATH=build/native`` and Python's ``-P`` (so the source tree in
the working directory does not shadow it).  Both builds run the same simulation event for event
(tests/system/test_native_build.py); only the CPU time differs, so a figure of CPU or wall time should
say which build produced it: ``build_label()``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import sysconfig
import time
from importlib.machinery import EXTENSION_SUFFIXES
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("protocol", "swarm", "simulations", "daemon")

# Where a large simulation spends its CPU (py-spy, docs/simulation.md#where-the-cpu-goes): the scheduler,
# membership and wire decoding, the node's download and gossip paths, the flow model and its
# transport, and the virtual-time loop's scheduling
# (simulations/clock.py itself cannot be: its loop subclasses asyncio's classes; its per-callback work
# is in loop_core.py).
NATIVE_MODULES = (
    "patchswarm/protocol/announce.py",
    "patchswarm/protocol/bitfield.py",
    "patchswarm/protocol/download.py",
    "patchswarm/protocol/head_follow.py",
    "patchswarm/protocol/membership.py",
    "patchswarm/protocol/membership_config.py",
    "patchswarm/protocol/membership_index.py",
    "patchswarm/protocol/membership_messages.py",
    "patchswarm/protocol/membership_records.py",
    "patchswarm/protocol/node_config.py",
    "patchswarm/protocol/ordered.py",
    "patchswarm/protocol/peers.py",
    "patchswarm/protocol/ratelimit.py",
    "patchswarm/protocol/scheduler.py",
    "patchswarm/protocol/scheduler_placement.py",
    "patchswarm/protocol/scheduler_state.py",
    "patchswarm/protocol/scheduler_types.py",
    "patchswarm/protocol/seeding.py",
    "patchswarm/protocol/uploads.py",
    "patchswarm/protocol/wire.py",
    "patchswarm/simulations/loop_core.py",
    "patchswarm/simulations/network.py",
    "patchswarm/simulations/network_share.py",
    "patchswarm/simulations/transport.py",
    "patchswarm/swarm/download.py",
    "patchswarm/swarm/futures.py",
    "patchswarm/swarm/node.py",
    "patchswarm/swarm/node_metrics.py",
    "patchswarm/swarm/sources.py",
    "patchswarm/swarm/staging.py",
    "patchswarm/swarm/stores.py",
    "patchswarm/swarm/uploads.py",
)


def compiled_modules() -> list[str]:
    """The project's loaded modules that come from compiled extensions, by dotted name."""
    suffixes = tuple(EXTENSION_SUFFIXES)
    return sorted(
        name
        for name, module in list(sys.modules.items())
        if name.startswith("patchswarm.") and str(getattr(module, "__file__", None) or "").endswith(suffixes)
    )


def build_label() -> str:
    """``interpreted``, or ``native (N modules compiled)``."""
    n = len(compiled_modules())
    return f"native ({n} modules compiled)" if n else "interpreted"


def missing_toolchain() -> str | None:
    """Why this machine cannot compile the build (no C compiler, no Python headers), or None."""
    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    if shutil.which(cc) is None:
        return f"no C compiler ({cc})"
    if not (Path(sysconfig.get_paths()["include"]) / "Python.h").exists():
        return "no Python headers (Python.h)"
    return None


def build(dest: Path) -> None:
    """Copy the packages into ``dest`` and compile ``NATIVE_MODULES`` in place there."""
    started = time.time()
    if dest.exists():  # a whole new copy: a file deleted from the source must not linger in it
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    ignore = shutil.ignore_patterns("__pycache__", "*.so")
    (dest / "patchswarm").mkdir()
    shutil.copy2(ROOT / "patchswarm" / "__init__.py", dest / "patchswarm" / "__init__.py")
    for package in PACKAGES:  # the folders themselves, not the links in patchswarm/ to them
        shutil.copytree(ROOT / package, dest / "patchswarm" / package, ignore=ignore)
    mypyc = Path(sys.executable).with_name("mypyc")
    if not mypyc.exists():
        raise SystemExit(f"no {mypyc}: the native build needs the dev extras (pip install -e '.[dev]')")
    r = subprocess.run(  # its output is a gcc command line per module; shown only when it fails
        [str(mypyc), "--config-file", str(ROOT / "pyproject.toml"), *NATIVE_MODULES],
        cwd=dest,
        capture_output=True,
        text=True,
    )
    if r.returncode != 0:
        raise SystemExit(f"mypyc failed (exit {r.returncode}):\n{r.stdout[-6000:]}{r.stderr[-6000:]}")
    # The stamp is dated when the copy began: a source edited while mypyc ran is newer than it, so
    # make builds again (dated at the end, make would call the stale copy up to date).
    (dest / ".built").touch()
    os.utime(dest / ".built", (started, started))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m patchswarm.simulations.build", description="compile the simulator's hot modules with mypyc"
    )
    ap.add_argument("dest", nargs="?", default=str(ROOT / "build" / "native"), help="default: build/native")
    args = ap.parse_args(argv)
    why = missing_toolchain()
    if why is not None:
        print(f"no native build: {why} (tests/system/test_native_build.py is skipped)")
        return 0
    print(f"compiling {len(NATIVE_MODULES)} modules into {args.dest} (mypyc, ~5 CPU-minutes)")
    build(Path(args.dest))
    return 0


if __name__ == "__main__":
    sys.exit(main())

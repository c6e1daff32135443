"""Helper processes for the weight-store tests (a daemon that gets killed, an engine, a fence reader).

Usage: python -m tests.support.store_worker MODE ...
  launcher NAME SHM_DIR JOURNAL_DIR SEED
      imports once, then per stdin command forks a daemon child (killed by the test or by itself)
      and prints "dead STATUS" when it is gone.  Commands:
        "go [CRASH_POINT CRASH_VERSION]": the child prints "pid P", opens the store, recovers,
            prints "ready K", then activates version k+1 over k forever ("activated K"); with a
            crash point it SIGKILLs itself there while activating CRASH_VERSION;
        "load VERSION CRASH_POINT": the child fully loads VERSION, killed at CRASH_POINT;
        "exit".
  engine INFO_FILE [DEVICE]
      attach to the store (or, with DEVICE, allocate an engine-owned buffer there and print its
      handle), then answer stdin commands: "version", "digest", "zerocopy", "exit".
  reader INFO_FILE STOP_VERSION
      poll with FenceReader.consistent until the store reaches STOP_VERSION; every consistent
      read's copy must hash to the root the fence reported; prints a JSON summary.

The versions are deterministic (``model(seed, k)``) so parent and child agree on every byte.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from patchswarm.daemon.engine import EngineView, allocate, attach
from patchswarm.daemon.journal import recover
from patchswarm.daemon.store_updates import diff_updates
from patchswarm.daemon.weightstore import WeightStore
from patchswarm.protocol.served import ServedModel, TensorSpec, bytes_digest, state_root

SPECS = [
    TensorSpec("a.weight", "BF16", (256, 384)),
    TensorSpec("b.weight", "F32", (200, 100)),
    TensorSpec("c.bias", "BF16", (384,)),
    TensorSpec("d.index", "I64", (1000,)),
    TensorSpec("e.scale", "F8_E4M3", (64, 64)),
    TensorSpec("f.empty", "F16", (0, 8)),
]


def model(seed: int, k: int, scale: int = 1) -> ServedModel:
    """Version ``k`` of the test model: a fixed base with ~2% of each tensor rewritten per version, c.bias dense."""
    specs = [TensorSpec(s.name, s.dtype, (s.shape[0] * scale, *s.shape[1:])) for s in SPECS] if scale > 1 else SPECS
    base = np.random.default_rng(seed)
    step = np.random.default_rng([seed, k])
    data = []
    for s in specs:
        raw = base.integers(0, 256, size=s.nbytes, dtype=np.uint8)
        w = raw.view(f"<i{s.dt.width}")
        if s.name == "c.bias":
            w[:] = step.integers(0, 256, size=s.nbytes, dtype=np.uint8).view(w.dtype)
        elif w.size:
            pos = step.choice(w.size, size=max(1, w.size // 50), replace=False)
            w[pos] = step.integers(0, 256, size=pos.size * s.dt.width, dtype=np.uint8).view(w.dtype)
        data.append(torch.from_numpy(raw))
    return ServedModel(list(specs), data)


def _killer(point: str) -> Callable[[str], None]:
    def fault(at: str) -> None:
        if at == point:
            os.kill(os.getpid(), signal.SIGKILL)

    return fault


def say(line: str) -> None:
    """One line in one write: print() writes the text and its newline apart, and with unbuffered output
    a SIGKILL between the two left "activated 25" and the launcher's "dead 9" on one line."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def run_daemon(name: str, shm_dir: str, jdir: str, seed: int, point: str | None, crash_version: int) -> None:
    store = WeightStore.open(name, shm_dir=shm_dir)
    recover(store, jdir)
    say(f"ready {store.header().version}")
    while True:
        k = store.header().version
        if point is not None and k + 1 == crash_version:
            store.fault = _killer(point)
        old, new = model(seed, k), model(seed, k + 1)
        store.activate(k + 1, new.root(), diff_updates(old, new), jdir)
        say(f"activated {k + 1}")


def run_load(name: str, shm_dir: str, seed: int, version: int, point: str) -> None:
    store = WeightStore.open(name, shm_dir=shm_dir)
    store.fault = _killer(point)
    m = model(seed, version)
    store.load(m, version, m.root())
    print("loaded", flush=True)


def view_root(view: EngineView) -> str:
    digests = [bytes_digest(view.data[s.offset : s.offset + s.nbytes]) for s in view.layout.slots]
    return state_root(view.layout.specs, digests).hex()


def run_engine(info_file: str, device: str | None) -> None:
    info = json.loads(Path(info_file).read_text())
    view = allocate(info, device) if device else attach(info)
    print(json.dumps({"handle": view.handle}), flush=True)
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "version":
            got = view.read_version()
            print(json.dumps(None if got is None else [got[0], got[1].hex()]), flush=True)
        elif cmd == "digest":
            print(json.dumps(view_root(view)), flush=True)
        elif cmd == "zerocopy":
            print(json.dumps(_zero_copy(view)), flush=True)
        elif cmd == "exit":
            break
    view.close()


def _zero_copy(view: EngineView) -> bool:
    """The data tensor lies inside the shared mapping, and typed tensors are views into it."""
    import ctypes

    seg = view._owned or view._segments[-1]  # the data lives in the last segment mapped
    base = ctypes.addressof(ctypes.c_char.from_buffer(seg.mm))
    s = view.layout.slots[0]
    inside = base <= view.data.data_ptr() < base + seg.size
    return inside and view.tensor(s.name).data_ptr() == view.data.data_ptr() + s.offset


def run_reader(info_file: str, stop_version: int) -> None:
    view = attach(json.loads(Path(info_file).read_text()))
    print("ready", flush=True)
    checked = torn = bad = waits = 0
    versions: set[int] = set()
    deadline = time.monotonic() + 300  # never outlive a test that died
    while time.monotonic() < deadline:
        obs = view.fence.consistent(lambda: view.data.clone())
        if obs.changed:
            torn += 1
        elif obs.version is not None:
            digests = [bytes_digest(obs.value[s.offset : s.offset + s.nbytes]) for s in view.layout.slots]
            if state_root(view.layout.specs, digests) != obs.root:
                bad += 1
            checked += 1
            versions.add(obs.version)
            if obs.version >= stop_version:
                break
        if view.fence.header() is None:
            waits += 1
    summary = {"checked": checked, "torn": torn, "bad": bad, "versions": sorted(versions), "odd_seen": waits}
    print(json.dumps(summary), flush=True)


def run_launcher(name: str, shm_dir: str, jdir: str, seed: int) -> None:
    for line in sys.stdin:
        cmd = line.split()
        if not cmd or cmd[0] == "exit":
            break
        pid = os.fork()
        if pid == 0:  # the child: a daemon that will die by SIGKILL (or exit after a load)
            try:
                say(f"pid {os.getpid()}")
                if cmd[0] == "go":
                    point = cmd[1] if len(cmd) > 1 else None
                    run_daemon(name, shm_dir, jdir, seed, point, int(cmd[2]) if point else -1)
                else:
                    run_load(name, shm_dir, seed, int(cmd[1]), cmd[2])
            finally:
                sys.stdout.flush()
                os._exit(1)
        _, status = os.waitpid(pid, 0)
        print(f"dead {status}", flush=True)


def main() -> None:
    mode, args = sys.argv[1], sys.argv[2:]
    if mode == "launcher":
        run_launcher(args[0], args[1], args[2], int(args[3]))
    elif mode == "engine":
        run_engine(args[0], args[1] if len(args) > 1 else None)
    elif mode == "reader":
        run_reader(args[0], int(args[1]))
    else:
        raise SystemExit(f"unknown mode {mode!r}")


# ---------------------------------------------------------------- helpers for the test modules


def unique_name(tag: str) -> str:
    return f"psw-test-{tag}-{os.getpid()}-{os.urandom(4).hex()}"


def remove_segments(name: str, shm_dir: str | Path = "/dev/shm") -> None:
    """Remove a test store and any engine buffers named after it."""
    for p in Path(shm_dir).glob(f"{name}*"):
        p.unlink(missing_ok=True)


if __name__ == "__main__":
    main()

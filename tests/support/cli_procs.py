"""`patchswarm` subcommands as child processes, their JSON lines collected (swarm process tests)."""

from __future__ import annotations

import contextlib
import json
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path


class Proc:
    """A child process whose JSON lines are collected by a reader thread."""

    def __init__(self, args: list[str], cwd: Path) -> None:
        self.p = subprocess.Popen(
            [sys.executable, "-m", "patchswarm.daemon.cli", *args],
            cwd=cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.lines: queue.Queue[dict[str, object]] = queue.Queue()
        self.versions: dict[int, str] = {}
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.p.stdout is not None
        for line in self.p.stdout:
            with contextlib.suppress(ValueError):
                self.lines.put(json.loads(line))

    def wait_event(self, event: str, timeout: float) -> dict[str, object]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                msg = self.lines.get(timeout=0.2)
            except queue.Empty:
                if self.p.poll() is not None:
                    raise AssertionError(f"process exited: {self.p.stderr.read() if self.p.stderr else ''}") from None
                continue
            if msg.get("event") == "version":
                self.versions[int(msg["version"])] = str(msg["root"])  # type: ignore[call-overload]
            if msg.get("event") == event:
                return msg
        raise AssertionError(f"no {event!r} within {timeout}s")

    def wait_version(self, version: int, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while version not in self.versions:
            self.wait_event("version", max(0.1, deadline - time.monotonic()))
        return self.versions[version]

    def stop(self) -> int:
        self.p.send_signal(signal.SIGTERM)
        try:
            rc = self.p.wait(timeout=20)
        finally:
            for f in (self.p.stdout, self.p.stderr):
                if f:
                    f.close()
        return rc

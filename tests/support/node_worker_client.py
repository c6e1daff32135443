"""The test side of tests/support/node_worker.py: start a node process, ask it for its metrics, stop it."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any


class NodeWorker:
    def __init__(self, name: str, *args: str) -> None:
        self.p = subprocess.Popen(
            [sys.executable, "-m", "tests.support.node_worker", name, *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.p.stdout is not None
        self.hello: dict[str, Any] = json.loads(self.p.stdout.readline())
        self.port: int = self.hello["port"]
        self.url: str = self.hello["url"]

    def ask(self, command: str) -> Any:
        assert self.p.stdin is not None and self.p.stdout is not None
        self.p.stdin.write(command + "\n")
        self.p.stdin.flush()
        return json.loads(self.p.stdout.readline())

    def metrics(self) -> dict[str, int]:
        return self.ask("metrics")  # type: ignore[no-any-return]

    def close(self) -> None:
        assert self.p.stdin is not None and self.p.stdout is not None
        self.p.stdin.close()
        try:
            self.p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait()
        self.p.stdout.close()

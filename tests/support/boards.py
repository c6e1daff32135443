"""Fixtures for trainer-side tests: keys, a certified board, HTTP servers that host it."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from patchswarm.daemon.board import Board
from patchswarm.daemon.publisher import Publisher
from patchswarm.daemon.served_format import ServedFormat
from patchswarm.protocol.board_names import HEAD_TAG, chunk_rel, head_rel
from patchswarm.protocol.head import Head
from patchswarm.protocol.keys import SigningKey
from patchswarm.protocol.patch_format import read_header
from patchswarm.protocol.served import ServedModel
from patchswarm.protocol.signed import Envelope
from patchswarm.protocol.trust import Certificate

DAY_MS = 86_400_000


@dataclass
class Keys:
    root: SigningKey
    trainer: SigningKey

    def certificate(self, run_id: str, now_ms: int | None = None, days: float = 1.0) -> bytes:
        now = int(time.time() * 1000) if now_ms is None else now_ms
        return (
            Certificate(self.trainer.key_id, run_id, now - DAY_MS, now + int(days * DAY_MS)).sign(self.root).to_bytes()
        )


def small_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Embedding(200, 64),
        torch.nn.Linear(64, 128),
        torch.nn.GELU(),
        torch.nn.LayerNorm(128),
        torch.nn.Linear(128, 64),
    )


def train_and_publish(pub: Publisher, steps: int, seed: int = 0, lr: float = 1e-6) -> dict[int, ServedModel]:
    """Adam training (a few normal-lr steps, then RL-like lr); returns every published served version."""
    model = small_model(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(seed)
    served: dict[int, ServedModel] = {}
    fmt = ServedFormat("bf16")
    for step in range(steps):
        tokens = torch.randint(0, 200, (16, 8), generator=g)
        loss = model(tokens).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step == 2:
            for group in opt.param_groups:
                group["lr"] = lr
        info = pub.publish(model)
        assert not hasattr(info, "result")
        served[pub.version] = ServedModel.from_tensors(fmt.convert(model.state_dict()))
    return served


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def nginx_serving(root: Path, workdir: Path) -> Iterator[str]:
    """A real nginx hosting ``root`` on a loopback port (the board is plain static files)."""
    binary = shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None)
    if binary is None:
        import pytest

        pytest.skip("nginx is not installed (make test installs it from apt; here it could not be)")
    port = free_port()
    workdir.mkdir(parents=True, exist_ok=True)
    conf = workdir / "nginx.conf"
    # As root, nginx's workers would drop to an account that cannot read pytest's private tmp dirs.
    user = "user root root;" if os.geteuid() == 0 else ""
    conf.write_text(
        f"""
{user}
worker_processes 1;
error_log {workdir}/error.log;
pid {workdir}/nginx.pid;
events {{ worker_connections 64; }}
http {{
    access_log off;
    client_body_temp_path {workdir}/body;
    proxy_temp_path {workdir}/proxy;
    fastcgi_temp_path {workdir}/fastcgi;
    uwsgi_temp_path {workdir}/uwsgi;
    scgi_temp_path {workdir}/scgi;
    server {{
        listen 127.0.0.1:{port};
        root {root};
        location /runs/ {{ add_header Cache-Control "no-cache"; }}
        location / {{ add_header Cache-Control "public, max-age=31536000, immutable"; }}
    }}
}}
"""
    )
    proc = subprocess.Popen([binary, "-c", str(conf), "-p", str(workdir), "-g", "daemon off;"], stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                    break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"nginx did not start: {proc.stderr.read() if proc.stderr else ''!r}") from None
                time.sleep(0.05)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        if proc.stderr:
            proc.stderr.close()


def board_files(board: Board) -> set[str]:
    return {str(p.relative_to(board.root)) for p in board.root.rglob("*") if p.is_file()}


def board_patches(board: Board, run: str) -> dict[int, tuple[int, list[str]]]:
    """Every patch the head lists: version -> (declared payload format, per-tensor encoding names),
    read from the board's own manifest and chunk files."""
    head = Head.from_bytes(Envelope.from_bytes(board.read(head_rel(run)) or b"", HEAD_TAG).body)
    out: dict[int, tuple[int, list[str]]] = {}
    for e in head.catalog:
        if e.kind.value != "patch":
            continue
        m = board.manifest(e.manifest_id)
        payload = b"".join(board.read(chunk_rel(c.hash)) or b"" for c in m.chunks)
        h = read_header(payload, list(m.specs))
        out[e.version] = (h.format, [enc.name for enc, _ in h.records])
    return out

"""An adversarial swarm peer for attack tests, and the loopback world the attacks run in.

:class:`Adversary` is a real :class:`swarm.node.SwarmNode` (real membership, real authenticated gossip,
real announcements) holding a board of its own, so real daemons take it for an ordinary peer that
holds every chunk of every version.  Its HTTP side exposes the routes of a real node (``/swarm/v1/...``)
and, like a board mirror, the board paths at the root; what it answers there is set per attack with
:meth:`Adversary.behave`: corrupted, truncated, endless, inflating (gzip bomb), trickled or never
answered chunks, a withheld chunk, board objects replaced (a stale, forged, foreign or forked head, a
wrong manifest), board requests never answered, and a lie about its head counter in every announcement.

:class:`AttackWorld` is the rest: a trainer (``tests.support.swarmkit.Swarm``) publishing to its own board,
an honest seed serving a *public* copy of it, the adversary's copy, and one real ``patchswarm daemon``
process, with helpers to read the daemon's status, metrics and persisted high-water mark.  Copying a
new version to the adversary's board only ("leaking it first") lets a test watch the daemon face the
attacker alone before the honest copy arrives.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gzip
import random
import re
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import aiohttp
import msgpack
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from patchswarm.daemon.board import Board
from patchswarm.protocol.board_names import chunk_rel, head_rel
from patchswarm.protocol.files import write_atomic
from patchswarm.protocol.keys import KeyPolicy, SigningKey
from patchswarm.protocol.membership_messages import NodeInfo, Ping
from patchswarm.protocol.node_config import NodeConfig
from patchswarm.protocol.trust import Certificate
from patchswarm.protocol.wire import Announcement, GossipFrame, encode_frame
from patchswarm.swarm.http import HttpTransport
from patchswarm.swarm.node import SwarmNode
from patchswarm.swarm.server import RunningNode, start_http_node
from patchswarm.swarm.stores import BoardChunkStore
from patchswarm.swarm.transport import SystemClock
from tests.support.daemonkit import Daemon, make_daemon
from tests.support.swarmkit import FAST_MEMBERSHIP, RUN, SECRET, Swarm

CHUNK_MODES = ("honest", "corrupt", "truncate", "endless", "bomb", "slow", "hang", "withhold")
BOMB_BYTES = 64 << 20  # what the gzip bomb inflates to (it is ~64 KiB on the wire)


@functools.cache
def gzip_bomb() -> bytes:
    return gzip.compress(bytes(BOMB_BYTES), compresslevel=9)


@dataclass
class Behaviour:
    chunks: str = "honest"  # one of CHUNK_MODES
    withhold: frozenset[bytes] = frozenset()  # chunk hashes answered 404 in "withhold" mode
    objects: dict[str, bytes] = field(default_factory=dict)  # board path -> bytes served instead
    hang_objects: bool = False  # board requests are accepted and never answered
    head_counter: int | None = None  # announced instead of the real one (lure fetches, fast-forward)


class _Node(SwarmNode):
    """The real node, but announcing what the attack says (a higher head counter than it has)."""

    behaviour: Behaviour

    def announcement(self) -> Announcement:
        ann = super().announcement()
        if self.behaviour.head_counter is not None:
            ann = replace(ann, head_counter=self.behaviour.head_counter)
        return ann


class Adversary:
    def __init__(self, board: Board, policy: KeyPolicy, *, node_id: str = "mallory", secret: bytes = SECRET) -> None:
        self.board = board
        self.policy = policy
        self.node_id = node_id
        self.secret = secret
        self.behaviour = Behaviour()
        self.requests: Counter[str] = Counter()  # "chunk", "object", "gossip": what peers asked
        self.sent_bytes = 0
        self._stop = asyncio.Event()
        self._runner: web.AppRunner | None = None
        self._transport = HttpTransport()
        self.node: _Node | None = None
        self.url = ""

    def behave(self, **changes: Any) -> None:
        """Replace the whole behaviour (fields not given go back to honest)."""
        b = Behaviour(**changes)
        if b.chunks not in CHUNK_MODES:
            raise ValueError(f"chunk mode {b.chunks!r} is not one of {CHUNK_MODES}")
        self.behaviour = b
        if self.node is not None:
            self.node.behaviour = b
            self.node._announce_dirty = True

    async def start(self, bootstrap: list[str]) -> None:
        app = web.Application()
        app.router.add_post("/swarm/v1/gossip", self._gossip)
        app.router.add_get("/swarm/v1/chunks/{hash:[0-9a-fA-F]+}", self._chunk)
        app.router.add_get("/swarm/v1/board/{path:.+}", self._object)
        app.router.add_get("/{path:.+}", self._object)  # the same objects, as a board mirror
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=1.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"
        cfg = NodeConfig(self.node_id, RUN, self.secret, bootstrap=bootstrap, membership=FAST_MEMBERSHIP)
        self.node = _Node(
            cfg,
            self.url,
            self._transport,
            SystemClock(),
            self.policy,
            random.Random(7),
            chunks=BoardChunkStore(self.board),
            board=self.board,  # passive: it never fetches, it serves (and lies about) its board
        )
        self.node.behaviour = self.behaviour
        await self.node.start()

    async def stop(self) -> None:
        self._stop.set()
        if self.node is not None:
            await self.node.stop()
            await self.node.source.close()
        await self._transport.close()
        if self._runner is not None:
            await self._runner.cleanup()

    # ------------------------------------------------------------ endpoints

    async def _gossip(self, request: web.Request) -> web.Response:
        self.requests["gossip"] += 1
        assert self.node is not None
        self.node.handle_gossip(await request.read())
        return web.Response(status=204)

    async def _object(self, request: web.Request) -> web.StreamResponse:
        rel = request.match_info["path"]
        self.requests["object"] += 1
        b = self.behaviour
        if b.hang_objects:
            await self._stop.wait()
        data = b.objects.get(rel)
        if data is None:
            data = self.board.read(rel) if re.fullmatch(r"(runs|manifests|certs|trust)/[\w./-]+", rel) else None
        if data is None:
            raise web.HTTPNotFound()
        return web.Response(body=data, content_type="application/octet-stream")

    async def _chunk(self, request: web.Request) -> web.StreamResponse:
        self.requests["chunk"] += 1
        h = request.match_info["hash"].lower()
        data = self.board.read(chunk_rel(bytes.fromhex(h)))
        mode = self.behaviour.chunks
        if data is None or (mode == "withhold" and bytes.fromhex(h) in self.behaviour.withhold):
            raise web.HTTPNotFound()
        if mode == "corrupt":  # same size, one bit off: only the hash can tell
            data = bytes([data[0] ^ 1]) + data[1:]
        elif mode == "truncate":
            data = data[: len(data) // 2]
        elif mode == "bomb":
            return web.Response(body=gzip_bomb(), headers={"Content-Encoding": "gzip"})
        elif mode == "hang":
            await self._stop.wait()
            raise web.HTTPNotFound()
        elif mode in ("endless", "slow"):
            return await self._stream(request, data, endless=mode == "endless")
        self.sent_bytes += len(data)
        return web.Response(body=data, content_type="application/octet-stream")

    async def _stream(self, request: web.Request, data: bytes, *, endless: bool) -> web.StreamResponse:
        resp = web.StreamResponse()
        if not endless:
            resp.content_length = len(data)  # promises the real size, then trickles it
        await resp.prepare(request)
        junk = random.Random(1).randbytes(1 << 16)
        with contextlib.suppress(ConnectionError, RuntimeError):
            for i in range(1 << 14):  # at most 1 GiB, should the client never hang up
                if self._stop.is_set():
                    break
                if endless:
                    await resp.write(junk)
                    self.sent_bytes += len(junk)
                elif i < len(data):
                    await resp.write(data[i : i + 1])  # one byte every 0.2 s
                    self.sent_bytes += 1
                    await asyncio.sleep(0.2)
                else:
                    break
        return resp


async def inject_gossip(
    addr: str, *, secret: bytes, sender: NodeInfo, head_counter: int, complete: tuple[bytes, ...]
) -> None:
    """An outsider's frames: a join (Ping) and a claim to hold everything, under a wrong cluster secret."""
    ann = Announcement(RUN, head_counter, head_counter, complete=complete, seed=True)
    transport = HttpTransport()
    try:
        for message in (Ping(1, "", ()), None):
            await transport.send(addr, encode_frame(secret, GossipFrame(sender, ann, message)))
    finally:
        await transport.close()


# ---------------------------------------------------------------- boards


def mirror(src: Board, dst: Board) -> None:
    """Copy a board like a sync job would: immutable files first, each run's head last."""
    files = sorted(p for p in src.root.rglob("*") if p.is_file() and not p.name.startswith("."))
    heads = [p for p in files if p.relative_to(src.root).parts[0] == "runs"]
    for p in [*(p for p in files if p not in heads), *heads]:
        target = dst.root / p.relative_to(src.root)
        data = p.read_bytes()
        if not target.exists() or target.read_bytes() != data:
            write_atomic(target, data, sync_dir=False)


def foreign_run(tmp: Path, root: SigningKey, run_id: str = "other-run") -> tuple[Board, SigningKey]:
    """Another run under the same trust root (its own certified key, another model layout)."""
    import torch

    from patchswarm.daemon.publisher import Publisher

    key = SigningKey.generate()
    now = int(time.time() * 1000)
    cert = Certificate(key.key_id, run_id, now - 60_000, now + 86_400_000).sign(root).to_bytes()
    board = Board(tmp / f"{run_id}-board")
    pub = Publisher(board, key, run_id=run_id, certificate=cert, chunk_size=16 << 10)
    g = torch.Generator().manual_seed(5)
    pub.publish({"other.weight": torch.randn(64, 96, generator=g)})
    return board, key


# ---------------------------------------------------------------- the world


def parse_metrics(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


@dataclass
class AttackWorld:
    """Trainer board -> (public board + honest seed) and (adversary board + adversary) -> one daemon."""

    tmp: Path
    sw: Swarm = field(init=False)
    public: Board = field(init=False)
    seed: RunningNode | None = None
    adversary: Adversary = field(init=False)
    daemon: Daemon | None = None

    def __post_init__(self) -> None:
        self.sw = Swarm(self.tmp)
        self.public = Board(self.tmp / "public")
        self.adversary = Adversary(Board(self.tmp / "adversary"), self.sw.policy())

    async def start(self, *, clock_skew: str = "5m") -> None:
        self.publish(everywhere=True)
        cfg = NodeConfig("seed", RUN, SECRET, zone="z0", region="r0", is_seed=True, membership=FAST_MEMBERSHIP)
        self.seed = await start_http_node(cfg, self.sw.policy(), board=self.public, rng=random.Random(0))
        self.sw.seed = self.seed
        await self.adversary.start([self.seed.url])
        d = make_daemon(self.sw, "target", self.tmp)
        self.configure(bootstrap=[self.seed.url, self.adversary.url], seed_urls=[self.seed.url], d=d, skew=clock_skew)
        self.daemon = d
        d.start()
        await d.wait_version(1, timeout=120)

    def configure(
        self, *, bootstrap: list[str], seed_urls: list[str], d: Daemon | None = None, skew: str | None = None
    ) -> None:
        d = d or self.daemon
        assert d is not None
        text = d.config.read_text()
        text = re.sub(r"(?m)^bootstrap = .*$", f"bootstrap = {list_toml(bootstrap)}", text)
        text = re.sub(r"(?m)^seed_urls = .*$", f"seed_urls = {list_toml(seed_urls)}", text)
        if skew is not None:
            text = re.sub(r'(?m)^(root = ".*")$', rf'\1\nclock_skew = "{skew}"', text)
        d.config.write_text(text)

    async def close(self) -> None:
        if self.daemon is not None:
            self.daemon.cleanup()
        await self.adversary.stop()
        if self.seed is not None:
            await self.seed.stop()

    # ------------------------------------------------------------ trainer side

    def publish(self, *, everywhere: bool = False, to_adversary: bool = False) -> int:
        v = self.sw.publish(scale=3e-4)
        if everywhere or to_adversary:
            mirror(self.sw.board, self.adversary.board)
        if everywhere:
            mirror(self.sw.board, self.public)
        return v

    def release(self) -> None:
        """The honest copy catches up with the trainer (and the adversary's board too)."""
        mirror(self.sw.board, self.public)
        mirror(self.sw.board, self.adversary.board)

    def head_bytes(self) -> bytes:
        data = self.sw.board.read(head_rel(RUN))
        assert data is not None
        return data

    # ------------------------------------------------------------ the daemon, from outside

    @property
    def d(self) -> Daemon:
        assert self.daemon is not None
        return self.daemon

    async def status(self) -> dict[str, Any]:
        st = await self.d.status()
        assert st is not None, self.d.log.read_text()[-3000:]
        return st

    async def metrics(self) -> dict[str, float]:
        async with (
            aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=self.d.socket)) as s,
            s.get("http://d/metrics", timeout=aiohttp.ClientTimeout(total=10)) as r,
        ):
            return parse_metrics(await r.text())

    def daemon_addr(self) -> str:
        """The daemon's swarm address, as the honest seed learnt it from membership."""
        assert self.seed is not None
        for info in self.seed.node.membership.alive():
            if info.node_id == self.d.name:
                return info.addr
        raise AssertionError(f"the seed does not know {self.d.name!r}")

    def persisted_counter(self) -> int:
        """The head counter the daemon persisted (its high-water mark across restarts)."""
        path = self.d.dir / "data" / "pull-state.msgpack"
        if not path.exists():
            return -1
        obj = msgpack.unpackb(path.read_bytes(), raw=False, strict_map_key=False)
        return int(obj["head"]["counter"])

    def evidence_files(self) -> list[Path]:
        d = self.d.dir / "data" / "equivocation"
        return sorted(d.iterdir()) if d.is_dir() else []

    async def settled_metrics(self, quiet: float = 1.0) -> dict[str, float]:
        """Metrics once two readings ``quiet`` seconds apart agree (in-flight requests have landed)."""
        last = await self.metrics()
        for _ in range(30):
            await asyncio.sleep(quiet)
            now = await self.metrics()
            if {k: v for k, v in now.items() if "refused" in k} == {k: v for k, v in last.items() if "refused" in k}:
                return now
            last = now
        raise AssertionError(f"refusal counters never settled: {last}")

    async def until(self, what: str, check: Any, timeout: float = 45.0) -> Any:
        """Poll ``check()`` (async, returns a truthy value when done) with a clear failure message."""
        deadline = time.monotonic() + timeout
        last: Any = None
        while time.monotonic() < deadline:
            last = await check()
            if last:
                return last
            await asyncio.sleep(0.2)
        st = await self.d.status()
        raise AssertionError(
            f"timed out waiting for {what}: {last!r}; status {st}; log {self.d.log.read_text()[-2500:]}"
        )

    async def metric_above(self, name: str, floor: float, timeout: float = 45.0) -> dict[str, float]:
        async def check() -> dict[str, float] | None:
            m = await self.metrics()
            return m if m.get(name, 0.0) > floor else None

        result: dict[str, float] = await self.until(f"{name} > {floor}", check, timeout)
        return result

    async def assert_unchanged(self, version: int, counter: int) -> dict[str, Any]:
        """What the engine serves and the persisted high-water mark are what they were before the attack."""
        st = await self.status()
        assert st["version"] == version, st
        assert st["root"] == self.sw.served[version].root().hex(), st
        assert self.persisted_counter() == counter
        return st


def list_toml(items: list[str]) -> str:
    return "[" + ", ".join(f'"{i}"' for i in items) + "]"

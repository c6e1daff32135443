"""``patchswarm seed --run`` and ``patchswarm node``: swarm processes from the command line.

The seed serves its board over HTTP and joins the swarm as a peer that holds everything; a
node follows a run's head through the swarm, holds the newest verified version in memory and
prints one JSON line per version it applies (the rollout daemon adds the weight store).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
from collections.abc import Callable
from typing import TypeVar

from daemon.board import Board
from daemon.pull import Held
from daemon.seed import parse_listen
from protocol.files import read_file
from protocol.keys import MAX_KEY_FILE_BYTES, TrustedKeys, load_public_key
from protocol.trust import TrustState
from swarm.node import NodeConfig
from swarm.server import start_http_node

SECRET_ENV = "PATCHSWARM_CLUSTER_SECRET"
_NODE = NodeConfig("", "", b"")
N = TypeVar("N", int, float)


class SwarmCliError(Exception):
    pass


def cluster_secret(path: str | None) -> bytes:
    data = read_file(path, MAX_KEY_FILE_BYTES).strip() if path else os.environ.get(SECRET_ENV, "").encode()
    if len(data) < 16:
        raise SwarmCliError(f"a cluster secret of at least 16 bytes is required (--secret-file or ${SECRET_ENV})")
    return data


def add_swarm_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--secret-file", metavar="FILE", help=f"cluster secret for gossip (or ${SECRET_ENV})")
    p.add_argument("--name", help="node id (default: the listen address)")
    p.add_argument("--zone", default="")
    p.add_argument("--region", default="")
    p.add_argument("--advertise", metavar="URL", help="address peers use to reach this node")
    p.add_argument("--upload-rate", type=float, default=float("inf"), metavar="BYTES/S")
    p.add_argument("--download-rate", type=float, default=float("inf"), metavar="BYTES/S")
    p.add_argument("--bootstrap", action="append", default=[], metavar="URL", help="a peer or seed to join through")
    p.add_argument(
        "--max-uploads",
        type=_count,
        metavar="N",
        help=f"chunk uploads served at once (default {_NODE.max_uploads}; a seed: {_NODE.seed_max_uploads})",
    )
    p.add_argument(
        "--upload-queue",
        type=_count,
        metavar="N",
        help=f"requests waiting for an upload slot before refusals (default {_NODE.upload_queue}; "
        f"a seed: {_NODE.seed_upload_queue})",
    )
    p.add_argument(
        "--tree-fanout",
        type=_fanout,
        metavar="K",
        help="stripe trees of this fan-out (default 0: off; a seed: serve every tree's root at once)",
    )


def add_seed_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--copy-window",
        type=_seconds,
        metavar="SECONDS",
        help=f"the seed hands out each chunk once per this window (default {_NODE.seed_copy_window})",
    )
    p.add_argument(
        "--object-copies",
        type=_copies,
        metavar="N",
        help="requesters the seed hands each manifest to before it names them to the rest "
        f"(default {_NODE.seed_object_copies}; 0: serve everyone)",
    )


def _bounded(convert: Callable[[str], N], what: str, low: N, high: N) -> Callable[[str], N]:
    """An argparse type: ``convert`` the text, refusing it (with why) outside ``low..high``."""

    def parse(text: str) -> N:
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not {what}: {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{value} is outside {low}..{high}")
        return value

    return parse


_count = _bounded(int, "a whole number", 0, 1024)
_seconds = _bounded(float, "a number of seconds", 0.0, 3600.0)
_copies = _bounded(int, "a whole number", 0, 1 << 20)
_fanout = _bounded(int, "a whole number", 0, 64)


def _config(args: argparse.Namespace, *, is_seed: bool, listen: str) -> NodeConfig:
    # The seed's own slots, line and copy window are separate fields (a trainer seed is tuned apart
    # from the rollout hosts); flags left out keep NodeConfig's defaults.
    prefix = "seed_" if is_seed else ""
    tuned = {
        f"{prefix}max_uploads": args.max_uploads,
        f"{prefix}upload_queue": args.upload_queue,
        "seed_copy_window": getattr(args, "copy_window", None),
        "seed_object_copies": getattr(args, "object_copies", None),
        "tree_fanout": args.tree_fanout,
    }
    return NodeConfig(
        node_id=args.name or listen,
        run_id=args.run,
        cluster_secret=cluster_secret(args.secret_file),
        zone=args.zone,
        region=args.region,
        bootstrap=list(args.bootstrap),
        seed_urls=list(getattr(args, "seed_url", None) or []),
        is_seed=is_seed,
        upload_rate=args.upload_rate,
        download_rate=args.download_rate,
        **{k: v for k, v in tuned.items() if v is not None},
    )


async def _serve_until_signalled() -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()


def run_seed(args: argparse.Namespace) -> int:
    host, port = parse_listen(args.listen)
    board = Board(args.board)
    config = _config(args, is_seed=True, listen=args.listen)

    async def main() -> None:
        # A seed serves its own board and never takes anything from peers: it trusts no key.
        policy = TrustedKeys(frozenset())
        node = await start_http_node(config, policy, host=host, port=port, advertise=args.advertise, board=board)
        print(json.dumps({"event": "listening", "url": node.url, "node": config.node_id}), flush=True)
        try:
            await _serve_until_signalled()
        finally:
            await node.stop()

    asyncio.run(main())
    return 0


def run_node(args: argparse.Namespace) -> int:
    host, port = parse_listen(args.listen)
    trust = TrustState(load_public_key(args.trust))
    config = _config(args, is_seed=False, listen=args.listen)

    def on_version(held: Held) -> None:
        root = held.model.root().hex() if args.print_root else None
        print(json.dumps({"event": "version", "version": held.version, "root": root}), flush=True)

    async def main() -> None:
        node = await start_http_node(
            config, trust, host=host, port=port, advertise=args.advertise, on_version=on_version
        )
        print(json.dumps({"event": "listening", "url": node.url, "node": config.node_id}), flush=True)
        try:
            await _serve_until_signalled()
        finally:
            m = node.node.metrics
            print(json.dumps({"event": "stopped", "metrics": m.__dict__}), flush=True)
            await node.stop()

    asyncio.run(main())
    return 0

"""``patchswarm seed --run`` and ``patchswarm node``: swarm processes from the command line.

The seed serves its board over HTTP and joins the swarm as a peer that holds everything; a
node follows a run's head through the swarm, holds the newest verified version in memory and
prints one JSON line per version it applies (the rollout daemon adds the weight store).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING

from patchswarm.daemon import cli_args
from patchswarm.daemon.head_cli import add_seed_refresh_args, seed_refresher
from patchswarm.daemon.user_error import UserError

if TYPE_CHECKING:
    from patchswarm.daemon.board_mirror import BoardMirror
    from patchswarm.protocol.held import Held
    from patchswarm.protocol.node_config import NodeConfig
    from patchswarm.swarm.server import RunningNode
    from patchswarm.swarm.tls import TlsReloader

log = logging.getLogger("patchswarm.seed")

SECRET_ENV = "PATCHSWARM_CLUSTER_SECRET"
# NodeConfig's defaults, for the help text only (swarm.node loads torch: --help must not);
# tests/unit/daemon/test_cli_validation.py checks they match.
HELP_DEFAULTS = {
    "max_uploads": 4,
    "seed_max_uploads": 6,
    "upload_queue": 2,
    "seed_upload_queue": 4,
    "seed_copy_window": 2.0,
    "seed_object_copies": 32,
}
_NODE = argparse.Namespace(**HELP_DEFAULTS)


class SwarmCliError(Exception):
    pass


def cluster_secret(path: str | None) -> bytes:
    from patchswarm.protocol.files import read_file
    from patchswarm.protocol.keys import MAX_KEY_FILE_BYTES

    data = read_file(path, MAX_KEY_FILE_BYTES).strip() if path else os.environ.get(SECRET_ENV, "").encode()
    if len(data) < 16:
        raise SwarmCliError(f"a cluster secret of at least 16 bytes is required (--secret-file or ${SECRET_ENV})")
    return data


def tls_from_args(args: argparse.Namespace) -> TlsReloader | None:
    """Mutual TLS from --tls-ca, --tls-cert and --tls-key (all three, or none: plain HTTP)."""
    given = [args.tls_ca, args.tls_cert, args.tls_key]
    if not any(given):
        return None
    if not all(given):
        raise SwarmCliError("TLS needs --tls-ca, --tls-cert and --tls-key together")
    from pathlib import Path

    from patchswarm.swarm.tls import TlsError, TlsFiles, TlsReloader

    try:
        return TlsReloader(TlsFiles(Path(args.tls_ca), Path(args.tls_cert), Path(args.tls_key)))
    except TlsError as e:
        raise SwarmCliError(str(e)) from None


def add_tls_args(p: argparse.ArgumentParser) -> None:
    for flag, what in (("ca", "the cluster CA bundle"), ("cert", "this host's certificate"), ("key", "its key")):
        p.add_argument(
            f"--tls-{flag}",
            type=cli_args.path,
            metavar="PEM",
            help=f"mutual TLS: {what} (all three --tls-* turn TLS on; docs/daemon.md)",
        )


def add_swarm_args(p: argparse.ArgumentParser) -> None:
    add_tls_args(p)
    p.add_argument(
        "--secret-file", type=cli_args.path, metavar="FILE", help=f"cluster secret for gossip (or ${SECRET_ENV})"
    )
    p.add_argument("--name", type=cli_args.node_name, help="node id (default: the listen address)")
    p.add_argument("--zone", type=cli_args.label, default="")
    p.add_argument("--region", type=cli_args.label, default="")
    p.add_argument("--advertise", type=cli_args.url, metavar="URL", help="address peers use to reach this node")
    # The same meaning as swarm.upload_rate in the daemon's config: 0 (the default) = unlimited.
    for flag in ("--upload-rate", "--download-rate"):
        p.add_argument(
            flag, type=cli_args.rate, default=float("inf"), metavar="RATE", help="bytes/s ('100MB'); 0 = unlimited"
        )
    p.add_argument(
        "--bootstrap",
        type=cli_args.url,
        action="append",
        default=[],
        metavar="URL",
        help="a peer or seed to join through",
    )
    p.add_argument(
        "--max-uploads",
        type=cli_args.count,
        metavar="N",
        help=f"chunk uploads served at once (default {_NODE.max_uploads}; a seed: {_NODE.seed_max_uploads})",
    )
    p.add_argument(
        "--upload-queue",
        type=cli_args.count,
        metavar="N",
        help=f"requests waiting for an upload slot before refusals (default {_NODE.upload_queue}; "
        f"a seed: {_NODE.seed_upload_queue})",
    )
    p.add_argument(
        "--tree-fanout",
        type=cli_args.fanout,
        metavar="K",
        help="stripe trees of this fan-out (default 0: off; a seed: serve every tree's root at once)",
    )


def add_seed_args(p: argparse.ArgumentParser) -> None:
    add_seed_refresh_args(p)
    p.add_argument(
        "--copy-window",
        type=cli_args.seconds,
        metavar="SECONDS",
        help=f"the seed hands out each chunk once per this window (default {_NODE.seed_copy_window})",
    )
    p.add_argument(
        "--object-copies",
        type=cli_args.copies,
        metavar="N",
        help="requesters the seed hands each manifest to before it names them to the rest "
        f"(default {_NODE.seed_object_copies}; 0: serve everyone)",
    )


def _config(args: argparse.Namespace, *, is_seed: bool, listen: str) -> NodeConfig:
    from patchswarm.protocol.node_config import NodeConfig

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


def _listen(listen: str) -> tuple[str, int]:
    from patchswarm.daemon.config_values import split_listen

    try:
        return split_listen(listen)
    except ValueError as e:
        raise SwarmCliError(f"--listen: {e}") from None


def _run(main: Coroutine[None, None, None]) -> None:
    from patchswarm.daemon.config_values import ListenError
    from patchswarm.swarm.serving import raise_nofile_limit

    raise_nofile_limit()  # a node or seed serving many peers needs more than the default 1024 descriptors
    try:
        asyncio.run(main)
    except ListenError as e:  # "--listen = [::1]:7000: address already in use"
        raise SwarmCliError(str(e)) from None


def run_seed(args: argparse.Namespace) -> int:
    from patchswarm.daemon.board import Board
    from patchswarm.daemon.board_mirror import BoardMirror, StaleHeadError
    from patchswarm.daemon.board_store import StoreBoard
    from patchswarm.daemon.config_values import bind_errors
    from patchswarm.protocol.keys import TrustedKeys
    from patchswarm.swarm.board_store import parse_store_url
    from patchswarm.swarm.server import start_http_node
    from patchswarm.swarm.serving import serve_until_signalled

    host, port = _listen(args.listen)
    store = parse_store_url(args.board)
    board = Board(args.cache if store is not None else args.board)
    # A board in an object store: the seed serves a local copy of the run, kept in step (daemon/board_mirror.py).
    mirror = BoardMirror(StoreBoard(store), board, args.run) if store is not None else None
    if mirror is not None:
        try:
            mirror.sync()
        except StaleHeadError as e:  # the copy is newer than the store: serve it
            log.warning("seed: %s", e)
    config = _config(args, is_seed=True, listen=args.listen)
    tls = tls_from_args(args)
    running: list[RunningNode] = []

    def head_moved() -> None:
        for n in running:
            n.node.board_changed()

    refresher = seed_refresher(args, head_moved)

    async def main() -> None:
        # A seed serves its own board and never takes anything from peers: it trusts no key.
        policy = TrustedKeys(frozenset())
        with bind_errors("--listen", args.listen):
            node = await start_http_node(
                config, policy, host=host, port=port, advertise=args.advertise, board=board, tls=tls
            )
        running.append(node)
        refreshing = refresher() if refresher else None  # with --key: re-signs the head while the trainer is idle
        copying = asyncio.get_running_loop().create_task(_mirroring(mirror, head_moved)) if mirror else None
        print(json.dumps({"event": "listening", "url": node.url, "node": config.node_id}), flush=True)
        try:
            await serve_until_signalled(tls.reload if tls is not None else None)
        finally:
            if refreshing is not None:
                refreshing.cancel()
            if copying is not None:
                copying.cancel()
            await node.stop()

    _run(main())
    return 0


async def _mirroring(mirror: BoardMirror, head_moved: Callable[[], None]) -> None:
    """Keep a seed's copy of a board in an object store in step (a store error: tried again next tick)."""
    from patchswarm.daemon.board_mirror import MIRROR_INTERVAL_S
    from patchswarm.protocol.errors import PatchswarmError

    last = ""
    while True:
        await asyncio.sleep(MIRROR_INTERVAL_S)
        try:
            changed = await asyncio.to_thread(mirror.sync)
        except (OSError, PatchswarmError) as e:
            if str(e) != last:  # once per distinct failure, not every second
                log.warning("seed: cannot copy the board from %s: %s", mirror.src.location, e)
            last = str(e)
            continue
        last = ""
        if changed:
            head_moved()


def run_node(args: argparse.Namespace) -> int:
    from patchswarm.daemon.config_values import bind_errors
    from patchswarm.protocol.keys import load_public_key
    from patchswarm.protocol.trust import TrustState
    from patchswarm.swarm.server import start_http_node
    from patchswarm.swarm.serving import serve_until_signalled

    host, port = _listen(args.listen)
    trust = TrustState(load_public_key(args.trust))
    config = _config(args, is_seed=False, listen=args.listen)
    tls = tls_from_args(args)

    def on_version(held: Held) -> None:
        root = held.model.root().hex() if args.print_root else None
        print(json.dumps({"event": "version", "version": held.version, "root": root}), flush=True)

    async def main() -> None:
        with bind_errors("--listen", args.listen):
            node = await start_http_node(
                config, trust, host=host, port=port, advertise=args.advertise, on_version=on_version, tls=tls
            )
        print(json.dumps({"event": "listening", "url": node.url, "node": config.node_id}), flush=True)
        try:
            await serve_until_signalled(tls.reload if tls is not None else None)
        finally:
            m = node.node.metrics
            print(json.dumps({"event": "stopped", "metrics": m.__dict__}), flush=True)
            await node.stop()

    _run(main())
    return 0


def cmd_node(args: argparse.Namespace) -> int:
    """``patchswarm node``: its errors as the command line's one line."""
    try:
        return run_node(args)
    except (SwarmCliError, ValueError) as e:
        raise UserError(str(e)) from None

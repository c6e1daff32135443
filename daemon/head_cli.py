"""``patchswarm head refresh`` (once, for cron) and the seed's background head refresher.

Both re-sign the board's head of one run with the run's key (daemon/head_refresh.py): same
version and catalog, counter + 1, a fresh expiry, so hosts do not take an idle trainer's board
for a frozen one.  ``--head-ttl`` is shared with ``patchswarm publish`` and ``patchswarm seed``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from patchswarm.daemon import cli_args
from patchswarm.daemon.run_rules import DEFAULT_HEAD_TTL_S, MAX_HEAD_TTL_S, MIN_HEAD_TTL_S, check_head_ttl

# The board, keys and the refresher load torch and cryptography: only inside the commands, so that
# ``patchswarm --help`` stays light (daemon/cli.py).
if TYPE_CHECKING:
    from patchswarm.daemon.board_store import AnyBoard
    from patchswarm.protocol.keys import SigningKey

log = logging.getLogger("patchswarm.head")


class HeadCliError(Exception):
    """One line for the user (the caller prints it and exits 1)."""


def head_ttl_arg(text: str) -> float:
    """argparse type of ``--head-ttl``: seconds, within the bounds ``Publisher(head_ttl=...)`` takes."""
    try:
        return check_head_ttl(float(text))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not a number of seconds between {MIN_HEAD_TTL_S:.0f} and {MAX_HEAD_TTL_S:.0f}: {text!r}"
        ) from None


def add_head_ttl_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--head-ttl",
        type=head_ttl_arg,
        default=DEFAULT_HEAD_TTL_S,
        metavar="SECONDS",
        help=f"lifetime of each signed head (default {DEFAULT_HEAD_TTL_S:g}); re-signed every third of it while idle",
    )


def add_seed_refresh_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--key", metavar="KEY", help="the run's signing key: re-sign its head while the trainer is idle")
    p.add_argument("--cert", metavar="CERT", help="certificate of KEY (default: the board's)")
    add_head_ttl_arg(p)


def add_head_parser(sub: Any) -> None:
    h = sub.add_parser("head", help="manage a run's signed head on a board")
    hsub = h.add_subparsers(dest="head_command", required=True)
    r = hsub.add_parser("refresh", help="re-sign a run's head with a fresh expiry (once; for cron)")
    r.add_argument(
        "--board", required=True, type=cli_args.board, metavar="BOARD", help="a directory or s3:// gs:// az:// URL"
    )
    r.add_argument("--key", required=True, metavar="KEY", help="a key certified for the run (or the one it began with)")
    r.add_argument("--run-id", required=True, type=cli_args.run_id)
    r.add_argument("--cert", metavar="CERT", help="certificate of KEY to place on the board")
    add_head_ttl_arg(r)
    r.set_defaults(func=cmd_head_refresh)


def _signer(board_dir: str, key_path: str, cert_path: str | None) -> tuple[AnyBoard, SigningKey, bytes | None]:
    from patchswarm.daemon.board import Board
    from patchswarm.daemon.board_store import open_board
    from patchswarm.protocol.board_names import MAX_DOC_BYTES
    from patchswarm.protocol.files import read_file
    from patchswarm.protocol.keys import SigningKey

    board = open_board(board_dir)
    if isinstance(board, Board) and not board.root.is_dir():
        raise HeadCliError(f"{board_dir} is not a directory")
    key = SigningKey.load(key_path)
    cert = read_file(cert_path, MAX_DOC_BYTES) if cert_path else None
    return board, key, cert


def cmd_head_refresh(args: argparse.Namespace) -> int:
    from patchswarm.daemon.head_refresh import refresh_board_head

    board, key, cert = _signer(args.board, args.key, args.cert)
    head = refresh_board_head(board, key, args.run_id, head_ttl=args.head_ttl, certificate=cert)
    assert head is not None  # not only_after: always re-signed
    expires = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(head.expires_ms / 1000))
    print(f"run {args.run_id!r}: head re-signed at version {head.version}, counter {head.counter}, expires {expires}")
    return 0


def seed_refresher(args: argparse.Namespace, on_refresh: Callable[[], None]) -> Callable[[], asyncio.Task[None]] | None:
    """The seed's refresher (``--key`` given), to start inside its event loop; None without a key."""
    if not getattr(args, "key", None):
        return None
    from patchswarm.daemon.head_refresh import refresh_board_head
    from patchswarm.protocol.errors import PatchswarmError

    try:
        board, key, cert = _signer(args.board, args.key, args.cert)
    except (OSError, PatchswarmError) as e:
        raise HeadCliError(f"--key/--cert: {e}") from None
    ttl: float = args.head_ttl

    async def loop() -> None:
        while True:
            await asyncio.sleep(ttl / 6)
            try:
                head = await asyncio.to_thread(
                    refresh_board_head, board, key, args.run, head_ttl=ttl, certificate=cert, only_after=ttl / 3
                )
            except (OSError, PatchswarmError) as e:  # no head yet, or a key the run's root does not trust
                log.warning("seed: cannot refresh the head of run %r: %s", args.run, e)
                continue
            if head is not None:
                on_refresh()

    return lambda: asyncio.get_running_loop().create_task(loop())

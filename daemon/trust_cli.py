"""``patchswarm keygen``, ``certify``, ``revoke`` and ``rotate-root``: keys and the trust root."""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

from patchswarm.daemon.cli_console import now_ms, say
from patchswarm.daemon.user_error import UserError
from patchswarm.protocol.board_names import root_rel

if TYPE_CHECKING:
    from patchswarm.daemon.board_store import AnyBoard
    from patchswarm.protocol.keys import SigningKey
    from patchswarm.protocol.trust import RootDocument


def cmd_keygen(args: argparse.Namespace) -> int:
    from patchswarm.protocol.keys import SigningKey

    for p in (args.output, f"{args.output}.pub"):
        if os.path.lexists(p):  # checked for both before either is written: never half a key pair
            raise UserError(f"{p} already exists; refusing to overwrite a key")
    key = SigningKey.generate()
    try:
        key.save(args.output)
    except FileExistsError:
        raise UserError(f"{args.output} already exists; refusing to overwrite a key") from None
    say(f"wrote {args.output} and {args.output}.pub (key id {key.key_id.hex()[:16]})")
    if args.root:
        say(
            f"this is a ROOT key: keep {args.output} offline; install {args.output}.pub on every host "
            "(trust root) and use the private key only to certify, revoke and rotate"
        )
    return 0


def cmd_certify(args: argparse.Namespace) -> int:
    from patchswarm.daemon.board_store import open_board
    from patchswarm.protocol.files import write_atomic
    from patchswarm.protocol.keys import SigningKey, load_public_key
    from patchswarm.protocol.trust import Certificate

    root = SigningKey.load(args.root)
    now = now_ms()
    cert = Certificate(load_public_key(args.key), args.run_id, now, now + int(args.days * 86_400_000))
    env = cert.sign(root).to_bytes()
    if args.output:
        write_atomic(Path(args.output), env)
    if args.board:
        open_board(args.board).put_certificate(cert.key, env)
    say(
        f"certified key {cert.key.hex()[:16]} for run {args.run_id!r} until "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(cert.not_after_ms / 1000))}"
    )
    return 0


def _next_root(board: AnyBoard, root: SigningKey) -> RootDocument:
    from patchswarm.protocol.trust import RootDocument, TrustState

    state = TrustState(root.key_id)
    for v in board.root_versions():
        data = board.read(root_rel(v))
        assert data is not None
        state.update_root(data)
    return state.root or RootDocument(0, (root.key_id,))


def cmd_revoke(args: argparse.Namespace) -> int:
    from patchswarm.daemon.board_store import open_board
    from patchswarm.protocol.keys import SigningKey, load_public_key
    from patchswarm.protocol.trust import RootDocument

    board = open_board(args.board)
    root = SigningKey.load(args.root)
    cur = _next_root(board, root)
    revoked = load_public_key(args.key)
    doc = RootDocument(cur.version + 1, cur.keys, tuple(sorted({*cur.revoked, revoked})))
    board.put_root(doc.version, doc.sign(root).to_bytes())
    say(f"root document {doc.version}: key {revoked.hex()[:16]} revoked")
    return 0


def cmd_rotate_root(args: argparse.Namespace) -> int:
    from patchswarm.daemon.board_store import open_board
    from patchswarm.protocol.keys import SigningKey, load_public_key
    from patchswarm.protocol.trust import RootDocument

    board = open_board(args.board)
    root = SigningKey.load(args.root)
    cur = _next_root(board, root)
    doc = RootDocument(cur.version + 1, (load_public_key(args.new_root),), cur.revoked)
    board.put_root(doc.version, doc.sign(root).to_bytes())
    say(f"root document {doc.version}: root key is now {doc.keys[0].hex()[:16]}")
    return 0

"""``patchswarm publish``, ``seed`` and ``pull``: a board written, served over HTTP, and read back."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from patchswarm.daemon import cli_args
from patchswarm.daemon.cli_console import err_console, say
from patchswarm.daemon.patch_cli import write_model
from patchswarm.daemon.user_error import UserError
from patchswarm.protocol.payload_formats import DEFAULT_FORMAT

if TYPE_CHECKING:
    from patchswarm.daemon.publisher import Publisher
    from patchswarm.daemon.served_format import ServedFormat


def cmd_publish(args: argparse.Namespace) -> int:
    from patchswarm.daemon.checkpoint import read_checkpoint
    from patchswarm.daemon.publish_chain import PublishInfo

    ckpt = read_checkpoint(args.model)
    from patchswarm.protocol.board_names import MAX_DOC_BYTES
    from patchswarm.protocol.files import read_file

    cert = read_file(args.cert, MAX_DOC_BYTES) if args.cert else None
    try:
        pub = _publisher(args, cert)
    except ValueError as e:
        raise UserError(str(e)) from None
    info = pub.publish(ckpt.tensors, anchor=args.anchor, metadata=ckpt.metadata())
    pub.close()
    assert isinstance(info, PublishInfo)
    say(
        f"published version {info.version} of run {args.run_id!r} (served {_format_label(pub.format)}"
        + (f", payload format {pub.payload_format}" if pub.payload_format != DEFAULT_FORMAT else "")
        + "): "
        f"{100 * info.changed_fraction:.3f}% changed, "
        f"patch {info.patch_bytes:,} bytes" + (f", anchor {info.anchor_bytes:,} bytes" if info.anchor_bytes else "")
    )
    return 0


def _format_label(fmt: ServedFormat) -> str:
    if fmt.name != "fp8_e4m3":
        return fmt.name.replace("_", "-")
    return f"fp8-e4m3, {f'{fmt.block}x{fmt.block} block' if fmt.block else 'per-tensor'} scales"


def _served_format(args: argparse.Namespace) -> ServedFormat:
    from patchswarm.daemon.served_format import ServedFormat

    if args.fp8_block is not None and args.served_format != "fp8_e4m3":
        raise UserError("--fp8-block applies to --served-format fp8-e4m3 only")
    if args.served_format != "fp8_e4m3":
        return ServedFormat(args.served_format)
    block = 128 if args.fp8_block is None else args.fp8_block
    return ServedFormat(args.served_format, block=block or None)


def _publisher(args: argparse.Namespace, cert: bytes | None) -> Publisher:
    from patchswarm.daemon.publisher import Publisher
    from patchswarm.protocol.keys import SigningKey

    return Publisher(
        args.board,
        SigningKey.load(args.key),
        run_id=args.run_id,
        anchor_every=args.anchor_every,
        certificate=cert,
        chunk_size=args.chunk_size,
        payload_format=args.payload_format,
        served_format=_served_format(args),
        head_ttl=args.head_ttl,
        refresh=False,  # one version and exit: `patchswarm seed --key` or `head refresh` keeps the head fresh
    )


def cmd_seed(args: argparse.Namespace) -> int:
    from patchswarm.daemon.config_values import split_listen
    from patchswarm.swarm.board_http import board_app
    from patchswarm.swarm.board_store import local_path, parse_store_url
    from patchswarm.swarm.serving import ServerLimits, raise_nofile_limit, run_app

    host, port = split_listen(args.listen)
    args.board = local_path(args.board) or args.board
    if parse_store_url(args.board) is not None:
        if not (args.run and args.cache):
            raise UserError(
                f"{args.board}: a seed serves a local copy of a board in an object store: give --run RUN and "
                "--cache DIR (or let hosts read the store directly: swarm.seed_urls, docs/daemon.md)"
            )
        Path(args.cache).mkdir(parents=True, exist_ok=True)
    elif not Path(args.board).is_dir():
        raise UserError(f"{args.board} is not a directory")
    if args.key and not args.run:
        raise UserError("--key needs --run (the run whose head the seed re-signs)")
    try:
        limits = ServerLimits.from_env()
    except ValueError as e:
        raise UserError(str(e)) from None
    raise_nofile_limit()
    if args.run:
        from patchswarm.daemon.swarm_cli import SwarmCliError, run_seed

        try:
            return run_seed(args)
        except SwarmCliError as e:
            raise UserError(str(e)) from None
    from patchswarm.daemon.config_values import ListenError, bind_errors
    from patchswarm.daemon.swarm_cli import SwarmCliError, tls_from_args

    try:
        tls = tls_from_args(args)
    except SwarmCliError as e:
        raise UserError(str(e)) from None
    ready = f"serving board {args.board} on {'https' if tls else 'http'}://{host}:{port}/"
    try:
        with bind_errors("--listen", args.listen):
            run_app(
                board_app(args.board),
                host,
                port,
                limits,
                on_ready=lambda: err_console().print(ready, markup=False, highlight=False),
                ssl_context=tls.server_context() if tls else None,
                on_hangup=tls.reload if tls else None,  # (SIGHUP: the certificate files, now)
            )
    except ListenError as e:
        raise UserError(str(e)) from None
    return 0


def run_from(url: str, run: str | None) -> tuple[str, str]:
    """The board and run of ``pull``; ArgumentTypeError when the run is neither given nor in the URL."""
    if run:
        return url, run
    base, sep, tail = url.rstrip("/").rpartition("/runs/")
    if sep and tail:
        return base, cli_args.run_id(tail)
    raise argparse.ArgumentTypeError("name the run with --run (or give the URL as BOARD/runs/RUN)")


def cmd_pull(args: argparse.Namespace) -> int:
    import asyncio

    from patchswarm.daemon.checkpoint import read_served
    from patchswarm.daemon.pull_state import PullState
    from patchswarm.daemon.swarm_cli import SwarmCliError, tls_from_args
    from patchswarm.protocol.held import Held
    from patchswarm.protocol.keys import load_public_key
    from patchswarm.protocol.trust import TrustState
    from patchswarm.swarm.board_sources import source_for
    from patchswarm.swarm.client_errors import shown_url
    from patchswarm.swarm.puller import Puller

    url, run = args.source, args.run
    try:
        tls = tls_from_args(args)
    except SwarmCliError as e:
        raise UserError(str(e)) from None
    if tls is not None and not url.startswith("https://"):
        raise UserError(f"--tls-* is for a board served over https://, got --from {shown_url(url)}")
    trust = TrustState(load_public_key(args.trust))
    state = PullState.load(Path(args.state), run) if args.state else None
    if state:
        state.restore_into(trust)
    have = read_served(args.have) if args.have else None

    async def go() -> tuple[Held, Puller]:
        src = source_for(url, tls=tls)
        try:
            puller = Puller(src, trust, run, tracker=state.tracker if state else None)
            head = await puller.fetch_head()
            held = await puller.identify(head, have) if have is not None else None
            if have is not None and held is None:
                err_console().print("[yellow]note:[/] --have matches no retained version; starting from an anchor")
            return await puller.catch_up(held, head, in_place=True), puller
        finally:
            await src.close()

    held, puller = asyncio.run(go())
    wrote = write_model(held.model, args.to)
    if args.state:
        PullState(puller.tracker).save(Path(args.state), trust)
    steps = ", ".join(f"{e.kind.value} {e.version}" for e in puller.stats.steps) or "nothing (already current)"
    fetched = puller.stats.bytes_fetched
    say(f"{args.to}: version {held.version} of run {run!r} verified ({wrote}); fetched {fetched:,} bytes via {steps}")
    return 0

"""The ``patchswarm`` command line.

User errors (bad files, failed verification, missing paths) print one line on stderr and
exit with status 1; usage errors exit with 2 (argparse).  Nothing partial is ever written:
outputs are staged and renamed into place only after verification.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from patchswarm.daemon import cli_args
from patchswarm.daemon.certs import add_certs_parser
from patchswarm.daemon.head_cli import HeadCliError, add_head_parser, add_head_ttl_arg
from patchswarm.daemon.simulate_cli import add_simulate_parser
from patchswarm.daemon.swarm_cli import add_seed_args, add_swarm_args, add_tls_args
from patchswarm.daemon.user_error import UserError
from patchswarm.protocol.board_names import root_rel

# Everything heavy (torch, numpy, aiohttp, rich) loads inside the command that needs it, so that
# ``--help``, ``--version`` and a usage error answer at once.
if TYPE_CHECKING:
    from rich.console import Console

    from patchswarm.daemon.board_store import AnyBoard
    from patchswarm.daemon.publisher import Publisher
    from patchswarm.daemon.served_format import ServedFormat
    from patchswarm.protocol.keys import SigningKey, TrustedKeys
    from patchswarm.protocol.served import ServedModel
    from patchswarm.protocol.trust import RootDocument


@functools.cache
def _err() -> Console:
    from rich.console import Console

    return Console(stderr=True, soft_wrap=True, emoji=False)


@functools.cache
def _out() -> Console:
    from rich.console import Console

    return Console(soft_wrap=True, emoji=False)


def say(text: str) -> None:
    """One line on stdout, with no rich markup: paths and run ids print as they are."""
    _out().print(text, markup=False, highlight=False)


def warn(text: str) -> None:
    _err().print(f"[yellow]warning:[/] {_escape(text)}")


def _escape(text: str) -> str:
    from rich.markup import escape

    return escape(text)


def one_line(text: str) -> str:
    """``text`` on one line: control characters and undecodable bytes (from argv) escaped."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def _now_ms() -> int:
    return int(time.time() * 1000)


@contextmanager
def _progress(label: str, total: int) -> Iterator[Callable[[int], None]]:
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

    err = _err()
    with Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TimeRemainingColumn(),
        console=err,
        transient=True,
        disable=not err.is_terminal,
    ) as bar:
        task = bar.add_task(label, total=total)
        yield lambda n: bar.advance(task, n)


def _trust(paths: Sequence[str] | None) -> TrustedKeys | None:
    from patchswarm.protocol.keys import TrustedKeys, load_public_key

    if not paths:
        return None
    return TrustedKeys(frozenset(load_public_key(p) for p in paths))


# ---------------------------------------------------------------- commands


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


def cmd_diff(args: argparse.Namespace) -> int:
    from patchswarm.daemon.checkpoint import read_served
    from patchswarm.protocol.keys import SigningKey
    from patchswarm.protocol.patchfile import build_version, write_file

    base = read_served(args.base)
    target = read_served(args.target)
    key = SigningKey.load(args.key) if args.key else None
    with _progress("diff+encode", target.nbytes) as advance:
        v = build_version(
            base,
            target,
            run_id=args.run_id,
            version=args.version,
            base_version=args.base_version,
            now_ms=_now_ms(),
            key=key,
            chunk_size=args.chunk_size,
            level=args.level,
            progress=advance,
        )
    write_file(args.output, v)
    enc = v.encoded
    assert enc is not None
    size = v.manifest.payload_size
    say(
        f"{args.output}: version {v.manifest.version}, {enc.changed:,} of {enc.numel:,} elements changed "
        f"({100 * enc.changed / max(enc.numel, 1):.3f}%), {size:,} bytes "
        f"({100 * size / max(target.nbytes, 1):.3f}% of {target.nbytes:,}), {len(v.manifest.chunks)} chunks"
        + ("" if key else " [unsigned]")
    )
    return 0


def cmd_apply(args: argparse.Namespace) -> int:
    from patchswarm.daemon.checkpoint import read_served
    from patchswarm.protocol.patchfile import apply_version, open_file, read_patch_file

    policy = _trust(args.trust)
    data = read_patch_file(args.patch)
    v = open_file(data, policy, now_ms=_now_ms())
    base = read_served(args.base)
    model, _ = apply_version(base, v.manifest, v.payload)
    _write_model(model, args.output, like_dir=os.path.isdir(args.base))
    if policy is None:  # after the work: an error stays the only line of a failed run
        warn("no --trust given: signature not checked (integrity still is)")
    say(f"{args.output}: version {v.manifest.version} verified (root {v.manifest.target_root.hex()[:16]})")
    return 0


def _write_model(model: ServedModel, out: str, *, like_dir: bool = False) -> str:
    """Write a served version to ``out``: a checkpoint directory or a safetensors file (checkpoint.py's
    ``wants_directory`` decides); the words that say which."""
    from patchswarm.daemon.checkpoint import wants_directory
    from patchswarm.daemon.checkpoint_writer import write_checkpoint
    from patchswarm.protocol.safetensors_io import save_safetensors

    if wants_directory(out, like_dir=like_dir, metadata=model.metadata):
        written = write_checkpoint(model, out.rstrip("/"))
        return f"checkpoint directory, {len(written.shards)} shard(s)"
    save_safetensors(model, out)
    return "safetensors file"


def cmd_verify(args: argparse.Namespace) -> int:
    from patchswarm.protocol.patch_format import read_header
    from patchswarm.protocol.patchfile import open_file, read_patch_file

    v = open_file(read_patch_file(args.patch), _trust(args.trust), now_ms=_now_ms())
    read_header(v.payload, list(v.manifest.specs))
    say(
        f"OK: version {v.manifest.version} of run {v.manifest.run_id!r}, signed by {v.signed.key_id.hex()[:16]}, "
        f"{len(v.manifest.chunks)} chunks verified"
    )
    return 0


def inspect_data(path: str) -> dict[str, Any]:
    from patchswarm.protocol.patch_format import read_header
    from patchswarm.protocol.patchfile import open_file, read_patch_file

    v = open_file(read_patch_file(path), None, verify_chunks=True)
    m = v.manifest
    header = read_header(v.payload, list(m.specs))
    tensors = [
        {
            "name": s.name,
            "dtype": s.dtype,
            "shape": list(s.shape),
            "encoding": enc.name,
            "changed": k,
            "numel": s.numel,
        }
        for s, (enc, k) in zip(m.specs, header.records, strict=True)
    ]
    elements = sum(s.numel for s in m.specs)
    changed = sum(k for enc, k in header.records if enc.name != "FULL") if m.kind == "patch" else elements
    return {
        "run_id": m.run_id,
        "version": m.version,
        "kind": str(m.kind),
        "base_version": m.base_version,
        "elements": elements,
        "changed": changed,
        "changed_fraction": changed / max(elements, 1),
        "served_bytes": m.nbytes,
        "encoded_bytes": m.payload_size,
        "raw_stream_bytes": m.raw_size,
        "chunk_size": m.chunk_size,
        "chunk_count": len(m.chunks),
        "signed_by": v.signed.key_id.hex() if v.signed.signed else None,
        "created_ms": m.created_ms,
        "expires_ms": m.expires_ms,
        "target_root": m.target_root.hex(),
        "streams": [{"name": n, "raw": r, "compressed": len(c)} for n, r, c in header.streams],
        "tensors": tensors,
    }


def cmd_inspect(args: argparse.Namespace) -> int:
    import json

    from rich.table import Table

    info = inspect_data(args.patch)
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    out = _out()
    out.print(
        f"[bold]version {info['version']}[/] ({info['kind']}, run {_escape(repr(info['run_id']))}"
        + (f", base {info['base_version']}" if info["base_version"] is not None else "")
        + f"), {info['changed']:,} of {info['elements']:,} elements changed ({100 * info['changed_fraction']:.3f}%)"
    )
    say(
        f"encoded {info['encoded_bytes']:,} bytes for {info['served_bytes']:,} served "
        f"({100 * info['encoded_bytes'] / max(info['served_bytes'], 1):.3f}%), "
        f"{info['chunk_count']} chunks of {info['chunk_size']:,}; "
        + (f"signed by {info['signed_by'][:16]}" if info["signed_by"] else "unsigned")
        + " (signature not checked: use verify)"
    )
    table = Table("tensor", "dtype", "shape", "encoding", "changed")
    for t in info["tensors"]:
        # Names come from the file: escaped, never read as markup.
        table.add_row(
            _escape(t["name"]), t["dtype"], "x".join(map(str, t["shape"])), t["encoding"], f"{t['changed']:,}"
        )
    out.print(table)
    return 0


def cmd_certify(args: argparse.Namespace) -> int:
    from patchswarm.daemon.board_store import open_board
    from patchswarm.protocol.files import write_atomic
    from patchswarm.protocol.keys import SigningKey, load_public_key
    from patchswarm.protocol.trust import Certificate

    root = SigningKey.load(args.root)
    now = _now_ms()
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


def cmd_publish(args: argparse.Namespace) -> int:
    from patchswarm.daemon.checkpoint import read_checkpoint
    from patchswarm.daemon.publisher import PublishInfo

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
        f"published version {info.version} of run {args.run_id!r} (served {_format_label(pub.format)}): "
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
        served_format=_served_format(args),
        head_ttl=args.head_ttl,
        refresh=False,  # one version and exit: `patchswarm seed --key` or `head refresh` keeps the head fresh
    )


def cmd_seed(args: argparse.Namespace) -> int:
    from patchswarm.daemon.config import split_listen
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
    from patchswarm.daemon.config import ListenError, bind_errors
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
                on_ready=lambda: _err().print(ready, markup=False, highlight=False),
                ssl_context=tls.server_context() if tls else None,
                on_hangup=tls.reload if tls else None,  # (SIGHUP: the certificate files, now)
            )
    except ListenError as e:
        raise UserError(str(e)) from None
    return 0


def cmd_daemon(args: argparse.Namespace) -> int:
    import asyncio

    from patchswarm.daemon.config import ConfigError, load_config
    from patchswarm.daemon.logs import setup_logging
    from patchswarm.daemon.rollout import DaemonError, run_daemon
    from patchswarm.daemon.store_format import StoreError

    try:
        cfg = load_config(args.config)
        cfg.cluster_secret()
    except ConfigError as e:
        raise UserError(str(e)) from None
    setup_logging(cfg["log.format"], cfg["log.level"])
    try:
        asyncio.run(run_daemon(cfg))
    except (DaemonError, ConfigError, StoreError) as e:
        raise UserError(str(e)) from None
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from patchswarm.daemon.status_cli import StatusError, run_status

    socket_path = args.socket
    if socket_path is None and args.config:
        from patchswarm.daemon.config import ConfigError, load_config

        try:
            socket_path = load_config(args.config)["api.socket"]
        except ConfigError as e:
            raise UserError(str(e)) from None
    try:
        return run_status(socket_path or "/run/patchswarm/api.sock", as_json=args.json, live=args.watch)
    except StatusError as e:
        raise UserError(str(e)) from None


def cmd_node(args: argparse.Namespace) -> int:
    from patchswarm.daemon.swarm_cli import SwarmCliError, run_node

    try:
        return run_node(args)
    except (SwarmCliError, ValueError) as e:
        raise UserError(str(e)) from None


def _run_from(url: str, run: str | None) -> tuple[str, str]:
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
                _err().print("[yellow]note:[/] --have matches no retained version; starting from an anchor")
            return await puller.catch_up(held, head, in_place=True), puller
        finally:
            await src.close()

    held, puller = asyncio.run(go())
    wrote = _write_model(held.model, args.to)
    if args.state:
        PullState(puller.tracker).save(Path(args.state), trust)
    steps = ", ".join(f"{e.kind.value} {e.version}" for e in puller.stats.steps) or "nothing (already current)"
    fetched = puller.stats.bytes_fetched
    say(f"{args.to}: version {held.version} of run {run!r} verified ({wrote}); fetched {fetched:,} bytes via {steps}")
    return 0


# ---------------------------------------------------------------- parser


class _Parser(argparse.ArgumentParser):
    """Usage errors in one line (exit 2): the argument, why, and where help is."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {one_line(message)} (see {self.prog} --help)\n")


def package_version() -> str:
    """The installed distribution's version; the source tree's pyproject.toml when not installed."""
    from importlib import metadata

    try:
        return metadata.version("patchswarm")
    except metadata.PackageNotFoundError:
        pass
    import tomllib

    try:
        with open(Path(__file__).resolve().parents[1] / "pyproject.toml", "rb") as fh:
            return str(tomllib.load(fh)["project"]["version"])
    except (OSError, KeyError, tomllib.TOMLDecodeError):
        return "unknown"


class _VersionAction(argparse.Action):
    """``--version``, looked up only when asked for."""

    def __init__(self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS, **kw: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help=kw.get("help"))

    def __call__(self, parser: argparse.ArgumentParser, *_: Any, **__: Any) -> None:
        print(f"patchswarm {package_version()}")
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="patchswarm", description="Lossless weight patches for RL post-training.")
    p.add_argument("--version", action=_VersionAction, help="print the version and exit")
    sub = p.add_subparsers(dest="command", required=True)
    path, out = cli_args.path, cli_args.output_path

    k = sub.add_parser("keygen", help="create an Ed25519 signing key (KEY and KEY.pub)")
    k.add_argument("-o", "--output", type=out, required=True, metavar="KEY")
    k.add_argument("--root", action="store_true", help="a root key (kept offline; certifies trainer keys)")
    k.set_defaults(func=cmd_keygen)

    c = sub.add_parser("certify", help="root key certifies a trainer key for a run, with an expiry")
    c.add_argument("--root", type=path, required=True, metavar="ROOT.key")
    c.add_argument("--key", type=path, required=True, metavar="TRAINER.key.pub")
    c.add_argument("--run-id", type=cli_args.run_id, required=True)
    c.add_argument(
        "--days",
        type=cli_args.days,
        default=30.0,
        help=f"validity in days (default 30, at most {cli_args.MAX_CERT_DAYS:g})",
    )
    c.add_argument("-o", "--output", type=out, metavar="CERT", help="write the certificate here")
    c.add_argument("--board", type=cli_args.board, metavar="BOARD", help="and/or place it on this board")
    c.set_defaults(func=cmd_certify, check=_check_certify)

    r = sub.add_parser("revoke", help="publish the next root document, revoking a trainer key")
    r.add_argument("--root", type=path, required=True, metavar="ROOT.key")
    r.add_argument("--board", type=cli_args.board, required=True, metavar="BOARD")
    r.add_argument("key", type=path, metavar="TRAINER.key.pub")
    r.set_defaults(func=cmd_revoke)

    rr = sub.add_parser("rotate-root", help="publish the next root document, handing over to a new root key")
    rr.add_argument("--root", type=path, required=True, metavar="ROOT.key")
    rr.add_argument("--board", type=cli_args.board, required=True, metavar="BOARD")
    rr.add_argument("--new-root", type=path, required=True, metavar="NEW_ROOT.key.pub")
    rr.set_defaults(func=cmd_rotate_root)

    pb = sub.add_parser("publish", help="publish a served version of a checkpoint onto a board")
    pb.add_argument("model", type=path, metavar="MODEL", help="checkpoint directory or .safetensors file")
    pb.add_argument(
        "--board", type=cli_args.board, required=True, metavar="BOARD", help="a directory or s3:// gs:// az:// URL"
    )
    pb.add_argument("--key", type=path, required=True, metavar="KEY")
    pb.add_argument("--run-id", type=cli_args.run_id, required=True)
    pb.add_argument("--cert", type=path, metavar="CERT", help="certificate of KEY to place on the board")
    pb.add_argument("--anchor", action="store_true", help="also publish this version as a full anchor")
    pb.add_argument("--anchor-every", type=cli_args.anchor_every, default=10, metavar="N")
    pb.add_argument("--chunk-size", type=cli_args.chunk_size, default=1 << 20, metavar="BYTES")
    pb.add_argument(
        "--served-format",
        type=cli_args.served_format,
        default="bf16",
        metavar="|".join(cli_args.SERVED_FORMATS),
        help="the dtype hosts serve (default bf16; as-is ships the file's own dtypes)",
    )
    pb.add_argument(
        "--fp8-block",
        type=cli_args.fp8_block,
        metavar="N|per-tensor",
        help="fp8-e4m3 scales: NxN blocks (default 128) or one per tensor",
    )
    add_head_ttl_arg(pb)
    pb.set_defaults(func=cmd_publish)

    sd = sub.add_parser("seed", help="serve a board over HTTP")
    sd.add_argument("--board", type=cli_args.board, required=True, metavar="BOARD")
    sd.add_argument("--listen", type=cli_args.listen, default="127.0.0.1:8700", metavar="HOST:PORT")
    sd.add_argument(
        "--run", type=cli_args.run_id, help="also join the swarm of this run as a peer that holds everything"
    )
    sd.add_argument(
        "--cache",
        type=path,
        metavar="DIR",
        help="with an s3:// gs:// az:// board: the local copy of the run the seed serves (kept in step)",
    )
    add_swarm_args(sd)
    add_seed_args(sd)
    sd.set_defaults(func=cmd_seed)

    dm = sub.add_parser("daemon", help="run the rollout-host daemon (see docs/daemon.md)")
    dm.add_argument("--config", type=path, required=True, metavar="daemon.toml")
    dm.set_defaults(func=cmd_daemon)

    st = sub.add_parser("status", help="show the local daemon's state (from its unix socket)")
    st.add_argument(
        "--socket", type=path, metavar="PATH", help="API socket (default: from --config, else /run/patchswarm/api.sock)"
    )
    st.add_argument("--config", type=path, metavar="daemon.toml")
    st.add_argument("--json", action="store_true")
    st.add_argument("--watch", action="store_true", help="live view")
    st.set_defaults(func=cmd_status)

    nd = sub.add_parser("node", help="follow a run through the swarm, holding the newest version in memory")
    nd.add_argument("--listen", type=cli_args.listen, required=True, metavar="HOST:PORT")
    nd.add_argument("--run", type=cli_args.run_id, required=True)
    nd.add_argument("--trust", type=path, required=True, metavar="ROOT.pub")
    nd.add_argument(
        "--seed-url", type=cli_args.board_url, action="append", metavar="URL", help="board URL polled for the head"
    )
    nd.add_argument("--print-root", action="store_true", help="print each version's state root")
    add_swarm_args(nd)
    nd.set_defaults(func=cmd_node)

    pl = sub.add_parser("pull", help="fetch, verify and write the head version of a run")
    pl.add_argument(
        "--from",
        dest="source",
        type=cli_args.board_source,
        required=True,
        metavar="URL",
        help="board: http(s)://, s3://, gs://, az:// URL or a directory",
    )
    pl.add_argument("--run", type=cli_args.run_id, metavar="RUN", help="run id (or give --from as BOARD/runs/RUN)")
    pl.add_argument("--trust", type=path, required=True, metavar="ROOT.pub")
    pl.add_argument(
        "--to",
        type=cli_args.output_target,
        required=True,
        metavar="OUT",
        help="a .safetensors file or a checkpoint directory (DIR/; the default when the run ships checkpoints)",
    )
    pl.add_argument(
        "--have", type=path, metavar="OLD", help="a version already held, file or directory (patches from it)"
    )
    pl.add_argument("--state", type=out, metavar="FILE", help="persist the high-water mark here (refuses rewinds)")
    add_tls_args(pl)  # (a seed serving over mutual TLS: --from https://...)
    pl.set_defaults(func=cmd_pull, check=_check_pull)

    d = sub.add_parser("diff", help="encode TARGET against BASE into a self-contained patch file")
    d.add_argument("base", type=path, metavar="BASE", help="checkpoint directory or .safetensors file")
    d.add_argument("target", type=path, metavar="TARGET", help="checkpoint directory or .safetensors file")
    d.add_argument("-o", "--output", type=out, required=True, metavar="PATCH")
    d.add_argument("--key", type=path, metavar="KEY", help="sign the manifest with this key")
    d.add_argument("--run-id", type=cli_args.run_id, default="local")
    d.add_argument("--version", type=cli_args.version, default=1, help="version number of TARGET (default 1)")
    d.add_argument("--base-version", type=cli_args.base_version, help="version number of BASE (default VERSION-1)")
    d.add_argument("--chunk-size", type=cli_args.chunk_size, default=1 << 20, metavar="BYTES")
    d.add_argument("--level", type=cli_args.zstd_level, default=3, help="zstd level (default 3)")
    d.set_defaults(func=cmd_diff, check=_check_diff)

    a = sub.add_parser("apply", help="apply PATCH to BASE and write the verified result to OUT")
    a.add_argument("base", type=path, metavar="BASE", help="checkpoint directory or .safetensors file")
    a.add_argument("patch", type=path, metavar="PATCH")
    a.add_argument(
        "-o",
        "--output",
        type=cli_args.output_target,
        required=True,
        metavar="OUT",
        help="file, or DIR/ for a checkpoint",
    )
    a.add_argument(
        "--trust", type=path, action="append", metavar="KEY.pub", help="accept only patches signed by this key"
    )
    a.set_defaults(func=cmd_apply)

    i = sub.add_parser("inspect", help="describe a patch file")
    i.add_argument("patch", type=path, metavar="PATCH")
    i.add_argument("--json", action="store_true")
    i.set_defaults(func=cmd_inspect)

    v = sub.add_parser("verify", help="check a patch's signature, manifest and chunks")
    v.add_argument("patch", type=path, metavar="PATCH")
    v.add_argument("--trust", type=path, action="append", required=True, metavar="KEY.pub")
    v.set_defaults(func=cmd_verify)

    add_simulate_parser(sub)
    add_certs_parser(sub)
    add_head_parser(sub)
    for sp in sub.choices.values():  # each subcommand knows its parser, for checks across arguments
        sp.set_defaults(subparser=sp)
    return p


# Checks across arguments, after parsing: each returns the usage error, or None.


def _check_diff(args: argparse.Namespace) -> str | None:
    if args.base_version is None:
        args.base_version = args.version - 1
    elif args.base_version >= args.version:
        return f"argument --base-version: {args.base_version} is not older than --version {args.version}"
    return None


def _check_certify(args: argparse.Namespace) -> str | None:
    if not args.output and not args.board:
        return "give --output CERT, --board DIR or both: the certificate must go somewhere"
    return None


def _check_pull(args: argparse.Namespace) -> str | None:
    try:
        args.source, args.run = _run_from(args.source, args.run)
    except argparse.ArgumentTypeError as e:
        return f"argument --from: {e}"
    return None


def _tolerant_stdout() -> None:
    # A path or run id with bytes that are not UTF-8 (argv keeps them as surrogates) prints
    # escaped instead of failing after the work is done.
    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None:
            try:
                reconfigure(errors="backslashreplace")
            except (ValueError, OSError):
                pass


def main(argv: Sequence[str] | None = None) -> int:
    _tolerant_stdout()
    args = build_parser().parse_args(argv)
    check: Callable[[argparse.Namespace], str | None] | None = getattr(args, "check", None)
    problem = check(args) if check else None
    if problem:
        args.subparser.error(problem)

    def fail(text: str) -> None:
        _err().print(one_line(f"patchswarm {args.command}: error: {text}"), markup=False, highlight=False)

    try:
        rc: int = args.func(args)
        return rc
    except (UserError, HeadCliError) as e:
        fail(str(e))
    except FileNotFoundError as e:
        fail(f"no such file: {e.filename}" if e.filename else str(e))
    except OSError as e:
        fail(f"{e.filename}: {e.strerror or e}" if e.filename else f"{e.strerror or e}")
    except KeyboardInterrupt:
        _err().print(f"patchswarm {args.command}: interrupted", markup=False, highlight=False)
        return 130
    except Exception as e:
        from patchswarm.protocol.errors import PatchswarmError

        if isinstance(e, PatchswarmError):
            fail(str(e))
        elif os.environ.get("PATCHSWARM_DEBUG"):
            raise
        else:  # a defect, not the user's doing: still one line, the traceback on request
            tb = e.__traceback__
            while tb is not None and tb.tb_next is not None:
                tb = tb.tb_next
            where = f" at {Path(tb.tb_frame.f_code.co_filename).name}:{tb.tb_lineno}" if tb else ""
            fail(f"internal error ({type(e).__name__}: {e}){where}; PATCHSWARM_DEBUG=1 shows the traceback")
    return 1


if __name__ == "__main__":
    sys.exit(main())

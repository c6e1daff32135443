"""The ``patchswarm`` command line.

User errors (bad files, failed verification, missing paths) print one line on stderr and
exit with status 1; usage errors exit with 2 (argparse).  Nothing partial is ever written:
outputs are staged and renamed into place only after verification.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

from patchswarm.daemon import cli_args
from patchswarm.daemon.board_cli import cmd_publish, cmd_pull, cmd_seed, run_from
from patchswarm.daemon.certs import add_certs_parser
from patchswarm.daemon.cli_console import err_console, one_line
from patchswarm.daemon.daemon_cli import cmd_daemon, cmd_status
from patchswarm.daemon.engine_cli import add_engine_parser
from patchswarm.daemon.head_cli import HeadCliError, add_head_parser, add_head_ttl_arg
from patchswarm.daemon.patch_cli import cmd_apply, cmd_diff, cmd_inspect, cmd_verify
from patchswarm.daemon.simulate_cli import add_simulate_parser
from patchswarm.daemon.swarm_cli import add_seed_args, add_swarm_args, add_tls_args, cmd_node
from patchswarm.daemon.trust_cli import cmd_certify, cmd_keygen, cmd_revoke, cmd_rotate_root
from patchswarm.daemon.user_error import UserError
from patchswarm.protocol.payload_formats import DEFAULT_FORMAT

# Everything heavy (torch, numpy, aiohttp, rich) loads inside the command that needs it, so that
# ``--help``, ``--version`` and a usage error answer at once.  The commands live in one module a
# family (patch_cli, trust_cli, board_cli, daemon_cli, swarm_cli, ...); this module holds the parser
# that registers them and ``main``.


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
    pb.add_argument(
        "--payload-format",
        type=cli_args.payload_format,
        default=DEFAULT_FORMAT,
        metavar="1|2",
        help=cli_args.PAYLOAD_FORMAT_HELP,
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
    d.add_argument(
        "--payload-format",
        type=cli_args.payload_format,
        default=DEFAULT_FORMAT,
        metavar="1|2",
        help=cli_args.PAYLOAD_FORMAT_HELP,
    )
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

    add_engine_parser(sub)
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
        args.source, args.run = run_from(args.source, args.run)
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
        err_console().print(one_line(f"patchswarm {args.command}: error: {text}"), markup=False, highlight=False)

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
        err_console().print(f"patchswarm {args.command}: interrupted", markup=False, highlight=False)
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

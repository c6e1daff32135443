"""The ``patchswarm`` command line.

User errors (bad files, failed verification, missing paths) print one line on stderr and
exit with status 1; usage errors exit with 2 (argparse).  Nothing partial is ever written:
outputs are staged and renamed into place only after verification.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from protocol.codec import read_header
from protocol.errors import PatchswarmError
from protocol.keys import SigningKey, TrustedKeys, load_public_key
from protocol.patchfile import apply_version, build_version, open_file, write_file
from protocol.safetensors_io import load_safetensors, save_safetensors

err = Console(stderr=True, soft_wrap=True)
out = Console(soft_wrap=True)


class UserError(Exception):
    """An error worth one line to the user, never a traceback."""


def _now_ms() -> int:
    return int(time.time() * 1000)


@contextmanager
def _progress(label: str, total: int) -> Iterator[Callable[[int], None]]:
    quiet = not err.is_terminal
    with Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TimeRemainingColumn(),
        console=err,
        transient=True,
        disable=quiet,
    ) as bar:
        task = bar.add_task(label, total=total)
        yield lambda n: bar.advance(task, n)


def _trust(paths: Sequence[str] | None) -> TrustedKeys | None:
    if not paths:
        return None
    return TrustedKeys(frozenset(load_public_key(p) for p in paths))


# ---------------------------------------------------------------- commands


def cmd_keygen(args: argparse.Namespace) -> int:
    key = SigningKey.generate()
    try:
        key.save(args.output)
    except FileExistsError:
        raise UserError(f"{args.output} already exists; refusing to overwrite a key") from None
    out.print(f"wrote {args.output} and {args.output}.pub (key id {key.key_id.hex()[:16]})")
    return 0


def cmd_diff(args: argparse.Namespace) -> int:
    base = load_safetensors(args.base)
    target = load_safetensors(args.target)
    key = SigningKey.load(args.key) if args.key else None
    with _progress("diff+encode", target.nbytes) as advance:
        v = build_version(
            base,
            target,
            run_id=args.run_id,
            version=args.version,
            base_version=args.base_version if args.base_version is not None else args.version - 1,
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
    out.print(
        f"{args.output}: version {v.manifest.version}, {enc.changed:,} of {enc.numel:,} elements changed "
        f"({100 * enc.changed / max(enc.numel, 1):.3f}%), {size:,} bytes "
        f"({100 * size / max(target.nbytes, 1):.3f}% of {target.nbytes:,}), {len(v.manifest.chunks)} chunks"
        + ("" if key else " [unsigned]")
    )
    return 0


def cmd_apply(args: argparse.Namespace) -> int:
    policy = _trust(args.trust)
    data = Path(args.patch).read_bytes()
    v = open_file(data, policy, now_ms=_now_ms())
    if policy is None:
        err.print("[yellow]warning:[/] no --trust given: signature not checked (integrity still is)")
    base = load_safetensors(args.base)
    model, _ = apply_version(base, v.manifest, v.payload)
    save_safetensors(model, args.output)
    out.print(f"{args.output}: version {v.manifest.version} verified (root {v.manifest.target_root.hex()[:16]})")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    v = open_file(Path(args.patch).read_bytes(), _trust(args.trust), now_ms=_now_ms())
    read_header(v.payload, list(v.manifest.specs))
    out.print(
        f"OK: version {v.manifest.version} of run {v.manifest.run_id!r}, signed by {v.signed.key_id.hex()[:16]}, "
        f"{len(v.manifest.chunks)} chunks verified"
    )
    return 0


def inspect_data(path: str) -> dict[str, Any]:
    v = open_file(Path(path).read_bytes(), None, verify_chunks=True)
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
    changed = sum(t["changed"] for t in tensors if t["encoding"] != "FULL") if m.kind == "patch" else elements
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
    info = inspect_data(args.patch)
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    out.print(
        f"[bold]version {info['version']}[/] ({info['kind']}, run {info['run_id']!r}"
        + (f", base {info['base_version']}" if info["base_version"] is not None else "")
        + f"), {info['changed']:,} of {info['elements']:,} elements changed ({100 * info['changed_fraction']:.3f}%)"
    )
    out.print(
        f"encoded {info['encoded_bytes']:,} bytes for {info['served_bytes']:,} served "
        f"({100 * info['encoded_bytes'] / max(info['served_bytes'], 1):.3f}%), "
        f"{info['chunk_count']} chunks of {info['chunk_size']:,}; "
        + (f"signed by {info['signed_by'][:16]}" if info["signed_by"] else "unsigned")
        + " (signature not checked: use verify)"
    )
    table = Table("tensor", "dtype", "shape", "encoding", "changed")
    for t in info["tensors"]:
        table.add_row(t["name"], t["dtype"], "x".join(map(str, t["shape"])), t["encoding"], f"{t['changed']:,}")
    out.print(table)
    return 0


# ---------------------------------------------------------------- parser


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="patchswarm", description="Lossless weight patches for RL post-training.")
    sub = p.add_subparsers(dest="command", required=True)

    k = sub.add_parser("keygen", help="create an Ed25519 signing key (KEY and KEY.pub)")
    k.add_argument("-o", "--output", required=True, metavar="KEY")
    k.set_defaults(func=cmd_keygen)

    d = sub.add_parser("diff", help="encode TARGET against BASE into a self-contained patch file")
    d.add_argument("base", metavar="BASE.safetensors")
    d.add_argument("target", metavar="TARGET.safetensors")
    d.add_argument("-o", "--output", required=True, metavar="PATCH")
    d.add_argument("--key", metavar="KEY", help="sign the manifest with this key")
    d.add_argument("--run-id", default="local")
    d.add_argument("--version", type=int, default=1, help="version number of TARGET (default 1)")
    d.add_argument("--base-version", type=int, help="version number of BASE (default VERSION-1)")
    d.add_argument("--chunk-size", type=int, default=1 << 20)
    d.add_argument("--level", type=int, default=3, help="zstd level (default 3)")
    d.set_defaults(func=cmd_diff)

    a = sub.add_parser("apply", help="apply PATCH to BASE and write the verified result to OUT")
    a.add_argument("base", metavar="BASE.safetensors")
    a.add_argument("patch", metavar="PATCH")
    a.add_argument("-o", "--output", required=True, metavar="OUT.safetensors")
    a.add_argument("--trust", action="append", metavar="KEY.pub", help="accept only patches signed by this key")
    a.set_defaults(func=cmd_apply)

    i = sub.add_parser("inspect", help="describe a patch file")
    i.add_argument("patch", metavar="PATCH")
    i.add_argument("--json", action="store_true")
    i.set_defaults(func=cmd_inspect)

    v = sub.add_parser("verify", help="check a patch's signature, manifest and chunks")
    v.add_argument("patch", metavar="PATCH")
    v.add_argument("--trust", action="append", required=True, metavar="KEY.pub")
    v.set_defaults(func=cmd_verify)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        rc: int = args.func(args)
        return rc
    except (UserError, PatchswarmError) as e:
        err.print(f"patchswarm {args.command}: error: {e}", markup=False, highlight=False)
    except FileNotFoundError as e:
        err.print(f"patchswarm {args.command}: error: no such file: {e.filename}", markup=False, highlight=False)
    except OSError as e:
        where = f"{e.filename}: " if e.filename else ""
        err.print(f"patchswarm {args.command}: error: {where}{e.strerror or e}", markup=False, highlight=False)
    except KeyboardInterrupt:
        err.print(f"patchswarm {args.command}: interrupted")
        return 130
    return 1


if __name__ == "__main__":
    sys.exit(main())

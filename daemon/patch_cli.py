"""``patchswarm diff``, ``apply``, ``verify`` and ``inspect``: self-contained patch files, offline."""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from patchswarm.daemon.cli_console import escape_markup, now_ms, out_console, progress, say, warn

if TYPE_CHECKING:
    from patchswarm.protocol.keys import TrustedKeys
    from patchswarm.protocol.served import ServedModel


def trusted_keys(paths: Sequence[str] | None) -> TrustedKeys | None:
    from patchswarm.protocol.keys import TrustedKeys, load_public_key

    if not paths:
        return None
    return TrustedKeys(frozenset(load_public_key(p) for p in paths))


def cmd_diff(args: argparse.Namespace) -> int:
    from patchswarm.daemon.checkpoint import read_served
    from patchswarm.protocol.keys import SigningKey
    from patchswarm.protocol.patchfile import build_version, write_file

    base = read_served(args.base)
    target = read_served(args.target)
    key = SigningKey.load(args.key) if args.key else None
    with progress("diff+encode", target.nbytes) as advance:
        v = build_version(
            base,
            target,
            run_id=args.run_id,
            version=args.version,
            base_version=args.base_version,
            now_ms=now_ms(),
            key=key,
            chunk_size=args.chunk_size,
            level=args.level,
            progress=advance,
            payload_format=args.payload_format,
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

    policy = trusted_keys(args.trust)
    data = read_patch_file(args.patch)
    v = open_file(data, policy, now_ms=now_ms())
    base = read_served(args.base)
    model, _ = apply_version(base, v.manifest, v.payload)
    write_model(model, args.output, like_dir=os.path.isdir(args.base))
    if policy is None:  # after the work: an error stays the only line of a failed run
        warn("no --trust given: signature not checked (integrity still is)")
    say(f"{args.output}: version {v.manifest.version} verified (root {v.manifest.target_root.hex()[:16]})")
    return 0


def write_model(model: ServedModel, out: str, *, like_dir: bool = False) -> str:
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

    v = open_file(read_patch_file(args.patch), trusted_keys(args.trust), now_ms=now_ms())
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
        "payload_format": header.format,
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
    out = out_console()
    out.print(
        f"[bold]version {info['version']}[/] ({info['kind']}, run {escape_markup(repr(info['run_id']))}"
        + (f", base {info['base_version']}" if info["base_version"] is not None else "")
        + f"), {info['changed']:,} of {info['elements']:,} elements changed ({100 * info['changed_fraction']:.3f}%)"
    )
    say(
        f"encoded {info['encoded_bytes']:,} bytes for {info['served_bytes']:,} served "
        f"({100 * info['encoded_bytes'] / max(info['served_bytes'], 1):.3f}%), "
        f"{info['chunk_count']} chunks of {info['chunk_size']:,}, payload format {info['payload_format']}; "
        + (f"signed by {info['signed_by'][:16]}" if info["signed_by"] else "unsigned")
        + " (signature not checked: use verify)"
    )
    table = Table("tensor", "dtype", "shape", "encoding", "changed")
    for t in info["tensors"]:
        # Names come from the file: escaped, never read as markup.
        table.add_row(
            escape_markup(t["name"]), t["dtype"], "x".join(map(str, t["shape"])), t["encoding"], f"{t['changed']:,}"
        )
    out.print(table)
    return 0

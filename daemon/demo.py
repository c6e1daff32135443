"""``make demo``: the patch codec on a real training trajectory.

Trains a small transformer with AdamW (FP32 master weights) on the CPU, takes RL-like steps at
lr 1e-6, and for every step encodes the served version (bf16, and fp8 with fixed per-tensor
scales) as a signed patch against the previous one, applies it, and checks the result is
bitwise identical.
"""

from __future__ import annotations

import argparse
import time

from rich.console import Console
from rich.table import Table

from daemon.trajectory import generate
from protocol.keys import SigningKey
from protocol.patchfile import apply_version, build_version


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--preset", default="small")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-6)
    args = ap.parse_args(argv)
    console = Console()
    t0 = time.perf_counter()
    with console.status(f"training the {args.preset!r} model (warm-up, then {args.steps} RL steps at lr {args.lr:g})"):
        traj = generate(args.preset, steps=args.steps, lr=args.lr)
    console.print(
        f"trained in {time.perf_counter() - t0:.1f} s; mean reward per RL step: "
        + ", ".join(f"{r:.3f}" for r in traj.rewards)
    )
    key = SigningKey.generate()
    table = Table(title="patches between consecutive served versions (signed, chunked, verified)")
    for col in ("version", "format", "changed", "patch bytes", "full bytes", "patch / full", "bitwise"):
        table.add_column(col, justify="right")
    all_ok = True
    for kind in ("bf16", "fp8"):
        served = traj.served(kind)
        for v in range(1, len(served)):
            base, target = served[v - 1], served[v]
            ver = build_version(base, target, run_id="demo", version=v, base_version=v - 1, now_ms=0, key=key)
            rebuilt, _ = apply_version(base.clone(), ver.manifest, ver.payload)
            ok = rebuilt.bitwise_equal(target)
            all_ok &= ok
            enc = ver.encoded
            assert enc is not None
            size = ver.manifest.payload_size
            table.add_row(
                str(v),
                kind,
                f"{100 * enc.changed / enc.numel:.3f}%",
                f"{size:,}",
                f"{target.nbytes:,}",
                f"{100 * size / target.nbytes:.3f}%",
                "[green]identical[/]" if ok else "[red]DIFFERENT[/]",
            )
    console.print(table)
    console.print("[bold green]all versions rebuilt bitwise[/]" if all_ok else "[bold red]mismatch[/]")
    return 0 if all_ok else 1


if __name__ == "__main__":
    raise SystemExit(main())

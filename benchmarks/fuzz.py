"""Mutation fuzzing of every parser of untrusted input: a million inputs by default.

    .venv/bin/python -m benchmarks.fuzz [--inputs 1000000] [--seed 0] [--jobs N] [--only a,b]
                                        [--crashes /tmp/patchswarm-fuzz] [--timeout 10]
    .venv/bin/python -m benchmarks.fuzz --atheris TARGET [--runs N | --max-time S]   # needs atheris

Targets, seeds and mutations are those of tests/support/fuzz_targets.py (the hypothesis tests in
tests/unit/protocol/test_fuzz.py use the same ones at CI size).  Each target gets a share of the inputs by its
weight; work is cut into batches spread over ``--jobs`` processes (default: every core), each
batch with its own seeded RNG, so a run is reproducible from ``--seed``.  One input in ten is
random bytes, the rest are mutations of valid inputs: byte-level (flips, cuts, splices,
dictionary tokens, huge lengths) and structure-aware (msgpack documents, TOML, safetensors headers
and patch payload streams edited and re-encoded).

An input is a crash when its parser raises anything but the documented errors, a hang when it
runs past ``--timeout`` seconds, and runs out of memory when the worker's address-space limit
(``--memory-gb`` above its size at start) is hit.  Each is saved as ``<crashes>/<target>/<sha1>.bin``
with the traceback beside it; ``tests.support.fuzz_targets.check(target, bytes)`` reproduces it.

``--atheris TARGET`` runs one target under atheris (coverage-guided, libFuzzer) instead, with the
modules of protocol/ and daemon/ instrumented and the target's seeds as the starting corpus
(kept in ``<crashes>/<target>/corpus``, so a later run resumes from what it found).
"""

from __future__ import annotations

import argparse
import hashlib
import multiprocessing
import os
import random
import resource
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections import Counter
from pathlib import Path
from types import FrameType

BATCH = 2000
RANDOM_FRACTION = 0.1


class Hang(BaseException):
    """Raised by the alarm in a parser that runs too long (a BaseException: parsers' handlers and
    the harness's ``except Exception`` must not swallow it)."""


def _alarm(signum: int, frame: FrameType | None) -> None:
    raise Hang("input ran past the time limit")


def _init_worker(memory_gb: float) -> None:
    os.nice(0)
    signal.signal(signal.SIGALRM, _alarm)
    if memory_gb > 0:
        size = int(Path("/proc/self/statm").read_text().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        limit = size + int(memory_gb * 2**30)
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def _save(crashes: Path, name: str, data: bytes, kind: str, detail: str) -> str:
    digest = hashlib.sha1(data).hexdigest()[:16]
    folder = crashes / name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{digest}.bin").write_bytes(data)
    (folder / f"{digest}.txt").write_text(f"{kind}\n{detail}")
    return str(folder / f"{digest}.bin")


def run_batch(job: tuple[str, int, int, int, str, float]) -> tuple[str, int, float, Counter[str], list[str]]:
    """Run ``count`` inputs of target ``name``; returns (name, count, cpu seconds, outcomes, crash files)."""
    from tests.support import fuzz_targets as ft

    name, seed, index, count, crashes, timeout = job
    rng = random.Random(f"{seed}/{name}/{index}")
    outcomes: Counter[str] = Counter()
    saved: list[str] = []
    t0 = time.process_time()
    for _ in range(count):
        random_bytes = rng.random() < RANDOM_FRACTION
        data = rng.randbytes(rng.choice((0, 1, 8, 64, 512))) if random_bytes else ft.mutate(rng, name)
        signal.setitimer(signal.ITIMER_REAL, timeout)
        try:
            err = ft.check(name, data)
            outcomes["parsed" if err is None else type(err).__name__] += 1
        except ft.UnexpectedError as e:
            cause = e.__cause__ or e
            kind = "oom" if isinstance(cause, MemoryError) else "crash"
            outcomes[kind] += 1
            detail = "".join(traceback.format_exception(cause))
            saved.append(_save(Path(crashes), name, data, kind, detail))
        except Hang:
            outcomes["hang"] += 1
            saved.append(_save(Path(crashes), name, data, "hang", f"ran past {timeout} s"))
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
    return name, count, time.process_time() - t0, outcomes, saved


def plan(total: int, names: list[str], weights: dict[str, int]) -> dict[str, int]:
    weight_sum = sum(weights[n] for n in names)
    share = {n: total * weights[n] // weight_sum for n in names}
    share[names[0]] += total - sum(share.values())
    return share


def fuzz(args: argparse.Namespace) -> int:
    from tests.support import fuzz_targets as ft

    names = sorted(ft.TARGETS) if not args.only else args.only.split(",")
    unknown = [n for n in names if n not in ft.TARGETS]
    if unknown:
        raise SystemExit(f"unknown targets {unknown}; known: {', '.join(sorted(ft.TARGETS))}")
    share = plan(args.inputs, names, {n: ft.TARGETS[n].weight for n in names})
    jobs = []
    for name in names:
        for index, start in enumerate(range(0, share[name], BATCH)):
            jobs.append((name, args.seed, index, min(BATCH, share[name] - start), args.crashes, args.timeout))
    random.Random(args.seed).shuffle(jobs)  # mix cheap and dear targets across workers
    print(f"fuzzing {args.inputs} inputs over {len(names)} targets, {len(jobs)} batches, {args.jobs} processes")
    done: Counter[str] = Counter()
    cpu: Counter[str] = Counter()
    outcomes: dict[str, Counter[str]] = {n: Counter() for n in names}
    crashes: list[str] = []
    t0 = time.perf_counter()
    ctx = multiprocessing.get_context("fork")
    scratch = tempfile.mkdtemp(prefix="psw-fuzz-run-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    os.environ["PSW_FUZZ_SCRATCH"] = scratch  # files the parsers read from paths; workers exit without cleanup
    with ctx.Pool(args.jobs, initializer=_init_worker, initargs=(args.memory_gb,)) as pool:
        for i, (name, count, seconds, out, saved) in enumerate(pool.imap_unordered(run_batch, jobs), 1):
            done[name] += count
            cpu[name] += seconds
            outcomes[name].update(out)
            crashes += saved
            if i % max(1, len(jobs) // 20) == 0:
                total = sum(done.values())
                print(f"  {total:>9} inputs  {total / (time.perf_counter() - t0):>8.0f}/s  crashes {len(crashes)}")
    wall = time.perf_counter() - t0
    shutil.rmtree(scratch, ignore_errors=True)
    print(
        f"\n{'target':<16} {'inputs':>9} {'per core/s':>10} {'parsed':>8} {'crash':>6} {'hang':>5} {'oom':>4}  errors"
    )
    for name in names:
        o = outcomes[name]
        errors = ", ".join(f"{k} {v}" for k, v in o.most_common() if k not in ("parsed", "crash", "hang", "oom"))
        rate = done[name] / cpu[name] if cpu[name] else 0.0
        print(
            f"{name:<16} {done[name]:>9} {rate:>10.0f} {o['parsed']:>8} {o['crash']:>6} {o['hang']:>5} {o['oom']:>4}  "
            f"{errors[:80]}"
        )
    total = sum(done.values())
    print(f"\ntotal {total} inputs in {wall:.1f} s wall: {total / wall:.0f} inputs/s on {args.jobs} processes")
    print(f"crashes, hangs, out of memory: {len(crashes)}" + (f" (saved under {args.crashes})" if crashes else ""))
    for path in crashes[:20]:
        print(f"  {path}")
    return 1 if crashes else 0


def run_atheris(args: argparse.Namespace) -> int:
    try:
        import atheris
    except ImportError:
        raise SystemExit("atheris is not installed (pip install atheris)") from None
    name = args.atheris
    # libFuzzer ends the process without running atexit: the corpus (kept, so a later run resumes
    # from it) and the parsers' scratch files live under the crashes folder, not in /tmp.
    work = Path(args.crashes) / name
    corpus, scratch = work / "corpus", work / "scratch"
    for folder in (corpus, scratch):
        folder.mkdir(parents=True, exist_ok=True)
    os.environ["PSW_FUZZ_SCRATCH"] = str(scratch)
    with atheris.instrument_imports(include=["patchswarm.protocol", "patchswarm.daemon"]):
        from tests.support import fuzz_targets as ft
    if name not in ft.TARGETS:
        raise SystemExit(f"unknown target {name!r}; known: {', '.join(sorted(ft.TARGETS))}")
    for i, seed in enumerate(ft.seeds_of(name)):
        (corpus / f"seed-{i}").write_bytes(seed)
    crashes = work

    def one_input(data: bytes) -> None:
        ft.check(name, data)  # UnexpectedError propagates: atheris saves the input and stops

    argv = [sys.argv[0], str(corpus), f"-artifact_prefix={crashes}/atheris-", f"-timeout={int(args.timeout)}"]
    argv += [f"-runs={args.runs}"] if args.runs else []
    argv += [f"-max_total_time={args.max_time}"] if args.max_time else []
    argv += [f"-rss_limit_mb={int(args.memory_gb * 1024) + 4096}"]
    atheris.Setup(argv, one_input)
    atheris.Fuzz()
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--inputs", type=int, default=1_000_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--only", default="", help="comma-separated targets (default: all)")
    ap.add_argument(
        "--crashes", default=os.path.join(tempfile.gettempdir(), "patchswarm-fuzz"), help="where crashing inputs go"
    )
    ap.add_argument("--timeout", type=float, default=10.0, help="seconds before an input counts as a hang")
    ap.add_argument("--memory-gb", type=float, default=4.0, help="address space a worker may add (0: no limit)")
    ap.add_argument("--atheris", metavar="TARGET", help="coverage-guided fuzzing of one target with atheris")
    ap.add_argument("--runs", type=int, default=0, help="atheris: inputs to run (0: until --max-time)")
    ap.add_argument("--max-time", type=int, default=0, help="atheris: seconds to run")
    args = ap.parse_args()
    return run_atheris(args) if args.atheris else fuzz(args)


if __name__ == "__main__":
    sys.exit(main())

"""The real-latency testbed: patchswarm, libtorrent and one central seed across regions with real RTTs.

    sudo .venv/bin/python -m benchmarks.latency_testbed                     # 3 x 6 hosts, 20/80/150 ms, 10 MB/s, 100 MB
    sudo .venv/bin/python -m benchmarks.latency_testbed --rate 3e6 --size-mb 30
    sudo .venv/bin/python -m benchmarks.latency_testbed --regions 2 --hosts 3 --rtt 40 --size-mb 4 --systems patchswarm

The network (benchmarks/latency_net.py): each host in its own namespace, a veth to its region's bridge in a
router namespace, a tbf on every host's uplink, and the one-way delay between regions from a TUN delay line
(benchmarks/delay_relay.py); this kernel has no netem.  Then, in order:

1. calibration: a TCP ping-pong between a host of each region pair (configured vs measured RTT min /
   median / p95) and one bulk transfer inside a region and one across the longest RTT (the uplink rate);
2. the systems, each process under ``ip netns exec``: patchswarm (a seed and N ``patchswarm node``
   processes, benchmarks/swarm_bench.py's run, the node's own pacing off: ``--upload-rate 0``), the same
   patch over libtorrent (swarm_bench's sessions, ``upload_rate_limit = 0``) and a central seed (an HTTP
   server in the seed's namespace; every host fetches the patch from it and nothing else).  The kernel's
   tbf limits all three the same way.  Time to all / the Kumar-Ross bound and the seed's egress / F;
   CPU seconds of the run's processes, of the delay line, and of the machine;
3. the simulator (``patchswarm simulate``) on the same topology: regions, per-pair latency (half the
   measured median RTT), the same uplinks, patch size and chunk size; its predicted time to all beside
   the measured one.

Prints a markdown report; ``--json FILE`` keeps everything.  Needs root; every namespace and link is
removed on the way out, also after an error or SIGTERM (``--cleanup`` removes those of a killed run).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import swarm_bench as sb
from benchmarks.latency_net import NetHost, Testbed, can_run, cleanup_stale
from patchswarm.protocol.node_config import NodeConfig

SYSTEMS = ("patchswarm", "libtorrent", "central")
ROOT = Path(__file__).resolve().parent.parent


def pairs(regions: int) -> list[tuple[int, int]]:
    return [(a, b) for a in range(regions) for b in range(a + 1, regions)]


def parse_rtts(text: str, regions: int) -> dict[tuple[int, int], float]:
    """``20,80,150`` (ms, one per pair in the order (0,1), (0,2), ..., (1,2), ...) or one value for all."""
    try:
        values = [float(x) / 1e3 for x in text.split(",")]
    except ValueError:
        raise SystemExit(f"--rtt: milliseconds separated by commas, got {text!r}") from None
    ps = pairs(regions)
    if len(values) == 1:
        values = values * len(ps)
    if len(values) != len(ps) or any(not 0 <= v <= 5 for v in values):
        raise SystemExit(f"--rtt: {len(ps)} values of 0..5000 ms for {regions} regions (pairs {ps}), got {text!r}")
    return dict(zip(ps, values, strict=True))


def log(msg: str) -> None:
    sb.log(msg)


def child_env() -> dict[str, str]:
    """The environment for the run's processes: ``benchmarks`` importable from their work directories."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(x for x in (str(ROOT), env.get("PYTHONPATH", "")) if x)
    return env


# ---------------------------------------------------------------- calibration


def calibrate(tb: Testbed, rtt: dict[tuple[int, int], float], rate: float) -> dict[str, Any]:
    by_region: dict[int, list[NetHost]] = {}
    for h in tb.hosts:
        by_region.setdefault(h.region, []).append(h)
    rows = []
    for a in range(tb.regions):
        for b in range(a, tb.regions):
            src = by_region[a][0]
            dst = by_region[b][1 % len(by_region[b])] if a == b else by_region[b][0]
            if src == dst:
                continue
            r = tb.rtt(src, dst)
            rows.append(
                {
                    "pair": f"r{a}-r{b}",
                    "configured_ms": 0.0 if a == b else rtt[(a, b)] * 1e3,
                    "min_ms": r[0] * 1e3,
                    "median_ms": r[len(r) // 2] * 1e3,
                    "p95_ms": r[int(0.95 * len(r))] * 1e3,
                }
            )
            log(f"calibration: RTT {rows[-1]}")
    far = max(rtt, key=lambda k: rtt[k]) if rtt else (0, 0)
    nbytes = int(rate * 4)
    bulk = {"intra_region_Bps": tb.bulk(by_region[0][0], by_region[0][-1], nbytes)}
    if far != (0, 0):
        bulk["longest_rtt_Bps"] = tb.bulk(by_region[far[0]][0], by_region[far[1]][0], nbytes)
    log(f"calibration: bulk {bulk} (configured {rate:.0f} B/s)")
    return {"rtt": rows, "bulk": bulk}


def intra_region_delay(calibration: dict[str, Any]) -> float:
    """One-way seconds inside a region: half the lowest median RTT measured between two hosts of one
    region (the medians also carry the load's jitter, which the simulator has no notion of).  With
    one host per region no such pair exists, and the bridge's ~0.1 ms is left out (0)."""
    same = [row["median_ms"] for row in calibration["rtt"] if row["configured_ms"] == 0]
    return min(same, default=0.0) / 2e3


# ---------------------------------------------------------------- the central seed


def run_central(args: argparse.Namespace, tb: Testbed, tmp: Path, payload: Path) -> sb.Result:
    """An HTTP server in the seed's namespace; every host fetches the whole patch from it at once."""
    work = tmp / "central"
    work.mkdir()
    data = work / "patch.bin"
    shutil.copy(payload, data)
    size = data.stat().st_size
    want = sb.file_sha256(data)
    port = 8080
    me = [sys.executable, "-m", "benchmarks.latency_testbed", "--role", "fetch"]
    server = sb.Proc(
        "central-seed",
        tb.seed.wrap([sys.executable, "-m", "benchmarks.latency_testbed", "--role", "serve", "--dir", str(work)])
        + ["--ip", tb.seed.ip, "--port", str(port)],
        work,
        env=child_env(),
    )
    procs = [server]
    try:
        server.wait("listening", 60)
        url = f"http://{tb.seed.ip}:{port}/patch.bin"
        nodes = [
            sb.Proc(f"c-{h.name}", h.wrap([*me, "--url", url]), work, stdin=True, env=child_env()) for h in tb.hosts
        ]
        procs += nodes
        for p in nodes:
            p.wait("ready", 60)
        bound = sb.kumar_ross(size, len(nodes), args.rate, args.rate)
        meter = sb.CpuMeter(procs)
        relay0 = sb.proc_cpu(tb.relay.pid) if tb.relay else 0.0
        log(f"central: {len(nodes)} hosts fetch {size} bytes from the seed; bound {bound:.2f}s")
        t0 = time.monotonic()
        for p in nodes:
            p.send("go")
        times: list[float] = []
        got: list[dict[str, Any]] = []
        time_to_all: float | None = None
        timeout = max(60.0, args.timeout_factor * size * len(nodes) / args.rate)
        try:
            for p in nodes:
                t, msg = p.wait("finished", max(1.0, t0 + timeout - time.monotonic()))
                times.append(t - t0)
                got.append(msg)
            time_to_all = max(times)
        except (TimeoutError, RuntimeError) as e:
            log(f"central: {e}")
        cpu = meter.stop()
        relay_cpu = (sb.proc_cpu(tb.relay.pid) if tb.relay else 0.0) - relay0
        extra = {
            "sha256_ok": [m.get("sha256") == want for m in got],
            "relay_cpu_s": round(relay_cpu, 2),
            "wall": time.monotonic() - t0,
        }
        egress = sum(int(m.get("bytes", 0)) for m in got)
        return sb.Result(
            "central seed", size, len(nodes), args.rate, bound, time_to_all, egress, *cpu, sorted(times), extra
        )
    finally:
        for p in procs:
            with contextlib.suppress(Exception):
                if p.p.stdin:
                    p.send("stop")
            p.stop(timeout=5)


def role_serve(argv: list[str]) -> int:
    """A threaded HTTP file server (the central seed), printing {"event": "listening"} when bound."""
    import functools
    import http.server

    p = argparse.ArgumentParser()
    p.add_argument("--dir", required=True)
    p.add_argument("--ip", required=True)
    p.add_argument("--port", type=int, required=True)
    a = p.parse_args(argv)

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:  # one line per request on stderr is noise here
            pass

    handler = functools.partial(Quiet, directory=a.dir)
    srv = http.server.ThreadingHTTPServer((a.ip, a.port), handler)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    print(json.dumps({"event": "listening"}), flush=True)
    srv.serve_forever()
    return 0


def role_fetch(argv: list[str]) -> int:
    """Wait for "go" on stdin, GET the URL, print {"event": "finished", "bytes", "sha256"}."""
    import hashlib
    import urllib.request

    p = argparse.ArgumentParser()
    p.add_argument("--url", required=True)
    a = p.parse_args(argv)
    print(json.dumps({"event": "ready"}), flush=True)
    if sys.stdin.readline().strip() != "go":
        return 0
    h, n = hashlib.sha256(), 0
    with urllib.request.urlopen(a.url, timeout=600) as r:
        while block := r.read(1 << 20):
            h.update(block)
            n += len(block)
    print(json.dumps({"event": "finished", "bytes": n, "sha256": h.hexdigest()}), flush=True)
    sys.stdin.readline()  # "stop"
    return 0


# ---------------------------------------------------------------- the simulator


def tcp_keys(args: argparse.Namespace) -> list[str]:
    """The hosts' TCP as the simulator's network keys (docs/simulation.md, "TCP on the connections").

    - ``initial_window``: ``--initcwnd`` segments (0: the kernel's 10) of one MSS, the MTU less the
      IPv4 and TCP headers with timestamps (52 bytes).
    - ``send_buffer``: what a server's ``resp.write`` hands to the kernel before it returns.  Linux
      sizes a new socket's send buffer to 2 x 10 segments (``tcp_sndbuf_expand``; more as the window
      grows), counted with each segment's overhead, and aiohttp returns from a drain once no more
      than 64 KiB wait in user space.  At MTU 64,000 that is over a MiB: a whole chunk.  With
      ``--notsent-lowat`` (the hosts') or ``upload_notsent_lowat`` for both the seed and the nodes
      (the node's default, or ``--config``) the write waits for the wire instead: 0.
    """
    mss = args.mtu - 52
    overrides = sb.load_overrides(args.config)
    default = NodeConfig.__dataclass_fields__["upload_notsent_lowat"].default
    lowat = all(int(overrides.get(r, {}).get("upload_notsent_lowat", default)) > 0 for r in ("seed", "node"))
    sndbuf = 0 if args.notsent_lowat or lowat else 2 * 10 * mss + (64 << 10)
    return [
        f"initial_window = {(args.initcwnd or 10) * mss}",
        f"slow_start_after_idle = {'false' if args.no_slow_start_after_idle else 'true'}",
        f"send_buffer = {sndbuf}",
    ]


def scenario_toml(
    args: argparse.Namespace, owd: dict[tuple[int, int], float], intra: float, size: int, rng_seed: int = 1
) -> str:
    """The testbed as a simulator scenario: regions of equal share, direct backbones with the measured delay,
    the hosts' TCP (``tcp_keys``), and the seed paced by the node only when the testbed's seed is."""
    seed_paced = args.pace or float(sb.load_overrides(args.config).get("seed", {}).get("upload_rate", 0)) > 0
    lines = [
        'name = "latency-testbed"',
        f'description = "benchmarks/latency_testbed.py: {args.regions} x {args.hosts} hosts"',
        "[hosts]",
        f"count = {args.regions * args.hosts}",
        f"uplink = {args.rate:.1f}",
        'downlink = "100Gbit/s"',
        "[seed]",
        f"uplink = {args.rate:.1f}",
        'region = "r0"',
        f"paced = {'true' if seed_paced else 'false'}",
        "[payload]",
        f"patch_size = {size}",
        f"chunk_size = {args.chunk_mib << 20}",
        "[run]",
        f"seed = {rng_seed}",
        'strategies = ["central", "swarm"]',
        f"deadline = {max(600.0, 20 * size * args.regions * args.hosts / args.rate):.0f}",
        "[network]",
        *tcp_keys(args),
    ]
    for r in range(args.regions):
        lines += ["[[regions]]", f'name = "r{r}"', f"share = {1 / args.regions!r}", f"latency = {intra:.6f}"]
    for (a, b), d in sorted(owd.items()):
        if a < b:
            lines += [
                "[[backbones]]",
                f'a = "r{a}"',
                f'b = "r{b}"',
                'capacity = "inf"',
                f"latency = {d:.6f}",
                "pinned = true",
            ]
    return "\n".join(lines) + "\n"


def simulate(
    args: argparse.Namespace, tmp: Path, owd: dict[tuple[int, int], float], intra: float, size: int
) -> dict[str, Any]:
    """``patchswarm simulate`` on the testbed's scenario once per RNG seed 1..``--sim-seeds`` (the
    simulator's hosts and nodes draw from it); ``strategies`` holds seed 1's, ``swarm_times`` all."""
    runs = []
    for k in range(1, args.sim_seeds + 1):
        path = tmp / f"testbed-{k}.toml"
        path.write_text(scenario_toml(args, owd, intra, size, k))
        out = tmp / f"sim-{k}"
        argv = [sys.executable, "-m", "patchswarm.daemon.cli", "simulate", str(path), "--out", str(out)]
        log(f"simulator: {' '.join(argv[1:])}")
        r = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, preexec_fn=_ordinary)
        if r.returncode != 0:
            raise RuntimeError(f"patchswarm simulate failed: {r.stderr.strip()[-2000:]}")
        runs.append(json.loads((out / "summary.json").read_text())["points"][0])
    swarm = [p["strategies"].get("swarm", {}).get("time_to_all_s") for p in runs]
    return {
        "scenario": (tmp / "testbed-1.toml").read_text(),
        "bound_s": runs[0]["bound_s"],
        "strategies": runs[0]["strategies"],
        "swarm_times": swarm,
        "swarm_egress": [p["strategies"].get("swarm", {}).get("seed_egress_ratio") for p in runs],
    }


def _ordinary() -> None:
    """(In a child, before exec) the ordinary scheduler: the simulator needs no priority over other jobs."""
    with contextlib.suppress(OSError):
        os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))


def prioritize(args: argparse.Namespace) -> str:
    """Put the testbed ahead of the machine's other jobs for the CPU; its processes inherit it.

    ``--realtime`` (the default): ``SCHED_RR`` at priority 1, so a runnable node never waits behind
    another job's time slice (they run under the ordinary scheduler; the kernel still keeps 5% of
    each second for them, ``sched_rt_runtime_us``), below the delay line's ``SCHED_FIFO`` 20.
    Otherwise niceness ``--nice`` only.  Returns what was set."""
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, 0, args.nice)
    if args.realtime:
        try:
            os.sched_setscheduler(0, os.SCHED_RR, os.sched_param(1))
            return f"SCHED_RR 1, nice {args.nice}"
        except OSError as e:
            log(f"SCHED_RR refused ({e}); nice {args.nice} only")
    return f"nice {args.nice}"


def accepted(res: sb.Result, args: argparse.Namespace) -> tuple[bool, str]:
    """Whether a patchswarm run measured the network, not a starved CPU, and why not.

    Two measured conditions, both over the transfer: the run's processes (and the delay line) waited
    for a CPU at most ``--max-wait`` of the CPU time they used (``/proc/PID/schedstat``'s run-queue
    delay: other jobs took the cores when they were runnable), and they used at most ``--max-cpu``
    of the machine's cores (beyond that they starve each other).  A run that did not reach every
    host is never accepted."""
    if res.time_to_all is None:
        return False, "did not finish"
    cpu = res.cpu_seconds + float(res.extra.get("relay_cpu_s", 0.0))
    wait = float(res.extra.get("cpu_wait_s", 0.0)) + float(res.extra.get("relay_wait_s", 0.0))
    wall = float(res.extra.get("wall") or res.time_to_all)
    share = cpu / max(wall * (os.cpu_count() or 1), 1e-9)
    res.extra["cpu_wait_ratio"] = round(wait / max(cpu, 1e-9), 3)
    res.extra["cpu_share"] = round(share, 3)
    if wait > args.max_wait * cpu:
        return False, f"CPU wait {wait:.1f} s > {args.max_wait:g} x its {cpu:.1f} CPU-s"
    if share > args.max_cpu:
        return False, f"used {share:.0%} of the cores > {args.max_cpu:.0%}"
    return True, ""


def summary(values: list[float]) -> dict[str, float]:
    """Median (the middle one; the mean of the two middle ones for an even count), min and max."""
    v = sorted(values)
    n = len(v)
    mid = v[n // 2] if n % 2 else (v[n // 2 - 1] + v[n // 2]) / 2
    return {"median": mid, "min": v[0], "max": v[-1], "n": n}


# ---------------------------------------------------------------- the run


def _have_libtorrent() -> bool:
    try:
        import libtorrent  # noqa: F401
    except ImportError:
        return False
    return True


def run(args: argparse.Namespace) -> dict[str, Any]:
    rtt = parse_rtts(args.rtt, args.regions)
    owd = {}
    for (a, b), v in rtt.items():
        owd[(a, b)] = owd[(b, a)] = v / 2
    tmp = Path(tempfile.mkdtemp(prefix="latency-testbed-"))
    log(f"work directory {tmp}")
    out: dict[str, Any] = {"args": vars(args) | {"rtt_ms": {f"r{a}-r{b}": v * 1e3 for (a, b), v in rtt.items()}}}
    busy0 = sb.machine_busy()
    try:
        with Testbed(
            args.regions,
            args.hosts,
            owd,
            args.rate,
            mtu=args.mtu,
            initcwnd=args.initcwnd,
            queue_seconds=args.queue,
            slow_start_after_idle=not args.no_slow_start_after_idle,
            notsent_lowat=args.notsent_lowat,
            work=tmp,
        ) as tb:
            log(f"testbed up: {len(tb.hosts)} hosts + seed in {args.regions} regions, namespaces {tb.prefix}-*")
            out["calibration"] = calibrate(tb, rtt, args.rate)
            out["tcp"] = tb.tcp_settings()
            args.nodes = len(tb.hosts)
            args.print_root = args.verify
            places = [sb.Place(tb.seed.ip, tuple(tb.seed.wrap([])), "r0")]
            places += [sb.Place(h.ip, tuple(h.wrap([])), f"r{h.region}") for h in tb.hosts]
            board = sb.build_board(args, tmp)
            results: list[sb.Result] = []
            if "patchswarm" in args.systems:
                for rep in range(args.repeat):
                    if rep:  # each run from version 1 again, on a board of its own
                        board = sb.build_board(args, tmp, f"patchswarm-{rep}")
                    relay0 = sb.proc_cpu(tb.relay.pid) if tb.relay else 0.0
                    wait0 = sb.proc_wait(tb.relay.pid) if tb.relay else 0.0
                    res = sb.run_patchswarm(
                        args, board, places, node_rate=args.rate if args.pace else 0, probe=lambda: wire_bytes(tb.seed)
                    )
                    res.extra["relay_cpu_s"] = round((sb.proc_cpu(tb.relay.pid) if tb.relay else 0.0) - relay0, 2)
                    res.extra["relay_wait_s"] = round((sb.proc_wait(tb.relay.pid) if tb.relay else 0.0) - wait0, 2)
                    res.extra["rep"] = rep + 1
                    ok, why = accepted(res, args)
                    res.extra["accepted"], res.extra["rejected_why"] = ok, why
                    log(f"patchswarm run {rep + 1}/{args.repeat}: {_f(res.time_to_all)} s, {why or 'accepted'}")
                    if args.verify:
                        from patchswarm.protocol.served import ServedModel

                        want = ServedModel.from_tensors(board.target).root().hex()
                        res.extra["roots_ok"] = [r == want for r in res.extra.get("roots", [])]
                        res.extra.pop("roots", None)
                    results.append(res)
            else:
                board.pub.publish(board.target)
            payload = sb.write_payload(tmp)
            if "central" in args.systems:
                results.append(run_central(args, tb, tmp, payload))
            if "libtorrent" in args.systems and not _have_libtorrent():
                log("libtorrent: not installed (pip install libtorrent==2.1.1); skipped")
            elif "libtorrent" in args.systems:
                relay0 = sb.proc_cpu(tb.relay.pid) if tb.relay else 0.0
                res = sb.run_libtorrent(args, tmp, payload, places, limit=0)
                res.extra["relay_cpu_s"] = round((sb.proc_cpu(tb.relay.pid) if tb.relay else 0.0) - relay0, 2)
                results.append(res)
            out["relay"] = tb.relay_stats()
        out["results"] = [
            {**vars(r), "ratio": r.ratio, "egress_ratio": r.egress_ratio, "per_node": r.per_node} for r in results
        ]
        if args.simulate and results:
            # The configured delays (the topology), plus the measured path inside a region.
            intra = intra_region_delay(out["calibration"])
            measured = {k: v + intra for k, v in owd.items()}
            try:
                out["simulator"] = simulate(args, tmp, measured, intra, results[0].size)
            except RuntimeError as e:
                log(str(e))
    finally:
        busy1 = sb.machine_busy()
        out["machine_busy"] = (busy1[0] - busy0[0]) / max(busy1[1] - busy0[1], 1)
        if args.keep:
            log(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def wire_bytes(host: NetHost) -> dict[str, int]:
    """Bytes and packets that left ``host``'s interface so far (its namespace's eth0 counters)."""
    out: dict[str, int] = {}
    for name in ("tx_bytes", "tx_packets"):
        text = subprocess.run(
            host.wrap(["cat", f"/sys/class/net/eth0/statistics/{name}"]), capture_output=True, text=True, timeout=10
        ).stdout.strip()
        out[name] = int(text) if text.isdigit() else 0
    return out


# ---------------------------------------------------------------- report


def _f(x: float | None, spec: str = ".2f") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def _row(*cells: object) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def comparison(out: dict[str, Any]) -> list[str]:
    """patchswarm's runs (CPU wait, share, load, accepted or why not), then the median and range of the
    accepted ones beside the simulator's over its seeds."""
    runs = [r for r in out.get("results", []) if r["name"] == "patchswarm"]
    if not runs:
        return []
    head = ("run", "time to all s", "seed egress/F", "CPU s", "CPU wait s", "cores used", "load 1 min", "accepted")
    lines = ["", _row(*head), _row(*["---"] * len(head))]
    for r in runs:
        x = r["extra"]
        load = x.get("loadavg", {})
        lines.append(
            _row(
                x.get("rep", 1),
                _f(r["time_to_all"]),
                _f(r["egress_ratio"]),
                f"{r['cpu_seconds'] + float(x.get('relay_cpu_s', 0)):.1f}",
                f"{float(x.get('cpu_wait_s', 0)) + float(x.get('relay_wait_s', 0)):.1f}",
                f"{x.get('cpu_share', 0):.0%}",
                f"{load.get('start', ['-'])[0]} -> {load.get('end', ['-'])[0]}",
                "yes" if x.get("accepted") else f"no: {x.get('rejected_why')}",
            )
        )
    good = [r["time_to_all"] for r in runs if r["extra"].get("accepted")]
    sims = [t for t in out.get("simulator", {}).get("swarm_times", []) if t is not None]
    m = summary(good) if good else None
    p = summary(sims) if sims else None
    lines.append("")
    if m:
        lines.append(f"measured, {m['n']} accepted runs: median {m['median']:.2f} s ({m['min']:.2f}-{m['max']:.2f})")
    else:
        lines.append("measured: no accepted run")
    if p:
        lines.append(f"simulator, {p['n']} seeds: median {p['median']:.2f} s ({p['min']:.2f}-{p['max']:.2f})")
    if m and p:
        lines.append(f"simulator vs measured median: {(p['median'] - m['median']) / m['median']:+.1%}")
    return lines


def report(out: dict[str, Any]) -> str:
    """The run as markdown: the RTT calibration, then the systems beside the simulator's prediction."""
    a = out["args"]
    lines = [
        f"{a['regions']} regions x {a['hosts']} hosts + a seed in r0; RTT {a['rtt_ms']} ms; "
        f"uplinks {a['rate'] / 1e6:g} MB/s (tbf); MTU {a['mtu']}; {os.cpu_count()} CPUs; "
        f"the testbed's processes at {a.get('priority', '-')}",
        "",
        _row("pair", "configured RTT ms", "measured min", "median", "p95"),
        _row(*["---"] * 5),
    ]
    for row in out["calibration"]["rtt"]:
        ms = (f"{row[k]:.2f}" for k in ("min_ms", "median_ms", "p95_ms"))
        lines.append(_row(row["pair"], f"{row['configured_ms']:.0f}", *ms))
    bulk = ", ".join(f"{k} {v / 1e6:.2f} MB/s" for k, v in out["calibration"]["bulk"].items())
    lines += ["", f"uplink, one TCP flow of 4 s at the rate, from its first byte: {bulk}"]
    lines += [f"TCP: {out.get('tcp', {})}", ""]
    sim = out.get("simulator", {}).get("strategies", {})
    head: tuple[str, ...] = (
        "system",
        "F bytes",
        "time to all s",
        "bound s",
        "time/bound",
        "seed egress/F",
        "simulator s",
    )
    head += ("CPU s: processes", "delay line", "rest of machine", "machine busy")
    lines += [_row(*head), _row(*["---"] * len(head))]
    for r in out.get("results", []):
        key = {"patchswarm": "swarm", "central seed": "central"}.get(r["name"])
        predicted = sim.get(key, {}).get("time_to_all_s") if key else None
        relay = float(r["extra"].get("relay_cpu_s", 0.0))
        lines.append(
            _row(
                r["name"],
                r["size"],
                _f(r["time_to_all"]),
                f"{r['bound']:.2f}",
                _f(r["ratio"]),
                _f(r["egress_ratio"]),
                _f(predicted),
                f"{r['cpu_seconds']:.1f}",
                f"{relay:.1f}",
                f"{max(0.0, r['other_cpu'] - relay):.1f}",
                f"{r['machine_util']:.0%}",
            )
        )
    lines += comparison(out)
    for r in out.get("results", []):
        x = r["extra"]
        if "probe" in x:  # what left the seed's interface (the chunks, headers and TCP/IP), not what it counted
            wire = x["probe"].get("tx_bytes", 0) / r["size"]
            lines.append(
                f"{r['name']}: seed wire egress/F {wire:.2f}; request timeouts {x.get('nodes_request_timeouts')}; "
                f"uploads abandoned: seed {x.get('seed_uploads_abandoned')} "
                f"({x.get('seed_bytes_abandoned', 0) / r['size']:.2f} F), nodes {x.get('nodes_uploads_abandoned')}; "
                f"busy replies: seed {x.get('seed_busy_replies')}, nodes {x.get('nodes_busy_replies')}"
            )
    for r in out.get("results", []):
        checks = {k: v for k, v in r["extra"].items() if k in ("roots_ok", "sha256_ok")}
        if checks:
            lines.append(f"{r['name']}: " + ", ".join(f"{k} {sum(v)}/{len(v)}" for k, v in checks.items()))
    relay = out.get("relay", {})
    if relay:
        lines.append(
            f"delay line: {relay.get('packets')} packets, {relay.get('bytes', 0) / 1e6:.0f} MB, "
            f"dropped {relay.get('dropped')}, release lateness {relay.get('late_ms')}, "
            f"compensation {relay.get('compensation_ms')} ms, CPU {relay.get('cpu_s')} s"
        )
    lines.append(f"machine busy over the whole run: {out['machine_busy']:.0%}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) >= 2 and argv[0] == "--role":
        return {"serve": role_serve, "fetch": role_fetch}[argv[1]](argv[2:])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--regions", type=int, default=3)
    p.add_argument("--hosts", type=int, default=6, help="hosts per region (the seed is one more, in region 0)")
    p.add_argument("--rtt", default="20,80,150", help="ms per region pair (0,1),(0,2),...,(1,2),... or one for all")
    p.add_argument("--rate", type=float, default=10e6, help="every uplink (hosts and seed), bytes/s")
    p.add_argument("--size-mb", type=float, default=100, help="patch size in MB (1e6 bytes)")
    p.add_argument("--chunk-mib", type=int, default=1)
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated, of {', '.join(SYSTEMS)}")
    p.add_argument("--mtu", type=int, default=64000)
    p.add_argument(
        "--initcwnd",
        type=int,
        default=1,
        help="TCP initial window in segments on the hosts' routes (0: the kernel's 10 = 640 kB at MTU 64000)",
    )
    p.add_argument("--no-simulate", dest="simulate", action="store_false", help="skip the simulator's prediction")
    p.add_argument("--verify", action="store_true", help="nodes print state roots (bitwise check; costs a hash each)")
    p.add_argument("--settle", type=float, default=3.0)
    p.add_argument("--timeout-factor", type=float, default=10.0)
    p.add_argument("--lt-port", type=int, default=46881)
    p.add_argument("--queue", type=float, default=0.1, help="tbf queue, seconds at the rate (at least 4 frames)")
    p.add_argument(
        "--no-slow-start-after-idle", action="store_true", help="hosts' TCP keeps its window across idle periods"
    )
    p.add_argument(
        "--notsent-lowat", type=int, default=0, help="hosts' net.ipv4.tcp_notsent_lowat, bytes (0: the kernel's)"
    )
    p.add_argument("--pace", action="store_true", help="patchswarm processes also pace themselves (--upload-rate)")
    p.add_argument("--trace", action="store_true", help="patchswarm processes log progress (swarm_bench --trace)")
    p.add_argument("--config", help="NodeConfig overrides for the patchswarm processes, JSON (swarm_bench --config)")
    p.add_argument("--repeat", type=int, default=3, help="patchswarm runs, one after another on the same testbed")
    p.add_argument("--sim-seeds", type=int, default=3, help="simulator runs, RNG seeds 1..N")
    p.add_argument(
        "--max-wait", type=float, default=0.25, help="reject a run whose processes waited for a CPU > this x their CPU"
    )
    p.add_argument("--max-cpu", type=float, default=0.6, help="reject a run whose processes used > this of the cores")
    p.add_argument(
        "--nice", type=int, default=-10, help="the testbed's and its processes' niceness (other jobs run at 0)"
    )
    p.add_argument(
        "--no-realtime",
        dest="realtime",
        action="store_false",
        help="the processes under the ordinary scheduler (at --nice), not SCHED_RR",
    )
    p.add_argument("--json", metavar="FILE")
    p.add_argument("--keep", action="store_true")
    p.add_argument("--cleanup", action="store_true", help="only remove the namespaces of killed runs, then exit")
    args = p.parse_args(argv)
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    if bad := set(args.systems) - set(SYSTEMS):
        p.error(f"--systems: unknown {sorted(bad)}")
    if not 1 <= args.regions <= 9 or not 1 <= args.hosts <= 50:
        p.error("--regions 1..9, --hosts 1..50")
    if args.config is not None:
        try:
            sb.load_overrides(args.config)
        except (ValueError, SystemExit) as e:
            p.error(f"--config: {e}")
    if not 0 <= args.notsent_lowat <= 1 << 30:
        p.error("--notsent-lowat: 0..2^30 bytes")
    if not 0.0 < args.queue <= 10.0:
        p.error("--queue: 0..10 s")
    if not 1 <= args.repeat <= 20 or not 1 <= args.sim_seeds <= 20:
        p.error("--repeat and --sim-seeds: 1..20")
    if not 0 < args.max_wait <= 100 or not 0 < args.max_cpu <= 1 or not -20 <= args.nice <= 19:
        p.error("--max-wait > 0, --max-cpu 0..1, --nice -20..19")
    if not 0 <= args.initcwnd <= 100:
        p.error("--initcwnd 0..100")
    if not 1e4 <= args.rate <= 1e9 or not 0 < args.size_mb <= 10_000 or not 1500 <= args.mtu <= 65000:
        p.error("--rate 1e4..1e9 B/s, --size-mb up to 10000, --mtu 1500..65000")
    why = can_run()
    if why:
        print(why, file=sys.stderr)
        return 2
    if args.cleanup:
        print(f"removed {cleanup_stale()}")
        return 0
    # Ahead of other jobs for the CPU, so that the runs measure the network, not a starved CPU.
    args.priority = prioritize(args)
    # SIGTERM unwinds like Ctrl-C, through every finally (namespaces and links removed).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    out = run(args)
    print(report(out))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())

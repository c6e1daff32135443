"""Swarm benchmark: a seed + N nodes on loopback, every uplink rate-limited, against the Kumar-Ross bound.

    python -m benchmarks.swarm_bench                      # 16 nodes, 10 MB/s each, 100 MB patch, 1 MiB chunks
    python -m benchmarks.swarm_bench --size-mb 20         # a quick run
    python -m benchmarks.swarm_bench --skip-libtorrent    # patchswarm only
    python -m benchmarks.swarm_bench --tls                # also patchswarm over mutual TLS, same run

Patchswarm: a board gets version 1 (a zero uint8 tensor of the patch size: a tiny anchor) and
every node converges to it; then version 2 (the same tensor filled with random bytes) is
published, whose PATCH is ~size MB of incompressible XOR planes.  The seed
(``patchswarm seed --run`` equivalent, see below) and each node (``patchswarm node``) are separate
OS processes, node i listening on 127.0.0.(i+1), all with ``--upload-rate RATE``.  Time-to-all
runs from ``publish()`` returning (the head is on the board) to the last node printing version 2.

libtorrent (if ``import libtorrent`` works; ``pip install libtorrent==2.1.1``): the same patch
payload as one file in a v1 torrent with the same piece size; one seeding session and N
downloading sessions, each in its own process bound to its own 127.0.0.x, every session with
``upload_rate_limit = RATE``, loopback peers put in the global (rate-limited) peer class, several
connections per IP allowed, DHT/LSD/UPnP/NAT-PMP and uTP off, peers connected explicitly.
Time-to-all runs from the "go" (each downloader connects to the seed and to the other
downloaders) to the last downloader finishing.

``--tls``: patchswarm runs a second time, on a second board built alike, with every process presenting
a certificate of a cluster CA made for the run (daemon/certs.py) and the whole swarm on https
(swarm/tls.py); the report adds the time and CPU of the TLS run relative to the plain one.

Both report, against the Kumar-Ross bound T >= max(F/u_seed, F/d_min, N*F/(u_seed + sum u_i)):
time-to-all / bound, and the seed's chunk egress / F.

NodeConfig overrides (to try parameters without editing swarm/): ``--config JSON`` or the
environment variable PATCHSWARM_BENCH_CONFIG, e.g.
``'{"seed": {"seed_copy_window": 4.0, "seed_max_uploads": 4}, "node": {"scheduler": {"max_inflight_per_peer": 2}}}'``.
The seed always runs through this script's worker (the CLI seed prints no metrics); nodes run
through the real ``patchswarm node`` CLI unless node overrides are given.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from patchswarm.protocol.board_names import HEAD_TAG, chunk_rel, head_rel

RUN = "bench-run"
SECRET = b"swarm-bench-cluster-secret-0123456789"
CONFIG_ENV = "PATCHSWARM_BENCH_CONFIG"
CLK_TCK = os.sysconf("SC_CLK_TCK")


# ---------------------------------------------------------------- helpers


def kumar_ross(size: float, n: int, u_seed: float, u_node: float, d_min: float = math.inf) -> float:
    """T >= max(F/u_seed, F/d_min, N*F/(u_seed + sum u_i)) (docs/design.md#distribution-lower-bounds)."""
    return max(size / u_seed, size / d_min if d_min > 0 else math.inf, n * size / (u_seed + n * u_node))


def proc_cpu(pid: int) -> float:
    """CPU seconds (user + system) of one process so far (0 if it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def proc_wait(pid: int) -> float:
    """Seconds one process has spent runnable but waiting for a CPU so far (``/proc/PID/schedstat``'s
    run-queue delay; 0 if it is gone): the direct measure of CPU starvation on a shared machine."""
    try:
        return int(Path(f"/proc/{pid}/schedstat").read_text().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


def machine_busy() -> tuple[float, float]:
    """(busy, total) jiffies over all CPUs from /proc/stat."""
    vals = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = vals[3] + (vals[4] if len(vals) > 4 else 0)
    total = sum(vals[:8])
    return total - idle, total


class CpuMeter:
    """CPU seconds of the given processes, and of everything else on the machine, over an interval."""

    def __init__(self, procs: list[Proc]) -> None:
        self.procs = procs
        self.mine0 = self._mine()
        self.wait0 = self._wait()
        self.busy0, self.total0 = machine_busy()
        self.load0 = os.getloadavg()
        self.wait_s = 0.0  # after ``stop``: the processes' run-queue delay over the interval, seconds
        self.load: dict[str, list[float]] = {}  # after ``stop``: load averages (1, 5, 15 min) at start and end

    def _mine(self) -> float:
        return sum(p.cpu() for p in self.procs) + proc_cpu(os.getpid())

    def _wait(self) -> float:
        return sum(proc_wait(p.p.pid) for p in self.procs)

    def stop(self) -> tuple[float, float, float]:
        """(our CPU s, other CPU s, machine busy fraction); also sets ``wait_s`` and ``load``."""
        mine = self._mine() - self.mine0
        self.wait_s = self._wait() - self.wait0
        self.load = {"start": [round(x, 2) for x in self.load0], "end": [round(x, 2) for x in os.getloadavg()]}
        busy1, total1 = machine_busy()
        busy = (busy1 - self.busy0) / CLK_TCK
        return mine, max(0.0, busy - mine), (busy1 - self.busy0) / max(total1 - self.total0, 1)


class Proc:
    """A child process whose stdout JSON lines are collected (with their arrival time) by a thread."""

    def __init__(
        self, name: str, argv: list[str], cwd: Path, *, stdin: bool = False, env: dict[str, str] | None = None
    ) -> None:
        self.name = name
        self.log = open(cwd / f"{name}.stderr", "w")  # noqa: SIM115 - closed in stop()
        self.p = subprocess.Popen(
            argv,
            cwd=cwd,
            stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            env=env,
        )
        self.seen: dict[str, tuple[float, dict[str, Any]]] = {}  # event key -> first (time, message)
        self._lock = threading.Lock()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.p.stdout is not None
        with open(self.log.name.replace(".stderr", ".stdout"), "w") as copy:
            for line in self.p.stdout:
                t = time.monotonic()
                copy.write(f"{t:.3f} {line}")
                self._line(t, line)

    def _line(self, t: float, line: str) -> None:
        try:
            msg = json.loads(line)
        except ValueError:
            return
        key = str(msg.get("event"))
        if key == "version":
            key = f"version:{msg.get('version')}"
        with self._lock:
            self.seen.setdefault(key, (t, msg))
            if key in ("stopped", "metrics"):
                self.seen[key] = (t, msg)  # the latest one

    def wait(self, key: str, timeout: float) -> tuple[float, dict[str, Any]]:
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                if key in self.seen:
                    return self.seen[key]
            if self.p.poll() is not None:
                time.sleep(0.2)  # let the reader drain
                with self._lock:
                    if key in self.seen:
                        return self.seen[key]
                raise RuntimeError(f"{self.name} exited (rc {self.p.returncode}) before {key!r}; see {self.log.name}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name}: no {key!r} within {timeout:.0f}s; see {self.log.name}")
            time.sleep(0.01)

    def forget(self, key: str) -> None:
        with self._lock:
            self.seen.pop(key, None)

    def send(self, line: str) -> None:
        assert self.p.stdin is not None
        self.p.stdin.write(line + "\n")
        self.p.stdin.flush()

    def cpu(self) -> float:
        return proc_cpu(self.p.pid)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> None:
        if self.p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.p.send_signal(sig)
            try:
                self.p.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait()
        time.sleep(0.1)
        self.log.close()


def load_overrides(text: str | None) -> dict[str, dict[str, Any]]:
    raw = text or os.environ.get(CONFIG_ENV) or "{}"
    data = json.loads(raw)
    if not isinstance(data, dict) or set(data) - {"seed", "node"}:
        raise SystemExit(f"--config / ${CONFIG_ENV}: a JSON object with keys 'seed' and/or 'node'")
    return {k: dict(v) for k, v in data.items()}


def apply_overrides(config: Any, overrides: dict[str, Any]) -> Any:
    """dataclasses.replace, recursing into nested dataclasses (scheduler, membership)."""
    changes: dict[str, Any] = {}
    for name, value in overrides.items():
        current = getattr(config, name)
        if dataclasses.is_dataclass(current) and isinstance(value, dict):
            changes[name] = apply_overrides(current, value)
        else:
            changes[name] = value
    return dataclasses.replace(config, **changes)


# ---------------------------------------------------------------- worker roles (child processes)


def worker_swarm(role: str, argv: list[str]) -> int:
    """``patchswarm seed --run`` / ``patchswarm node`` with NodeConfig overrides, printing metrics.

    SIGUSR1 prints {"event": "metrics", ...}; SIGTERM prints {"event": "stopped", ...} and exits.
    """
    import asyncio

    from patchswarm.daemon.board import Board
    from patchswarm.daemon.cli import build_parser
    from patchswarm.daemon.config import split_listen
    from patchswarm.daemon.swarm_cli import _config, tls_from_args
    from patchswarm.protocol.keys import TrustedKeys, load_public_key
    from patchswarm.protocol.trust import TrustState
    from patchswarm.swarm.server import start_http_node

    args = build_parser().parse_args(argv)
    overrides = load_overrides(None).get(role, {})
    if os.environ.get("PATCHSWARM_BENCH_TRACE"):
        trace_apply()
        import logging

        # Every chunk request's outcome (swarm.node logs them at debug), timestamped, on stderr.
        logging.basicConfig(level=logging.INFO, format="%(created).3f %(name)s %(message)s")
        logging.getLogger("patchswarm.swarm").setLevel(logging.DEBUG)
        import gc

        gc_start: list[float] = [0.0]

        def gc_timer(phase: str, info: dict[str, Any]) -> None:  # collections that stall the loop
            if phase == "start":
                gc_start[0] = time.monotonic()
            elif time.monotonic() - gc_start[0] > 0.02:
                rec = {"event": "gc", "gen": info["generation"], "seconds": time.monotonic() - gc_start[0]}
                print(json.dumps(rec), flush=True)

        gc.callbacks.append(gc_timer)
    host, port = split_listen(args.listen)
    tls = tls_from_args(args)
    config = apply_overrides(_config(args, is_seed=role == "seed", listen=args.listen), overrides)

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        if role == "seed":
            policy: Any = TrustedKeys(frozenset())
            running = await start_http_node(config, policy, host=host, port=port, board=Board(args.board), tls=tls)
        else:

            def on_version(held: Any) -> None:
                root = held.model.root().hex() if args.print_root else None
                print(json.dumps({"event": "version", "version": held.version, "root": root}), flush=True)

            policy = TrustState(load_public_key(args.trust))
            running = await start_http_node(config, policy, host=host, port=port, on_version=on_version, tls=tls)

        def metrics(event: str) -> None:
            print(json.dumps({"event": event, "metrics": running.node.metrics.__dict__}), flush=True)

        loop.add_signal_handler(signal.SIGUSR1, metrics, "metrics")
        tracer = loop.create_task(trace(running.node)) if os.environ.get("PATCHSWARM_BENCH_TRACE") else None
        print(json.dumps({"event": "listening", "url": running.url, "node": config.node_id}), flush=True)
        try:
            await stop.wait()
        finally:
            if tracer is not None:
                tracer.cancel()
            metrics("stopped")
            await running.stop()

    prof_dir = os.environ.get("PATCHSWARM_BENCH_PROFILE")  # a diagnostic: cProfile stats per process
    if prof_dir:
        import cProfile

        prof = cProfile.Profile(time.process_time)
        prof.enable()
        try:
            asyncio.run(main())
        finally:
            prof.disable()
            prof.dump_stats(str(Path(prof_dir) / f"{config.node_id}.prof"))
    else:
        asyncio.run(main())
    return 0


def trace_apply() -> None:
    """Print the wall and CPU time of each apply_version (a diagnostic, with --trace)."""
    import patchswarm.swarm.node
    import patchswarm.swarm.staging

    inner = getattr(patchswarm.swarm.staging, "apply_version")  # noqa: B009 - patched below

    def timed(*a: Any, **kw: Any) -> Any:
        t, c = time.monotonic(), time.process_time()
        try:
            return inner(*a, **kw)
        finally:
            rec = {"event": "apply", "start": t, "wall": time.monotonic() - t, "cpu": time.process_time() - c}
            print(json.dumps(rec), flush=True)

    setattr(patchswarm.swarm.staging, "apply_version", timed)  # noqa: B010 - a diagnostic wrapper

    # Count gossip frames sent and received (the HTTP transport's POSTs).
    import patchswarm.swarm.http

    send, handle = patchswarm.swarm.http.HttpTransport.send, patchswarm.swarm.node.SwarmNode.handle_gossip

    async def counted_send(self: Any, addr: str, data: bytes) -> None:
        GOSSIP["sent"] += 1
        GOSSIP["sent_bytes"] += len(data)
        await send(self, addr, data)

    def counted_handle(self: Any, data: bytes) -> None:  # SwarmNode.handle_gossip is synchronous
        GOSSIP["received"] += 1
        handle(self, data)

    patchswarm.swarm.http.HttpTransport.send = counted_send  # type: ignore[method-assign]
    patchswarm.swarm.node.SwarmNode.handle_gossip = counted_handle  # type: ignore[method-assign]


GOSSIP = {"sent": 0, "sent_bytes": 0, "received": 0}


async def trace(node: Any) -> None:
    """Every 0.5 s: download progress, scheduler counters, uplink use (a diagnostic, with --trace)."""
    import asyncio

    while True:
        await asyncio.sleep(0.5)
        m = node.metrics
        rec: dict[str, Any] = {
            "event": "trace",
            "t": time.monotonic(),
            "cpu": time.process_time(),
            "up": m.bytes_uploaded,
            "from_seed": m.bytes_from_seed,
            "from_peers": m.bytes_from_peers,
            "busy": m.busy_replies,
            "peers": len(node.peers),
            "slots": node.upload_slots.in_use,
            "queued": len(node.serving.queue),
            "held": node.held.version if node.held else None,
            **GOSSIP,
        }
        for sched in list(node.partial.values()):
            st = sched.stats()
            rec["sched"] = {k: st[k] for k in ("have", "inflight", "requests", "seed_requests", "timeouts", "busy")}
            rec["sched"]["missing"] = st["missing"]
        print(json.dumps(rec), flush=True)


def worker_libtorrent(argv: list[str]) -> int:
    """One libtorrent session in its own process, driven by lines on stdin ("go", "stop")."""
    import libtorrent as lt

    p = argparse.ArgumentParser()
    p.add_argument("--ip", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--torrent", required=True)
    p.add_argument("--save", required=True)
    p.add_argument("--rate", type=float, required=True)
    p.add_argument("--seed", action="store_true")
    p.add_argument("--peers", default="", help="ip:port,... to connect to on 'go'")
    p.add_argument("--trace", action="store_true", help="print progress every 0.5 s")
    a = p.parse_args(argv)

    settings = {
        "listen_interfaces": f"{a.ip}:{a.port}",
        "outgoing_interfaces": a.ip,
        "upload_rate_limit": int(a.rate),
        "download_rate_limit": 0,
        "rate_limit_ip_overhead": False,  # patchswarm's token bucket counts payload bytes only
        "allow_multiple_connections_per_ip": True,
        "enable_dht": False,
        "enable_lsd": False,
        "enable_upnp": False,
        "enable_natpmp": False,
        "enable_incoming_utp": False,  # TCP only, like patchswarm's HTTP
        "enable_outgoing_utp": False,
        "alert_mask": lt.alert.category_t.status_notification | lt.alert.category_t.error_notification,
    }
    ses = lt.session(settings)  # type: ignore[call-overload]  # a dict of settings works at run time
    if a.rate > 0:
        # Local peers default to local_peer_class, which has no rate limit: put every address in the
        # global class, whose limit upload_rate_limit sets.
        pcf = lt.ip_filter()
        pcf.add_rule("0.0.0.0", "255.255.255.255", 1 << lt.session.global_peer_class_id)
        ses.set_peer_class_filter(pcf)

    info = lt.torrent_info(a.torrent)
    atp = lt.add_torrent_params()
    atp.ti = info
    atp.save_path = a.save
    if a.seed:
        atp.flags |= lt.torrent_flags.seed_mode
    h = ses.add_torrent(atp)

    def out(event: str, **kw: Any) -> None:
        print(json.dumps({"event": event, **kw}), flush=True)

    # Wait until listening and (seed) seeding / (downloader) checked.
    deadline = time.monotonic() + 60
    listening = False
    while time.monotonic() < deadline:
        for alert in ses.pop_alerts():
            if isinstance(alert, lt.listen_succeeded_alert):
                listening = True
            elif isinstance(alert, lt.listen_failed_alert):
                out("error", message=alert.message())
                return 1
        st = h.status()
        ready = st.is_seeding if a.seed else st.state in (lt.torrent_status.downloading, lt.torrent_status.seeding)
        if listening and ready:
            break
        time.sleep(0.05)
    out("ready", seeding=h.status().is_seeding, port=ses.listen_port())

    commands: queue.Queue[str] = queue.Queue()

    def read_stdin() -> None:
        for line in sys.stdin:
            commands.put(line.strip())
        commands.put("stop")

    threading.Thread(target=read_stdin, daemon=True).start()
    peers = [(ip, int(port)) for ip, port in (x.rsplit(":", 1) for x in a.peers.split(",") if x)]
    going = False
    finished = a.seed
    last_connect = last_trace = 0.0
    while True:
        try:
            cmd = commands.get(timeout=0.02)
        except queue.Empty:
            cmd = ""
        if cmd == "go":
            going = True
        elif cmd == "stop":
            break
        if going and not finished and time.monotonic() - last_connect > 1.0:
            last_connect = time.monotonic()
            connected = {pi.ip[0] for pi in h.get_peer_info()}
            for ip, port in peers:
                if ip not in connected:
                    h.connect_peer((ip, port))
        ses.pop_alerts()
        st = h.status()
        if a.trace and time.monotonic() - last_trace >= 0.5:
            last_trace = time.monotonic()
            out("trace", done=st.total_done, up=st.total_payload_upload, peers=st.num_peers, state=str(st.state))
        if not finished and st.is_seeding:
            finished = True
            out("finished")
    st = h.status()
    out(
        "stopped",
        total_payload_upload=st.total_payload_upload,
        total_upload=st.total_upload,
        total_payload_download=st.total_payload_download,
        total_download=st.total_download,
        total_wanted=st.total_wanted,
        is_seeding=st.is_seeding,
    )
    return 0


# ---------------------------------------------------------------- patchswarm


@dataclasses.dataclass
class Result:
    name: str
    size: int
    nodes: int
    rate: float
    bound: float
    time_to_all: float | None
    seed_egress: int | None
    cpu_seconds: float  # of the benchmark's processes during the transfer
    other_cpu: float  # CPU seconds of everything else on the machine meanwhile (should be ~0)
    machine_util: float  # busy fraction of all CPUs during the transfer
    per_node: list[float] = dataclasses.field(default_factory=list)  # completion times
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def ratio(self) -> float | None:
        return None if self.time_to_all is None else self.time_to_all / self.bound

    @property
    def egress_ratio(self) -> float | None:
        return None if self.seed_egress is None else self.seed_egress / self.size


def node_ip(i: int) -> str:
    return f"127.0.0.{i + 2}"  # node i; the seed is 127.0.0.1


@dataclasses.dataclass(frozen=True)
class Place:
    """Where one process of a run lives: its address, an argv prefix (``ip netns exec NS``) and a region."""

    ip: str
    wrap: tuple[str, ...] = ()
    region: str = ""


def loopback_places(nodes: int) -> list[Place]:
    """The seed on 127.0.0.1, node i on 127.0.0.(i+2): the default, everything on this machine's loopback."""
    return [Place("127.0.0.1")] + [Place(node_ip(i)) for i in range(nodes)]


@dataclasses.dataclass
class Board:
    work: Path
    pub: Any  # daemon.publisher.Publisher, version 1 published
    target: dict[str, Any]  # version 2's tensors


def build_board(args: argparse.Namespace, tmp: Path, name: str = "patchswarm") -> Board:
    """Keys, certificate and a board holding version 1 (a tiny anchor); version 2 is built, not published."""
    import torch

    from patchswarm.daemon.publisher import Publisher
    from patchswarm.protocol.keys import SigningKey
    from patchswarm.protocol.trust import Certificate

    nbytes = int(args.size_mb * 1e6)
    work = tmp / name
    work.mkdir()
    root, trainer = SigningKey.generate(), SigningKey.generate()
    root.save(work / "root.key")
    (work / "secret").write_bytes(SECRET)
    now = int(time.time() * 1000)
    cert = Certificate(trainer.key_id, RUN, now - 60_000, now + 86_400_000).sign(root).to_bytes()
    pub = Publisher(
        work / "board", trainer, run_id=RUN, served_format="as_is", certificate=cert, chunk_size=args.chunk_mib << 20
    )
    pub.publish({"w": torch.zeros(nbytes, dtype=torch.uint8)})  # v1: a tiny anchor (zeros compress away)
    gen = torch.Generator().manual_seed(1)
    return Board(work, pub, {"w": torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)})


def make_certs(work: Path, places: list[Place]) -> dict[str, list[str]]:
    """A cluster CA and one certificate per process (its address as SAN): --tls-* flags by name."""
    from patchswarm.daemon.certs import issue, make_ca

    pki = work / "pki"
    make_ca(pki / "ca")
    flags = {}
    names = ["seed", *(f"n{i}" for i in range(len(places) - 1))]
    for name, place in zip(names, places, strict=True):
        got = issue(pki / "ca", pki, name, ips=[place.ip], days=1)
        flags[name] = ["--tls-ca", str(pki / "ca" / "ca.pem"), "--tls-cert", str(got.cert), "--tls-key", str(got.key)]
    return flags


def run_patchswarm(
    args: argparse.Namespace,
    board: Board,
    places: list[Place] | None = None,
    *,
    node_rate: float | None = None,
    tls: bool = False,
    probe: Callable[[], dict[str, int]] | None = None,
) -> Result:
    """``probe``: counters read where the seed's metrics are (before the publish, after the last node),
    their differences in ``Result.extra["probe"]`` (the testbed: bytes on the seed's wire).
    ``places``: the seed's then each node's (default: loopback).  ``node_rate``: every process's own
    ``--upload-rate`` (default ``args.rate``; 0: unlimited, when the kernel limits the links instead).
    With ``args.print_root`` nodes print each version's state root (``Result.extra["roots"]``).
    ``tls``: every process over mutual TLS, certificates from a cluster CA made for the run."""
    places = places or loopback_places(args.nodes)
    overrides = load_overrides(args.config)
    env = dict(os.environ)
    env[CONFIG_ENV] = json.dumps(overrides)
    if args.trace:
        env["PATCHSWARM_BENCH_TRACE"] = "1"
    work, pub, target = board.work, board.pub, board.target
    nbytes = target["w"].numel()
    rate = f"{args.rate if node_rate is None else node_rate:.0f}"
    common = ["--run", RUN, "--secret-file", "secret", "--upload-rate", rate]
    me = [sys.executable, str(Path(__file__).resolve())]
    certs = make_certs(work, places) if tls else {}
    name = "patchswarm+tls" if tls else "patchswarm"
    print_root = ["--print-root"] if getattr(args, "print_root", False) else []
    procs: list[Proc] = []
    try:
        sp = places[0]
        seed = Proc(
            "seed",
            [*sp.wrap, *me, "--role", "seed", "seed", "--board", str(work / "board"), "--listen", f"{sp.ip}:0"]
            + ["--name", "seed", *(["--region", sp.region] if sp.region else []), *common, *certs.get("seed", [])],
            work,
            env=env,
        )
        procs.append(seed)
        seed_url = str(seed.wait("listening", 120)[1]["url"])
        for i in range(args.nodes):
            np_ = places[i + 1]
            node_args = ["node", "--listen", f"{np_.ip}:0", "--name", f"n{i}", "--trust", "root.key.pub"]
            node_args += ["--bootstrap", seed_url, "--seed-url", seed_url, *common, *print_root]
            node_args += ["--region", np_.region] if np_.region else []
            node_args += certs.get(f"n{i}", [])
            if overrides.get("node") or args.trace:
                argv = [*me, "--role", "node", *node_args]
            else:
                argv = [sys.executable, "-m", "patchswarm.daemon.cli", *node_args]
            procs.append(Proc(f"n{i}", [*np_.wrap, *argv], work, env=env))
        nodes = procs[1:]
        for p in nodes:
            p.wait("version:1", 180)
        log(f"{name}: seed + {args.nodes} nodes at version 1; settling {args.settle:.0f}s")
        idle = CpuMeter(procs)
        time.sleep(args.settle)
        idle_cpu = idle.stop()[0] / args.settle / len(procs)
        seed.p.send_signal(signal.SIGUSR1)
        before = seed.wait("metrics", 30)[1]["metrics"]
        seed.forget("metrics")
        probed = probe() if probe is not None else {}

        log(f"{name}: publishing version 2 ({nbytes / 1e6:.0f} MB of random bytes)")
        info = pub.publish(target)
        t0 = time.monotonic()
        meter = CpuMeter(procs)
        size = info.patch_bytes
        bound = kumar_ross(size, args.nodes, args.rate, args.rate)
        log(f"{name}: v2 patch {size} bytes published in {info.seconds:.1f}s; bound {bound:.2f}s; waiting")
        times: list[float] = []
        roots: list[str | None] = []
        timeout = max(60.0, args.timeout_factor * bound)
        time_to_all: float | None = None
        try:
            for p in nodes:
                t, msg = p.wait("version:2", max(1.0, t0 + timeout - time.monotonic()))
                times.append(t - t0)
                roots.append(msg.get("root"))
            time_to_all = max(times)
        except (TimeoutError, RuntimeError) as e:
            log(f"{name}: {e}")
        t1 = time.monotonic()
        cpu = meter.stop()
        seed.p.send_signal(signal.SIGUSR1)
        after = seed.wait("metrics", 30)[1]["metrics"]
        if probe is not None:
            probed = {k: v - probed.get(k, 0) for k, v in probe().items()}
        for p in nodes:
            p.stop()
        node_metrics = [p.seen.get("stopped", (0, {"metrics": {}}))[1]["metrics"] for p in nodes]
        seed.stop()
        egress = after["bytes_uploaded"] - before["bytes_uploaded"]
        extra = {
            "seed_chunks_uploaded": after["chunks_uploaded"] - before["chunks_uploaded"],
            "seed_busy_replies": after["busy_replies"] - before["busy_replies"],
            "nodes_bytes_from_seed": sum(m.get("bytes_from_seed", 0) for m in node_metrics),
            "nodes_bytes_from_peers": sum(m.get("bytes_from_peers", 0) for m in node_metrics),
            "nodes_busy_replies": sum(m.get("busy_replies", 0) for m in node_metrics),
            "nodes_request_timeouts": sum(m.get("request_timeouts", 0) for m in node_metrics),
            "seed_uploads_abandoned": after.get("uploads_abandoned", 0) - before.get("uploads_abandoned", 0),
            "seed_bytes_abandoned": after.get("bytes_abandoned", 0) - before.get("bytes_abandoned", 0),
            "nodes_uploads_abandoned": sum(m.get("uploads_abandoned", 0) for m in node_metrics),
            "publish_seconds": round(info.seconds, 2),
            "idle_cpu_per_process": f"{idle_cpu:.1%} of a core",
            "overrides": overrides,
            "wall": t1 - t0,
            "cpu_wait_s": round(meter.wait_s, 2),  # the processes' time runnable but without a CPU
            "loadavg": meter.load,
        }
        if print_root:
            extra["roots"] = roots
        if probe is not None:
            extra["probe"] = probed
        return Result(
            name,
            size,
            args.nodes,
            args.rate,
            bound,
            time_to_all,
            egress,
            *cpu,
            sorted(times),
            extra,
        )
    finally:
        for p in procs:
            p.stop()


# ---------------------------------------------------------------- libtorrent


def run_libtorrent(
    args: argparse.Namespace, tmp: Path, payload: Path, places: list[Place] | None = None, *, limit: float | None = None
) -> Result:
    """``places`` as for run_patchswarm; ``limit``: each session's upload_rate_limit (default ``args.rate``;
    0: none, when the kernel limits the links instead).  Each downloader checks its file against the
    torrent's piece hashes before it reports "finished"; ``Result.extra["sha256_ok"]`` also compares the
    files with the payload after the run when ``args.print_root`` is set."""
    import libtorrent as lt

    places = places or loopback_places(args.nodes)
    work = tmp / "libtorrent"
    seed_dir = work / "seed"
    seed_dir.mkdir(parents=True)
    data = seed_dir / "patch.bin"
    shutil.move(str(payload), data)
    size = data.stat().st_size
    ct = lt.create_torrent(lt.list_files(str(data)), args.chunk_mib << 20, flags=lt.create_torrent.v1_only)
    lt.set_piece_hashes(ct, str(seed_dir))
    torrent = work / "patch.torrent"
    torrent.write_bytes(lt.bencode(ct.generate()))
    port = args.lt_port
    ips = [pl.ip for pl in places]
    me = [sys.executable, str(Path(__file__).resolve()), "--role", "libtorrent"]
    common = ["--port", str(port), "--torrent", str(torrent), "--rate", f"{args.rate if limit is None else limit:.0f}"]
    common += ["--trace"] if args.trace else []
    procs: list[Proc] = []
    try:
        seed_argv = [*places[0].wrap, *me, "--ip", ips[0], "--save", str(seed_dir), "--seed", *common]
        seed = Proc("lt-seed", seed_argv, work, stdin=True)
        procs.append(seed)
        for i in range(args.nodes):
            save = work / f"n{i}"
            save.mkdir()
            # Node i dials the seed and the nodes before it; later nodes dial node i.
            peers = ",".join(f"{ip}:{port}" for ip in ips[: i + 1])
            argv = [*places[i + 1].wrap, *me, "--ip", ips[i + 1], "--save", str(save), "--peers", peers, *common]
            procs.append(Proc(f"lt-n{i}", argv, work, stdin=True))
        for p in procs:
            p.wait("ready", 120)
        nodes = procs[1:]
        log(f"libtorrent: seed + {args.nodes} sessions ready; settling {args.settle:.0f}s")
        idle = CpuMeter(procs)
        time.sleep(args.settle)
        idle_cpu = idle.stop()[0] / args.settle / len(procs)
        bound = kumar_ross(size, args.nodes, args.rate, args.rate)
        meter = CpuMeter(procs)
        t0 = time.monotonic()
        for p in nodes:
            p.send("go")
        times: list[float] = []
        timeout = max(60.0, args.timeout_factor * bound)
        time_to_all: float | None = None
        try:
            for p in nodes:
                t, _ = p.wait("finished", max(1.0, t0 + timeout - time.monotonic()))
                times.append(t - t0)
            time_to_all = max(times)
        except (TimeoutError, RuntimeError) as e:
            log(f"libtorrent: {e}")
        t1 = time.monotonic()
        cpu = meter.stop()
        for p in procs:
            p.send("stop")
        stats = [p.wait("stopped", 30)[1] for p in procs]
        extra = {
            "seed_total_upload": stats[0]["total_upload"],
            "nodes_payload_download": sum(s["total_payload_download"] for s in stats[1:]),
            "idle_cpu_per_process": f"{idle_cpu:.1%} of a core",
            "wall": t1 - t0,
        }
        if getattr(args, "print_root", False):
            want = file_sha256(data)
            extra["sha256_ok"] = [file_sha256(work / f"n{i}" / data.name) == want for i in range(args.nodes)]
        return Result(
            "libtorrent " + lt.__version__,
            size,
            args.nodes,
            args.rate,
            bound,
            time_to_all,
            int(stats[0]["total_payload_upload"]),
            *cpu,
            sorted(times),
            extra,
        )
    finally:
        for p in procs:
            with contextlib.suppress(Exception):
                if p.p.poll() is None and p.p.stdin:
                    p.send("stop")
            p.stop()


def file_sha256(path: Path) -> str | None:
    """The SHA-256 of a file (None if it cannot be read)."""
    import hashlib

    h = hashlib.sha256()
    try:
        with open(path, "rb") as fh:
            while block := fh.read(1 << 20):
                h.update(block)
    except OSError:
        return None
    return h.hexdigest()


def write_payload(tmp: Path) -> Path:
    """The v2 patch payload, reassembled from the board's chunks (the file the torrent carries)."""
    from patchswarm.daemon.board import Board
    from patchswarm.protocol.head import Head
    from patchswarm.protocol.signed import Envelope

    board = Board(tmp / "patchswarm" / "board")
    head = Head.from_bytes(Envelope.from_bytes(board.read(head_rel(RUN)) or b"", HEAD_TAG).body)
    entry = next(e for e in head.catalog if e.version == head.version and e.kind.value == "patch")
    out = tmp / "patch.bin"
    with open(out, "wb") as fh:
        for ref in board.manifest(entry.manifest_id).chunks:
            fh.write(board.path(chunk_rel(ref.hash)).read_bytes())
    return out


# ---------------------------------------------------------------- report


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def report(results: list[Result], args: argparse.Namespace) -> None:
    r0 = results[0]
    print()
    print(
        f"seed + {args.nodes} nodes on loopback, upload {args.rate / 1e6:g} MB/s each, "
        f"{args.chunk_mib} MiB chunks/pieces, {os.cpu_count()} CPUs"
    )
    print(f"F = {r0.size} bytes; Kumar-Ross bound = {r0.bound:.2f} s")
    head = f"{'':<18}{'F bytes':>11}{'time s':>9}{'bound s':>9}{'time/bound':>12}{'seed egress/F':>15}"
    head += f"{'CPU s':>8}{'other CPU s':>12}{'CPU util':>10}{'first..median s':>17}"
    print(head)
    for r in results:
        spread = f"{r.per_node[0]:.1f}..{r.per_node[len(r.per_node) // 2]:.1f}" if r.per_node else "-"
        print(
            f"{r.name:<18}{r.size:>11}{fmt(r.time_to_all, '.2f'):>9}{r.bound:>9.2f}{fmt(r.ratio, '.2f'):>12}"
            f"{fmt(r.egress_ratio, '.2f'):>15}{r.cpu_seconds:>8.1f}{r.other_cpu:>12.1f}"
            f"{r.machine_util:>9.0%} {spread:>16}"
        )
    for r in results:
        extra = {k: v for k, v in r.extra.items() if v not in ({}, None)}
        print(f"  {r.name}: {json.dumps(extra, default=str)}")
    plain = next((r for r in results if r.name == "patchswarm"), None)
    tls = next((r for r in results if r.name == "patchswarm+tls"), None)
    if plain and tls and plain.time_to_all and tls.time_to_all:
        print(
            f"TLS/plain: time {tls.time_to_all / plain.time_to_all:.2f}x, "
            f"CPU {tls.cpu_seconds / max(plain.cpu_seconds, 1e-9):.2f}x "
            f"({plain.cpu_seconds:.1f} -> {tls.cpu_seconds:.1f} s)"
        )
    parts = [f"{r.name}: time/bound {fmt(r.ratio, '.2f')}, seed egress/F {fmt(r.egress_ratio, '.2f')}" for r in results]
    print("RESULT " + " | ".join(parts))
    if args.json:
        Path(args.json).write_text(
            json.dumps([dataclasses.asdict(r) | {"ratio": r.ratio, "egress_ratio": r.egress_ratio} for r in results])
        )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) >= 2 and argv[0] == "--role":
        role, rest = argv[1], argv[2:]
        if role == "libtorrent":
            return worker_libtorrent(rest)
        return worker_swarm(role, rest)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=16)
    p.add_argument("--rate", type=float, default=10e6, help="upload limit of every node and the seed, bytes/s")
    p.add_argument("--size-mb", type=float, default=100, help="patch size in MB (1e6 bytes)")
    p.add_argument("--chunk-mib", type=int, default=1, help="chunk / piece size in MiB")
    p.add_argument("--skip-libtorrent", action="store_true")
    p.add_argument("--tls", action="store_true", help="also run patchswarm over mutual TLS (a second board, same run)")
    p.add_argument("--skip-patchswarm", action="store_true", help="libtorrent only (the board is still built)")
    p.add_argument("--settle", type=float, default=3.0, help="seconds to let membership/connections settle")
    p.add_argument("--timeout-factor", type=float, default=10.0, help="give up after this many bounds")
    p.add_argument("--lt-port", type=int, default=46881, help="libtorrent listen port (on every 127.0.0.x)")
    p.add_argument("--config", help=f"NodeConfig overrides as JSON (else ${CONFIG_ENV})")
    p.add_argument(
        "--trace", action="store_true", help="processes print progress to <name>.stdout (nodes via this script)"
    )
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    p.add_argument("--keep", action="store_true", help="keep the work directory (logs: <dir>/*/<name>.stderr)")
    args = p.parse_args(argv)
    if args.nodes < 1 or args.nodes > 250:
        p.error("--nodes must be in 1..250 (one 127.0.0.x address each)")

    tmp = Path(tempfile.mkdtemp(prefix="swarm-bench-"))
    log(f"work directory {tmp}")
    results: list[Result] = []
    try:
        board = build_board(args, tmp)
        if args.skip_patchswarm:
            board.pub.publish(board.target)
        else:
            results.append(run_patchswarm(args, board))
            if args.tls:
                results.append(run_patchswarm(args, build_board(args, tmp, "patchswarm-tls"), tls=True))
        if args.skip_libtorrent:
            log("libtorrent: skipped (--skip-libtorrent)")
        else:
            try:
                import libtorrent  # noqa: F401
            except ImportError:
                log("libtorrent: not installed (pip install libtorrent==2.1.1); skipped")
            else:
                results.append(run_libtorrent(args, tmp, write_payload(tmp)))
    finally:
        if args.keep:
            log(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    if results:
        report(results, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())

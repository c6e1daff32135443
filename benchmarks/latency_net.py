"""The real-latency testbed's network: namespaces, veth links, tbf uplinks and the TUN delay line.

Needs root (``ip netns``, ``tc``, /dev/net/tun).  Layout, for R regions of H hosts and a seed:

* a router namespace ``<prefix>-rt`` with one bridge per region (``br<r>``, 10.77.<r+1>.254/24);
* each host in its own namespace ``<prefix>-r<r>h<i>`` with one veth (``eth0``, 10.77.<r+1>.<i+1>)
  whose other end is a port of its region's bridge; the seed is ``<prefix>-seed``, 10.77.1.200, in
  region 0;
* every host's uplink is a ``tc tbf`` on its ``eth0`` (its egress), at ``rate`` bytes/s, with a queue of
  ``queue_seconds`` at that rate (at least 4 frames); downlinks
  and the router are not limited;
* traffic inside a region is switched by its bridge and never reaches the delay line; traffic between
  regions is routed, and a policy rule (``iif br<r> lookup 200``, table 200: 10.77.0.0/16 via the TUN
  device) sends it into benchmarks/delay_relay.py, which holds it for the pair's one-way delay and
  writes it back; from the TUN device the main table's connected routes deliver it;
* jumbo frames (MTU 64,000) on every link: several times less CPU in the relay per byte.

``prefix`` is ``lt<pid>``, so leftovers of a dead run are recognised (``cleanup_stale``) and two runs
never collide.  ``Testbed`` is a context manager: leaving it (normally, by an exception, or by SIGTERM
turned into SystemExit by the caller) kills every process in its namespaces and deletes them, which
deletes their links.

Probes (run inside the namespaces as ``python -m benchmarks.latency_net --role ...``): a TCP ping-pong
(``ping``/``pingserver``) and a bulk sender/receiver (``bulk``/``bulksink``) for the calibration.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

NET = "10.77"
TUN = "dly0"
TABLE = 200
DEFAULT_MTU = 64000
SEED_OCTET = 200
_PREFIX_RE = re.compile(r"^lt(\d+)-")


@dataclasses.dataclass(frozen=True)
class NetHost:
    name: str  # "seed", "r0h1"
    region: int
    ns: str
    ip: str

    def wrap(self, argv: list[str]) -> list[str]:
        """``argv`` run inside this host's namespace."""
        return ["ip", "netns", "exec", self.ns, *argv]


def sh(*argv: str, check: bool = True) -> str:
    r = subprocess.run(argv, capture_output=True, text=True)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {r.stderr.strip() or r.stdout.strip()} (rc {r.returncode})")
    return r.stdout


def can_run() -> str | None:
    """None if a testbed can be built here, else why not (one line)."""
    if os.geteuid() != 0:
        return "the real-latency testbed needs root (ip netns, tc, /dev/net/tun)"
    for tool in ("ip", "tc"):
        if subprocess.run(["which", tool], capture_output=True).returncode != 0:
            return f"the real-latency testbed needs {tool!r} (iproute2)"
    if not Path("/dev/net/tun").exists():
        return "the real-latency testbed needs /dev/net/tun"
    return None


def namespaces() -> list[str]:
    return [line.split()[0] for line in sh("ip", "netns", "list", check=False).splitlines() if line.strip()]


def kill_namespace(ns: str) -> None:
    """SIGKILL every process left in ``ns``, then delete it (its links go with it)."""
    for pid in sh("ip", "netns", "pids", ns, check=False).split():
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)
    sh("ip", "netns", "del", ns, check=False)


def cleanup_stale() -> list[str]:
    """Delete the namespaces of testbeds whose process is gone; returns their names."""
    gone = []
    for ns in namespaces():
        m = _PREFIX_RE.match(ns)
        if m and not Path(f"/proc/{m.group(1)}").exists():
            kill_namespace(ns)
            gone.append(ns)
    return gone


class Testbed:
    """``regions`` x ``hosts`` namespaces plus a seed; ``owd[(a, b)]``: one-way seconds from region a to b."""

    def __init__(
        self,
        regions: int,
        hosts: int,
        owd: dict[tuple[int, int], float],
        rate: float,
        *,
        mtu: int = DEFAULT_MTU,
        queue_seconds: float = 0.1,
        initcwnd: int = 0,
        slow_start_after_idle: bool = True,
        notsent_lowat: int = 0,
        work: Path,
    ) -> None:
        if not 1 <= regions <= 50 or not 1 <= hosts <= 100:
            raise ValueError("1..50 regions of 1..100 hosts")
        self.prefix = f"lt{os.getpid()}"
        self.router = f"{self.prefix}-rt"
        self.regions, self.rate, self.mtu, self.queue_seconds = regions, rate, mtu, queue_seconds
        self.initcwnd = initcwnd
        self.slow_start_after_idle = slow_start_after_idle
        self.notsent_lowat = notsent_lowat
        self.owd = dict(owd)
        self.work = work
        self.seed = NetHost("seed", 0, f"{self.prefix}-seed", f"{NET}.1.{SEED_OCTET}")
        self.hosts = [
            NetHost(f"r{r}h{i}", r, f"{self.prefix}-r{r}h{i}", f"{NET}.{r + 1}.{i + 1}")
            for r in range(regions)
            for i in range(hosts)
        ]
        self.made: list[str] = []
        self.relay: subprocess.Popen[str] | None = None
        self.relay_lines: list[dict[str, Any]] = []

    # ------------------------------------------------------------ building

    def __enter__(self) -> Testbed:
        try:
            self.up()
        except BaseException:
            self.down()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()

    def _ns(self, ns: str) -> None:
        sh("ip", "netns", "add", ns)
        self.made.append(ns)
        sh("ip", "-n", ns, "link", "set", "lo", "up")

    def up(self) -> None:
        cleanup_stale()
        self._ns(self.router)
        rt = self.router
        sysctls = ["net.ipv4.ip_forward=1", "net.ipv4.conf.all.rp_filter=0", "net.ipv4.conf.default.rp_filter=0"]
        sh("ip", "netns", "exec", rt, "sysctl", "-qw", *sysctls)
        for r in range(self.regions):
            br = f"br{r}"
            sh("ip", "-n", rt, "link", "add", br, "type", "bridge", "forward_delay", "0", "stp_state", "0")
            sh("ip", "-n", rt, "link", "set", br, "mtu", str(self.mtu))
            sh("ip", "-n", rt, "addr", "add", f"{NET}.{r + 1}.254/24", "dev", br)
            sh("ip", "-n", rt, "link", "set", br, "up")
        for h in [self.seed, *self.hosts]:
            self._host(h)
        self._start_relay()

    def _host(self, h: NetHost) -> None:
        self._ns(h.ns)
        rt, port = self.router, f"v{h.name}"
        sh("ip", "link", "add", "name", "eth0", "netns", h.ns, "type", "veth", "peer", "name", port, "netns", rt)
        sh("ip", "-n", rt, "link", "set", port, "mtu", str(self.mtu), "master", f"br{h.region}", "up")
        sh("ip", "-n", h.ns, "link", "set", "eth0", "mtu", str(self.mtu), "up")
        sh("ip", "-n", h.ns, "addr", "add", f"{h.ip}/24", "dev", "eth0")
        # initcwnd (segments; 0: the kernel's 10): with jumbo frames 10 segments are 640 kB, where the
        # Internet's 1,500-byte frames start a connection at ~14.6 kB; 1 segment (64 kB) is closer.
        cwnd = ["initcwnd", str(self.initcwnd)] if self.initcwnd else []
        sh("ip", "-n", h.ns, "route", "add", "default", "via", f"{NET}.{h.region + 1}.254", *cwnd)
        if not self.slow_start_after_idle:  # per namespace: a connection idle for an RTO keeps its window
            sh("ip", "netns", "exec", h.ns, "sysctl", "-qw", "net.ipv4.tcp_slow_start_after_idle=0")
        if self.notsent_lowat:  # a writer blocks once this much is unsent: no seconds of data in socket buffers
            sh("ip", "netns", "exec", h.ns, "sysctl", "-qw", f"net.ipv4.tcp_notsent_lowat={self.notsent_lowat}")
        if self.initcwnd:  # the region's own subnet too (its connected route carries no initcwnd)
            subnet = [f"{NET}.{h.region + 1}.0/24", "dev", "eth0", "proto", "kernel", "scope", "link", "src", h.ip]
            sh("ip", "-n", h.ns, "route", "replace", *subnet, *cwnd)
        # The uplink: a token bucket of 2 frames' burst and queue_seconds of queue behind it.
        burst = max(2 * self.mtu, int(self.rate / 1000))
        limit = max(4 * self.mtu, int(self.rate * self.queue_seconds))
        bits = f"{int(self.rate * 8)}bit"
        tbf = ["tbf", "rate", bits, "burst", str(burst), "limit", str(limit)]
        sh("tc", "-n", h.ns, "qdisc", "add", "dev", "eth0", "root", *tbf)

    def _start_relay(self) -> None:
        rt = self.router
        argv = [sys.executable, "-m", "benchmarks.delay_relay", "--tun", TUN]
        for (a, b), d in sorted(self.owd.items()):
            argv += ["--owd", f"{a + 1}:{b + 1}:{d:.6f}"]
        self.relay_log = open(self.work / "relay.stdout", "w")  # noqa: SIM115 - closed in down()
        self.relay = subprocess.Popen(
            ["ip", "netns", "exec", rt, *argv],
            stdout=subprocess.PIPE,
            stderr=open(self.work / "relay.stderr", "w"),  # noqa: SIM115 - the child holds it
            text=True,
            cwd=Path(__file__).resolve().parent.parent,
        )
        assert self.relay.stdout is not None
        line = self.relay.stdout.readline()
        if not line.startswith('{"event": "relay_up"'):
            raise RuntimeError(f"the delay relay did not start: {line!r}; see {self.work / 'relay.stderr'}")
        import threading

        threading.Thread(target=self._relay_reader, daemon=True).start()
        sh("ip", "-n", rt, "link", "set", TUN, "mtu", str(self.mtu), "txqueuelen", "10000", "up")
        sh("ip", "netns", "exec", rt, "sysctl", "-qw", f"net.ipv4.conf.{TUN}.rp_filter=0")
        sh("ip", "-n", rt, "route", "add", f"{NET}.0.0/16", "dev", TUN, "table", str(TABLE))
        for r in range(self.regions):
            sh("ip", "-n", rt, "rule", "add", "iif", f"br{r}", "lookup", str(TABLE), "pref", "100")

    def _relay_reader(self) -> None:
        assert self.relay is not None and self.relay.stdout is not None
        for line in self.relay.stdout:
            with contextlib.suppress(ValueError):  # a bad line, or the log closed by down()
                self.relay_log.write(line)
                self.relay_log.flush()
                self.relay_lines.append(json.loads(line))

    def relay_stats(self) -> dict[str, Any]:
        """The relay's final report (it stops the relay)."""
        if self.relay is not None and self.relay.poll() is None:
            self.relay.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.relay.wait(10)
            time.sleep(0.2)
        finals = [x for x in self.relay_lines if x.get("event") == "relay_final"]
        return finals[-1] if finals else {}

    def down(self) -> None:
        if self.relay is not None and self.relay.poll() is None:
            self.relay.kill()
            self.relay.wait()
        for ns in reversed(self.made):
            kill_namespace(ns)
        self.made.clear()
        if hasattr(self, "relay_log"):
            self.relay_log.close()

    # ------------------------------------------------------------ probes

    def tcp_settings(self) -> dict[str, str]:
        """The TCP settings the hosts' connections run with (congestion control, slow start after idle)."""
        keys = ("tcp_congestion_control", "tcp_slow_start_after_idle", "tcp_notsent_lowat")
        h = self.hosts[0]
        return {k: sh(*h.wrap(["cat", f"/proc/sys/net/ipv4/{k}"])).strip() for k in keys} | {
            "initcwnd_segments": str(self.initcwnd or 10),
            "tbf_queue_s": str(self.queue_seconds),
            "mtu": str(self.mtu),
        }

    def rtt(self, a: NetHost, b: NetHost, count: int = 50, port: int = 7001) -> list[float]:
        """Round trips (s) of a 1-byte TCP ping-pong from a to b, sorted."""
        me = [sys.executable, "-m", "benchmarks.latency_net"]
        cwd = Path(__file__).resolve().parent.parent
        srv = subprocess.Popen(b.wrap([*me, "--role", "pingserver", "--ip", b.ip, "--port", str(port)]), cwd=cwd)
        try:
            out = sh(*a.wrap([*me, "--role", "ping", "--ip", b.ip, "--port", str(port), "--count", str(count)]))
        finally:
            srv.kill()
            srv.wait()
        return sorted(json.loads(out)["rtt"])

    def bulk(self, a: NetHost, b: NetHost, nbytes: int, port: int = 7002) -> float:
        """Bytes/s of one TCP transfer of ``nbytes`` from a to b (after its first round trip)."""
        me = [sys.executable, "-m", "benchmarks.latency_net"]
        cwd = Path(__file__).resolve().parent.parent
        sink = subprocess.Popen(
            b.wrap([*me, "--role", "bulksink", "--ip", b.ip, "--port", str(port)]),
            cwd=cwd,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            sh(*a.wrap([*me, "--role", "bulk", "--ip", b.ip, "--port", str(port), "--bytes", str(nbytes)]))
            out, _ = sink.communicate(timeout=120)
        finally:
            if sink.poll() is None:
                sink.kill()
                sink.wait()
        return float(json.loads(out)["rate"])


# ---------------------------------------------------------------- probe roles (inside a namespace)


def _listen(ip: str, port: int) -> socket.socket:
    ls = socket.socket()
    ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    ls.bind((ip, port))
    ls.listen()
    return ls


def _connect(ip: str, port: int) -> socket.socket:
    deadline = time.monotonic() + 10
    while True:
        try:
            return socket.create_connection((ip, port), timeout=30)
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def role(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--role", choices=["ping", "pingserver", "bulk", "bulksink"], required=True)
    p.add_argument("--ip", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--count", type=int, default=50)
    p.add_argument("--bytes", type=int, default=10**7)
    a = p.parse_args(argv)
    if a.role in ("pingserver", "bulksink"):
        c, _ = _listen(a.ip, a.port).accept()
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if a.role == "pingserver":
            while d := c.recv(64):
                c.sendall(d)
            return 0
        n, t0, t_first = 0, time.monotonic(), None
        while d := c.recv(1 << 20):
            n += len(d)
            if t_first is None:
                t_first, n0 = time.monotonic(), n
        t1 = time.monotonic()
        rate = (n - n0) / max(t1 - t_first, 1e-9) if t_first is not None else 0.0
        print(json.dumps({"bytes": n, "seconds": t1 - t0, "rate": rate}))
        return 0
    s = _connect(a.ip, a.port)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if a.role == "bulk":
        buf = b"\0" * (1 << 20)
        left = a.bytes
        while left > 0:
            left -= s.send(buf[: min(left, len(buf))])
        s.close()
        return 0
    rtts = []
    for _ in range(a.count):
        t0 = time.perf_counter()
        s.sendall(b"x")
        if not s.recv(64):
            break
        rtts.append(time.perf_counter() - t0)
        time.sleep(0.01)
    print(json.dumps({"rtt": rtts, "median": statistics.median(rtts)}))
    return 0


if __name__ == "__main__":
    sys.exit(role(sys.argv[1:]))

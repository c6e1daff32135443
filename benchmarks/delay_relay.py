"""A one-way delay line on a TUN device: the testbed's substitute for netem, which this kernel lacks.

    python -m benchmarks.delay_relay --tun dly0 --owd 1:2:0.040 --owd 2:1:0.040 ...

Run inside the router namespace of benchmarks/latency_net.py.  Policy routing sends every packet
that crosses regions into the TUN device; this process reads it, holds it for the one-way delay of
its (source region, destination region) pair, and writes it back, where the kernel forwards it to
the destination's bridge.  Regions are read from the addresses: 10.77.<region + 1>.<host>.

Why a user-space line: the kernel here has no netem, fq or etf (CONFIG_NET_SCH_NETEM/FQ/ETF unset,
no modules), so neither netem nor eBPF departure times (which need fq) can delay packets.

* One FIFO per (source region, destination region) pair and one timer for all of them: a pair's
  packets all get the same delay, so releasing each FIFO from its head never reorders a flow (a heap
  of per-packet timers can: equal deadlines break ties arbitrarily).
* Release lateness is measured (the moment a packet is written, minus its due time) and its running
  median is subtracted from later deadlines, so the RTT a flow sees is the configured one, not the
  configured one plus the scheduler's wake-up latency twice.
* The TUN device's packets are up to its MTU (64,000 on the testbed: ~5x less CPU here than 1,500).

Prints one JSON line per ``--report`` seconds and one on SIGTERM/SIGINT:
{"event": "relay", "packets", "bytes", "late_ms": {"median", "p99", "max"}, "compensation_ms", ...}.
"""

from __future__ import annotations

import argparse
import collections
import fcntl
import json
import os
import select
import signal
import struct
import sys
import time
from typing import Any

TUNSETIFF = 0x400454CA
IFF_TUN = 0x0001
IFF_NO_PI = 0x1000
MAX_PACKET = 65536
MAX_COMPENSATION = 0.002  # s: never release more than this early, whatever the estimate says
LATE_WINDOW = 512
MAX_SAMPLES = 4_000_000  # lateness samples the compensation's median is taken over


def open_tun(name: str) -> int:
    """Attach to (or create) the TUN device ``name``; packets come without a packet-info header."""
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI))
    return fd


def parse_owd(text: str) -> tuple[tuple[int, int], float]:
    """``SRC:DST:SECONDS`` (regions as the third octet of their addresses) -> ((src, dst), seconds)."""
    try:
        a, b, d = text.split(":")
        src, dst, owd = int(a), int(b), float(d)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected SRC:DST:SECONDS, got {text!r}") from None
    if not (0 <= src <= 255 and 0 <= dst <= 255 and 0.0 <= owd <= 10.0):
        raise argparse.ArgumentTypeError(f"regions 0..255 and a delay of 0..10 s, got {text!r}")
    return (src, dst), owd


class Relay:
    def __init__(self, fd: int, owd: dict[tuple[int, int], float]) -> None:
        self.fd = fd
        self.owd = owd
        self.queues: dict[tuple[int, int], collections.deque[tuple[float, bytes]]] = {
            k: collections.deque() for k in owd
        }
        self.late: collections.deque[float] = collections.deque(maxlen=LATE_WINDOW)
        self.compensation = 0.0
        self.report_late: list[float] = []
        self.all_late: list[float] = []  # the whole run's, for the final line (capped)
        self.packets = self.bytes = self.passed = self.dropped = self.other = 0
        self.per_pair: dict[tuple[int, int], int] = dict.fromkeys(owd, 0)
        self.backlog_max = 0
        self.realtime = False

    def receive(self, now: float) -> None:
        """Read every packet waiting on the TUN device and queue it (or write it straight back)."""
        while True:
            try:
                pkt = os.read(self.fd, MAX_PACKET)
            except BlockingIOError:
                return
            if len(pkt) < 20 or pkt[0] >> 4 != 4:
                self.other += 1  # IPv6 or junk: the testbed is IPv4 only
                continue
            key = (pkt[14], pkt[18])  # third octet of the source and destination addresses
            self.packets += 1
            self.bytes += len(pkt)
            q = self.queues.get(key)
            if q is None:
                self.passed += 1  # a pair without a delay: straight back
                self._write(pkt)
                continue
            self.per_pair[key] += 1
            # The due time is what lateness is measured against; release aims compensation earlier.
            q.append((now + self.owd[key], pkt))
            self.backlog_max = max(self.backlog_max, len(q))

    def _write(self, pkt: bytes) -> None:
        try:
            os.write(self.fd, pkt)
        except OSError:
            self.dropped += 1  # the kernel's backlog is full: a drop, as a router would

    def release(self, now: float) -> float:
        """Write every packet whose (compensated) time has come; return the next such time (inf: none)."""
        nxt = float("inf")
        for q in self.queues.values():
            while q and q[0][0] - self.compensation <= now:
                due, pkt = q.popleft()
                self._write(pkt)
                late = time.monotonic() - due
                self.late.append(late)
                self.report_late.append(late)
                if len(self.all_late) < MAX_SAMPLES:
                    self.all_late.append(late)
            if q:
                nxt = min(nxt, q[0][0] - self.compensation)
        return nxt

    def update_compensation(self) -> None:
        """Aim earlier by the running median lateness (what is left over stays in the measured RTT)."""
        if len(self.late) >= 32:
            raw = sorted(self.late)[len(self.late) // 2] + self.compensation
            self.compensation = min(max(raw, 0.0), MAX_COMPENSATION)

    def report(self, final: bool = False) -> dict[str, Any]:
        """Lateness percentiles since the last report, or over the whole run (``final``)."""
        late = sorted(self.all_late if final else self.report_late)
        self.report_late.clear()

        def q(f: float) -> float | None:
            return round(late[min(len(late) - 1, int(f * len(late)))] * 1e3, 3) if late else None

        return {
            "event": "relay_final" if final else "relay",
            "packets": self.packets,
            "bytes": self.bytes,
            "passed": self.passed,
            "dropped": self.dropped,
            "other": self.other,
            "backlog_max": self.backlog_max,
            "late_ms": {"median": q(0.5), "p99": q(0.99), "max": round(late[-1] * 1e3, 3) if late else None},
            "compensation_ms": round(self.compensation * 1e3, 3),
            "per_pair": {f"{a}:{b}": n for (a, b), n in self.per_pair.items()},
            "cpu_s": round(time.process_time(), 3),
            "realtime": self.realtime,
        }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tun", required=True, help="TUN device name (created if absent)")
    p.add_argument("--owd", type=parse_owd, action="append", default=[], metavar="SRC:DST:SECONDS")
    p.add_argument("--report", type=float, default=5.0, help="seconds between progress lines")
    p.add_argument("--no-compensation", action="store_true", help="release at the due time, not before")
    p.add_argument("--no-realtime", action="store_true", help="do not ask for SCHED_FIFO")
    a = p.parse_args(argv)
    if len(a.tun) > 15:
        p.error("--tun: at most 15 characters")
    owd = dict(a.owd)
    relay = Relay(open_tun(a.tun), owd)
    # The line is the network: when the hosts' processes saturate the CPUs it must still release on time
    # (at normal priority its p99 lateness reached 2.6 s with 19 busy processes on 2 cores).  It sleeps
    # in select() between packets, and the kernel's RT throttling keeps 5% of each CPU for the rest.
    realtime = False
    if not a.no_realtime:
        try:
            os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(20))
            realtime = relay.realtime = True
        except (OSError, AttributeError):
            pass
    stop = [False]

    def on_signal(signum: int, frame: Any) -> None:
        stop[0] = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    pairs = {f"{k[0]}:{k[1]}": v for k, v in owd.items()}
    print(json.dumps({"event": "relay_up", "pairs": pairs, "realtime": realtime}), flush=True)
    next_report = time.monotonic() + a.report
    nxt = float("inf")
    next_tune = 0.0
    while not stop[0]:
        now = time.monotonic()
        timeout = max(0.0, min(nxt, next_report) - now)
        try:
            ready, _, _ = select.select([relay.fd], [], [], timeout)
        except InterruptedError:
            continue
        now = time.monotonic()
        if ready:
            relay.receive(now)
        nxt = relay.release(time.monotonic())
        if not a.no_compensation and now >= next_tune:
            next_tune = now + 0.25
            relay.update_compensation()
        if now >= next_report:
            next_report = now + a.report
            print(json.dumps(relay.report()), flush=True)
    print(json.dumps(relay.report(final=True)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""TCP's congestion window on the simulator's keep-alive connections: slow start and restart after idle.

The flow model (simulations/network.py) gives a transfer its max-min share from the moment its
one-way latency has passed, at most ``window / RTT``.  A real TCP connection cannot: a new one
first spends a round trip on its handshake, and then sends ``initial_window`` bytes in its first
round trip, about twice as much in each next one (slow start, RFC 5681 section 3.1; BBR's startup
grows its rate by 2/ln 2 per round, about the same), until the window covers its share of the path.
A connection idle for longer than its retransmission timeout falls back towards the initial window
(RFC 5681 section 4.1, RFC 2861; Linux ``tcp_cwnd_restart`` halves the window once per RTO idle,
down to ``min(initial window, cwnd)``, while ``net.ipv4.tcp_slow_start_after_idle`` is 1, the default).

This module holds only the bookkeeping: which connections between two hosts are open and idle, with
what window.  ``simulations/transport.py`` turns a reply into rounds: round k carries at most
``cwnd_k`` bytes as a flow capped at ``cwnd_k / RTT`` (so it lasts at least one RTT, the ACK clock),
and the rest goes as one flow once a round shows that the path's share, not the window, bounds it.
That is the round-based slow-start latency model of Cardwell, Savage and Anderson, "Modeling TCP
latency" (INFOCOM 2000), in the flow model's terms.  With RTT 0 nothing changes: no handshake, no
rounds, the plain max-min flow.

Left out: loss and congestion avoidance (the flow's share stands for the steady state), delayed
ACKs, the server closing idle keep-alive connections, and queueing delay in the links' buffers.

Pure: time comes in, no I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

__all__ = ["Connection", "Connections", "TcpModel"]


@dataclass(frozen=True, slots=True)
class TcpModel:
    """``initial_window``: bytes a new connection may send in its first round trip (RFC 6928: 10
    segments, 14,600 bytes at a 1,460-byte MSS).  ``restart_after_idle``: Linux's
    ``tcp_slow_start_after_idle``.  ``rto_min``: Linux's minimum retransmission timeout (200 ms); a
    connection's RTO is taken as RTT + ``rto_min`` (Linux: SRTT + max(4 RTTVAR, rto_min)).
    ``send_buffer``: bytes the kernel takes from a writer at once; a chunk reply no larger returns
    from the server's write (and frees its upload slot) as soon as it starts, while its bytes are
    still on their way, as ``resp.write`` does once the socket has taken them.  0: the write lasts
    until the bytes have arrived (the slot is the flow)."""

    initial_window: float
    restart_after_idle: bool = True
    rto_min: float = 0.2
    send_buffer: float = 0.0

    def __post_init__(self) -> None:
        if not self.initial_window > 0 or math.isinf(self.initial_window):
            raise ValueError("initial_window must be a positive number of bytes")
        if not self.rto_min >= 0 or math.isinf(self.rto_min):
            raise ValueError("rto_min must be >= 0 seconds")
        if not self.send_buffer >= 0 or math.isinf(self.send_buffer):
            raise ValueError("send_buffer must be >= 0 bytes")


@dataclass(slots=True)
class Connection:
    """One keep-alive connection from a server ``src`` to a client ``dst`` (the direction replies take)."""

    src: str
    dst: str
    cwnd: float
    idle_since: float = math.nan  # NaN: in use
    new: bool = True  # not yet used: a request on it first pays the handshake


@dataclass(slots=True)
class Connections:
    """The idle connections per (server, client) pair; a request takes the most recently freed one
    (as aiohttp's connector pool does) or opens a new one."""

    model: TcpModel
    _idle: dict[tuple[str, str], list[Connection]] = field(default_factory=dict)
    opened: int = 0
    restarts: int = 0

    def take(self, src: str, dst: str, now: float, rtt: float) -> Connection:
        """A connection for one request at ``now``, its window as it stands after any idle time."""
        pool = self._idle.get((src, dst))
        if not pool:
            self.opened += 1
            return Connection(src, dst, self.model.initial_window)
        conn = pool.pop()
        idle = now - conn.idle_since
        conn.idle_since = math.nan
        conn.new = False
        if self.model.restart_after_idle:
            rto = rtt + self.model.rto_min
            floor = min(self.model.initial_window, conn.cwnd)
            if idle > rto and conn.cwnd > floor:
                self.restarts += 1
                # Linux tcp_cwnd_restart: halve once per RTO of idle time, never below the floor.
                halvings = min(int(idle / rto), 64)
                conn.cwnd = max(floor, conn.cwnd / 2.0**halvings)
        return conn

    def give_back(self, conn: Connection, now: float) -> None:
        """The exchange on ``conn`` ended at ``now`` and the connection stays open for the next one."""
        conn.idle_since = now
        conn.new = False
        self._idle.setdefault((conn.src, conn.dst), []).append(conn)

    def close(self, conn: Connection) -> None:
        """The connection was closed (a requester gave up, a host died): it is not reused."""
        conn.idle_since = math.nan

    def forget_host(self, host: str) -> None:
        """A crashed host's connections are gone."""
        for key in [k for k in self._idle if host in k]:
            del self._idle[key]

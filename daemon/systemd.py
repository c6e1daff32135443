"""sd_notify(3): READY, STOPPING, STATUS and watchdog keep-alives, over $NOTIFY_SOCKET.

The protocol is one datagram of newline-separated assignments; a no-op when not run by systemd.
"""

from __future__ import annotations

import asyncio
import os
import socket


def notify(*assignments: str) -> bool:
    addr = os.environ.get("NOTIFY_SOCKET")
    if not addr:
        return False
    if addr.startswith("@"):
        addr = "\0" + addr[1:]  # abstract namespace
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.connect(addr)
        s.sendall("\n".join(assignments).encode())
    return True


def watchdog_interval() -> float | None:
    """Half of WatchdogSec (systemd's advice), if the watchdog is on for this process."""
    usec = os.environ.get("WATCHDOG_USEC")
    pid = os.environ.get("WATCHDOG_PID")
    if not usec or (pid and int(pid) != os.getpid()):
        return None
    return int(usec) / 2e6


async def watchdog_loop(interval: float) -> None:
    """Keep-alives from the event loop itself: a stuck loop stops them and systemd restarts us."""
    while True:
        notify("WATCHDOG=1")
        await asyncio.sleep(interval)

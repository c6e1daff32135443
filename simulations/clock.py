"""Virtual time for asyncio: an event loop whose clock jumps to the next timer when it is idle.

``VirtualTimeLoop`` is a stock selector event loop with two changes: ``time()`` returns a
virtual clock, and the selector never waits.  When the loop has nothing ready it would block
in ``select(timeout)`` until its earliest timer; here the virtual clock moves to that timer's
deadline instead, at once.  Everything scheduled through the loop (``asyncio.sleep``,
``call_later``, ``asyncio.timeout``, ``wait_for``) therefore runs in virtual time, so real,
unmodified asyncio code (a ``swarm.node.SwarmNode``) runs on it at the speed of its callbacks.
Real I/O still works (the selector is polled without waiting), but a simulation should have
none: a socket's data would arrive at an arbitrary virtual instant.

The loop raises ``VirtualTimeDeadlock`` when nothing is ready, no timer is pending and no
real I/O arrives within ``idle_wall_timeout`` wall seconds: in a simulation that means every
task waits for something that can never happen.

``SimClock`` implements ``swarm.transport.Clock`` over the running loop's virtual time; its
``wall()`` is a fixed epoch plus virtual seconds, so signed documents' expiry checks see a
clock that advances with the simulation.

(The ``looptime`` package on PyPI does the same by patching a loop; this subclass needs no
dependency and keeps the mechanism in one short file.)
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import selectors
from collections.abc import Coroutine, Iterator
from typing import Any, TypeVar

T = TypeVar("T")


class VirtualTimeDeadlock(RuntimeError):
    """The loop has no ready callbacks, no timers and no I/O: nothing can ever happen again."""


class _VirtualSelector(selectors.BaseSelector):
    """Wraps a real selector; ``select`` polls it without waiting and advances the loop's virtual clock."""

    def __init__(self, idle_wall_timeout: float) -> None:
        self._real = selectors.DefaultSelector()
        self._idle_wall_timeout = idle_wall_timeout
        self.loop: VirtualTimeLoop | None = None

    def register(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        return self._real.register(fileobj, events, data)

    def unregister(self, fileobj: Any) -> selectors.SelectorKey:
        return self._real.unregister(fileobj)

    def modify(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        return self._real.modify(fileobj, events, data)

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        if timeout == 0:
            # Callbacks are ready: run them; the real selector is polled before the clock next moves.
            # (A poll per loop iteration was a system call per simulated callback batch.)
            return []
        ready = self._real.select(0)
        if ready:
            return ready
        if timeout is None:
            # No timer at all: only another thread (call_soon_threadsafe) could still wake us.
            ready = self._real.select(self._idle_wall_timeout)
            if ready:
                return ready
            raise VirtualTimeDeadlock("no callbacks, no timers, no I/O: every task waits forever")
        assert self.loop is not None
        self.loop._jump(timeout)
        return []

    def close(self) -> None:
        self._real.close()

    def get_map(self) -> Any:
        return self._real.get_map()


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """An event loop on virtual time, starting at ``start`` seconds."""

    def __init__(self, start: float = 0.0, *, idle_wall_timeout: float = 1.0) -> None:
        self._virtual_now = float(start)
        selector = _VirtualSelector(idle_wall_timeout)
        super().__init__(selector)
        selector.loop = self
        self.jumps = 0  # how many times the clock moved (a measure of simulated events)

    def time(self) -> float:
        return self._virtual_now

    def _jump(self, timeout: float) -> None:
        """Move to the earliest timer's deadline exactly (``timeout`` is its distance, rounded by the loop)."""
        target = self._virtual_now + timeout
        scheduled: list[asyncio.TimerHandle] = getattr(self, "_scheduled", [])
        if scheduled:
            when = scheduled[0].when()
            if abs(when - target) <= 1e-6 * max(1.0, abs(target)):
                target = when
        self._virtual_now = max(self._virtual_now, target)
        self.jumps += 1


def run_virtual(main: Coroutine[Any, Any, T], *, start: float = 0.0, debug: bool = False) -> T:
    """Run ``main`` to completion on a fresh VirtualTimeLoop (like ``asyncio.run``), then close the loop."""
    with _sparse_gc(), asyncio.Runner(debug=debug, loop_factory=lambda: VirtualTimeLoop(start)) as runner:
        return runner.run(main)


@contextlib.contextmanager
def _sparse_gc() -> Iterator[None]:
    """Fewer, cheaper cyclic collections while a simulation runs: what exists before it (modules, torch,
    the setup) is frozen out of the collector's scans, and the youngest generation is collected every
    50,000 allocations instead of 700.  A simulation allocates millions of short-lived objects (tasks,
    futures, timer handles), and the default thresholds cost ~20% of its CPU time (300 hosts x 500 MB:
    22.6 -> 17.4 s) for no memory saved (same peak RSS).  Restored afterwards."""
    threshold = gc.get_threshold()
    gc.freeze()
    gc.set_threshold(max(threshold[0], 50_000), *threshold[1:])
    try:
        yield
    finally:
        gc.set_threshold(*threshold)
        gc.unfreeze()


class SimClock:
    """``swarm.transport.Clock`` over the running loop's (virtual) time."""

    def __init__(self, epoch: float) -> None:
        self.epoch = epoch  # the Unix time virtual time 0 stands for
        # The loop of the run, taken on first use (nodes read the clock hundreds of thousands of times
        # a run); a clock read on another loop later (a clock reused across runs) takes that one.
        self._loop: asyncio.AbstractEventLoop | None = None

    def now(self) -> float:
        loop = self._loop
        if loop is None or not loop.is_running():
            loop = self._loop = asyncio.get_running_loop()
        return loop.time()

    def wall(self) -> float:
        return self.epoch + self.now()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(max(0.0, seconds))

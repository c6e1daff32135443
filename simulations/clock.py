"""Virtual time for asyncio: an event loop whose clock jumps to the next timer when it is idle.

``VirtualTimeLoop`` is a stock selector event loop with two changes: ``time()`` returns a
virtual clock, and the selector never waits.  When the loop has nothing ready it would block
in ``select(timeout)`` until its earliest timer; here the virtual clock moves to that timer's
deadline instead, at once.  Everything scheduled through the loop (``asyncio.sleep``,
``call_later``, ``asyncio.timeout``, ``wait_for``) therefore runs in virtual time, so real,
unmodified asyncio code (a ``swarm.node.SwarmNode``) runs on it at the speed of its callbacks.
Real I/O still works (the selector is polled without waiting), but a simulation should have
none: a socket's data would arrive at an arbitrary virtual instant.  (For speed the loop also
carries lean copies of asyncio's scheduling methods; they keep its order of callbacks exactly.)

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
import contextvars
import gc
import heapq
import math
import selectors
from asyncio import events, format_helpers
from collections.abc import Callable, Coroutine, Iterator
from typing import Any, TypeVar, TypeVarTuple

T = TypeVar("T")
_Ts = TypeVarTuple("_Ts")


class VirtualTimeDeadlock(RuntimeError):
    """The loop has no ready callbacks, no timers and no I/O: nothing can ever happen again."""


class _VirtualSelector(selectors.BaseSelector):
    """Wraps a real selector; ``select`` polls it without waiting and advances the loop's virtual clock."""

    def __init__(self, idle_wall_timeout: float) -> None:
        self._real = selectors.DefaultSelector()
        self._idle_wall_timeout = idle_wall_timeout
        self._watched = 0  # registered files
        self.loop: VirtualTimeLoop | None = None

    def register(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        key = self._real.register(fileobj, events, data)
        self._watched += 1
        return key

    def unregister(self, fileobj: Any) -> selectors.SelectorKey:
        key = self._real.unregister(fileobj)
        self._watched -= 1
        return key

    def modify(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        return self._real.modify(fileobj, events, data)

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        if timeout == 0:
            # Callbacks are ready: run them; the real selector is polled before the clock next moves.
            # (A poll per loop iteration was a system call per simulated callback batch.)
            return []
        # The loop's own self-pipe is always registered; it only wakes a waiting select, and this one
        # waits only below, where nothing is ready (call_soon_threadsafe queues its callback directly).
        # So poll only when something else is watched: a system call per clock jump saved (~3% of a run).
        if self._watched > 1 and (ready := self._real.select(0)):
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


# asyncio.base_events' thresholds for purging cancelled timers (copied: the purge order must be the same).
_MIN_SCHEDULED_TIMER_HANDLES = 100
_MIN_CANCELLED_TIMER_HANDLES_FRACTION = 0.5
_MAXIMUM_SELECT_TIMEOUT = 24 * 3600
_NAN = math.nan


class _Handle(events.Handle):
    """asyncio's Handle without the per-handle debug check (the loop uses these only outside debug mode)."""

    __slots__ = ()

    def __init__(
        self,
        callback: Callable[..., object],
        args: Any,
        loop: asyncio.AbstractEventLoop,
        context: contextvars.Context | None = None,
    ) -> None:
        _init_handle(self, callback, args, loop, context)


def _init_handle(
    h: Any,
    callback: Callable[..., object],
    args: Any,
    loop: asyncio.AbstractEventLoop,
    context: contextvars.Context | None,
) -> None:
    """The fields asyncio's Handle.__init__ sets, without its debug-mode check."""
    h._context = contextvars.copy_context() if context is None else context
    h._loop = loop
    h._callback = callback
    h._args = args
    h._cancelled = False
    h._repr = None
    h._source_traceback = None


class _TimerHandle(events.TimerHandle):
    """asyncio's TimerHandle without the debug checks; ``cancel`` does the loop's bookkeeping inline."""

    __slots__ = ()

    def __init__(
        self,
        when: float,
        callback: Callable[..., object],
        args: Any,
        loop: asyncio.AbstractEventLoop,
        context: contextvars.Context | None = None,
    ) -> None:
        h: Any = self
        _init_handle(h, callback, args, loop, context)
        h._when = when
        h._scheduled = False

    def cancel(self) -> None:
        h: Any = self
        if not h._cancelled:
            loop = h._loop
            if h._scheduled:
                loop._timer_cancelled_count += 1
            h._cancelled = True
            if loop._debug:
                h._repr = repr(self)
            h._callback = None
            h._args = None


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """An event loop on virtual time, starting at ``start`` seconds.

    ``call_soon``, ``call_at``, ``call_later`` and ``_run_once`` are lean copies of asyncio's (3.11):
    the same handles and the same order of callbacks, without the debug checks and layers of calls
    (a large simulation runs tens of millions of callbacks).  The timers sit in a heap of
    ``(when, nan, handle)``: the C tuple comparison orders them exactly as asyncio's heap of handles
    does (by ``when``; a tie compares the NaNs, neither below the other, as two handles due at the
    same time are not), without a Python ``TimerHandle.__lt__`` call per comparison.  Each entry has
    its own NaN object: an identical one would count as equal and pass the tie on to the handles.
    """

    def __init__(self, start: float = 0.0, *, idle_wall_timeout: float = 1.0) -> None:
        self._virtual_now = float(start)
        selector = _VirtualSelector(idle_wall_timeout)
        super().__init__(selector)
        selector.loop = self
        self._timers: list[tuple[float, float, asyncio.TimerHandle]] = []  # heap, see the class docstring
        self.jumps = 0  # how many times the clock moved (a measure of simulated events)

    def time(self) -> float:
        return self._virtual_now

    def call_soon(
        self, callback: Callable[[*_Ts], object], *args: *_Ts, context: contextvars.Context | None = None
    ) -> asyncio.Handle:
        s: Any = self
        if s._debug:
            return super().call_soon(callback, *args, context=context)
        if s._closed:
            raise RuntimeError("Event loop is closed")
        handle = _Handle(callback, args, self, context)
        s._ready.append(handle)
        return handle

    def call_at(
        self,
        when: float,
        callback: Callable[[*_Ts], object],
        *args: *_Ts,
        context: contextvars.Context | None = None,
    ) -> asyncio.TimerHandle:
        s: Any = self
        if when is None:
            raise TypeError("when cannot be None")
        if s._closed:
            raise RuntimeError("Event loop is closed")
        if s._debug:
            s._check_thread()
            s._check_callback(callback, "call_at")
            timer: Any = events.TimerHandle(when, callback, args, self, context)
        else:
            timer = _TimerHandle(when, callback, args, self, context)
        heapq.heappush(self._timers, (when, -_NAN, timer))  # -_NAN: a new NaN object
        timer._scheduled = True
        return timer  # type: ignore[no-any-return]

    def call_later(
        self,
        delay: float,
        callback: Callable[[*_Ts], object],
        *args: *_Ts,
        context: contextvars.Context | None = None,
    ) -> asyncio.TimerHandle:
        if delay is None:
            raise TypeError("delay must not be None")
        return self.call_at(self._virtual_now + delay, callback, *args, context=context)

    def close(self) -> None:
        super().close()
        self._timers.clear()

    def _run_once(self) -> None:
        """asyncio's ``BaseEventLoop._run_once`` over the timer heap above, with the selector called only
        when idle (where the clock jumps).  (Its debug-mode slow-callback warning is left out: virtual time
        does not pass during a callback.)"""
        s: Any = self
        timers = self._timers
        count = len(timers)
        if (
            count > _MIN_SCHEDULED_TIMER_HANDLES
            and s._timer_cancelled_count / count > _MIN_CANCELLED_TIMER_HANDLES_FRACTION
        ):
            kept = []
            for entry in timers:
                if entry[2]._cancelled:
                    entry[2]._scheduled = False  # type: ignore[attr-defined]
                else:
                    kept.append(entry)
            heapq.heapify(kept)
            self._timers = timers = kept
            s._timer_cancelled_count = 0
        else:
            while timers and timers[0][2]._cancelled:
                s._timer_cancelled_count -= 1
                heapq.heappop(timers)[2]._scheduled = False  # type: ignore[attr-defined]
        ready = s._ready
        if not ready and not s._stopping:
            timeout = None
            if timers:
                timeout = min(max(0, timers[0][0] - self._virtual_now), _MAXIMUM_SELECT_TIMEOUT)
            s._process_events(s._selector.select(timeout))  # polls real I/O, then jumps (see _VirtualSelector)
        end_time = self._virtual_now + s._clock_resolution
        while timers:
            if timers[0][0] >= end_time:
                break
            handle: Any = heapq.heappop(timers)[2]
            handle._scheduled = False
            ready.append(handle)
        popleft = ready.popleft
        for _ in range(len(ready)):
            handle = popleft()
            if handle._cancelled:
                continue
            try:  # Handle._run, inlined
                handle._context.run(handle._callback, *handle._args)
            except (SystemExit, KeyboardInterrupt):
                raise
            except BaseException as exc:
                source = format_helpers._format_callback_source(handle._callback, handle._args)
                context = {"message": f"Exception in callback {source}", "exception": exc, "handle": handle}
                if handle._source_traceback:
                    context["source_traceback"] = handle._source_traceback
                self.call_exception_handler(context)
        handle = None  # breaks a cycle when an exception occurred

    def _jump(self, timeout: float) -> None:
        """Move to the earliest timer's deadline exactly (``timeout`` is its distance, rounded by the loop)."""
        target = self._virtual_now + timeout
        if self._timers:
            when = self._timers[0][0]
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
    500,000 allocations instead of 700.  A simulation allocates millions of short-lived objects (tasks,
    futures, timer handles), and the default thresholds cost ~20% of its CPU time (300 hosts x 500 MB:
    22.6 -> 17.4 s) for no memory saved (same peak RSS).  50,000 still left the collector 7% (1,000 hosts
    x 500 MB) to 19% (3,000 hosts x 150 MB, bounded views: 13.8 CPU-s, 3.8 at 500,000): most of those
    objects live a little longer than 50,000 allocations, and each collection scans and promotes them.
    Peak RSS is the same as with no collection at all (the run leaves little cyclic garbage).  Restored
    afterwards."""
    threshold = gc.get_threshold()
    gc.freeze()
    gc.set_threshold(max(threshold[0], 500_000), *threshold[1:])
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

    def sleep(self, seconds: float) -> Coroutine[Any, Any, None]:
        return asyncio.sleep(max(0.0, seconds))  # the coroutine itself: no frame of ours per sleep

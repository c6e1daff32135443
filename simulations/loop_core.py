"""The virtual-time loop's per-callback work, compiled with the simulator (simulations/build.py).

``simulations.clock.VirtualTimeLoop`` subclasses asyncio's loop, so mypyc cannot compile it; a
large simulation runs tens of millions of callbacks through its ``call_soon``, ``call_at`` and
``_run_once``.  ``LoopCore`` holds that work and its state (the virtual clock, the timer heap,
the count of cancelled timers): the loop installs the core's bound methods as its own
``call_soon``, ``call_at``, ``call_later``, ``time``, ``get_debug``, ``create_future`` and
``create_task`` (instance attributes: asyncio's C tasks and futures call them by name) and runs
``run_once`` for ``_run_once``.  Interpreted (the source
tree) it is the same code, slower.

The order of callbacks is asyncio's (3.11) exactly, ties and cancelled timers included
(tests/test_sim_transport.py runs both side by side): the timers sit in a heap of
``(when, nan, handle)``, whose C tuple comparison orders them as asyncio's heap of handles does
(by ``when``; a tie compares the NaNs, neither below the other, as two handles due at the same
time are not).  Each entry has its own NaN object: an identical one would count as equal and
pass the tie on to the handles.
"""

from __future__ import annotations

import asyncio
import contextvars
import heapq
import math
from asyncio import format_helpers
from collections import deque
from collections.abc import Callable, Coroutine
from typing import Any, Final

# asyncio.base_events' thresholds for purging cancelled timers (copied: the purge order must be the same).
_MIN_SCHEDULED_TIMER_HANDLES: Final = 100
_MIN_CANCELLED_TIMER_HANDLES_FRACTION: Final = 0.5
_MAXIMUM_SELECT_TIMEOUT: Final = 24 * 3600
_NAN: Final = math.nan


class Handle:
    """asyncio's ``Handle``: its fields (by their names: asyncio's code and the loop read them) and methods."""

    def __init__(
        self,
        callback: Callable[..., object],
        args: tuple[Any, ...],
        loop: Any,
        context: contextvars.Context | None,
    ) -> None:
        self._context = contextvars.copy_context() if context is None else context
        self._loop = loop
        self._callback: Callable[..., object] | None = callback
        self._args: tuple[Any, ...] | None = args
        self._cancelled = False
        self._repr: str | None = None
        self._source_traceback: object = None

    def cancel(self) -> None:
        if not self._cancelled:
            self._cancelled = True
            self._callback = None  # drop what the callback holds at once, as asyncio does
            self._args = None

    def cancelled(self) -> bool:
        return self._cancelled

    def get_context(self) -> contextvars.Context:
        return self._context

    def _run(self) -> None:
        run_handle(self._loop, self)

    def __repr__(self) -> str:
        state = " cancelled" if self._cancelled else ""
        source = format_helpers._format_callback_source(self._callback, self._args or ()) if self._callback else ""
        return f"<{type(self).__name__}{state} {source}>"


class TimerHandle(Handle):
    """asyncio's ``TimerHandle``; ``cancel`` counts itself in its core (the purge threshold)."""

    def __init__(
        self,
        when: float,
        callback: Callable[..., object],
        args: tuple[Any, ...],
        loop: Any,
        context: contextvars.Context | None,
        core: LoopCore,
    ) -> None:
        super().__init__(callback, args, loop, context)
        self._when = when
        self._scheduled = False
        self._core = core

    def when(self) -> float:
        return self._when

    def cancel(self) -> None:
        if not self._cancelled and self._scheduled:
            self._core.cancelled += 1
        super().cancel()


def run_handle(loop: Any, handle: Any) -> None:
    """``Handle._run``: the callback in its context; an exception goes to the loop's exception handler."""
    try:
        handle._context.run(handle._callback, *handle._args)
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException as exc:
        report(loop, handle, exc)


def report(loop: Any, handle: Any, exc: BaseException) -> None:
    """A callback raised: tell the loop's exception handler, as asyncio's ``Handle._run`` does."""
    source = format_helpers._format_callback_source(handle._callback, handle._args or ())
    context = {"message": f"Exception in callback {source}", "exception": exc, "handle": handle}
    if handle._source_traceback:
        context["source_traceback"] = handle._source_traceback
    loop.call_exception_handler(context)


class LoopCore:
    """A virtual-time loop's clock, timers and scheduling (see the module docstring).

    ``loop``: the asyncio loop it serves; ``ready``: that loop's deque of ready handles (asyncio's own
    code appends there too); ``selector``: the loop's selector, asked only when real files are
    watched (``watched`` > 1: the loop's self-pipe is always registered) or no timer is left."""

    def __init__(self, loop: Any, ready: deque[Any], selector: Any, start: float, resolution: float) -> None:
        self.loop = loop
        self.ready = ready
        self.selector = selector
        self.now = start
        self.resolution = resolution
        self.timers: list[tuple[float, float, Any]] = []  # heap, see the module docstring
        self.cancelled = 0  # cancelled timers still in the heap
        self.closed = False
        self.running = False  # the loop's run_forever is on
        self.watched = 0  # files registered with the selector
        self.jumps = 0  # how many times the clock moved (a measure of simulated events)

    def time(self) -> float:
        return self.now

    def get_debug(self) -> bool:
        return False  # installed outside debug mode only (asyncio's futures and tasks ask at creation)

    def create_future(self) -> asyncio.Future[Any]:
        return asyncio.Future(loop=self.loop)

    def create_task(
        self,
        coro: Coroutine[Any, Any, Any],
        *,
        name: str | None = None,
        context: contextvars.Context | None = None,
    ) -> asyncio.Task[Any]:
        if self.closed:
            raise RuntimeError("Event loop is closed")
        if self.loop._task_factory is not None:
            return asyncio.BaseEventLoop.create_task(self.loop, coro, name=name, context=context)
        return asyncio.Task(coro, loop=self.loop, name=name, context=context)

    def call_soon(
        self, callback: Callable[..., object], *args: Any, context: contextvars.Context | None = None
    ) -> Handle:
        if self.closed:
            raise RuntimeError("Event loop is closed")
        handle = Handle(callback, args, self.loop, context)
        self.ready.append(handle)
        return handle

    def call_at(
        self, when: float, callback: Callable[..., object], *args: Any, context: contextvars.Context | None = None
    ) -> TimerHandle:
        return self.timer(when, callback, args, context)

    def call_later(
        self, delay: float, callback: Callable[..., object], *args: Any, context: contextvars.Context | None = None
    ) -> TimerHandle:
        return self.timer(self.now + delay, callback, args, context)

    def timer(
        self, when: float, callback: Callable[..., object], args: tuple[Any, ...], context: contextvars.Context | None
    ) -> TimerHandle:
        """``call_at`` with the arguments as a tuple (compiled, a call with ``*args`` builds a list and a dict)."""
        if self.closed:
            raise RuntimeError("Event loop is closed")
        timer = TimerHandle(when, callback, args, self.loop, context, self)
        self.push(when, timer)
        return timer

    def push(self, when: float, timer: Any) -> None:
        """Schedule ``timer`` (this module's or asyncio's TimerHandle) at ``when``."""
        if math.isnan(when):  # (None: a TypeError here) a NaN would corrupt the heap's order
            raise ValueError("when is NaN")
        heapq.heappush(self.timers, (when, -_NAN, timer))  # -_NAN: a new NaN object
        timer._scheduled = True

    def run_once(self) -> None:
        """asyncio's ``BaseEventLoop._run_once`` over the timer heap above; where nothing is ready the
        clock jumps to the earliest timer (the selector is asked only for real files or no timer).
        (Its debug-mode slow-callback warning is left out: virtual time does not pass in a callback.)"""
        timers = self.timers
        count = len(timers)
        if count > _MIN_SCHEDULED_TIMER_HANDLES and self.cancelled / count > _MIN_CANCELLED_TIMER_HANDLES_FRACTION:
            kept = []
            for entry in timers:
                if entry[2]._cancelled:
                    entry[2]._scheduled = False
                else:
                    kept.append(entry)
            heapq.heapify(kept)
            self.timers = timers = kept
            self.cancelled = 0
        else:
            while timers and timers[0][2]._cancelled:
                self.cancelled -= 1
                heapq.heappop(timers)[2]._scheduled = False
        ready = self.ready
        loop = self.loop
        if not ready and not loop._stopping:
            timeout: float | None = None
            if timers:
                timeout = min(max(0.0, timers[0][0] - self.now), _MAXIMUM_SELECT_TIMEOUT)
            if timeout is None or self.watched > 1:
                loop._process_events(self.selector.select(timeout))  # real I/O first, then maybe a jump
            elif timeout > 0:  # (the selector's select(0) returns at once: a timer is due)
                self.jump(timeout)
        end_time = self.now + self.resolution
        while timers:
            if timers[0][0] >= end_time:
                break
            handle = heapq.heappop(timers)[2]
            handle._scheduled = False
            ready.append(handle)
        popleft = ready.popleft
        for _ in range(len(ready)):
            h = popleft()
            if isinstance(h, Handle):  # this module's: fields read directly
                if h._cancelled:
                    continue
                try:
                    h._context.run(h._callback, *h._args)  # type: ignore[arg-type, misc]
                except (SystemExit, KeyboardInterrupt):
                    raise
                except BaseException as exc:
                    report(loop, h, exc)
            elif not h._cancelled:  # asyncio's (call_soon_threadsafe, I/O callbacks, debug mode)
                run_handle(loop, h)

    def jump(self, timeout: float) -> None:
        """Move to the earliest timer's deadline exactly (``timeout`` is its distance, rounded by the loop)."""
        target = self.now + timeout
        if self.timers:
            when = self.timers[0][0]
            if abs(when - target) <= 1e-6 * max(1.0, abs(target)):
                target = when
        self.now = max(self.now, target)
        self.jumps += 1


class SimClock:
    """``swarm.transport.Clock`` over the running loop's (virtual) time; ``wall()`` is ``epoch`` plus it."""

    def __init__(self, epoch: float) -> None:
        self.epoch = epoch  # the Unix time virtual time 0 stands for
        # The running VirtualTimeLoop's core, taken on first use (nodes read the clock hundreds of
        # thousands of times a run); a clock read on another loop later (reused across runs) takes
        # that one.  On any other loop it reads the loop's time().
        self._core: LoopCore | None = None

    def now(self) -> float:
        core = self._core
        if core is not None and core.running:
            return core.now
        loop = asyncio.get_running_loop()
        found = getattr(loop, "_core", None)
        self._core = found if isinstance(found, LoopCore) else None
        return loop.time()

    def wall(self) -> float:
        return self.epoch + self.now()

    def sleep(self, seconds: float) -> Coroutine[Any, Any, None]:
        return asyncio.sleep(max(0.0, seconds))  # the coroutine itself: no frame of ours per sleep

"""The CPU twin of a CUDA stream and event: asynchronous reads an engine launches and does not wait for.

A CUDA engine's forward pass returns once its kernels are queued; they read the weights later.
``CpuStream`` does the same on a CPU: one worker thread runs the callables launched on it, in
order, while the caller goes on; ``CpuEvent.record(stream)`` marks the work launched so far and
``synchronize()`` / ``query()`` wait for or poll it, as ``torch.cuda.Event`` does.  A reader that
launches its reads here and never syncs is what ``FenceReader.consistent(fn, sync=stream)`` must
make safe (tests; a CUDA-less engine).  An error raised by launched work is raised again by the
next ``synchronize`` of the stream, as CUDA reports asynchronous errors.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable


class CpuEvent:
    """A point in a stream's work: complete once everything launched before ``record`` ran."""

    def __init__(self) -> None:
        self._stream: CpuStream | None = None
        self._mark = 0  # (an event never recorded is complete, as CUDA's)

    def record(self, stream: CpuStream) -> None:
        self._stream, self._mark = stream, stream.launched

    def query(self) -> bool:
        return self._stream is None or self._stream.completed >= self._mark

    def synchronize(self) -> None:
        if self._stream is not None:
            self._stream.wait_for(self._mark)


class CpuStream:
    """One worker thread running launched work in launch order (started at the first launch)."""

    def __init__(self, name: str = "cpu-stream") -> None:
        self.name = name
        self.launched = 0  # works launched so far
        self.completed = 0  # of which run (in order)
        self._queue: queue.SimpleQueue[Callable[[], object] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._cv = threading.Condition()

    def launch(self, work: Callable[[], object]) -> None:
        """Queue ``work`` and return at once."""
        with self._cv:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._thread.start()
            self.launched += 1
            self._queue.put(work)

    def _run(self) -> None:
        while (work := self._queue.get()) is not None:
            error = None
            try:
                work()
            except BaseException as e:  # kept for the next synchronize (the worker goes on)
                error = e
            with self._cv:
                self._error = self._error or error
                self.completed += 1
                self._cv.notify_all()

    def wait_for(self, mark: int) -> None:
        """Wait until the first ``mark`` works have run; raise the first error launched work raised."""
        with self._cv:
            self._cv.wait_for(lambda: self.completed >= mark)
            err, self._error = self._error, None
        if err is not None:
            raise err

    def synchronize(self) -> None:
        """Wait until every work launched so far has run (and raise an error one of them raised)."""
        self.wait_for(self.launched)

    def query(self) -> bool:
        """True when no launched work is waiting or running."""
        return self.completed >= self.launched

    def close(self) -> None:
        """Let the worker finish the launched work and stop."""
        with self._cv:
            thread, self._thread = self._thread, None
            if thread is not None:
                self._queue.put(None)
        if thread is not None:
            thread.join()

"""Where the reference engine's weights come from (daemon/refengine.py): a ``WeightSource`` hands out
the tensors every step reads (zero-copy views of the weight store in production) and the version
they hold; ``StoreViewSource`` runs each step under the store's version fence.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Protocol, TypeVar, runtime_checkable

import torch

__all__ = ["NO_VERSION", "STABLE_WAIT_S", "StaticSource", "StoreView", "StoreViewSource", "WeightSource"]

T = TypeVar("T")
# How long a step waits for the daemon's write in progress to end (an activation takes milliseconds);
# past it the fence is taken as stuck (a daemon killed mid-write) and steps run unattributed until
# the sequence number moves (the restarted daemon's recovery).
STABLE_WAIT_S = 2.0


@runtime_checkable
class WeightSource(Protocol):
    """Where the engine's weights live.  ``tensors()``: zero-copy views, read at every step;
    ``version()``: the version those tensors hold when no write is in progress."""

    def tensors(self) -> Mapping[str, torch.Tensor]: ...

    def version(self) -> int: ...


class StaticSource:
    """An in-memory source for tests and demos.  It keeps the tensors it is given (no copy);
    :meth:`update` writes a new version into them in place, as the weight store would."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], version: int = 0) -> None:
        if version < 0:
            raise ValueError("version must be non-negative")
        self._tensors = dict(tensors)
        self._version = version

    def tensors(self) -> Mapping[str, torch.Tensor]:
        return self._tensors

    def version(self) -> int:
        return self._version

    def update(self, new: Mapping[str, torch.Tensor], version: int) -> None:
        """Copy ``new`` into the held tensors (same names, dtypes, shapes), then publish ``version``."""
        if version <= self._version:
            raise ValueError(f"version {version} does not move past {self._version}")
        if set(new) != set(self._tensors):
            raise ValueError("update must carry exactly the tensors of the current version")
        for name, t in new.items():
            cur = self._tensors[name]
            if t.dtype != cur.dtype or t.shape != cur.shape:
                raise ValueError(f"{name}: {t.dtype}{tuple(t.shape)} does not match {cur.dtype}{tuple(cur.shape)}")
        with torch.no_grad():
            for name, t in new.items():
                self._tensors[name].copy_(t)
        self._version = version


NO_VERSION = -1


class StoreView(Protocol):
    """What ``daemon.engine.attach(info)`` returns, as far as the engine needs it."""

    def tensors(self) -> Mapping[str, torch.Tensor]: ...

    def read_version(self) -> tuple[int, bytes] | None: ...


class StoreViewSource:
    """A :class:`WeightSource` over a weight-store view: the tensors are mapped once (zero-copy
    views of the store), the version comes from the store's fence, and is :data:`NO_VERSION` (-1)
    while the daemon is writing or before the store holds a version.  A view with a ``fence``
    (``daemon.engine.EngineView``) runs each step under ``fence.consistent`` (:meth:`run`)."""

    def __init__(self, view: StoreView) -> None:
        self.view = view
        self._tensors = view.tensors()
        self._stuck_at: int | None = None  # a fence found odd past STABLE_WAIT_S, at this seq

    def tensors(self) -> Mapping[str, torch.Tensor]:
        return self._tensors

    def version(self) -> int:
        got = self.view.read_version()
        return NO_VERSION if got is None else got[0]

    def run(self, step: Callable[[], T]) -> tuple[T, int, int]:
        """``step`` (one forward pass) and the versions to report for it: (value, before, after).

        Under the view's fence (daemon/engine.py ``FenceReader.consistent``: no write begins
        while the step may read, its device work synchronized before the fence is read again),
        ``before == after`` names the one version the step read; a step the fence saw change
        reports an ``after`` other than ``before``, so that nothing attributes it to one version."""
        fence = getattr(self.view, "fence", None)
        if fence is None:
            before = self.version()
            value = step()
            return value, before, self.version()
        started = False

        def fenced() -> T:
            nonlocal started
            started = True
            return step()

        while True:
            if fence.seq() == self._stuck_at:
                # A fence left odd (a daemon killed mid-write): serve, attributed to no version.
                return step(), NO_VERSION, self.version()
            try:
                obs = fence.consistent(fenced, timeout=STABLE_WAIT_S)
                break
            except TimeoutError:
                if started:
                    raise
                seq = fence.seq()
                if seq % 2:  # (even: a writer waits for other readers, bounded by its deadline; wait on)
                    self._stuck_at = seq
        self._stuck_at = None
        before = NO_VERSION if obs.version is None else obs.version
        if not obs.changed:
            return obs.value, before, before
        after = self.version()
        return obs.value, before, NO_VERSION if after == before else after

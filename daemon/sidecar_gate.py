"""The sidecar's version gate: which request may run on which weight version, and the activation
protocol around a switch (docs/sidecar.md; the attribution guarantee is daemon/sidecar.py's docstring).

A request is admitted with a ``Ticket`` (the version it starts on) or refused with ``NotReady``;
``begin_activation`` closes admission and drains what the commit mode requires before the weights
change, ``end_activation`` reopens it on the new version.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Literal

CommitMode = Literal["quiesce", "in_place"]


COMMIT_MODES: tuple[CommitMode, ...] = ("quiesce", "in_place")


class ConstraintError(ValueError):
    """A malformed or unsatisfiable version constraint (the client's mistake: HTTP 400)."""


class ActivationError(RuntimeError):
    """The activation API was misused (overlapping activations, a version that rewinds)."""


class DrainTimeoutError(TimeoutError):
    """The drain before a switch outlasted its deadline; admission is open again, nothing switched."""

    def __init__(self, timeout_s: float, blocking: int) -> None:
        self.timeout_s, self.blocking = timeout_s, blocking
        super().__init__(f"sidecar drain timed out after {timeout_s:g} s with {blocking} requests in flight")


@dataclass(frozen=True, slots=True)
class VersionConstraint:
    """What a request demands of the weights it runs on; both fields ``None``: anything goes."""

    min_version: int | None = None
    exact_version: int | None = None

    def __post_init__(self) -> None:
        for field_name in ("min_version", "exact_version"):
            v = getattr(self, field_name)
            if v is not None and (type(v) is not int or v < 0):
                raise ConstraintError(f"{field_name} must be a non-negative integer, got {v!r}")
        if self.min_version is not None and self.exact_version is not None and self.exact_version < self.min_version:
            raise ConstraintError(
                f"exact_version {self.exact_version} is below min_version {self.min_version}: no version satisfies both"
            )

    @property
    def pinned(self) -> bool:
        return self.exact_version is not None

    @property
    def unconstrained(self) -> bool:
        return self.min_version is None and self.exact_version is None

    def satisfied_by(self, version: int) -> bool:
        if self.exact_version is not None:
            return version == self.exact_version
        return self.min_version is None or version >= self.min_version

    def unreachable_after(self, version: int) -> bool:
        """True when no version from ``version`` on can satisfy this constraint (versions never rewind)."""
        return self.exact_version is not None and self.exact_version < version

    def merged(self, other: VersionConstraint) -> VersionConstraint:
        """Combine the header and body forms; the same field given twice must agree."""
        fields: dict[str, int | None] = {}
        for field_name in ("min_version", "exact_version"):
            a, b = getattr(self, field_name), getattr(other, field_name)
            if a is not None and b is not None and a != b:
                raise ConstraintError(f"{field_name} given twice with different values ({a} and {b})")
            fields[field_name] = a if a is not None else b
        return VersionConstraint(**fields)

    def to_json(self) -> dict[str, int | None]:
        return {"min_version": self.min_version, "exact_version": self.exact_version}


@dataclass(frozen=True, slots=True)
class Ticket:
    """An admitted request: released exactly once, when its response is complete."""

    id: int
    start_version: int
    constraint: VersionConstraint

    @property
    def pinned(self) -> bool:
        return self.constraint.pinned


NotReadyReason = Literal["not_ready", "unavailable", "activating"]


@dataclass(frozen=True, slots=True)
class NotReady:
    """Why a request was refused, with the versions the client needs to decide what to do next.

    ``not_ready``: the version asked for is not (yet) served: retry later (409).
    ``unavailable``: an exact pin to a version already replaced: retrying is pointless (409).
    ``activating``: an activation outlasted the admission wait: retry later (503).
    """

    reason: NotReadyReason
    applied: int
    target: int
    activating: int | None
    retry_after_s: float

    @property
    def retryable(self) -> bool:
        return self.reason != "unavailable"

    @property
    def status(self) -> int:
        return 503 if self.reason == "activating" else 409

    @property
    def error(self) -> str:
        return {
            "not_ready": "WeightVersionNotReady",
            "unavailable": "WeightVersionUnavailable",
            "activating": "WeightActivationInProgress",
        }[self.reason]


class VersionGate:
    """Admission control keyed on the weight version the engine serves.

    Single event loop, no locks: every state change happens between awaits.  The daemon that
    applies patches drives the activation side; the sidecar drives the request side.
    """

    def __init__(
        self,
        applied: int,
        target: int | None = None,
        *,
        admission_timeout_s: float = 30.0,
        retry_after_s: float = 1.0,
    ) -> None:
        if applied < 0:
            raise ValueError("applied version must be non-negative")
        if admission_timeout_s < 0 or retry_after_s < 0:
            raise ValueError("timeouts must be non-negative")
        self._applied = applied
        self._target = max(applied, target if target is not None else applied)
        self.admission_timeout_s = admission_timeout_s
        self.retry_after_s = retry_after_s
        self._activating: int | None = None
        self._mode: CommitMode | None = None
        self._in_flight: dict[int, Ticket] = {}
        self._pinned_in_flight = 0
        self._waiting = 0
        self._ids = itertools.count(1)
        self._changed = asyncio.Event()

    # -- state

    @property
    def applied(self) -> int:
        """The version the engine serves (moves only in :meth:`end_activation`)."""
        return self._applied

    @property
    def target(self) -> int:
        """The newest version known to exist (never below ``applied``)."""
        return self._target

    @property
    def activating(self) -> int | None:
        """The version being activated, or ``None`` when admission is open."""
        return self._activating

    @property
    def mode(self) -> CommitMode | None:
        return self._mode

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    @property
    def pinned_in_flight(self) -> int:
        return self._pinned_in_flight

    @property
    def waiting(self) -> int:
        """Requests held at the gate by an activation in progress."""
        return self._waiting

    def snapshot(self) -> dict[str, Any]:
        return {
            "applied_version": self._applied,
            "target_version": self._target,
            "activating_version": self._activating,
            "commit_mode": self._mode,
            "in_flight": self.in_flight,
            "pinned_in_flight": self._pinned_in_flight,
            "waiting": self._waiting,
        }

    def set_target(self, version: int) -> None:
        """Record that ``version`` exists (published, being fetched); lower values are ignored."""
        if version > self._target:
            self._target = version
            self._notify()

    async def wait_until(self, predicate: Callable[[VersionGate], bool]) -> None:
        """Return once ``predicate(self)`` holds (re-checked after every state change)."""
        while not predicate(self):
            await self._changed.wait()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    # -- request side

    async def admit(self, constraint: VersionConstraint | None = None) -> Ticket | NotReady:
        """Admit a request now, refuse it, or (during an activation) wait for the switch first."""
        c = constraint or VersionConstraint()
        if self._activating is None:
            return self._decide(c)
        if not self._worth_waiting(c):
            return self._refusal(c)
        self._waiting += 1
        self._notify()
        try:
            async with asyncio.timeout(self.admission_timeout_s):
                while self._activating is not None:
                    await self._changed.wait()
                    if self._activating is not None and not self._worth_waiting(c):
                        return self._refusal(c)
        except TimeoutError:
            return NotReady("activating", self._applied, self._target, self._activating, self.retry_after_s)
        finally:
            self._waiting -= 1
            self._notify()
        return self._decide(c)

    def release(self, ticket: Ticket) -> int:
        """Mark a request complete; returns the version it ended on (the applied version now)."""
        if self._in_flight.pop(ticket.id, None) is None:
            raise ValueError(f"ticket {ticket.id} is not in flight (released twice?)")
        if ticket.pinned:
            self._pinned_in_flight -= 1
        self._notify()
        return self._applied

    def _decide(self, c: VersionConstraint) -> Ticket | NotReady:
        if not c.satisfied_by(self._applied):
            return self._refusal(c)
        ticket = Ticket(next(self._ids), self._applied, c)
        self._in_flight[ticket.id] = ticket
        if ticket.pinned:
            self._pinned_in_flight += 1
        self._notify()
        return ticket

    def _refusal(self, c: VersionConstraint) -> NotReady:
        reason: NotReadyReason = "unavailable" if c.unreachable_after(self._applied) else "not_ready"
        return NotReady(reason, self._applied, self._target, self._activating, self.retry_after_s)

    def _worth_waiting(self, c: VersionConstraint) -> bool:
        """During an activation: could the outcome (commit or abort) satisfy ``c``?"""
        nxt = self._activating
        assert nxt is not None
        return c.satisfied_by(self._applied) or c.satisfied_by(nxt)

    # -- activation side

    async def begin_activation(self, mode: CommitMode, next_version: int, *, timeout_s: float | None = None) -> None:
        """Close admission and wait until the weights may be switched to ``next_version``.

        ``quiesce``: wait until no request is in flight.  ``in_place``: wait until no exact-pinned
        request is in flight; the caller then pauses the engine, and unpinned requests continue
        across the switch.  On timeout (:class:`DrainTimeoutError`, naming the requests still in
        flight) or cancellation admission reopens and the error propagates.
        """
        if mode not in COMMIT_MODES:
            raise ValueError(f"unknown commit mode {mode!r} (one of {', '.join(COMMIT_MODES)})")
        if self._activating is not None:
            raise ActivationError(f"activation of version {self._activating} already in progress")
        if next_version <= self._applied:
            raise ActivationError(f"version {next_version} does not move past the applied version {self._applied}")
        self._activating, self._mode = next_version, mode
        self.set_target(next_version)
        self._notify()
        drained: Callable[[VersionGate], bool] = (
            (lambda g: g.in_flight == 0) if mode == "quiesce" else (lambda g: g.pinned_in_flight == 0)
        )
        try:
            async with asyncio.timeout(timeout_s):
                await self.wait_until(drained)
        except TimeoutError:
            blocking = self.in_flight if mode == "quiesce" else self.pinned_in_flight
            self._reopen()
            raise DrainTimeoutError(timeout_s or 0.0, blocking) from None
        except BaseException:
            self._reopen()
            raise

    def retarget(self, next_version: int) -> None:
        """Move the activation in progress to ``next_version`` (admission stays closed): the daemon
        held it open after a commit the engine did not acknowledge, and a newer version came."""
        if self._activating is None:
            raise ActivationError("no activation in progress")
        if next_version <= self._applied:
            raise ActivationError(f"version {next_version} does not move past the applied version {self._applied}")
        self._activating = next_version
        self.set_target(next_version)
        self._notify()

    def end_activation(self, new_version: int) -> None:
        """Reopen admission at ``new_version``: the version being activated (commit) or the
        applied one (abort: the weights were not changed)."""
        if self._activating is None:
            raise ActivationError("no activation in progress")
        if new_version not in (self._applied, self._activating):
            raise ActivationError(
                f"activation of {self._activating} cannot end at version {new_version} "
                f"(commit: {self._activating}, abort: {self._applied})"
            )
        self._applied = new_version
        self._target = max(self._target, new_version)
        self._reopen()

    def _reopen(self) -> None:
        self._activating, self._mode = None, None
        self._notify()

    @contextlib.asynccontextmanager
    async def activation(
        self, mode: CommitMode, next_version: int, *, timeout_s: float | None = None
    ) -> AsyncIterator[None]:
        """``async with gate.activation(mode, v): write the weights`` — commits ``v`` when the body
        returns, aborts (keeps the applied version) when it raises."""
        await self.begin_activation(mode, next_version, timeout_s=timeout_s)
        try:
            yield
        except BaseException:
            self.end_activation(self._applied)
            raise
        self.end_activation(next_version)

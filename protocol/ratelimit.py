"""Bandwidth and concurrency limits as pure bookkeeping (the caller sleeps, not this module).

``TokenBucket`` is the generic cell-rate algorithm in its "virtual scheduling" form: the state
is one instant, ``_zero_at``, when the bucket was (or will be) empty; tokens at time ``t`` are
``min(burst, rate * (t - _zero_at))``.  Reserving ``n`` bytes moves that instant ``n / rate``
later and returns the time the bytes may go.  Because the state only ever moves forward by
non-negative amounts, returned send times never decrease (exactly, not just up to rounding),
and the bytes released by time ``T`` never exceed ``rate * (T - t0) + burst``.
"""

from __future__ import annotations

import math


class TokenBucket:
    """Rate limit of ``rate`` bytes/s with bursts up to ``burst`` bytes (the bucket starts full).

    ``rate <= 0`` or ``rate == inf`` (or ``burst == inf``) means unlimited: every reservation
    may go at once.  Reservations may drive the bucket into debt; later ones queue behind.
    """

    __slots__ = ("_burst", "_rate", "_zero_at")

    def __init__(self, rate: float, burst: float) -> None:
        if math.isnan(rate) or math.isnan(burst):
            raise ValueError("rate and burst must be numbers")
        if burst < 0:
            raise ValueError(f"burst must be >= 0, got {burst}")
        self._rate = rate
        self._burst = burst
        self._zero_at = -math.inf

    @property
    def unlimited(self) -> bool:
        return self._rate <= 0 or math.isinf(self._rate) or math.isinf(self._burst)

    @property
    def rate(self) -> float:
        return self._rate

    @property
    def burst(self) -> float:
        return self._burst

    def available(self, now: float) -> float:
        """Bytes that could go at ``now`` without waiting; negative while reservations are queued."""
        if self.unlimited:
            return math.inf
        return min(self._burst, self._rate * (now - self._zero_at))

    def reserve(self, now: float, n: float) -> float:
        """Book ``n`` bytes; returns the time (``>= now``) at which they may be sent."""
        if n < 0 or math.isnan(n):
            raise ValueError(f"cannot reserve {n} bytes")
        if self.unlimited:
            return now
        self._zero_at = max(self._zero_at, now - self._burst / self._rate) + n / self._rate
        return max(now, self._zero_at)


class UploadSlots:
    """At most ``max_concurrent`` uploads at once (0: serve nothing)."""

    __slots__ = ("_in_use", "_max")

    def __init__(self, max_concurrent: int) -> None:
        if max_concurrent < 0:
            raise ValueError(f"max_concurrent must be >= 0, got {max_concurrent}")
        self._max = max_concurrent
        self._in_use = 0

    def acquire(self) -> bool:
        """Take a slot if one is free; a False answer is the caller's cue to refuse (BUSY)."""
        if self._in_use >= self._max:
            return False
        self._in_use += 1
        return True

    def release(self) -> None:
        if self._in_use == 0:
            raise ValueError("release() without a matching acquire()")
        self._in_use -= 1

    @property
    def in_use(self) -> int:
        return self._in_use

    @property
    def capacity(self) -> int:
        return self._max

    @property
    def free(self) -> int:
        return self._max - self._in_use

    @property
    def max_concurrent(self) -> int:
        return self._max

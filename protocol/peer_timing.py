"""How long a chunk request to one peer should take: a per-peer estimate in the manner of TCP's
retransmission timer (RFC 6298: SRTT + 4 RTTVAR, https://www.rfc-editor.org/rfc/rfc6298), over a
request's whole duration instead of a segment's round trip.

Two kinds of sample come in (sans-IO: the driver measures, this keeps the numbers):

* ``answer(elapsed)``: a reply without a chunk (busy, missing) took ``elapsed``: a round trip plus the
  uploader's line.  SRTT and RTTVAR as RFC 6298 (alpha 1/8, beta 1/4).
* ``transfer(elapsed, predicted)``: a chunk arrived in ``elapsed`` where ``predicted`` was expected
  (from the delivery rate the scheduler keeps per peer, bytes / elapsed, updated after this):
  the mean deviation of a transfer's time from its prediction, with RTTVAR's weight.

A deadline is then ``slack x predicted + 4 deviations + SRTT + 4 RTTVAR``, within the configured
bounds.  The scheduler's rate estimate halves on every timeout (protocol/scheduler.py ``_punish``),
so the next deadline for that peer roughly doubles: TCP's backoff of its timer, up to the cap.
"""

from __future__ import annotations

_ALPHA = 1 / 8  # RFC 6298's gains
_BETA = 1 / 4


class PeerTiming:
    __slots__ = ("dev", "rttvar", "srtt")

    def __init__(self) -> None:
        self.srtt: float | None = None  # a reply without a chunk: round trip plus the uploader's line
        self.rttvar = 0.0
        self.dev: float | None = None  # mean |transfer time - its prediction|

    def answer(self, elapsed: float) -> None:
        """A reply without a chunk took ``elapsed`` seconds."""
        elapsed = max(0.0, elapsed)
        if self.srtt is None:
            self.srtt, self.rttvar = elapsed, elapsed / 2
        else:
            self.rttvar = (1 - _BETA) * self.rttvar + _BETA * abs(self.srtt - elapsed)
            self.srtt = (1 - _ALPHA) * self.srtt + _ALPHA * elapsed

    def transfer(self, elapsed: float, predicted: float | None) -> None:
        """A chunk arrived in ``elapsed`` seconds; ``predicted``: what the rate estimate said (None: none yet)."""
        if predicted is None:
            return
        miss = abs(max(0.0, elapsed) - predicted)
        self.dev = miss if self.dev is None else (1 - _BETA) * self.dev + _BETA * miss

    def timeout(self, predicted: float, slack: float, low: float, high: float) -> float:
        """Seconds to allow a request whose transfer ``predicted`` seconds, within [low, high]."""
        t = slack * predicted + 4 * (self.dev or 0.0)
        if self.srtt is not None:
            t += self.srtt + 4 * self.rttvar
        return min(high, max(low, t))

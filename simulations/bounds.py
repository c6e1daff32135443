"""Lower bounds on distribution time that no strategy can beat (docs/design.md#distribution-lower-bounds).

Kumar & Ross (2006): with a seed of uplink ``u_s`` and N receivers of uplinks ``u_i`` and
downlinks ``d_i``, distributing F bytes takes at least

    T >= max(F / u_s, F / min(d_i), N * F / (u_s + sum(u_i)))

in a fluid model (no latency, no chunking).  Mundinger et al. (2008) give the exact optimum
for M equal chunks and N equal links of rate u: T = (F / u) * (1 + floor(log2 N) / M).
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def _div(a: float, b: float) -> float:
    if b == math.inf:
        return 0.0
    return math.inf if b <= 0 else a / b


def kumar_ross(file_bytes: float, seed_up: float, peer_ups: Sequence[float], peer_downs: Sequence[float]) -> float:
    """Seconds below which no schedule can give ``file_bytes`` to every receiver."""
    if not peer_downs:
        return 0.0
    n = len(peer_downs)
    terms = (
        _div(file_bytes, seed_up),
        _div(file_bytes, min(peer_downs)),
        _div(n * file_bytes, seed_up + math.fsum(peer_ups)),
    )
    return max(terms)


def mundinger(file_bytes: float, rate: float, receivers: int, chunks: int) -> float:
    """The optimal time with ``chunks`` equal chunks, ``receivers`` peers and every link at ``rate``."""
    if receivers <= 0:
        return 0.0
    return _div(file_bytes, rate) * (1 + math.floor(math.log2(receivers)) / max(chunks, 1))

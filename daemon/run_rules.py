"""What a run's names and heads may be: the run id rule and the head lifetime bounds, in one place.

Light on purpose (stdlib only): the CLI's argument checks import it before anything heavy loads.
The publisher, the head refresher, ``patchswarm head refresh`` and the daemon's ``swarm.run_id`` all
apply these rules, so a writer never produces a run id or head that a host refuses.
"""

from __future__ import annotations

import re

MIN_HEAD_TTL_S = 1.0
MAX_HEAD_TTL_S = 30 * 86_400.0  # a head that outlives a month hides a frozen board for that long
DEFAULT_HEAD_TTL_S = 120.0
# A directory name on every board (no leading dot, no '/') that hosts also take as swarm.run_id.
RUN_ID = re.compile(r"[A-Za-z0-9_:-][A-Za-z0-9._:-]{0,127}")
RUN_ID_RULE = "1 to 128 letters, digits and . _ : - (not starting with .)"


def check_run_id(value: object, name: str = "run_id") -> str:
    """``value`` as a run id, or ValueError naming ``name``."""
    if not (isinstance(value, str) and RUN_ID.fullmatch(value)):
        raise ValueError(f"{name} must be {RUN_ID_RULE}, not {value!r}")
    return value


def check_head_ttl(value: float, name: str = "head_ttl") -> float:
    """``value`` seconds as a head lifetime, or ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name} must be a number of seconds, not {type(value).__name__}")
    if not MIN_HEAD_TTL_S <= value <= MAX_HEAD_TTL_S:  # also refuses NaN
        raise ValueError(f"{name} must be between {MIN_HEAD_TTL_S:.0f} and {MAX_HEAD_TTL_S:.0f} seconds, not {value!r}")
    return float(value)

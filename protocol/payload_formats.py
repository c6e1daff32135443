"""Patch payload formats (docs/format.md sections 2 and 2a): which this build reads, and which a
publisher allows by default.  No imports: the command line names the default without loading the codec.
"""

from __future__ import annotations

PAYLOAD_FORMATS = (1, 2)  # every format this build reads (and may write)

# What a publisher allows unless told otherwise: 2, so each float tensor's positions are coded under
# base-value contexts where that is smaller (a payload declares the lowest format holding its records,
# so where contexts never pay it is still format 1).  Hosts of builds before payload format 2 cannot take
# such patches (they plan around them from the manifest, docs/format.md section 4): a fleet that still
# runs them publishes with 1.  What 2 costs hosts is in docs/benchmarks.md (its decode reads every base
# element of a changed float tensor, format 1 only the changed ones).
DEFAULT_FORMAT = 2

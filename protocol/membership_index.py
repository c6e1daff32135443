"""The membership's indexes of member ids by state (protocol/membership.py), kept sorted, and the view
that random samples of members are drawn from without building a list.  Internal to the
membership's modules."""

from __future__ import annotations

import bisect
from collections.abc import Sequence

from patchswarm.protocol.membership_messages import NodeInfo
from patchswarm.protocol.membership_records import _Member


class _SortedIds:
    """Node ids kept sorted (bisect): the k-th id by node_id in O(1), an insert or removal in O(log n) plus
    a memmove, so ``random.sample`` over the ids draws exactly what it drew over a freshly sorted list."""

    __slots__ = ("ids",)

    def __init__(self) -> None:
        self.ids: list[str] = []

    def add(self, node_id: str) -> None:
        i = bisect.bisect_left(self.ids, node_id)
        if i == len(self.ids) or self.ids[i] != node_id:
            self.ids.insert(i, node_id)

    def discard(self, node_id: str) -> None:
        i = bisect.bisect_left(self.ids, node_id)
        if i < len(self.ids) and self.ids[i] == node_id:
            del self.ids[i]

    def __len__(self) -> int:
        return len(self.ids)


class _InfoView(Sequence[NodeInfo]):
    """The NodeInfo of sorted ids, optionally without one id: what ``_pick`` samples from, without copying."""

    def __init__(self, ids: list[str], members: dict[str, _Member], skip: str | None = None) -> None:
        self._ids = ids
        self._members = members
        self._skip = -1
        if skip is not None:
            i = bisect.bisect_left(ids, skip)
            if i < len(ids) and ids[i] == skip:
                self._skip = i

    def __len__(self) -> int:
        return len(self._ids) - (self._skip >= 0)

    def __getitem__(self, i: int) -> NodeInfo:  # type: ignore[override]
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(i)
        if 0 <= self._skip <= i:
            i += 1
        return self._members[self._ids[i]].info

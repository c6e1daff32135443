"""Stripe trees: a fixed, regular relay plan for one version, computed alike by every node.

With every link equal, a swarm where requests fall on random holders leaves links part idle: under
fair sharing, k random flows per host use 0.83-0.92 of the capacity, flows on a regular graph (each
host k in, k out) all of it (docs/bandwidth-study.md section 4).  SplitStream's answer: cut the
version into ``k`` stripes (chunk ``c`` is in stripe ``c % k``) and give each stripe its own ``k``-ary
tree, where every host is interior in exactly one tree (its home stripe) and a leaf in the rest.
Then each host receives from ``k`` parents and sends to at most ``k`` children, one stripe each,
and the seed sends each stripe once, to that tree's root.

Every node computes the same trees from the same inputs: a key (the manifest id) and the member ids.
Nodes whose member lists differ compute slightly different trees; a parent is a preference the
scheduler falls back from (see ``SchedulerConfig.tree_patience``), so such a node costs some
regularity, not correctness.  Pure functions of their arguments: no clock, no global randomness.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Iterable
from dataclasses import dataclass


def _rank(key: bytes, salt: int, node_id: str) -> bytes:
    return hashlib.blake2b(node_id.encode(), digest_size=8, key=key[:64], salt=salt.to_bytes(16, "little")).digest()


@dataclass(frozen=True, slots=True, eq=False)
class StripeTrees:
    """Each stripe's tree over ``members``; the seed (``None``) is every root's parent."""

    fanout: int
    order: tuple[tuple[str, ...], ...]  # per stripe: the members breadth first (index i's parent: (i - 1) // fanout)
    place: tuple[dict[str, int], ...]  # per stripe: member -> its index in ``order``

    @classmethod
    def build(cls, key: bytes, members: Iterable[str], fanout: int) -> StripeTrees:
        """The trees of ``members`` (duplicates ignored) for ``key``, each ``fanout``-ary.

        Every node of a swarm asks for the same plan, and a simulation runs thousands of nodes in one
        process: the last few plans are kept (a plan depends on its arguments alone)."""
        if fanout < 1:
            raise ValueError("fanout must be >= 1")
        return _build(key, tuple(sorted(set(members))), fanout)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, StripeTrees) and (self.fanout, self.order) == (other.fanout, other.order)

    def __hash__(self) -> int:
        return hash((self.fanout, self.order))

    def stripe(self, chunk: int) -> int:
        return chunk % self.fanout

    def parents(self, node_id: str) -> tuple[str | None, ...]:
        """``node_id``'s parent in each stripe's tree (None: the seed); () if it is not a member."""
        out: list[str | None] = []
        for order, place in zip(self.order, self.place, strict=True):
            i = place.get(node_id)
            if i is None:
                return ()
            out.append(None if i == 0 else order[(i - 1) // self.fanout])
        return tuple(out)

    def children(self, node_id: str) -> tuple[tuple[str, ...], ...]:
        """The members whose parent is ``node_id``, per stripe; () if it is not a member."""
        k = self.fanout
        out: list[tuple[str, ...]] = []
        for order, place in zip(self.order, self.place, strict=True):
            i = place.get(node_id)
            if i is None:
                return ()
            out.append(order[k * i + 1 : k * i + 1 + k])
        return tuple(out)


@functools.lru_cache(maxsize=8)
def _build(key: bytes, ids: tuple[str, ...], fanout: int) -> StripeTrees:
    ranked = sorted(ids, key=lambda m: _rank(key, 0, m))
    # Home stripes dealt round in rank order: each stripe gets len(ids) / fanout interior members
    # (a hash mod fanout would leave some stripes short, and their leaves on a second tree's relays).
    homes = [ranked[s::fanout] for s in range(fanout)]
    order = []
    for s in range(fanout):
        home = set(homes[s])
        leaves = sorted((m for m in ranked if m not in home), key=lambda m: _rank(key, s + 1, m))
        order.append((*homes[s], *leaves))
    place = tuple({m: i for i, m in enumerate(o)} for o in order)
    return StripeTrees(fanout, tuple(order), place)

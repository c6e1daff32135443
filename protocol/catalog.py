"""The version catalog of a run and catch-up planning over it (pure).

Versions are nodes; every retained patch is an edge base -> version and every anchor an edge
from "nothing" -> version, each weighted by its payload size.  The plan is the cheapest path
from what a host holds (or nothing) to the wanted version: plain Dijkstra, since weights are
positive and catalogs are small (retention keeps a few anchors' worth of versions).

A host plans only through versions its build can read: ``CatchUpPlanner`` leaves out every version
whose verified manifest declared needs the host does not meet (a newer payload format), learned
when the manifest is fetched and before any of its chunks.
"""

from __future__ import annotations

import heapq
from collections.abc import Collection, Iterable
from dataclasses import dataclass

from patchswarm.protocol.errors import NoPathError
from patchswarm.protocol.manifest import Kind, Manifest
from patchswarm.protocol.payload_formats import PAYLOAD_FORMATS

NOTHING = -1


@dataclass(frozen=True, slots=True)
class CatalogEntry:
    version: int
    kind: Kind
    base_version: int | None
    size: int
    manifest_id: bytes

    def to_wire(self) -> list[object]:
        return [self.version, str(self.kind), self.base_version, self.size, self.manifest_id]


def plan(
    entries: Iterable[CatalogEntry], have: int | None, want: int, *, skip: Collection[bytes] = ()
) -> list[CatalogEntry]:
    """Fewest-bytes sequence of entries taking a host from ``have`` (None: nothing) to ``want``,
    using no entry whose manifest id is in ``skip``.

    A host holding a version may also start over from an anchor, so both its version and
    "nothing" are sources.  Ties go to fewer steps, then to lower manifest ids, so every host
    given the same catalog plans the same path.
    """
    start = NOTHING if have is None else have
    if start == want:
        return []
    edges: dict[int, list[CatalogEntry]] = {}
    for e in entries:
        src = NOTHING if e.kind == Kind.ANCHOR else e.base_version
        if src is not None and e.version <= want and e.manifest_id not in skip:
            edges.setdefault(src, []).append(e)
    best: dict[int, tuple[int, int, bytes]] = {}
    back: dict[int, CatalogEntry] = {}
    heap: list[tuple[int, int, bytes, int]] = []
    for source in {start, NOTHING}:
        best[source] = (0, 0, b"")
        heapq.heappush(heap, (0, 0, b"", source))
    while heap:
        cost, steps, tie, node = heapq.heappop(heap)
        if (cost, steps, tie) != best[node]:
            continue
        if node == want:
            break
        for e in edges.get(node, []):
            cand = (cost + e.size, steps + 1, e.manifest_id)
            if e.version not in best or cand < best[e.version]:
                best[e.version] = cand
                back[e.version] = e
                heapq.heappush(heap, (*cand, e.version))
    if want not in back:
        raise NoPathError(f"no retained chain reaches version {want} from {'nothing' if have is None else have}")
    path: list[CatalogEntry] = []
    node = want
    while node in back and node not in (start, NOTHING):
        e = back[node]
        path.append(e)
        node = NOTHING if e.kind == Kind.ANCHOR else int(e.base_version or 0)
    path.reverse()
    return path


class CatchUpPlanner:
    """One host's catch-up planning: :func:`plan` around the versions it learned it cannot read.

    ``payload_formats``: the patch payload formats the host reads (its build's, unless a test or a
    deliberately limited host says fewer).  ``readable`` is asked with each verified manifest before
    anything of its payload is fetched; a version it refuses is left out of every later plan, so the
    host goes around it (an anchor, another chain) or, with no such path, fails with the reason.
    """

    def __init__(self, payload_formats: Collection[int] = PAYLOAD_FORMATS) -> None:
        self.payload_formats = tuple(sorted(set(payload_formats)))
        # manifest id -> (its version, why this host cannot take it)
        self.unreadable: dict[bytes, tuple[int, str]] = {}

    def readable(self, entry: CatalogEntry, manifest: Manifest) -> str | None:
        """None if the host can take ``manifest`` (of ``entry``); else the one-line reason, remembered."""
        why = manifest.unmet_need(self.payload_formats)
        if why is not None:
            self.unreadable[entry.manifest_id] = (entry.version, why)
        return why

    def plan(self, catalog: Collection[CatalogEntry], have: int | None, want: int) -> list[CatalogEntry]:
        """:func:`plan` without the unreadable versions (forgotten once the catalog no longer lists them)."""
        named = {e.manifest_id for e in catalog}
        self.unreadable = {mid: got for mid, got in self.unreadable.items() if mid in named}
        try:
            return plan(catalog, have, want, skip=self.unreadable)
        except NoPathError as e:
            # The versions in the way: the newest unreadable ones past what the host holds.
            why = [w for v, w in sorted(self.unreadable.values(), reverse=True) if have is None or v > have]
            if not why:
                raise
            more = f"; and {len(why) - 2} more" if len(why) > 2 else ""
            raise NoPathError(f"{e} that this build reads ({'; '.join(why[:2])}{more})") from None

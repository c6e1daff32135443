"""Gossip frames between swarm nodes: msgpack, authenticated with the cluster secret.

    frame = msgpack ["patchswarm/gossip/2", body: bin, mac: bin32]
    mac   = HMAC-SHA256(cluster secret, "patchswarm/gossip/v2\\0" || body)
    body  = msgpack [sender, announcement, message | nil, sent_ms, seq]

The MAC keeps outsiders from injecting members or availability claims; it never protects data:
chunks, manifests and heads are verified against the trainer's signatures whatever their source.
Every decoded field is type- and bound-checked; anything else raises WireError.

Version 2 added freshness (version 1 had no ``seq``, and a frame captured once could be replayed
forever): ``sent_ms`` is the sender's wall clock in ms and ``seq`` counts up with every frame it
sends (from its start time in ms x 1024, so it keeps rising across restarts).  ``FrameGuard`` is the
receiver's side: frames too old or from too far ahead, and (sender, seq) pairs already accepted, are
refused.  Time comes in from the caller (sans-IO).
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from typing import Any

import msgpack

from patchswarm.protocol.errors import FormatError
from patchswarm.protocol.membership_messages import (
    MAX_SYNC_MEMBERS,
    Ack,
    Gossip,
    MemberState,
    Message,
    Nack,
    NodeInfo,
    Ping,
    PingReq,
    Sync,
    Update,
)

FRAME_TAG = "patchswarm/gossip/2"
OLD_FRAME_TAGS = ("patchswarm/gossip/1",)
MAC_DOMAIN = b"patchswarm/gossip/v2\x00"
SEQ_PER_MS = 1024  # a sender's first seq is its start time in ms times this (see module docstring)
MAX_FRAME = 1 << 20
MAX_UPDATES = 4096
assert MAX_SYNC_MEMBERS <= MAX_UPDATES  # a Sync a node sends must be one its peers accept
MAX_LISTED = 64
MAX_BITFIELD = 1 << 16
MAX_STR = 512


class WireError(FormatError):
    """A gossip frame that is unauthenticated, malformed or out of bounds."""


@dataclass(frozen=True, slots=True)
class Announcement:
    """What a node tells every peer it talks to: its run, head, held version and chunk availability."""

    run_id: str
    head_counter: int  # -1: no head yet
    version: int  # applied version, -1: none
    complete: tuple[bytes, ...] = ()  # manifest ids whose chunks it holds and serves in full
    partial: tuple[tuple[bytes, bytes], ...] = ()  # (manifest id, bitfield) of downloads in progress
    seed: bool = False  # holds every chunk of the board


@dataclass(frozen=True, slots=True)
class GossipFrame:
    sender: NodeInfo
    announcement: Announcement
    message: Message | None  # None: an availability push only
    sent_ms: int = 0  # the sender's wall clock, ms
    seq: int = 0  # the sender's frame counter (see the module docstring)


def mac(secret: bytes, body: bytes) -> bytes:
    return hmac.digest(secret, MAC_DOMAIN + body, "sha256")  # one-shot: no HMAC object per frame


def encode_frame(secret: bytes, frame: GossipFrame) -> bytes:
    body = msgpack.packb(
        [_info(frame.sender), _ann(frame.announcement), _msg(frame.message), frame.sent_ms, frame.seq],
        use_bin_type=True,
    )
    packed: bytes = msgpack.packb([FRAME_TAG, body, mac(secret, body)], use_bin_type=True)
    return packed


def decode_frame(secret: bytes, data: bytes) -> GossipFrame:
    if len(data) > MAX_FRAME:
        raise WireError("gossip frame too large")
    try:
        outer = msgpack.unpackb(data, raw=False, use_list=True, max_bin_len=MAX_FRAME, max_str_len=MAX_STR)
    except (ValueError, TypeError, msgpack.UnpackException) as e:
        raise WireError(f"gossip frame is malformed ({type(e).__name__})") from None
    if not (isinstance(outer, list) and len(outer) == 3 and outer[0] == FRAME_TAG):
        if isinstance(outer, list) and outer and outer[0] in OLD_FRAME_TAGS:
            raise WireError(f"gossip frame is {outer[0]!r}: this node speaks {FRAME_TAG!r} (upgrade every node)")
        raise WireError("not a patchswarm gossip frame")
    _, body, tag = outer
    if not isinstance(body, bytes) or not isinstance(tag, bytes):
        raise WireError("gossip frame fields must be bytes")
    if not hmac.compare_digest(tag, mac(secret, body)):
        raise WireError("gossip frame fails authentication (wrong cluster secret or tampered)")
    try:
        obj = msgpack.unpackb(body, raw=False, use_list=True, max_str_len=MAX_STR, max_array_len=MAX_UPDATES)
        if not (isinstance(obj, list) and len(obj) == 5):
            raise WireError("gossip body must be [sender, announcement, message, sent_ms, seq]")
        return GossipFrame(_to_info(obj[0]), _to_ann(obj[1]), _to_msg(obj[2]), _uint(obj[3]), _uint(obj[4]))
    except WireError:
        raise
    except (ValueError, TypeError, KeyError, IndexError, msgpack.UnpackException) as e:
        raise WireError(f"gossip body is malformed ({type(e).__name__})") from None


# ---------------------------------------------------------------- freshness

STALE = "stale"  # sent longer ago than the window (plus the skew allowed), or further ahead than the skew
REPLAYED = "replayed"  # this sender's seq was accepted already (or is too far behind its newest to tell)
REPLAY_BITS = 1024  # seqs below a sender's newest that are remembered one by one (reordering tolerated)
_REPLAY_MASK = (1 << REPLAY_BITS) - 1


class FrameGuard:
    """The receiver's freshness check on authenticated frames (pure: the caller passes the time).

    A frame is fresh when ``-skew_ms <= now_ms - sent_ms <= window_ms + skew_ms`` and its sender has
    not had its ``seq`` accepted before.  Per sender: the highest seq accepted and a bitmap of the
    ``REPLAY_BITS`` below it, as IPsec's anti-replay window (frames may arrive out of order: gossip
    goes out concurrently), and the newest ``sent_ms`` accepted.  A sender's entry is dropped once
    every frame it recorded is stale anyway; the table holds at most ``senders`` entries, and when
    it is full of live ones the oldest goes, and frames sent before that sender's newest are refused
    from senders that enter the table after it (their replays could no longer be told apart)."""

    __slots__ = ("_floor_ms", "_max_age", "_seen", "_senders", "_skew")

    def __init__(self, window_ms: int, skew_ms: int, senders: int = 1 << 14) -> None:
        if window_ms < 0 or skew_ms < 0 or senders < 1:
            raise ValueError("window_ms and skew_ms must be >= 0, senders >= 1")
        self._max_age = window_ms + skew_ms
        self._skew = skew_ms
        self._senders = senders
        # sender -> [highest seq, bitmap below it, newest sent_ms, floor_ms when the entry was made]
        self._seen: dict[str, list[int]] = {}
        self._floor_ms = -1

    def check(self, sender: str, sent_ms: int, seq: int, now_ms: int) -> str | None:
        """None, recording the frame as seen; or why it is refused (``STALE``, ``REPLAYED``)."""
        age = now_ms - sent_ms
        if age > self._max_age or age < -self._skew:
            return STALE
        entry = self._seen.get(sender)
        if entry is not None and now_ms - entry[2] > self._max_age:
            # Every frame it recorded is stale: start afresh (a sender restarted with a clock set back
            # counts from below its old seqs, and is heard again once its old frames are all stale).
            del self._seen[sender]
            entry = None
        if entry is None:
            if sent_ms <= self._floor_ms:
                return STALE
            self._make_room(now_ms)
            self._seen[sender] = [seq, 1, sent_ms, self._floor_ms]
            return None
        if sent_ms <= entry[3]:
            return STALE  # from before an eviction: its seq may be one the evicted entry held
        top = entry[0]
        if seq > top:
            shift = seq - top
            entry[0] = seq
            entry[1] = ((entry[1] << shift) | 1) & _REPLAY_MASK if shift < REPLAY_BITS else 1
        else:
            back = top - seq
            if back >= REPLAY_BITS or (entry[1] >> back) & 1:
                return REPLAYED
            entry[1] |= 1 << back
        if sent_ms > entry[2]:
            entry[2] = sent_ms
        return None

    def _make_room(self, now_ms: int) -> None:
        if len(self._seen) < self._senders:
            return
        for sender in [s for s, e in self._seen.items() if now_ms - e[2] > self._max_age]:
            del self._seen[sender]  # all its frames are stale now: nothing left to remember
        if len(self._seen) >= self._senders:
            oldest = next(iter(self._seen))
            self._floor_ms = max(self._floor_ms, self._seen.pop(oldest)[2])

    def __len__(self) -> int:
        return len(self._seen)


# ---------------------------------------------------------------- encoders


def _info(i: NodeInfo) -> list[str]:
    return [i.node_id, i.addr, i.zone, i.region]


def _update(u: Update) -> list[Any]:
    return [_info(u.info), u.incarnation, int(u.state), u.origin]


def _updates(us: tuple[Update, ...]) -> list[Any]:
    return [_update(u) for u in us]


def _ann(a: Announcement) -> list[Any]:
    return [a.run_id, a.head_counter, a.version, list(a.complete), [list(p) for p in a.partial], a.seed]


def _msg(m: Message | None) -> list[Any] | None:
    if m is None:
        return None
    pb = _updates(m.piggyback)
    if isinstance(m, Ping):
        return ["ping", pb, m.seq, m.target_id]
    if isinstance(m, PingReq):
        return ["ping-req", pb, m.seq, _info(m.target)]
    if isinstance(m, Ack):
        return ["ack", pb, m.seq, m.target_id]
    if isinstance(m, Nack):
        return ["nack", pb, m.seq, m.target_id]
    if isinstance(m, Sync):
        return ["sync", pb, _updates(m.members), m.reply]
    return ["gossip", pb]


# ---------------------------------------------------------------- decoders


def _uint(x: Any) -> int:
    if type(x) is not int or x < 0 or x >= 1 << 63:
        raise WireError("expected a non-negative integer")
    return x


def _int(x: Any) -> int:
    if type(x) is not int or not -1 <= x < 1 << 63:
        raise WireError("expected an integer >= -1")
    return x


def _str(x: Any) -> str:
    if not isinstance(x, str) or len(x) > MAX_STR:
        raise WireError("expected a short string")
    return x


# Decoded member records, interned: a node hears the same few thousand (member, incarnation, state)
# facts over and over (piggybacks, syncs), and they are immutable.  A hit skips validation (the key
# was validated when it entered) and shares one object per fact.  Keys hold only str and int (types
# checked first: True == 1 and 1.0 == 1 must not hit).  Cleared when full: bounded memory.
_INTERN_MAX = 1 << 16
_infos: dict[tuple[Any, ...], NodeInfo] = {}
_updates_seen: dict[tuple[Any, ...], Update] = {}


def _to_info(x: Any) -> NodeInfo:
    if not (type(x) is list and len(x) == 4):
        raise WireError("node info must be [id, addr, zone, region]")
    key: tuple[Any, ...] | None = tuple(x)
    try:
        info = _infos.get(key)  # type: ignore[arg-type]
    except TypeError:  # an unhashable field: not a string, and the check below says so
        info, key = None, None
    if info is None:
        info = NodeInfo(*(_str(v) for v in x))
        if key is not None:
            if len(_infos) >= _INTERN_MAX:
                _infos.clear()
            _infos[key] = info
    return info


def _to_update(x: Any) -> Update:
    if not (type(x) is list and len(x) == 4):
        raise WireError("update must be [info, incarnation, state, origin]")
    info, incarnation, state, origin = x
    key: tuple[Any, ...] | None
    if type(info) is list and len(info) == 4 and type(incarnation) is int and type(state) is int:
        key = (*info, incarnation, state, origin)
        try:
            u = _updates_seen.get(key)
        except TypeError:  # an unhashable field: the checks below reject it
            u, key = None, None
        if u is not None:
            return u
    else:
        key = None
    try:
        member_state = MemberState(state)
    except ValueError:
        raise WireError(f"unknown member state {state!r}") from None
    u = Update(_to_info(info), _uint(incarnation), member_state, _str(origin))
    if key is not None:
        if len(_updates_seen) >= _INTERN_MAX:
            _updates_seen.clear()
        _updates_seen[key] = u
    return u


def _to_updates(x: Any) -> tuple[Update, ...]:
    if not isinstance(x, list) or len(x) > MAX_UPDATES:
        raise WireError("updates must be a bounded list")
    return tuple(_to_update(u) for u in x)


def _mid(x: Any) -> bytes:
    if not isinstance(x, bytes) or len(x) != 32:
        raise WireError("manifest id must be 32 bytes")
    return x


def _to_ann(x: Any) -> Announcement:
    if not (isinstance(x, list) and len(x) == 6):
        raise WireError("announcement must have 6 fields")
    run, counter, version, complete, partial, seed = x
    if not isinstance(complete, list) or not isinstance(partial, list) or len(complete) + len(partial) > MAX_LISTED:
        raise WireError("announcement lists are malformed or too long")
    parts = []
    for p in partial:
        if not (isinstance(p, list) and len(p) == 2 and isinstance(p[1], bytes) and len(p[1]) <= MAX_BITFIELD):
            raise WireError("partial entry must be [manifest id, bitfield]")
        parts.append((_mid(p[0]), p[1]))
    if not isinstance(seed, bool):
        raise WireError("seed flag must be a boolean")
    return Announcement(_str(run), _int(counter), _int(version), tuple(_mid(m) for m in complete), tuple(parts), seed)


def _to_msg(x: Any) -> Message | None:
    if x is None:
        return None
    if not (isinstance(x, list) and x and isinstance(x[0], str)):
        raise WireError("message must be [kind, piggyback, ...]")
    kind, rest = x[0], x[1:]
    if not rest:
        raise WireError("message lacks its piggyback")
    pb = _to_updates(rest[0])
    if kind == "gossip" and len(rest) == 1:
        return Gossip(pb)
    if kind == "ping" and len(rest) == 3:
        return Ping(_uint(rest[1]), _str(rest[2]), pb)
    if kind == "ack" and len(rest) == 3:
        return Ack(_uint(rest[1]), _str(rest[2]), pb)
    if kind == "nack" and len(rest) == 3:
        return Nack(_uint(rest[1]), _str(rest[2]), pb)
    if kind == "ping-req" and len(rest) == 3:
        return PingReq(_uint(rest[1]), _to_info(rest[2]), pb)
    if kind == "sync" and len(rest) == 3 and isinstance(rest[2], bool):
        return Sync(_to_updates(rest[1]), rest[2], pb)
    raise WireError(f"unknown or malformed message {kind!r}")

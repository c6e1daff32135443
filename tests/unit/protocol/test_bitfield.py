"""Bitfield: set semantics, the LSB-first wire form, and rejection of malformed wire bitfields."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from patchswarm.protocol.bitfield import Bitfield, BitfieldError
from patchswarm.protocol.errors import FormatError


@st.composite
def bitfields(draw: st.DrawFn, max_n: int = 300) -> tuple[int, set[int]]:
    n = draw(st.integers(0, max_n))
    held = draw(st.sets(st.integers(0, n - 1), max_size=n)) if n else set()
    return n, held


def _make(n: int, held: set[int]) -> Bitfield:
    bf = Bitfield(n)
    for i in held:
        bf.set(i)
    return bf


@given(bitfields())
def test_set_semantics_match_a_python_set(case: tuple[int, set[int]]) -> None:
    n, held = case
    bf = _make(n, held)
    assert bf.n == n
    assert bf.count() == len(held)
    assert bf.complete == (len(held) == n)
    assert list(bf.held()) == sorted(held)
    assert list(bf.missing()) == sorted(set(range(n)) - held)
    assert all((i in bf) == (i in held) and bf.has(i) == (i in held) for i in range(-2, n + 2))


@given(bitfields())
def test_wire_round_trip_and_layout(case: tuple[int, set[int]]) -> None:
    n, held = case
    bf = _make(n, held)
    raw = bf.to_bytes()
    assert len(raw) == (n + 7) // 8
    assert int.from_bytes(raw, "little") == sum(1 << i for i in held)  # LSB-first: chunk i is bit i
    back = Bitfield.from_bytes(n, raw)
    assert back == bf
    assert back.count() == len(held)
    assert bf.to_int() == Bitfield.mask_from_bytes(n, raw) == sum(1 << i for i in held)


def test_lsb_first_bit_order() -> None:
    bf = Bitfield(10)
    bf.set(0)
    bf.set(9)
    assert bf.to_bytes() == bytes([0b0000_0001, 0b0000_0010])


@given(bitfields(), bitfields())
def test_difference(a: tuple[int, set[int]], b: tuple[int, set[int]]) -> None:
    n = min(a[0], b[0])
    x = _make(n, {i for i in a[1] if i < n})
    y = _make(n, {i for i in b[1] if i < n})
    assert list(x.difference(y)) == sorted(set(x.held()) - set(y.held()))


@given(bitfields(), bitfields())
def test_intersects(a: tuple[int, set[int]], b: tuple[int, set[int]]) -> None:
    n = min(a[0], b[0])
    x = _make(n, {i for i in a[1] if i < n})
    y = _make(n, {i for i in b[1] if i < n})
    assert x.intersects(y) == bool(set(x.held()) & set(y.held()))
    with pytest.raises(ValueError):
        x.intersects(Bitfield(n + 1))


def test_set_and_clear_report_changes() -> None:
    bf = Bitfield(5)
    assert bf.set(3) is True
    assert bf.set(3) is False
    assert bf.count() == 1
    assert bf.clear(3) is True
    assert bf.clear(3) is False
    assert bf.count() == 0
    with pytest.raises(IndexError):
        bf.set(5)
    with pytest.raises(IndexError):
        bf.clear(-1)


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 100_000])
def test_full(n: int) -> None:
    bf = Bitfield.full(n)
    assert bf.complete and bf.count() == n
    assert next(bf.missing(), None) is None
    assert Bitfield.from_bytes(n, bf.to_bytes()) == bf  # spare bits are zero


@pytest.mark.parametrize(("n", "length"), [(0, 1), (8, 0), (9, 1), (9, 3), (16, 1)])
def test_from_bytes_rejects_wrong_length(n: int, length: int) -> None:
    with pytest.raises(BitfieldError) as info:
        Bitfield.from_bytes(n, bytes(length))
    assert isinstance(info.value, FormatError)
    assert info.value.n == n
    with pytest.raises(BitfieldError, match="expected"):
        Bitfield.mask_from_bytes(n, bytes(length))


@pytest.mark.parametrize(("n", "last"), [(1, 0b10), (7, 0x80), (9, 0b10), (15, 0x80)])
def test_from_bytes_rejects_spare_bits(n: int, last: int) -> None:
    raw = bytes((n + 7) // 8 - 1) + bytes([last])
    with pytest.raises(BitfieldError, match="spare bits"):
        Bitfield.from_bytes(n, raw)
    with pytest.raises(BitfieldError, match="spare bits"):
        Bitfield.mask_from_bytes(n, raw)


def test_copy_is_independent_and_iteration_uses_a_snapshot() -> None:
    bf = Bitfield(16)
    bf.set(1)
    cp = bf.copy()
    cp.set(2)
    assert 2 not in bf and 2 in cp
    for i in bf.missing():  # mutating while iterating is safe
        bf.set(i)
    assert bf.complete


def test_large_bitfield_is_cheap() -> None:
    n = 100_000
    bf = Bitfield(n)
    for i in range(0, n, 3):
        bf.set(i)
    assert bf.count() == len(range(0, n, 3))
    assert sum(1 for _ in bf.missing()) == n - bf.count()
    full = Bitfield.full(n)
    assert sum(1 for _ in full.missing()) == 0
    assert Bitfield.from_bytes(n, bf.to_bytes()) == bf


def test_rejects_negative_size_and_is_unhashable() -> None:
    with pytest.raises(ValueError):
        Bitfield(-1)
    with pytest.raises(TypeError):
        hash(Bitfield(3))
    assert Bitfield(3) != Bitfield(4)
    assert Bitfield(3) != "abc"

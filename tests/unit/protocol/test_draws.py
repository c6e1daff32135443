"""protocol/draws.py takes the same draws as ``random.Random``'s own methods, in the same order."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from patchswarm.protocol import draws

seeds = st.integers(min_value=0, max_value=2**64)


@given(seeds, st.integers(min_value=0, max_value=300))
def test_shuffle_is_random_shuffle(seed: int, n: int) -> None:
    a, b = list(range(n)), list(range(n))
    mine, theirs = random.Random(seed), random.Random(seed)
    draws.shuffle(mine, a)
    theirs.shuffle(b)
    assert a == b
    assert mine.random() == theirs.random()  # the generators were left in the same state


@given(seeds, st.integers(min_value=0, max_value=2000), st.data())
def test_sample_is_random_sample(seed: int, n: int, data: st.DataObject) -> None:
    k = data.draw(st.integers(min_value=0, max_value=n))  # small and large k: both of sample's methods
    population = [f"m{i}" for i in range(n)]
    mine, theirs = random.Random(seed), random.Random(seed)
    assert draws.sample(mine, population, k) == theirs.sample(population, k)
    assert mine.random() == theirs.random()


@given(seeds, st.lists(st.integers(), min_size=1, max_size=50))
def test_choice_is_random_choice(seed: int, seq: list[int]) -> None:
    mine, theirs = random.Random(seed), random.Random(seed)
    assert [draws.choice(mine, seq) for _ in range(5)] == [theirs.choice(seq) for _ in range(5)]


@given(seeds, st.integers(min_value=-5, max_value=5), st.integers(min_value=0, max_value=2**70))
def test_randint_is_random_randint(seed: int, a: int, width: int) -> None:
    mine, theirs = random.Random(seed), random.Random(seed)
    assert draws.randint(mine, a, a + width) == theirs.randint(a, a + width)


def test_bad_arguments_are_refused() -> None:
    rng = random.Random(0)
    with pytest.raises(IndexError):
        draws.choice(rng, [])
    with pytest.raises(ValueError, match="sample larger"):
        draws.sample(rng, [1, 2], 3)
    with pytest.raises(ValueError, match="sample larger"):
        draws.sample(rng, [1, 2], -1)
    with pytest.raises(ValueError, match="empty range"):
        draws.randint(rng, 3, 2)

"""Random draws made as ``random.Random``'s methods make them, in code the native build compiles.

``Random.shuffle``, ``sample``, ``choice`` and ``randint`` are Python code over the generator's C
``getrandbits``; a simulated swarm calls them on every announcement and gossip round, where their
interpreted frames were ~3% of a node's work.  These functions take the same draws from the same
generator in the same order (CPython's algorithms, checked against it by tests/unit/protocol/test_draws.py), so a
seed gives the same run whichever is called.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from typing import TypeVar

T = TypeVar("T")


def below(rng: random.Random, n: int) -> int:
    """An int in [0, n), n > 0: ``Random._randbelow``'s draw (rejection over ``getrandbits``)."""
    k = n.bit_length()
    r = rng.getrandbits(k)
    while r >= n:
        r = rng.getrandbits(k)
    return r


def shuffle(rng: random.Random, x: list[T]) -> None:
    """``rng.shuffle(x)``: Fisher-Yates from the end."""
    for i in range(len(x) - 1, 0, -1):
        j = below(rng, i + 1)
        x[i], x[j] = x[j], x[i]


def choice(rng: random.Random, seq: Sequence[T]) -> T:
    """``rng.choice(seq)``."""
    if not seq:
        raise IndexError("cannot choose from an empty sequence")
    return seq[below(rng, len(seq))]


def sample(rng: random.Random, population: Sequence[T], k: int) -> list[T]:
    """``rng.sample(population, k)``: a partial shuffle of a copy for small populations, else draws
    with a set of the indices taken."""
    n = len(population)
    if not 0 <= k <= n:
        raise ValueError("sample larger than population or is negative")
    setsize = 21  # (CPython's estimate of when a set of indices is cheaper than copying the population)
    if k > 5:
        setsize += 4 ** math.ceil(math.log(k * 3, 4))
    result: list[T] = []
    if n <= setsize:
        pool = list(population)
        for i in range(k):
            j = below(rng, n - i)
            result.append(pool[j])
            pool[j] = pool[n - i - 1]
        return result
    taken: set[int] = set()
    for _ in range(k):
        j = below(rng, n)
        while j in taken:
            j = below(rng, n)
        taken.add(j)
        result.append(population[j])
    return result


def randint(rng: random.Random, a: int, b: int) -> int:
    """``rng.randint(a, b)``: an int in [a, b]."""
    if b < a:
        raise ValueError(f"empty range [{a}, {b}]")
    return a + below(rng, b - a + 1)

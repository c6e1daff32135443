"""Resolving a future that something else may have resolved first (a timer racing a reply), and
letting go of one nobody will wait for."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, TypeVar

T = TypeVar("T")


def settle(fut: asyncio.Future[T], value: T) -> None:
    """Give ``fut`` its result, unless it is done already (answered, failed or cancelled)."""
    if not fut.done():
        fut.set_result(value)


def fail(fut: asyncio.Future[Any], error: BaseException) -> None:
    """Fail ``fut`` with ``error``, unless it is done already."""
    if not fut.done():
        fut.set_exception(error)


def drain(fut: asyncio.Future[Any]) -> None:
    """A done callback for a future nobody will wait for: its exception counts as retrieved (no
    "exception was never retrieved" log)."""
    with contextlib.suppress(asyncio.CancelledError, Exception):
        fut.result()

"""Resolving a future that something else may have resolved first (a timer racing a reply)."""

from __future__ import annotations

import asyncio
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

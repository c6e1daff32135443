"""What the ``patchswarm`` command line prints: one-line messages, warnings and progress bars.

rich loads inside each function, so that ``--help``, ``--version`` and a usage error answer at once.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rich.console import Console


@functools.cache
def err_console() -> Console:
    from rich.console import Console

    return Console(stderr=True, soft_wrap=True, emoji=False)


@functools.cache
def out_console() -> Console:
    from rich.console import Console

    return Console(soft_wrap=True, emoji=False)


def say(text: str) -> None:
    """One line on stdout, with no rich markup: paths and run ids print as they are."""
    out_console().print(text, markup=False, highlight=False)


def warn(text: str) -> None:
    err_console().print(f"[yellow]warning:[/] {escape_markup(text)}")


def escape_markup(text: str) -> str:
    from rich.markup import escape

    return escape(text)


def one_line(text: str) -> str:
    """``text`` on one line: control characters and undecodable bytes (from argv) escaped."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def now_ms() -> int:
    return int(time.time() * 1000)


@contextmanager
def progress(label: str, total: int) -> Iterator[Callable[[int], None]]:
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

    err = err_console()
    with Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TimeRemainingColumn(),
        console=err,
        transient=True,
        disable=not err.is_terminal,
    ) as bar:
        task = bar.add_task(label, total=total)
        yield lambda n: bar.advance(task, n)

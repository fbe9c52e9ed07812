"""Progress bars for long operations (rich, on stderr)."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

ProgressFn = Callable[[int, int], None]


def wanted(progress: bool | None) -> bool:
    """``None`` means: only when stderr is a terminal."""
    if progress is None:
        return sys.stderr.isatty()
    return progress


@contextmanager
def bar(enabled: bool, description: str) -> Iterator[ProgressFn | None]:
    if not enabled:
        yield None
        return
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(binary_units=True),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=Console(stderr=True), transient=True) as p:
        task = p.add_task(description, total=None)

        def update(done: int, total: int) -> None:
            p.update(task, completed=done, total=total or None)

        yield update

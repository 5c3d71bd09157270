"""A progress bar on stderr for bench runs (rich), shown only when stderr is a terminal and the
run is not in ``--json`` mode."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn


@contextmanager
def steps(title: str, total: int, show: bool = True) -> Iterator[Progress | None]:
    """Yield a rich Progress with one task of ``total`` steps (None when not ``show`` or not on a
    terminal).

    Advance it with ``progress.advance(progress.task_ids[0])`` / :func:`advance`.
    """
    if not show or not sys.stderr.isatty():
        yield None
        return
    progress = Progress(
        TextColumn(title), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        TextColumn("{task.description}"), console=Console(stderr=True), transient=True,
    )
    with progress:
        progress.add_task("", total=total)
        yield progress


def advance(progress: Progress | None, label: str) -> None:
    """One step done; ``label`` names the next one."""
    if progress is not None:
        progress.update(progress.task_ids[0], advance=1, description=label)

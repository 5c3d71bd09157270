"""What every command prints: exit statuses, diagnostics, JSON lines, summary tables, progress bars.

Results go to stdout, diagnostics to stderr; ``--json`` prints JSON objects (one per line for
streams) instead of text.
"""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TextIO

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


def err(message: str) -> None:
    print(f"omni-async: {message}", file=sys.stderr, flush=True)


def emit_json(obj: Mapping[str, Any], stream: TextIO | None = None) -> None:
    print(json.dumps(obj, default=str), file=stream or sys.stdout, flush=True)



class Progress:
    """Rich progress bars on stderr (bytes, rate, ETA), one per running task; nothing when disabled.

    Use it around the command (``with Progress(enabled) as bars``); ``with bars.task(label,
    total) as advance`` shows one bar until the block ends (bars vanish when done).  Lines the
    command prints to stdout are left alone (no redirection); diagnostics on stderr appear above.
    """

    def __init__(self, enabled: bool) -> None:
        self._bars: Any = None
        if enabled:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                DownloadColumn,
                Progress,
                TextColumn,
                TimeRemainingColumn,
                TransferSpeedColumn,
            )

            self._bars = Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(binary_units=True),
                                  TransferSpeedColumn(), TimeRemainingColumn(), console=Console(stderr=True),
                                  transient=True, redirect_stdout=False)

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._bars is not None and self._bars.live.is_started:
            self._bars.stop()

    @contextlib.contextmanager
    def task(self, label: str, total: int) -> Iterator[Callable[[int], None]]:
        """One bar of ``total`` bytes; yields ``advance(nbytes)``."""
        bars = self._bars
        if bars is None:
            yield lambda _n: None
            return
        if not bars.tasks:  # the display runs only while a bar is up (an empty one eats a line)
            bars.start()
        task = bars.add_task(label, total=total)
        try:
            yield lambda n: bars.advance(task, n)
        finally:
            bars.remove_task(task)
            if not bars.tasks:
                bars.stop()


def summary_table(rows: list[tuple[str, str]], title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, show_header=False, title_justify="left")
    table.add_column("metric", style="bold")
    table.add_column("value", justify="right")
    for name, value in rows:
        table.add_row(name, value)
    Console().print(table)


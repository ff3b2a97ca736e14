"""A rich progress bar fed by the load generator's progress callback (on stderr)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
from rich.progress import Progress as Bar

from kvroute.bench.loadgen import Progress, ProgressFn


@contextlib.contextmanager
def rich_progress(
    description: str, total: int | None, duration_s: float | None, *, enabled: bool = True
) -> Iterator[ProgressFn | None]:
    """Yield a callback that advances a bar: by requests when ``total`` is known, else by time."""
    if not enabled:
        yield None
        return
    columns = [TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn()]
    if total:
        columns.insert(2, MofNCompleteColumn())
    with Bar(*columns, console=Console(stderr=True), transient=False) as bar:
        task = bar.add_task(description, total=total or duration_s or None)

        def update(p: Progress) -> None:
            done = p.completed + p.failed
            label = f"{description} ({done} done, {p.failed} failed)"
            position = done if total else min(p.elapsed_s, duration_s or p.elapsed_s)
            bar.update(task, completed=position, description=label)

        yield update

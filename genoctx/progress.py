"""Progress bars on stderr: a rich bar on a terminal, nothing at all otherwise (logs stay plain lines in pipes).

The command line turns bars on (``use_console``) with the one stderr ``Console`` its ``RichHandler`` logs through,
so log lines print above the bar; library callers and Ray workers get no bar unless they do the same. Code that
makes progress says so with :func:`bar` whether or not a bar shows: when none does, it costs a no-op call.

    with bar("train", total=steps, completed=start, unit="steps") as b:
        for step in ...:
            b.advance(tokens=n)         # one step of n tokens: the bar shows steps done/total, tokens/s, ETA
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rich.console import Console
    from rich.progress import Progress

_console: Console | None = None  # the stderr console bars draw on; None = no bars


def use_console(console: Console | None) -> None:
    """Draw bars on ``console`` from now on (the one a ``RichHandler`` logs through, so logs print above the bar);
    ``None`` turns bars off (the default: stderr not a terminal, a library caller, a Ray worker)."""
    global _console
    _console = console


def console() -> Console | None:
    """The console bars draw on, or None when bars are off."""
    return _console


class Bar:
    """One task's progress: units done of ``total`` and the tokens processed since the bar started."""

    def __init__(self, progress: Progress | None = None, task=None):
        self._progress, self._task = progress, task
        self._tokens = 0
        self._t0 = time.perf_counter()

    def advance(self, n: int = 1, tokens: int = 0) -> None:
        """``n`` more units done (steps, windows), with ``tokens`` tokens processed in them (for tokens/s)."""
        if self._progress is None:
            return
        self._tokens += tokens
        rate = self._tokens / max(time.perf_counter() - self._t0, 1e-9)
        self._progress.update(self._task, advance=n, rate=f"{rate:,.0f} tok/s")


@contextmanager
def bar(description: str, total: int, unit: str, completed: int = 0) -> Iterator[Bar]:
    """A bar ``description  [####    ] completed/total unit  tokens/s  elapsed  ETA`` on the console of
    :func:`use_console`, closed (left drawn, complete or not) when the block ends; a no-op :class:`Bar` when bars
    are off. ``total``, ``completed``: units (steps, windows); tokens/s is the mean since the bar started."""
    if _console is None:
        yield Bar()
        return
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    progress = Progress(
        TextColumn("{task.description}"),
        BarColumn(bar_width=24),
        MofNCompleteColumn(),
        TextColumn(unit),
        TextColumn("{task.fields[rate]}"),
        TimeElapsedColumn(),
        TextColumn("eta"),
        TimeRemainingColumn(),
        console=_console,
        redirect_stdout=False,  # stdout carries the JSON result: never through the bar's console (stderr)
    )
    task = progress.add_task(description, total=total, completed=completed, rate="- tok/s")
    with progress:
        yield Bar(progress, task)

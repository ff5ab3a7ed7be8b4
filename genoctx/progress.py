"""Progress on stderr: a rich bar on a terminal, plain rate-limited log lines otherwise (pipes, log files, Ray workers).

The command line turns bars on (``use_console``) with the one stderr ``Console`` its ``RichHandler`` logs through,
so log lines print above the bar. Without a console (stderr a pipe or a file, a Ray worker, a library caller) a bar
is a rate-limiter instead: at most one INFO line per task every :func:`interval` seconds (``MIN_SECONDS``, or
``GENOCTX_PROGRESS_SECONDS``) through the ``genoctx.progress`` logger, with done/total, rate and ETA, and one last
line when the task ends if any came before::

    12:00:10 INFO genoctx.progress: eval: 12/40 windows (30%), 1.20 windows/s, 2,458 tok/s, elapsed 10.0s, eta 23.3s

A task shorter than the interval prints nothing. The lines go where genoctx's logs go (the CLI's stderr handler; in a
Ray worker ``genoctx.train.distributed.worker_logging``'s, which Ray forwards to the driver's stderr); a library
caller that has not configured logging sees none. ``plain_lines(False)`` silences them (the Ray workers of rank > 0:
rank 0 speaks for the group).

Bars nest: a bar opened inside another (a training step's chunks inside the steps, a window's chunks inside the
windows) is its own task, with its own lines; on a terminal it joins the outer bar's display, appears once it has run
for the interval and is removed when it ends. Code that makes progress says so with :func:`bar` whether or not
anything shows: a short task costs a clock read per ``advance``.

    with bar("train", total=steps, completed=start, unit="steps") as b:
        for step in ...:
            b.advance(tokens=n)         # one step of n tokens: steps done/total, tokens/s, ETA
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rich.console import Console
    from rich.progress import Progress

MIN_SECONDS = 10.0  # plain lines: at most one per task this often (seconds), unless ENV says otherwise
ENV = "GENOCTX_PROGRESS_SECONDS"

log = logging.getLogger("genoctx.progress")

_console: Console | None = None  # the stderr console bars draw on; None = plain lines
_lines = True  # plain lines on (off: a Ray worker of rank > 0)
_live: Progress | None = None  # the display of the outermost open bar (nested bars add tasks to it)
_clock = time.monotonic  # seconds; tests replace it with a fake clock


def use_console(console: Console | None) -> None:
    """Draw bars on ``console`` from now on (the one a ``RichHandler`` logs through, so logs print above the bar);
    ``None`` turns bars off and plain lines on (the default: stderr not a terminal, a library caller, a Ray worker)."""
    global _console
    _console = console


def console() -> Console | None:
    """The console bars draw on, or None when bars are off."""
    return _console


def plain_lines(on: bool) -> None:
    """Plain progress lines on (the default) or off (a Ray worker of rank > 0: rank 0's lines speak for all)."""
    global _lines
    _lines = on


def interval() -> float:
    """Seconds between two plain lines of one task: ``GENOCTX_PROGRESS_SECONDS`` when set (0: a line per advance),
    else ``MIN_SECONDS``.

    Raises:
        ValueError: the variable is not a finite number >= 0 (one line naming it).
    """
    raw = os.environ.get(ENV, "").strip()
    if not raw:
        return MIN_SECONDS
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{ENV}={raw!r}: must be a number of seconds >= 0")
    return value


def _hms(seconds: float) -> str:
    """``12.3s`` under a minute, else ``h:mm:ss``."""
    if seconds < 59.95:
        return f"{seconds:.1f}s"
    s = int(round(seconds))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


class Lines:
    """The plain lines of one task: a rate limiter and the line's text.

    Args:
        description, total, unit: as :func:`bar`'s (``total`` units, ``unit`` their plural name).
        completed: units already done when the task starts (a resumed run's steps); the rate counts only the
            units done since.
        every: at most one line per ``every`` seconds (0: one per advance).
        clock: seconds, monotonic (``time.monotonic``; a fake one in tests).
    """

    def __init__(self, description: str, total: int, unit: str, completed: int = 0, every: float = MIN_SECONDS,
                 clock=time.monotonic):  # fmt: skip
        self.description, self.total, self.unit, self.every, self.clock = description, total, unit, every, clock
        self.start = self.done = self.shown = completed
        self.tokens = 0
        self.t0 = self.last = clock()
        self.emitted = 0

    def advance(self, n: int = 1, tokens: int = 0) -> str | None:
        """``n`` more units (with ``tokens`` tokens) done: the line to print, when ``every`` seconds have passed
        since the task started or since its last line; else None."""
        self.done += n
        self.tokens += tokens
        now = self.clock()
        if now - self.last < self.every:
            return None
        return self._line(now)

    def close(self) -> str | None:
        """The task's last line (done/total at its end) when it printed any before and has advanced since; else
        None: a task shorter than ``every`` stays silent."""
        if not self.emitted or self.shown == self.done:
            return None
        return self._line(self.clock())

    def _line(self, now: float) -> str:
        self.last, self.shown = now, self.done
        self.emitted += 1
        dt = now - self.t0
        rate = (self.done - self.start) / dt if dt > 0 else 0.0
        parts = [f"{self.description}: {self.done:,}/{self.total:,} {self.unit}"
                 + (f" ({100 * self.done / self.total:.0f}%)" if self.total else "")]  # fmt: skip
        parts.append(f"{rate:.3g} {self.unit}/s")
        if self.tokens:
            parts.append(f"{self.tokens / dt if dt > 0 else 0.0:,.0f} tok/s")
        parts.append(f"elapsed {_hms(dt)}")
        parts.append(f"eta {_hms((self.total - self.done) / rate)}" if rate > 0 else "eta ?")
        return ", ".join(parts)


class Bar:
    """One task's progress: units done of ``total`` and the tokens processed since the bar started, shown on a rich
    display (``progress``, ``task``), as plain lines (``lines``), or nowhere (neither given)."""

    def __init__(self, progress: Progress | None = None, task=None, lines: Lines | None = None,
                 show_after: float = 0.0):  # fmt: skip
        self._progress, self._task, self._lines = progress, task, lines
        self._tokens = 0
        self._t0 = time.perf_counter()
        self._show_after = show_after  # a nested task's rich row appears after this many seconds (0: at once)

    def advance(self, n: int = 1, tokens: int = 0) -> None:
        """``n`` more units done (steps, windows, chunks), with ``tokens`` tokens processed in them (for tokens/s)."""
        if self._lines is not None:
            line = self._lines.advance(n, tokens)
            if line is not None:
                log.info("%s", line)
        if self._progress is None:
            return
        self._tokens += tokens
        elapsed = time.perf_counter() - self._t0
        fields = {"rate": f"{self._tokens / max(elapsed, 1e-9):,.0f} tok/s"} if self._tokens else {}
        if self._show_after and elapsed >= self._show_after:
            fields["visible"], self._show_after = True, 0.0
        self._progress.update(self._task, advance=n, **fields)

    def close(self) -> None:
        """The plain lines' last line (:meth:`Lines.close`); the rich row is closed by :func:`bar`."""
        if self._lines is not None:
            line = self._lines.close()
            if line is not None:
                log.info("%s", line)


@contextmanager
def bar(description: str, total: int, unit: str, completed: int = 0) -> Iterator[Bar]:
    """A task of ``total`` units (steps, windows, chunks) named ``description``, ``completed`` of them done already.

    On the console of :func:`use_console`: a bar ``description  [####    ] completed/total unit  tokens/s  elapsed
    ETA``, left drawn when the block ends; a bar opened inside another joins its display, shows once it has run for
    :func:`interval` seconds and is removed when it ends. Without a console: plain INFO lines on the
    ``genoctx.progress`` logger, at most one per :func:`interval` seconds (:class:`Lines`), none when
    ``plain_lines(False)``. tokens/s is the mean since the bar started.

    Raises:
        ValueError: a bad ``GENOCTX_PROGRESS_SECONDS`` (:func:`interval`).
    """
    global _live
    every = interval()
    if _console is None:
        b = Bar(lines=Lines(description, total, unit, completed, every, _clock) if _lines else None)
        yield b
        b.close()
        return
    if _live is not None:  # nested: a row of the outer bar's display, shown after ``every`` seconds, then removed
        live = _live
        task = live.add_task(description, total=total, completed=completed, unit=unit, rate="- tok/s",
                             visible=every == 0)  # fmt: skip
        try:
            yield Bar(live, task, show_after=every)
        finally:
            live.remove_task(task)
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
        TextColumn("{task.fields[unit]}"),
        TextColumn("{task.fields[rate]}"),
        TimeElapsedColumn(),
        TextColumn("eta"),
        TimeRemainingColumn(),
        console=_console,
        redirect_stdout=False,  # stdout carries the JSON result: never through the bar's console (stderr)
    )
    task = progress.add_task(description, total=total, completed=completed, unit=unit, rate="- tok/s")
    _live = progress
    try:
        with progress:
            yield Bar(progress, task)
    finally:
        _live = None

"""Fault injection for the restart tests: ``GENOCTX_FAULT_KILL`` makes one process SIGKILL itself once per run.

Grammar of ``GENOCTX_FAULT_KILL``:

- ``RANK:STEP``: the worker of rank ``RANK`` (0 for one process) dies before it runs step ``STEP + 1``, after
  steps 1..STEP: a worker lost mid-run.
- ``save:STEP``: the process writing checkpoint ``STEP`` dies after the checkpoint's files are written under their
  temporary name, before the rename: a kill during a save.
- ``save+driver:STEP``: the same, and first the driver of a Ray run (``GENOCTX_FAULT_DRIVER_PID``, set by
  ``genoctx.train.distributed``) is killed too: the whole job is lost, only ``--resume`` continues it.

The fault fires once per run directory: it leaves ``RUN/.fault_done`` behind, so a restarted attempt runs through.
Unset (the normal case) it costs one dict lookup.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

from ..errors import GenoctxError

ENV = "GENOCTX_FAULT_KILL"
DRIVER_ENV = "GENOCTX_FAULT_DRIVER_PID"
MARKER = ".fault_done"


def parse_fault(text: str | None) -> tuple[str, int, int] | None:
    """``(phase, rank, step)`` of a ``GENOCTX_FAULT_KILL`` value (phase ``step``, ``save`` or ``save+driver``;
    rank 0 for the save phases), or None when unset.

    Raises:
        GenoctxError: a value outside the grammar (the variable and value are named).
    """
    if not text:
        return None
    head, _, tail = text.partition(":")
    try:
        step = int(tail)
        if head in ("save", "save+driver"):
            return head, 0, step
        return "step", int(head), step
    except ValueError:
        raise GenoctxError(f"{ENV}={text!r}: expected RANK:STEP, save:STEP or save+driver:STEP") from None


def maybe_kill(phase: str, rank: int, step: int, run_dir: Path) -> None:
    """SIGKILL this process (and for ``save+driver`` the driver first) when ``GENOCTX_FAULT_KILL`` names this
    ``phase`` (``step`` or ``save``), ``rank`` and ``step`` and the fault has not fired yet in ``run_dir``."""
    fault = parse_fault(os.environ.get(ENV))
    if fault is None:
        return
    want_phase, want_rank, want_step = fault
    if want_phase.split("+")[0] != phase or want_rank != rank or want_step != step:
        return
    marker = Path(run_dir) / MARKER
    if marker.exists():
        return
    marker.touch()
    driver = os.environ.get(DRIVER_ENV)
    if want_phase == "save+driver" and driver and int(driver) != os.getpid():
        os.kill(int(driver), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)

"""``genoctx verify``: check a run's or a checkpoint's files."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from .common import _absolute_paths, _Command, _emit_json, _one_line, _setup_logging, _user_errors, app
from .options import Verbose


@app.command(cls=_Command)
@_user_errors
@_absolute_paths
def verify(
    path: Annotated[Path, typer.Argument(help="A run directory (every checkpoint of it) or one checkpoint directory.")],
    verbose: Verbose = False,
) -> None:
    """Check checkpoint files against the sizes and xxh3_64 digests recorded in their state.json when they were
    written; prints JSON (per checkpoint: path, step, ok, and per file: bytes, expected and actual digest, status
    ok | mismatch | missing | size | unrecorded; seconds and GB hashed).

    A checkpoint that holds only what trains (a run from a base with train.trainable not all) is also checked
    against its base: the base's weight files are hashed again and compared with the digests the checkpoint
    recorded (its "base" entry; status "base_changed" when the base changed or is missing).

    Exit codes (like sha256sum -c): 0 every file verifies, 1 something is damaged (a file whose size or digest
    differs, or missing), incomplete (a checkpoint folder without state.json: status "incomplete") or its base
    changed (status "base_changed": the checkpoint cannot be read as it was written; eval, export and --resume
    refuse it with exit 2), 2 bad input (no such path, not a checkpoint or run directory). A checkpoint written
    before digests were recorded has every file "unrecorded": a warning, not a failure.

    Examples:
      genoctx verify runs/demo
      genoctx verify runs/demo/checkpoints/step_000200
    """
    _setup_logging(verbose)
    from ..train.integrity import verify_path

    doc = verify_path(path)
    _emit_json(doc)
    if not doc["ok"]:
        from ..train.integrity import problem

        for report in doc["checkpoints"]:
            if (line := problem(report)) is not None:
                typer.echo(f"genoctx: {report.get('status', 'damaged')}: {_one_line(line)}", err=True)
        raise typer.Exit(1)

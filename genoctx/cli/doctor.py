"""``genoctx doctor``: what this machine (or a Ray cluster) can run."""

from __future__ import annotations

from typing import Annotated

import typer

from .common import _Command, _emit_json, _one_line, _setup_logging, _user_errors, app
from .options import Verbose


@app.command(cls=_Command)
@_user_errors
def doctor(
    address: Annotated[
        str | None, typer.Option(help="Also check a Ray cluster: auto, HOST:PORT or ray://HOST:PORT (its resources).")
    ] = None,
    targets: Annotated[
        str | None,
        typer.Option(
            help="Compile genoctx's kernels for these targets (sm_90, sm_100, comma-separated) instead of the GPUs' "
            "own, e.g. on a CPU machine; none skips compiling."
        ),
    ] = None,
    cpu_ok: Annotated[
        bool, typer.Option("--cpu-ok", help="A machine without a GPU is not a failure (CI, a laptop): exit 0.")
    ] = False,
    verbose: Verbose = False,
) -> None:
    """Check this machine before a GPU job: prints JSON with the torch, CUDA, NCCL, Triton and fla versions, the
    GPUs (memory, compute capability), whether genoctx's kernels compile for them and, with --address, the Ray
    cluster's resources; "missing" lists what GPU training needs and is absent.

    Kernels are compiled ahead of time for each GPU's target (sm_90 or sm_100; about 25 CPU-seconds each), as
    bench/kernel_compile.py does, at GLM-5.3-Flash's shapes; a machine without a GPU compiles none unless --targets
    names them.

    Exit codes: 0 nothing is missing, 1 something is (stderr names it, e.g. "no CUDA GPU"; --cpu-ok excuses the
    absence of a GPU, a CUDA torch and NCCL), 2 bad input (--targets, an --address where no Ray answers).

    Examples:
      genoctx doctor
      genoctx doctor --address auto
      genoctx doctor --targets sm_90,sm_100 --cpu-ok
    """
    _setup_logging(verbose)
    from ..doctor import check

    doc = check(address=address, targets=targets, cpu_ok=cpu_ok)
    _emit_json(doc)
    if doc["missing"]:
        excused = " (--cpu-ok: not a failure)" if doc["ok"] else ""
        typer.echo(f"genoctx: doctor: missing: {_one_line('; '.join(doc['missing']))}{excused}", err=True)
    for w in doc["warnings"]:
        typer.echo(f"genoctx: doctor: warning: {_one_line(w)}", err=True)
    if not doc["ok"]:
        raise typer.Exit(1)

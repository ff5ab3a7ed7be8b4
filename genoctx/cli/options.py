"""The options several verbs share, defined once (``Annotated`` aliases used as parameter types)."""

from __future__ import annotations

from typing import Annotated

import typer

# the Ray options train and eval share (genoctx.cluster.run_workers)
RayAddress = Annotated[
    str | None, typer.Option(help="Ray cluster: auto or ray://HOST:PORT (default: start a local Ray).")
]
GpusPerWorker = Annotated[
    float, typer.Option(help="GPUs per Ray worker: 1 (one GPU per rank, NCCL) or 0 (CPU, gloo); nothing else.")
]
PlacementTimeout = Annotated[
    float | None,
    typer.Option(
        help="Seconds the Ray workers may wait for their CPUs/GPUs before exit 2 (default 600; 0 = wait "
        "forever); a group the cluster can never hold is refused at once."
    ),
]

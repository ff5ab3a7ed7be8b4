"""The options several verbs share, defined once (``Annotated`` aliases used as parameter types)."""

from __future__ import annotations

from typing import Annotated

import typer

# --verbose/-v (every verb), --wait (prepare, train, export), --device (train, eval), the hidden old name of
# --seq-chunk (eval, plan)
Verbose = Annotated[bool, typer.Option("--verbose", "-v")]
Wait = Annotated[
    bool, typer.Option("--wait", help="If another genoctx process is writing --out, wait for it (default: exit 2).")
]
Device = Annotated[str, typer.Option(help="cpu, cuda, or auto.")]
ChunkTokens = Annotated[str | None, typer.Option("--chunk-tokens", hidden=True)]  # old name of --seq-chunk

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

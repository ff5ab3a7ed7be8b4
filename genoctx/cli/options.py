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

# the Ray mesh options eval and plan share (train's --num-workers too). The help texts were unified (they differed
# only in wording). Kept per verb, and why:
# - train's --cp/--ep/--fsdp/--ep-folded (cli/train.py) override recipe keys: None means "the recipe's value"
#   (--ep-folded is tri-state, bool | None) and each help names its key (= train.cp, ...);
# - plan's --gpus/--num-workers (cli/plan.py) is a count, default 1, the world size of the layouts planned; no
#   worker is started (train and eval: omitted = one process, no Ray);
# - --hardware: train's applies only with --dry-run and defaults to None (a --hardware without --dry-run is
#   refused as having no effect); plan's defaults to b200 and times every layout;
# - --format: eval writes table, json or csv; plan table or json (the choices differ).
NumWorkers = Annotated[
    int | None,
    typer.Option(help="Run on Ray with N workers on the training mesh (FSDP x EP x CP); omit for one process."),
]
Fsdp = Annotated[int | None, typer.Option("--fsdp", help="FSDP2 size: workers (ranks) sharding the parameters.")]
Ep = Annotated[int | None, typer.Option(help="Expert-parallel size: workers (ranks) splitting the routed experts.")]
Cp = Annotated[
    int | None, typer.Option(help="Context-parallel size: workers (ranks) sharing one window, a piece each.")
]
EpFolded = Annotated[
    bool,
    typer.Option(
        "--ep-folded/--no-ep-folded",
        help="Draw the --ep group from the --fsdp x --cp workers (MoE parallel folding) instead of an axis of its "
        "own, as train's.",
    ),
]

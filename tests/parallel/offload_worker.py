"""Worker of tests/parallel/test_offload.py: gloo ranks train two steps with activation checkpointing, with
``offload_activations`` off and then on, in each case's layout; each rank writes ``rank{r}.pt``.

A case is ``mesh_worker.CASES``' layout name (``cp2_fep2``: CP=2, FSDP over the CP ranks, EP=2 folded); a
``_chunk`` case trains each rank's piece in chunks of ``mesh_worker.CHUNK`` tokens (the chunked backward). Per case
and setting: the two steps' metrics, every weight after step 2 gathered whole, the ``OffloadStats`` counters of the
steps and this rank's tokens per pass.
"""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist

from genoctx.parallel.mesh import leaving_mesh


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def train_two_steps(name: str, windows: torch.Tensor, offload: bool) -> dict:
    from mesh_worker import CHUNK, init_case, mesh_config, train_config

    from genoctx.parallel.build import build_model
    from genoctx.parallel.offload import OffloadStats
    from genoctx.train.loop import build_optimizer, train_step

    dims = init_case(name.removesuffix("_chunk"))
    torch.manual_seed(0)  # Fresh(): the same weights in every layout and setting
    model = build_model(mesh_config(), dims, activation_checkpointing=True, offload_activations=offload)
    cfg = train_config()
    if name.endswith("_chunk"):
        cfg.seq_chunk_tokens = CHUNK
    opt, sched = build_optimizer(model, cfg, cfg.steps)
    tokens = windows[dims.dp_rank][None]
    OffloadStats.reset()
    metrics = [train_step(model, opt, sched, tokens, cfg, nullcontext(), dims) for _ in range(2)]
    return {
        "metrics": metrics,
        "weights": {n: _full(p) for n, p in model.named_parameters()},
        "stats": dict(vars(OffloadStats)),
        "layers": len(model.layers),
        "piece_tokens": tokens.shape[1] // dims.cp,
    }


def run(rank: int, world: int, init_file: str, out_dir: str, windows_path: str, cases: list[str]) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    with leaving_mesh():
        windows = torch.load(windows_path)["windows"]
        res = {name: {on: train_two_steps(name, windows, on) for on in (False, True)} for name in cases}
    torch.save(res, Path(out_dir) / f"rank{rank}.pt")

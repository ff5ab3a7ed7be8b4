"""``genoctx model info``: a model's size and config."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ..errors import GenoctxError
from .common import _Command, _emit_json, _size, _user_errors, model_app


@model_app.command("info", cls=_Command)
@_user_errors
def model_info(
    preset: Annotated[
        str | None, typer.Option(help="Preset name: tiny, cpu-small, glm-5.3-flash (default cpu-small).")
    ] = None,
    recipe: Annotated[Path | None, typer.Option(help="Use the model of a recipe instead of a preset.")] = None,
    hf: Annotated[
        Path | None,
        typer.Option("--hf", help="Use the config.json of an HF glm5_next model directory (no weights needed)."),
    ] = None,
    seq_len: Annotated[
        str, typer.Option("--seq-len", metavar="SIZE", help="Sequence length for FLOPs per token, e.g. 4096, 512k, 1M.")
    ] = "1M",
) -> None:
    """Print the architecture, parameter counts (total and active per token) and FLOPs per token as JSON.

    Parameters are counted on the meta device (no memory): total, active (minus unused routed experts),
    and both in billions rounded to 0.1 (total_b, active_b).

    FLOPs per token at --seq-len L, one window on one device, by component: see genoctx.plan.flops.flops_per_token
    (``train`` = forward + backward, ``train_with_recompute`` with activation checkpointing, ``forward`` = scoring).

    Examples:
      genoctx model info --preset glm-5.3-flash --seq-len 1M
      genoctx model info --hf path/to/GLM-5.3-Flash
    """
    from ..model.config import DSA, KDA
    from ..model.config import preset as get_preset
    from ..plan.flops import flops_per_token

    if sum(x is not None for x in (preset, recipe, hf)) > 1:
        raise GenoctxError("give one of --preset, --recipe and --hf")
    if hf is not None:
        from ..model.hf import read_config

        cfg, _ = read_config(hf)
        source = {"preset": None, "recipe": None, "hf": str(hf)}
    elif recipe is not None:
        from ..recipes import load_recipe

        rec = load_recipe(recipe)
        cfg = rec.model
        source = {"preset": rec.preset, "recipe": str(recipe), "hf": None}
    else:
        preset = preset or "cpu-small"
        try:
            cfg = get_preset(preset)
        except KeyError as e:
            raise GenoctxError(f"--preset: {e.args[0]}") from None
        source = {"preset": preset, "recipe": None, "hf": None}
    L = _size("--seq-len", seq_len)
    counts = _count_params_meta(cfg)  # meta device: no memory, any size
    counts.update(total_b=round(counts["total"] / 1e9, 1), active_b=round(counts["active"] / 1e9, 1))
    flops = flops_per_token(cfg, L, counts["active"])
    _emit_json(
        {
            **source,
            "layers": "".join("D" if t == DSA else "K" for t in cfg.layer_types),
            "kda_layers": cfg.layer_types.count(KDA),
            "dsa_layers": cfg.layer_types.count(DSA),
            "moe_layers": cfg.mlp_layer_types.count("sparse"),
            "dense_mlp_layers": cfg.mlp_layer_types.count("dense"),
            "parameters": counts,
            "seq_len": L,
            "flops_per_token": flops,
            "config": cfg.to_dict(),
        }
    )


def _count_params_meta(cfg) -> dict:
    import torch

    from ..model.model import HybridLM

    with torch.device("meta"):
        return HybridLM(cfg).num_parameters()

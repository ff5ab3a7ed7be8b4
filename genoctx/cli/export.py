"""``genoctx export``: a checkpoint as a Hugging Face folder."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated

import typer

from ..errors import GenoctxError
from .common import _absolute_paths, _Command, _emit_json, _out_dir, _setup_logging, _user_errors, app
from .options import Verbose, Wait


@app.command(cls=_Command)
@_user_errors
@_absolute_paths
def export(
    ckpt: Annotated[
        Path,
        typer.Argument(
            help="Run directory (its latest checkpoint), checkpoint directory, or HF model directory (a re-export)."
        ),
    ],
    out: Annotated[
        Path,
        typer.Option(
            help="Output directory: an HF model (config.json + safetensors), or a PEFT adapter for a LoRA run."
        ),
    ],
    merge: Annotated[
        bool,
        typer.Option(
            "--merge",
            help="A LoRA run: write the full model with the adapters merged (W + alpha/r B A) instead of a PEFT "
            "adapter. Any other run or HF directory: no effect (the full model is what export writes).",
        ),
    ] = False,
    force: Annotated[bool, typer.Option("--force", help="Replace a non-empty --out.")] = False,
    wait: Wait = False,
    base: Annotated[
        Path | None,
        typer.Option(
            help="HF directory the model came from: its config, vision tower, MTP layer and tokenizer files are kept "
            "(a PEFT adapter: its base_model_name_or_path). Default: the run's init model (state.json `init`), or CKPT "
            "itself when it is an HF directory."
        ),
    ] = None,
    no_base: Annotated[
        bool, typer.Option("--no-base", help="Write the model's own config and nothing else (ignore any base).")
    ] = False,
    max_shard_size: Annotated[
        str, typer.Option(help="Most tensor bytes per safetensors file: 5GB (10^9 bytes), 500MB, 2GiB, or bytes.")
    ] = "5GB",
    dtype: Annotated[
        str, typer.Option(help="Stored dtype: keep (as trained), bf16 or fp32; fp32 islands stay fp32.")
    ] = "keep",
    no_verify: Annotated[
        bool,
        typer.Option(
            "--no-verify",
            help="Read a genoctx checkpoint without checking its files against the sizes and digests recorded when "
            "it was written.",
        ),
    ] = False,
    verbose: Verbose = False,
) -> None:
    """Write a checkpoint as a Hugging Face model directory that transformers loads
    (Glm5NextForConditionalGeneration.from_pretrained); prints a JSON summary. See docs/checkpoints.md, "Export".

    A LoRA run (train.trainable names lora) is written as a PEFT adapter folder (adapter_config.json +
    adapter_model.safetensors, the routed experts' adapters as peft's target_parameters, groups trained whole as
    modules_to_save) that peft.PeftModel.from_pretrained loads onto transformers' glm5_next base; --merge writes the
    merged full model instead (a sharded checkpoint too: its adapters read alone, or merged weight by weight).

    A genoctx checkpoint's weight files are first checked against the sizes and xxh3_64 digests recorded when it
    was written (--no-verify skips it); a run directory whose newest checkpoint does not verify is refused, naming
    the newest one that does.

    Examples:
      genoctx export runs/demo --out export/demo --dtype bf16
      genoctx export runs/hg38-512k --out export/glm-dna --base models/GLM-5.3-Flash --max-shard-size 5GB
      genoctx export export/demo --out export/demo-1gb --max-shard-size 1GB
      genoctx export runs/lora --out export/lora-adapter
      genoctx export runs/lora --out export/lora-merged --merge
    """
    _setup_logging(verbose)
    import os

    import torch

    from ..model.groups import LORA, parse_trainable
    from ..model.hf import base_config, check_export_dir, is_hf_dir, load_hf, parse_bytes, read_config, save_hf
    from ..model.lora import is_lora_name, merge_lora
    from ..train.checkpoint import load_model, load_recipe_of, read_state, resolve_checkpoint
    from ..train.sharded import is_sharded, lazy_state

    dtypes = {"keep": None, "bf16": torch.bfloat16, "fp32": torch.float32}
    if dtype not in dtypes:
        raise GenoctxError(f"--dtype must be keep, bf16 or fp32, got {dtype!r}")
    if base is not None and no_base:
        raise GenoctxError("give --base DIR or --no-base, not both")
    shard = parse_bytes(max_shard_size, "--max-shard-size")
    _out_dir(out)
    check_export_dir(out, force)
    path = resolve_checkpoint(ckpt)
    hf = not (path / "state.json").is_file()
    if not hf and not no_verify:
        from ..train.integrity import refuse_unverified, run_of

        refuse_unverified(path, ckpt, run_of(ckpt), "export", "export it")
    src, dst = Path(os.path.realpath(path)), Path(os.path.realpath(out))
    if src.is_relative_to(dst) and not (hf and src == dst):
        raise GenoctxError(f"--out {out} holds the checkpoint {path}: replacing it would delete it; choose another")
    log = logging.getLogger("genoctx")
    recipe = None if hf else load_recipe_of(path)
    adapters = recipe is not None and LORA in parse_trainable(recipe.train.trainable)
    state = None if hf else read_state(path)
    init = None if state is None else state.get("init")
    base_dir = base
    if base is None and not no_base:
        if hf:
            base_dir = path  # a re-export keeps what the directory holds besides the text model
        else:
            if isinstance(init, dict) and (init.get("hf_base") or init.get("path")):
                init["path"] = init.get("hf_base") or init["path"]  # the HF root of a chain of --init runs
                if is_hf_dir(init["path"]):
                    base_dir = Path(init["path"])
                    log.info("base: %s, the model the run started from (state.json init)", base_dir)
                else:
                    log.warning(
                        "the run started from %s, but %s is no longer an HF directory: exporting without a base "
                        "(no vision tower, MTP layer or tokenizer files); pass --base DIR to keep them",
                        init.get("source") or init["path"], init["path"],
                    )  # fmt: skip
    cfg = read_config(path)[0] if hf else recipe.model
    if base_dir is not None:
        base_config(cfg, base_dir)  # a base of another architecture fails now, before loading weights
    if adapters and not merge:  # a LoRA run: a PEFT adapter folder
        from ..model.peft_export import base_of_run, save_peft

        name, revision, note = base_of_run(init if isinstance(init, dict) else None)
        if base is not None or no_base:
            name, revision, note = (str(base) if base is not None else None), None, None
        if note:
            log.info("%s", note)
        t = recipe.train
        if is_sharded(path):  # a mesh run's DCP checkpoint: the adapters and modules saved whole alone are read
            from ..train.checkpoint import check_base, is_partial
            from ..train.sharded import adapter_model

            if is_partial(state):
                check_base(state, path)
            lora_model = adapter_model(path, recipe)
        else:
            lora_model = load_model(path)[0]
        summary = save_peft(lora_model, out, parse_trainable(t.trainable), rank=t.lora_rank,
                            alpha=t.lora_alpha, base=name, revision=revision, dtype=dtypes[dtype], force=force,
                            wait=wait)  # fmt: skip
        _emit_json({"checkpoint": str(path), **summary})
        return
    from ..train.checkpoint import is_partial

    if not hf and is_sharded(path) and not is_partial(state):  # a distributed run's checkpoint: read one tensor at
        # a time, never all at once; a LoRA run's adapted weights merged as they are read (--merge)
        model = lazy_state(path, cfg, lora_scale=recipe.train.lora_alpha / recipe.train.lora_rank if adapters else None)
        if adapters:
            log.info("a LoRA run, --merge: writing the merged model (W + alpha/r B A)")
    else:
        model = load_hf(path) if hf else load_model(path)[0]
        if any(is_lora_name(n) for n, _ in model.named_parameters()):  # a LoRA run with --merge
            merge_lora(model)
            log.info("a LoRA run, --merge: writing the merged model (W + alpha/r B A)")
    summary = save_hf(model, out, base_dir=base_dir, max_shard_bytes=shard, force=force, dtype=dtypes[dtype], wait=wait)
    _emit_json({"checkpoint": str(path), **summary})

"""The ``genoctx`` command line: thin wrappers that parse flags and call one function per verb.

Results go to stdout (JSON, or a table/CSV for ``eval``); logs and progress go to stderr. Exit codes:
0 success, 2 bad input (a one-line message naming the file, record or flag), 1 an internal error.
"""

from __future__ import annotations

import functools
import json
import logging
import sys
from pathlib import Path
from typing import Annotated

import typer

from .errors import GenoctxError

app = typer.Typer(
    help="Post-train hybrid long-context models on the human genome and measure how they use context.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
model_app = typer.Typer(help="Inspect model presets.", no_args_is_help=True)
app.add_typer(model_app, name="model")


def _setup_logging(verbose: bool) -> None:
    """Logs to stderr: rich on a terminal, plain unwrapped lines (no colour codes) in pipes and files."""
    level = logging.DEBUG if verbose else logging.INFO
    if sys.stderr.isatty():
        from rich.console import Console
        from rich.logging import RichHandler

        handler: logging.Handler = RichHandler(
            console=Console(stderr=True), show_path=False, markup=False, rich_tracebacks=False
        )
        fmt = "%(message)s"
    else:
        handler = logging.StreamHandler(sys.stderr)
        fmt = "%(asctime)s %(levelname)s %(name)s: %(message)s"
    logging.basicConfig(level=level, format=fmt, datefmt="%H:%M:%S", handlers=[handler], force=True)


def _user_errors(fn):
    """Turn GenoctxError into a one-line message on stderr and exit code 2 (no traceback)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except GenoctxError as e:
            typer.echo(f"genoctx: error: {e}", err=True)
            raise typer.Exit(2) from None
        except KeyboardInterrupt:
            typer.echo("genoctx: interrupted", err=True)
            raise typer.Exit(130) from None

    return wrapper


def _emit_json(doc: dict) -> None:
    sys.stdout.write(json.dumps(doc, indent=None if not sys.stdout.isatty() else 2) + "\n")
    sys.stdout.flush()


def _split_list(s: str | None) -> list[str] | None:
    return [c.strip() for c in s.split(",") if c.strip()] if s else None


@app.command()
@_user_errors
def prepare(
    fasta: Annotated[
        list[Path], typer.Option("--fasta", help="FASTA file (plain, gzip or bgzip); repeatable.")
    ],
    out: Annotated[Path, typer.Option("--out", help="Output directory for shards and manifest.json.")],
    window: Annotated[
        str, typer.Option(help="Window length in tokens (bases); k/M suffixes, k = 1024.")
    ] = "512k",
    stride: Annotated[
        str | None, typer.Option(help="Stride between window starts; default = window.")
    ] = None,
    chroms: Annotated[
        str | None, typer.Option(help="Training chromosomes, comma-separated (e.g. chr1,chr2).")
    ] = None,
    eval_chroms: Annotated[
        str | None, typer.Option(help="Held-out chromosomes, comma-separated (e.g. chr22).")
    ] = None,
    max_n_fraction: Annotated[float, typer.Option(help="Skip windows with a larger fraction of N.")] = 0.5,
    uppercase_only: Annotated[bool, typer.Option(help="Drop the soft-mask channel.")] = False,
    keep_partial: Annotated[
        bool, typer.Option(help="Keep (pad) the last partial window of each chromosome.")
    ] = False,
    verbose: Annotated[bool, typer.Option("--verbose", "-v")] = False,
) -> None:
    """Tokenize FASTA into windows split by chromosome; prints a JSON summary.

    Example: genoctx prepare --fasta data/hg38/hg38_chr22_32000001-32300000.fa --window 16k --out prepared
    """
    _setup_logging(verbose)
    from .data.windows import parse_size
    from .data.windows import prepare as run_prepare

    w = parse_size(window)
    manifest = run_prepare(
        fasta,
        out,
        window=w,
        stride=parse_size(stride) if stride else None,
        train_chroms=_split_list(chroms),
        eval_chroms=_split_list(eval_chroms),
        max_n_fraction=max_n_fraction,
        uppercase_only=uppercase_only,
        drop_last=not keep_partial,
        progress=sys.stderr.isatty(),
    )
    _emit_json(
        {
            "out": str(out),
            "window": manifest["window"],
            "stride": manifest["stride"],
            "splits": manifest["splits"],
            "counts": manifest.get("counts"),
            "skipped": manifest.get("skipped"),
        }
    )


@app.command()
@_user_errors
def train(
    data: Annotated[Path, typer.Option(help="Prepared data directory (genoctx prepare --out).")],
    out: Annotated[Path, typer.Option(help="Run directory: checkpoints/ and metrics.jsonl.")],
    recipe: Annotated[Path | None, typer.Option(help="YAML recipe (recipes/*.yaml).")] = None,
    steps: Annotated[
        int | None, typer.Option(help="Optimizer steps (overrides train.steps; 0 = save init).")
    ] = None,
    resume: Annotated[bool, typer.Option(help="Continue from the run's latest checkpoint.")] = False,
    stop_after: Annotated[
        int | None, typer.Option(help="End this invocation after step N (checkpointed); --resume continues.")
    ] = None,
    set_: Annotated[
        list[str] | None, typer.Option("--set", help="Override a recipe key: train.lr=1e-3.")
    ] = None,
    device: Annotated[str, typer.Option(help="cpu, cuda, or auto.")] = "cpu",
    verbose: Annotated[bool, typer.Option("--verbose", "-v")] = False,
) -> None:
    """Post-train the hybrid model on the train split; prints a JSON run summary.

    Example: genoctx train --data prepared --recipe recipes/cpu-small.yaml --out runs/demo --steps 200
    """
    _setup_logging(verbose)
    from .recipes import load_recipe
    from .train.loop import train as run_train

    overrides = list(set_ or [])
    if steps is not None:
        overrides.append(f"train.steps={steps}")
    rec = load_recipe(recipe, overrides)
    _emit_json(run_train(data, rec, out, resume=resume, device=_device(device), stop_after=stop_after))


def _device(name: str) -> str:
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise GenoctxError(f"--device {name}: CUDA is not available on this machine")
    return name


@app.command("eval")
@_user_errors
def eval_(
    checkpoint: Annotated[Path, typer.Option(help="Checkpoint directory, or a run directory (its latest).")],
    data: Annotated[Path, typer.Option(help="Prepared data directory.")],
    by_position: Annotated[
        bool, typer.Option("--by-position", help="Bin the loss by context length.")
    ] = False,
    baseline: Annotated[Path | None, typer.Option(help="Checkpoint to compare against.")] = None,
    split: Annotated[str, typer.Option(help="Split of the prepared data to score.")] = "eval",
    bins: Annotated[str, typer.Option(help="log2, linear:N, or comma-separated edges in tokens.")] = "log2",
    format_: Annotated[str, typer.Option("--format", help="table, json or csv (on stdout).")] = "table",
    plot: Annotated[Path | None, typer.Option(help="Write a PNG of loss against position.")] = None,
    chunk_tokens: Annotated[str | None, typer.Option(help="Score windows in chunks (carried cache).")] = None,
    max_windows: Annotated[int | None, typer.Option(help="Score only the first N windows.")] = None,
    device: Annotated[str, typer.Option(help="cpu, cuda, or auto.")] = "cpu",
    verbose: Annotated[bool, typer.Option("--verbose", "-v")] = False,
) -> None:
    """Held-out next-token loss, binned by how many tokens of context each token had.

    Example: genoctx eval --by-position --checkpoint runs/demo --baseline runs/init --data prepared --format json
    """
    _setup_logging(verbose)
    if format_ not in ("table", "json", "csv"):
        raise GenoctxError(f"--format must be table, json or csv, got {format_!r}")
    if not by_position:
        raise GenoctxError("only --by-position evaluation exists so far; pass --by-position")
    from .data.windows import parse_size
    from .eval.position import evaluate, to_csv, to_table
    from .eval.position import plot as write_plot

    doc = evaluate(
        checkpoint,
        data,
        split=split,
        bins=bins,
        baseline=baseline,
        chunk_tokens=parse_size(chunk_tokens) if chunk_tokens else None,
        max_windows=max_windows,
        device=_device(device),
    )
    if plot is not None:
        write_plot(doc, plot)
        logging.getLogger("genoctx.eval").info("wrote %s", plot)
    if format_ == "json":
        _emit_json(doc)
    elif format_ == "csv":
        sys.stdout.write(to_csv(doc))
    else:
        sys.stdout.write(to_table(doc) + "\n")


@model_app.command("info")
@_user_errors
def model_info(
    preset: Annotated[str, typer.Option(help="Preset name: tiny, cpu-small, glm-flash-like.")] = "cpu-small",
    recipe: Annotated[
        Path | None, typer.Option(help="Use the model of a recipe instead of a preset.")
    ] = None,
) -> None:
    """Print the architecture and parameter counts (total and active per token) as JSON."""
    from .model.config import preset as get_preset
    from .recipes import load_recipe

    try:
        cfg = load_recipe(recipe).model if recipe else get_preset(preset)
    except KeyError as e:
        raise GenoctxError(e.args[0]) from None
    from .model.model import HybridLM

    if cfg.d_model * cfg.n_layers > 20000:
        counts = _count_params_meta(cfg)
    else:
        counts = HybridLM(cfg).num_parameters()
    _emit_json(
        {
            "preset": preset if recipe is None else None,
            "layers": "".join(cfg.layer_types),
            "kda_layers": cfg.layer_types.count("K"),
            "dsa_layers": cfg.layer_types.count("D"),
            "parameters": counts,
            "config": cfg.to_dict(),
        }
    )


def _count_params_meta(cfg) -> dict:
    import torch

    from .model.model import HybridLM

    with torch.device("meta"):
        return HybridLM(cfg).num_parameters()


def main() -> None:  # pragma: no cover
    app()


if __name__ == "__main__":  # pragma: no cover
    main()

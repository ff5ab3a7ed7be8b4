"""``genoctx prepare``: FASTA to prepared windows."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from ..errors import GenoctxError
from .common import (
    MAX_WINDOW,
    MIN_WINDOW,
    WHY_MIN_WINDOW,
    _Command,
    _data_dir,
    _emit_json,
    _out_dir,
    _setup_logging,
    _size,
    _split_list,
    _user_errors,
    app,
)
from .options import Verbose, Wait


@app.command(cls=_Command)
@_user_errors
def prepare(
    fasta: Annotated[
        list[Path] | None,
        typer.Option("--fasta", metavar="FILE", help="Local FASTA file (plain, gzip or bgzip); repeatable."),
    ] = None,
    out: Annotated[Path | None, typer.Option("--out", help="Output directory for shards and manifest.json.")] = None,
    assembly: Annotated[
        str | None, typer.Option(help="Download this assembly (hg38) instead of --fasta: only the chromosomes asked.")
    ] = None,
    base_url: Annotated[
        str | None,
        typer.Option(envvar="GENOCTX_BASE_URL", help="Mirror with UCSC's layout (default: UCSC goldenPath)."),
    ] = None,
    cache_dir: Annotated[Path | None, typer.Option(help="Download cache (default $XDG_CACHE_HOME/genoctx).")] = None,
    verify: Annotated[
        Path | None, typer.Option("--verify", help="Re-check every shard and window checksum of DIR; no prepare.")
    ] = None,
    window: Annotated[
        str,
        typer.Option(
            metavar="SIZE",
            help="Window length in tokens (bases); k/M suffixes, k = 1024. At least 64 (a shorter window holds "
            "less than one KDA chunk and no DSA key pool: the model needs context), at most 1G.",
        ),
    ] = "512k",
    stride: Annotated[
        str | None,
        typer.Option(
            metavar="SIZE", help="Stride between window starts, 1 to --window (no base skipped); default = window."
        ),
    ] = None,
    chroms: Annotated[str | None, typer.Option(help="Training chromosomes, comma-separated (e.g. chr1,chr2).")] = None,
    eval_chroms: Annotated[str | None, typer.Option(help="Held-out chromosomes, comma-separated (e.g. chr22).")] = None,
    max_n_fraction: Annotated[float, typer.Option(help="Skip windows with a larger fraction of N.")] = 0.5,
    uppercase_only: Annotated[bool, typer.Option(help="Drop the soft-mask channel.")] = False,
    keep_partial: Annotated[
        bool,
        typer.Option(
            "--keep-partial/--drop-partial",
            "--pad-last/--drop-last",
            help="Keep (pad with <pad>) or drop the last partial window of each chromosome.",
        ),
    ] = False,  # fmt: skip
    wait: Wait = False,
    verbose: Verbose = False,
) -> None:
    """Tokenize FASTA (local, or downloaded and verified) into windows split by chromosome; prints JSON.

    Examples:
      genoctx prepare --fasta data/hg38/hg38_chr22_32000001-32300000.fa --window 16k --out prepared
      genoctx prepare --assembly hg38 --chroms chr1,chr2 --eval-chroms chr22 --window 512k --out hg38-512k
      genoctx prepare --verify hg38-512k

    --window is at least 64 bases on the command line: a shorter window holds less than one KDA chunk (64
    tokens) and no DSA key pool, and the model needs context to learn from. (The library function
    genoctx.data.windows.prepare takes any positive window.) --stride is 1 to --window: a longer stride would
    skip the bases between windows.
    """
    _setup_logging(verbose)
    from ..data.windows import prepare as run_prepare
    from ..data.windows import verify as verify_dir

    if verify is not None:
        from ..data.dataset import load_manifest

        verify = _data_dir(verify, "--verify")
        load_manifest(verify)  # the manifest's entries are well-formed before any shard is read
        problems = verify_dir(verify)
        _emit_json({"verify": str(verify), "ok": not problems, "problems": problems})
        if problems:
            raise GenoctxError(f"{verify}: {len(problems)} problem(s); first: {problems[0]}")
        return
    if out is None:
        raise GenoctxError("--out is required (or use --verify DIR)")
    _out_dir(out)
    if bool(fasta) == bool(assembly):
        raise GenoctxError("give either --fasta FILE (repeatable) or --assembly NAME (e.g. hg38)")
    w = _size("--window", window, MIN_WINDOW, MAX_WINDOW, WHY_MIN_WINDOW, " (1G: longer than any human chromosome)")
    st = (
        _size("--stride", stride, 1, w, why_max=f" (--window {window}: a longer stride skips bases)")
        if stride
        else None
    )
    if not 0 <= max_n_fraction <= 1:
        raise GenoctxError(f"--max-n-fraction: must be between 0 and 1, got {max_n_fraction}")
    train_list, eval_list = _split_list(chroms), _split_list(eval_chroms)
    expected = None
    if assembly:
        from ..data.assemblies import get_assembly
        from ..data.download import fetch_assembly

        asm = get_assembly(assembly)
        wanted = (train_list or []) + (eval_list or [])
        fasta, sizes = fetch_assembly(
            asm, wanted or None, cache_dir=cache_dir, base_url=base_url, progress=sys.stderr.isatty()
        )
        expected = sizes
    manifest = run_prepare(
        fasta,
        out,
        window=w,
        stride=st,
        train_chroms=train_list,
        eval_chroms=eval_list,
        max_n_fraction=max_n_fraction,
        uppercase_only=uppercase_only,
        drop_last=not keep_partial,
        progress=sys.stderr.isatty(),
        expected_lengths=expected,
        wait=wait,
    )
    _emit_json(
        {
            "out": str(out),
            "window": manifest["window"],
            "stride": manifest["stride"],
            "splits": manifest["splits"],
            "counts": manifest.get("counts"),
            "skipped": manifest.get("skipped"),
            "sources": [s["path"] for s in manifest.get("sources", [])],
        }
    )

"""The ``genoctx`` command line: thin wrappers that parse flags and call one function per verb.

Results go to stdout (JSON, or a table/CSV for ``eval``); logs and progress go to stderr. Exit codes:
0 success, 2 bad input (a one-line message naming the file, record or flag), 1 an internal error.

Help (``--help``) is plain text at most 80 columns wide whatever the terminal (``_HelpFormatter``): option names
are never cut and help text wraps instead of being truncated. One idea has one flag name across verbs
(``--seq-chunk``, ``--gpu-memory-gib``, ``--ep-folded/--no-ep-folded``, ``--cp-layout``); an old name stays
accepted as a hidden alias (``_alias``), and messages name the flag the user typed.

Flags are checked here, before any work (a size flag through :func:`_size`, an output file before scoring), so
a bad value never costs a long run or leaves partial output.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import json
import logging
import re
import sys
import textwrap
from pathlib import Path
from typing import Annotated

import typer
import typer.core
from typer.core import TyperGroup

from .errors import GenoctxError

# click's exception classes, from typer's own click (typer >= 0.24 vendors it as typer._click)
_USAGE_ERROR = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "UsageError")
_CLICK_EXCEPTION = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException")


_CLICK = importlib.import_module(_USAGE_ERROR.__module__.rpartition(".")[0])  # typer's click (or click itself)


def _wrap(text: str, width: int, indent: str = "", hanging: str = "") -> list[str]:
    """``text`` wrapped to ``width`` columns (first line after ``indent``, the others after ``hanging``), never
    inside a word or at a hyphen: a flag name (``--no-ep-folded``) or a path is never cut. A word longer than a line
    stands on a line of its own."""
    return textwrap.wrap(text, width, initial_indent=indent, subsequent_indent=hanging, break_long_words=False,
                         break_on_hyphens=False) or [indent.rstrip()]  # fmt: skip


class _HelpFormatter(_CLICK.formatting.HelpFormatter):
    """click's help formatter (plain text, at most ``width`` columns: the terminal's, capped at 80) that never
    truncates and never cuts a name: option names stay whole (a long one takes its own line, its help below it),
    help text wraps at spaces only. A paragraph of a docstring whose lines after the first are indented (``Examples:``
    and its command lines) keeps its line breaks, each line wrapped with a hanging indent."""

    def write_text(self, text: str) -> None:
        width = max(self.width - self.current_indent, 20)
        pad = " " * self.current_indent
        for i, para in enumerate(text.split("\n\n")):
            if i:
                self.write("\n")
            lines = para.splitlines()
            if len(lines) > 1 and any(ln[:1].isspace() for ln in lines[1:]):  # a block: keep its line breaks
                for ln in lines:
                    lead = ln[: len(ln) - len(ln.lstrip())]
                    out = _wrap(ln.strip(), width, pad + lead, pad + lead + "    ")
                    self.write("".join(f"{o}\n" for o in out))
            else:
                self.write("".join(f"{o}\n" for o in _wrap(" ".join(para.split()), width, pad, pad)))

    def write_dl(self, rows, col_max: int = 30, col_spacing: int = 2) -> None:
        rows = list(rows)
        if not rows:
            return
        first = min(max(len(name) for name, _ in rows), col_max) + col_spacing
        pad = " " * self.current_indent
        text_width = max(self.width - self.current_indent - first, 20)
        for name, help_ in rows:
            names = _wrap(name, max(self.width - self.current_indent, 20), pad, pad + "  ")
            text = _wrap(" ".join((help_ or "").split()), text_width)
            if help_ and len(names) == 1 and len(name) <= first - col_spacing:
                head = f"{names[0]:<{self.current_indent + first}}{text[0]}"
                self.write(head + "\n" + "".join(f"{pad}{' ' * first}{t}\n" for t in text[1:]))
            else:
                self.write("".join(f"{n}\n" for n in names))
                self.write("".join(f"{pad}{' ' * first}{t}\n" for t in text if help_))


def _get_help(cmd, ctx) -> str:
    formatter = _HelpFormatter(width=ctx.terminal_width, max_width=ctx.max_content_width)
    cmd.format_help(ctx, formatter)
    return formatter.getvalue().rstrip("\n")


class _Command(typer.core.TyperCommand):
    """A verb whose ``--help`` is plain text that fits the terminal (``_HelpFormatter``): every option name whole,
    help wrapped rather than truncated, nothing wider than 80 columns; literal (no rich markup)."""

    def get_help(self, ctx) -> str:
        return _get_help(self, ctx)


_FIRST_SENTENCE = re.compile(r"(?<=[a-z0-9)\]]\.)\s+(?=[A-Z])")


class _Group(TyperGroup):
    """A group of verbs with ``_Command``'s help; its list of verbs gives each verb's whole first sentence
    (wrapped), not one truncated to a line."""

    def get_help(self, ctx) -> str:
        return _get_help(self, ctx)

    def format_commands(self, ctx, formatter) -> None:
        rows = []
        for name in self.list_commands(ctx):
            cmd = self.get_command(ctx, name)
            if cmd is not None and not cmd.hidden:
                first = " ".join(inspect.cleandoc(cmd.help or "").split("\n\n")[0].split())
                rows.append((name, _FIRST_SENTENCE.split(first, 1)[0]))
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)


class _OneLineUsageErrors(_Group):
    """Click's usage errors (``--steps abc``, a missing ``--data``, an unknown verb) as one line on stderr,
    ``genoctx: error: ...``, exit code 2, like every other user error (instead of a usage box)."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode, **extra)
        try:
            rv = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except _USAGE_ERROR as e:
            if type(e).__name__ == "NoArgsIsHelpError":  # no verb: the help on stdout, exit 2 (as typer)
                typer.echo(e.ctx.get_help())
                sys.exit(e.exit_code)
            where = f" (see `{e.ctx.command_path} --help`)" if e.ctx is not None else ""
            typer.echo(f"genoctx: error: {_one_line(e.format_message())}{where}", err=True)
            sys.exit(2)
        except _CLICK_EXCEPTION as e:
            e.show()
            sys.exit(e.exit_code)
        except typer.Abort:
            typer.echo("Aborted!", err=True)
            sys.exit(1)
        sys.exit(rv if isinstance(rv, int) else 0)


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

app = typer.Typer(
    help="Post-train hybrid long-context models on the human genome and measure how they use context.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # plain help (_HelpFormatter): names whole and text wrapped at 80 columns, literal text
    cls=_OneLineUsageErrors,
)
model_app = typer.Typer(
    help="Inspect model presets, recipes and HF checkpoints.", no_args_is_help=True, rich_markup_mode=None, cls=_Group
)
app.add_typer(model_app, name="model")


def _version(value: bool) -> None:
    """``genoctx --version``: print ``genoctx X.Y.Z`` (the installed distribution's version, importlib.metadata) and
    exit 0 before any verb runs."""
    if value:
        from importlib.metadata import PackageNotFoundError, version

        try:
            v = version("genoctx")
        except PackageNotFoundError:  # a source tree that was not installed: the package's own
            from . import __version__ as v
        typer.echo(f"genoctx {v}")
        raise typer.Exit(0)


@app.callback()
def _options(
    version: Annotated[
        bool,
        typer.Option("--version", is_eager=True, callback=_version, help="Print genoctx's version and exit."),
    ] = False,
) -> None:
    pass


def _setup_logging(verbose: bool) -> None:
    """Logs to stderr: rich on a terminal, plain unwrapped lines (no colour codes) in pipes and files. On a terminal
    the progress bars (``genoctx.progress``: train's steps, eval's windows) share the log's console, so log lines
    print above the bar; in pipes there is no bar."""
    from . import progress

    level = logging.DEBUG if verbose else logging.INFO
    if sys.stderr.isatty():
        from rich.console import Console
        from rich.logging import RichHandler

        console = Console(stderr=True)
        handler: logging.Handler = RichHandler(console=console, show_path=False, markup=False, rich_tracebacks=False)
        fmt = "%(message)s"
        progress.use_console(console)
    else:
        handler = logging.StreamHandler(sys.stderr)
        fmt = "%(asctime)s %(levelname)s %(name)s: %(message)s"
        progress.use_console(None)
    try:
        progress.interval()  # a bad GENOCTX_PROGRESS_SECONDS: one line before any work
    except ValueError as e:
        raise GenoctxError(str(e)) from None
    logging.basicConfig(level=level, format=fmt, datefmt="%H:%M:%S", handlers=[handler], force=True)


def _user_errors(fn):
    """Turn GenoctxError into a one-line message on stderr and exit code 2 (no traceback)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except GenoctxError as e:
            typer.echo(f"genoctx: error: {_one_line(str(e))}", err=True)
            raise typer.Exit(2) from None
        except KeyboardInterrupt:
            typer.echo("genoctx: interrupted", err=True)
            raise typer.Exit(130) from None

    return wrapper


def _absolute_paths(fn):
    """Every path a verb is given (its ``Path`` and ``list[Path]`` parameters, and train's ``--init`` when it names
    an existing file or folder rather than a Hub repo id) made absolute against this process's working directory
    before the verb runs: Ray workers start in another directory, so a relative path handed on to them names another
    file, or none; and a run records its ``--init`` for later. Symlinks are kept (``Path.absolute``, not
    ``resolve``)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        def absolute(k, v):
            if isinstance(v, Path):
                return v.absolute()
            if isinstance(v, list | tuple) and v and all(isinstance(x, Path) for x in v):
                return [x.absolute() for x in v]
            if k == "init" and isinstance(v, str) and v and Path(v).expanduser().exists():
                return str(Path(v).expanduser().absolute())
            return v

        return fn(*args, **{k: absolute(k, v) for k, v in kwargs.items()})

    return wrapper


def _one_line(msg: str) -> str:
    """``msg`` on one line whatever a quoted value held: control characters (newlines, \\x1d, \\x85, ...) and
    other unprintable ones are written as Python escapes."""
    return "".join(c if c.isprintable() or c == "\t" else repr(c)[1:-1] for c in msg).strip() or "(no message)"


def _emit_json(doc: dict) -> None:
    sys.stdout.write(json.dumps(doc, indent=None if not sys.stdout.isatty() else 2) + "\n")
    sys.stdout.flush()


def _alias(flag: str, value, old_flag: str, old_value):
    """``(value, name)`` of an option that has an old name kept as a hidden alias: the value given by ``flag`` or by
    ``old_flag`` (None when neither), and the name it was given by (for messages).

    Raises:
        GenoctxError: both names given (one line naming both).
    """
    if old_value is None:
        return value, flag
    if value is not None:
        raise GenoctxError(f"{old_flag} is the old name of {flag}: give one of them")
    return old_value, old_flag


def _split_list(s: str | None) -> list[str] | None:
    return [c.strip() for c in s.split(",") if c.strip()] if s else None


MIN_WINDOW = 64  # bases: one KDA chunk (kda_chunk_size 64) and a few DSA key pools (index_kpool 16)
MAX_WINDOW = 1 << 30  # bases (1G): longer than any human chromosome (chr1: 248,956,422)
WHY_MIN_WINDOW = " (a shorter window holds less than one KDA chunk and no DSA key pool: the model needs context)"


def _size(
    flag: str, value: str, minimum: int = 1, maximum: int | None = None, why_min: str = "", why_max: str = ""
) -> int:
    """A size flag (``4096``, ``16k``, ``512k``, ``1M``; :func:`genoctx.data.windows.parse_size`) in bases/tokens.

    Raises:
        GenoctxError: not a size, or outside ``minimum..maximum`` (``why_min``/``why_max`` say why); the message
            names ``flag`` and the value.
    """
    from .data.windows import parse_size

    try:
        size = parse_size(value)
    except GenoctxError as e:
        raise GenoctxError(f"{flag}: {e}") from None
    if size < minimum:
        raise GenoctxError(f"{flag}: {value!r} is {size} bases, less than the minimum of {minimum}{why_min}")
    if maximum is not None and size > maximum:
        raise GenoctxError(f"{flag}: {value!r} is {size} bases, more than the maximum of {maximum}{why_max}")
    return size


def _at_least(flag: str, value: float | None, minimum: float) -> None:
    if value is not None and value < minimum:
        raise GenoctxError(f"{flag}: must be >= {minimum}, got {value}")


def _out_dir(path: Path, flag: str = "--out") -> None:
    """Check that the output directory ``path`` is a directory or can be made one (creates nothing).

    Raises:
        GenoctxError: ``path`` or an ancestor is a file (naming ``flag`` and the path).
    """
    p = Path(path)
    try:
        anc = p
        while not anc.exists() and anc != anc.parent:
            anc = anc.parent
        is_dir = anc.is_dir()
    except (OSError, ValueError) as e:  # e.g. a NUL byte, a name too long
        raise GenoctxError(f"{flag} {p}: invalid path: {e}") from None
    if not is_dir:
        what = "is a file" if anc == p else f"cannot be created: {anc} is not a directory"
        raise GenoctxError(f"{flag} {p}: {what}; give a directory")


def _data_dir(path: Path, flag: str = "--data") -> Path:
    """A prepared directory given as ``--data DIR`` or ``--data DIR/manifest.json`` (both mean DIR).

    Raises:
        GenoctxError: no such path, not a directory, or no manifest.json in it (naming ``flag`` and the path).
    """
    p = Path(path)
    try:
        if p.name == "manifest.json" and p.is_file():
            return p.parent
        if not p.exists():
            raise GenoctxError(f"{flag} {p}: no such directory")
        if not p.is_dir():
            raise GenoctxError(f"{flag} {p}: not a directory; give the folder `genoctx prepare --out` wrote")
        if not (p / "manifest.json").is_file():
            raise GenoctxError(f"{flag} {p}: no manifest.json; run `genoctx prepare --out {p}` first")
    except (OSError, ValueError) as e:  # e.g. a NUL byte, a name too long
        raise GenoctxError(f"{flag} {p}: invalid path: {e}") from None
    return p


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
            "less than one KDA chunk and no DSA key pool: the model needs context), at most 1G."
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
    wait: Annotated[
        bool, typer.Option("--wait", help="If another genoctx process is writing --out, wait for it (default: exit 2).")
    ] = False,
    verbose: Annotated[bool, typer.Option("--verbose", "-v")] = False,
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
    from .data.windows import prepare as run_prepare
    from .data.windows import verify as verify_dir

    if verify is not None:
        from .data.dataset import load_manifest

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
        from .data.assemblies import get_assembly
        from .data.download import fetch_assembly

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


@app.command(cls=_Command)
@_user_errors
@_absolute_paths
def train(
    data: Annotated[Path, typer.Option(help="Prepared data directory (genoctx prepare --out).")],
    out: Annotated[Path, typer.Option(help="Run directory: checkpoints/ and metrics.jsonl.")],
    recipe: Annotated[Path | None, typer.Option(help="YAML recipe (recipes/*.yaml).")] = None,
    steps: Annotated[int | None, typer.Option(help="Optimizer steps (overrides train.steps; 0 = save init).")] = None,
    resume: Annotated[
        bool,
        typer.Option(help="Continue the run in --out from its latest checkpoint (exactly: weights, AdamW, schedule); "
                     "--out must hold a run."),  # fmt: skip
    ] = False,
    allow_batch_change: Annotated[
        bool,
        typer.Option(
            "--allow-batch-change",
            help="Let --resume change the data-parallel size (--num-workers / --cp) and so the tokens per step "
            "(refused otherwise); recorded in state.json's batch_changes.",
        ),
    ] = False,
    stop_after: Annotated[
        int | None,
        typer.Option(help="End this invocation after step N >= 1 (checkpointed); --resume continues."),
    ] = None,
    set_: Annotated[
        list[str] | None, typer.Option("--set", metavar="KEY=VALUE", help="Override a recipe key: train.lr=1e-3.")
    ] = None,
    init: Annotated[
        str | None,
        typer.Option(
            "--init",
            help="Start from a pretrained base: an HF model directory or a Hub repo id (org/name[@revision]) "
            "fetched by huggingface_hub into its cache (HF_HUB_OFFLINE, HF_ENDPOINT respected); = model.init.",
        ),
    ] = None,
    device: Annotated[str, typer.Option(help="cpu, cuda, or auto.")] = "cpu",
    num_workers: Annotated[
        int | None, typer.Option(help="Train on Ray with N workers (CP x DP); omit for one process.")
    ] = None,
    cp: Annotated[
        int | None,
        typer.Option(
            help="Context-parallel size: workers sharing one window (pieces: --cp-layout); = train.cp."
        ),
    ] = None,
    cp_layout: Annotated[
        str | None,
        typer.Option(
            "--cp-layout",
            metavar="LAYOUT",
            help="CP pieces: contiguous or zigzag, as eval's and plan's; = train.cp_layout.",
        ),
    ] = None,
    ep: Annotated[
        int | None, typer.Option(help="Expert-parallel size: workers splitting the routed experts; = train.ep.")
    ] = None,
    fsdp: Annotated[
        int | None,
        typer.Option(help="FSDP2 size: workers sharding parameters and optimizer state; = train.fsdp."),
    ] = None,
    ep_folded: Annotated[
        bool | None,
        typer.Option(
            "--ep-folded/--no-ep-folded",
            help="Draw the --ep group from the --fsdp x --cp workers (MoE parallel folding) instead of an axis of "
            "its own; = train.ep_folded.",
        ),
    ] = None,
    fsdp_one: Annotated[
        bool | None,
        typer.Option(
            "--fsdp-one/--no-fsdp-one",
            help="FSDP2 on one worker (--num-workers 1): bf16 mixed precision and offload_optimizer as a sharded "
            "layout runs them, on one GPU; = train.fsdp_one.",
        ),
    ] = None,
    seq_chunk: Annotated[
        str | None,
        typer.Option(
            "--seq-chunk",
            metavar="SIZE",
            help="Train each window as consecutive chunks of this many tokens (k/M suffixes), exactly (the chunked "
            "backward: memory bounded by the chunk plus the state crossing chunk boundaries); with --cp C each "
            "worker chunks its piece (rounds of C chunks); = train.seq_chunk_tokens.",
        ),
    ] = None,
    force: Annotated[
        bool, typer.Option("--force", help="Train even when the memory planner predicts the layout does not fit.")
    ] = False,
    gpu_memory_gib: Annotated[
        float | None,
        typer.Option(
            "--gpu-memory-gib",
            help="With --gpus-per-worker 1: memory of one worker's GPU in GiB for the memory plan before launch "
            "(default: this machine's GPU; a driver without one leaves the plan to each worker's GPU).",
        ),
    ] = None,
    address: RayAddress = None,
    gpus_per_worker: GpusPerWorker = 0,
    placement_timeout: PlacementTimeout = None,
    wait: Annotated[
        bool, typer.Option("--wait", help="If another genoctx process is writing --out, wait for it (default: exit 2).")
    ] = False,
    dry_run: Annotated[
        bool,
        typer.Option(
            "--dry-run",
            help="Build the recipe's model on the layout (fake process group, meta device) and print each simulated "
            "rank's bytes as JSON, with the planner's step time and GPU-hours for the run's steps on --hardware; no "
            "Ray, no training, --out untouched.",
        ),
    ] = False,
    hardware: Annotated[
        str | None,
        typer.Option(
            "--hardware",
            metavar="NAME|FILE",
            help="With --dry-run: the GPU profile of the predicted step time (h100, h200, b200 or a YAML file; "
            "default b200).",
        ),
    ] = None,
    logger: Annotated[
        list[str] | None,
        typer.Option(
            "--logger",
            metavar="NAME",
            help="Also send metrics.jsonl's rows to tensorboard (RUN/tensorboard), mlflow (RUN/mlruns/mlflow.db) or "
            "wandb (W&B; WANDB_MODE=offline keeps it to RUN/wandb); repeatable or a comma list; = train.loggers. "
            "Needs pip install 'genoctx[loggers]'.",
        ),
    ] = None,
    no_verify: Annotated[
        bool,
        typer.Option(
            "--no-verify",
            help="Load the --resume checkpoint or the --init genoctx checkpoint without checking its files against "
            "the sizes and digests recorded when it was written; = train.verify_checkpoints=false.",
        ),
    ] = False,
    verbose: Annotated[bool, typer.Option("--verbose", "-v")] = False,
) -> None:
    """Post-train the hybrid model on the train split; prints a JSON run summary.

    --resume continues from the newest checkpoint whose files verify (sizes and xxh3_64 digests recorded in its
    state.json); each newer damaged one is skipped with a warning and set aside as step_N.broken. --init RUN
    (a genoctx run or checkpoint) is refused when its checkpoint does not verify. --no-verify skips the checks.

    Example: genoctx train --data prepared --recipe recipes/cpu-small.yaml --out runs/demo --steps 200

    Example (metrics to TensorBoard too): genoctx train ... --logger tensorboard; tensorboard --logdir runs/demo

    Example (Ray, 2 workers sharing each window): genoctx train --data prepared --recipe recipes/tiny.yaml
    --out runs/cp2 --num-workers 2 --cp 2 [--set train.cp_layout=zigzag]
    """
    _setup_logging(verbose)
    from .recipes import load_recipe
    from .train.frozen import check_frozen_dtype
    from .train.loop import check_trainable
    from .train.loop import train as run_train

    _at_least("--steps", steps, 0)
    _at_least("--stop-after", stop_after, 1)
    _at_least("--num-workers", num_workers, 1)
    _at_least("--cp", cp, 1)
    _at_least("--ep", ep, 1)
    _at_least("--fsdp", fsdp, 1)
    _gpus_per_worker(gpus_per_worker)
    _at_least("--placement-timeout", placement_timeout, 0)
    if gpu_memory_gib is not None and not 0 < gpu_memory_gib < float("inf"):
        raise GenoctxError(f"--gpu-memory-gib: must be a positive number of GiB, got {gpu_memory_gib}")
    data = _data_dir(data)
    _out_dir(out)  # creates nothing
    overrides = list(set_ or [])
    if steps is not None:  # the flag wins over the recipe and --set (and is checked above)
        overrides.append(f"train.steps={steps}")
    if init is not None:
        overrides.append(f"model.init={init}")
    for key, value in (("cp", cp), ("ep", ep), ("fsdp", fsdp)):
        if value is not None:
            overrides.append(f"train.{key}={value}")
    if ep_folded is not None:
        overrides.append(f"train.ep_folded={str(ep_folded).lower()}")
    if fsdp_one is not None:
        overrides.append(f"train.fsdp_one={str(fsdp_one).lower()}")
    if cp_layout is not None:
        if cp_layout not in ("contiguous", "zigzag"):
            raise GenoctxError(f"--cp-layout must be contiguous or zigzag, got {cp_layout!r}")
        overrides.append(f"train.cp_layout={cp_layout}")
    if seq_chunk is not None:
        overrides.append(f"train.seq_chunk_tokens={_size('--seq-chunk', seq_chunk)}")
    if logger is not None:
        overrides.append(f"train.loggers=[{','.join(_loggers(logger))}]")
    if no_verify:
        overrides.append("train.verify_checkpoints=false")
    rec = load_recipe(recipe, overrides)
    # lora: one line before anything is built (not compiled yet; every mesh layout runs it)
    check_trainable(rec.train.trainable, mesh=num_workers is not None or rec.train.ep > 1, compile=rec.train.compile)
    check_frozen_dtype(rec.train, mesh=num_workers is not None or rec.train.ep > 1)  # fp8: not with compile
    _train_flags_without_effect(data, rec, seq_chunk=seq_chunk is not None, hardware=hardware, dry_run=dry_run,
                                num_workers=num_workers, gpus_per_worker=gpus_per_worker, device=device,
                                gpu_memory_gib=gpu_memory_gib, force=force, cp_layout=cp_layout,
                                allow_batch_change=allow_batch_change, resume=resume,
                                stop_after=stop_after)  # fmt: skip
    if dry_run:
        if resume or stop_after is not None or address is not None:
            raise GenoctxError("--dry-run builds the model only: --resume, --stop-after and --address do not apply")
        _emit_json({"dry_run": _train_dry_run(data, rec, num_workers, hardware or "b200")})
        return
    dev = _device(device)
    if num_workers is None:
        ray_flags = (address, placement_timeout, gpu_memory_gib)
        if any(v not in (None, 1) for v in (cp, ep, fsdp)) or any(v is not None for v in ray_flags) or gpus_per_worker \
                or ep_folded or rec.train.fsdp_one:  # fmt: skip
            raise GenoctxError("--cp, --ep, --fsdp, --ep-folded, --fsdp-one, --address, --gpus-per-worker, "
                               "--gpu-memory-gib and --placement-timeout need --num-workers")  # fmt: skip
        _emit_json(run_train(data, rec, out, resume=resume, device=dev, stop_after=stop_after, wait=wait,
                             allow_batch_change=allow_batch_change))  # fmt: skip
        return
    from .cluster import check_local, run_workers
    from .train.distributed import train_distributed

    if address is None:
        check_local(num_workers, gpus_per_worker)  # GPUs this machine lacks: refused before --out is touched

    _emit_json(
        train_distributed(
            data,
            rec,
            out,
            run_workers=run_workers,
            num_workers=num_workers,
            cp=rec.train.cp,
            ep=rec.train.ep,
            fsdp=rec.train.fsdp,
            ep_folded=rec.train.ep_folded,
            force=force,
            address=address,
            gpus_per_worker=gpus_per_worker,
            placement_timeout=placement_timeout,
            resume=resume,
            stop_after=stop_after,
            wait=wait,
            allow_batch_change=allow_batch_change,
            gpu_memory_gib=gpu_memory_gib,
        )
    )


def _train_flags_without_effect(data: Path, rec, *, seq_chunk: bool, hardware: str | None, dry_run: bool,
                                num_workers: int | None, gpus_per_worker: float, device: str,
                                gpu_memory_gib: float | None, force: bool, cp_layout: str | None,
                                allow_batch_change: bool, resume: bool, stop_after: int | None) -> None:  # fmt: skip
    """``genoctx train``'s flags that another setting makes inert: one warning line each on stderr, or a
    ``GenoctxError`` (exit 2) where the run would not be what was asked:

    - ``--seq-chunk`` with a crop (``train.seq_len``, e.g. a recipe's) at or below the chunk while the whole windows
      are longer: the step would train one short crop in one pass, not the windows in chunks (refused; naming
      ``--set train.seq_len=null``). A chunk at or above the whole window (a one-pass run) warns, in the loop.
    - ``--device cuda`` with ``--num-workers`` and ``--gpus-per-worker 0``: the workers would train on CPUs
      (refused).
    - warnings: ``--hardware`` without ``--dry-run``; ``--gpu-memory-gib`` / ``--force`` where nothing is planned
      (one process, CPU workers); ``--cp-layout`` with ``--cp 1``; ``--allow-batch-change`` without ``--resume``;
      ``--stop-after`` at or past ``train.steps``.

    Raises:
        GenoctxError: the two refusals above, one line naming the flags and what to pass.
    """
    from .data.dataset import WindowDataset
    from .train.loop import unused_seq_chunk

    warn = logging.getLogger("genoctx.train").warning
    if seq_chunk:
        unused = unused_seq_chunk(rec.train, WindowDataset(data, "train").window)
        if unused is not None and unused[1]:
            raise GenoctxError(f"--seq-chunk: {unused[0]}; or drop --seq-chunk")
    if num_workers is not None and not gpus_per_worker and device not in ("cpu", "auto") and not dry_run:
        raise GenoctxError(f"--device {device} with --num-workers: the Ray workers' device is set by "
                           "--gpus-per-worker (0: CPUs); pass --gpus-per-worker 1 to train on GPUs")  # fmt: skip
    if hardware is not None and not dry_run:
        warn("--hardware %s has no effect without --dry-run (the predicted step time)", hardware)
    planned = num_workers is not None and gpus_per_worker > 0 and not dry_run  # genoctx.train.distributed
    if not planned and (force or (gpu_memory_gib is not None and num_workers is not None)):
        flags = " and ".join(f for f, on in (("--force", force), ("--gpu-memory-gib", gpu_memory_gib is not None))
                             if on)  # fmt: skip
        warn("%s: no effect: the memory plan before launch runs for GPU workers only (--num-workers with "
             "--gpus-per-worker 1)", flags)  # fmt: skip
    if cp_layout is not None and rec.train.cp == 1:
        warn("--cp-layout %s has no effect with --cp 1 (one worker per window: nothing is cut)", cp_layout)
    if allow_batch_change and not resume:
        warn("--allow-batch-change has no effect without --resume")
    if stop_after is not None and stop_after >= rec.train.steps and not dry_run:
        warn("--stop-after %d has no effect: the run ends at train.steps %d", stop_after, rec.train.steps)


def _loggers(values: list[str]) -> list[str]:
    """``--logger`` values (repeated, or comma lists) as a list of names from ``genoctx.recipes.LOGGERS``.

    Raises:
        GenoctxError: an unknown or empty name (one line naming --logger).
    """
    from .recipes import LOGGERS

    names = [name.strip() for value in values for name in value.split(",")]
    for name in names:
        if name not in LOGGERS:
            raise GenoctxError(f"--logger {name!r}: expected {' or '.join(LOGGERS)} (repeatable, or a comma list)")
    return names


def _train_dry_run(data: Path, rec, num_workers: int | None, hardware: str = "b200") -> dict:
    """``genoctx train --dry-run``: ``genoctx.train.dryrun.dry_run`` of the recipe's model (``_recipe_model``: a
    preset, or ``model.init``'s config with the recipe's compute knobs) on ``num_workers`` ranks (1 when None) with
    ``train.ep``/``train.fsdp``/``train.cp``, the recipe's dtype, activation checkpointing, optimizer offload and
    AdamW moment dtype (``train.optimizer_state_dtype``);
    with ``"time"``: the planner's step time on ``hardware`` (``genoctx.plan.time.plan_time``) and the GPU-hours
    of the recipe's ``train.steps`` (logged on stderr too).

    Raises:
        GenoctxError: ``model.init``'s config not readable without a download, a layout that does not make
            ``num_workers`` ranks or that this model or window cannot run (one line naming the flag).
    """
    from .data.dataset import WindowDataset
    from .parallel.layout import Layout
    from .train.dryrun import dry_run

    cfg = _recipe_model(rec, "--dry-run")
    t = rec.train
    try:
        layout = Layout.for_world(num_workers or 1, ep=t.ep, dp_shard=t.fsdp, cp=t.cp, ep_folded=t.ep_folded,
                                  fsdp_one=t.fsdp_one)  # fmt: skip
    except ValueError as e:
        raise GenoctxError(str(e)) from None
    L = t.seq_len or WindowDataset(data, "train").window
    if L % t.cp or L // t.cp < cfg.kda_chunk_size:
        raise GenoctxError(f"--cp {t.cp}: the {L}-token window does not split into {t.cp} pieces of at least "
                           f"{cfg.kda_chunk_size} tokens")  # fmt: skip
    hw, _ = _hardware_and_skew(hardware, "1")
    out = dry_run(cfg, layout, activation_checkpointing=t.activation_checkpointing, dtype=t.dtype,
                  optimizer_offload=t.offload_optimizer, optimizer_state_dtype=t.optimizer_state_dtype)  # fmt: skip
    out["time"] = _predicted_time(cfg, L, layout, hw, t)
    out["trainable"] = _trainable_meta(cfg, t.trainable)
    return out


def _trainable_meta(cfg, spec: str) -> dict:
    """What ``train.trainable`` trains of ``cfg`` (``genoctx.train.loop.trainable_counts`` on the meta device), logged
    on stderr as ``trainable: kda,dsa (12.3M of 313.3B parameters)``."""
    import torch

    from .model.model import HybridLM
    from .train.loop import describe_trainable, trainable_counts

    with torch.device("meta"):
        counts = trainable_counts(HybridLM(cfg), spec)
    logging.getLogger("genoctx.train").info(describe_trainable(counts))
    return counts


def _predicted_time(cfg, seq_len: int, layout, hw, t) -> dict:
    """``plan_time``'s step of the recipe's training (``t``: ``TrainConfig``) on ``hw``, the GPU-hours of its
    ``t.steps`` steps, logged on stderr."""
    from .plan import plan_memory
    from .plan.time import TIME_KEYS, gpu_hours, plan_time, with_host_time

    try:
        p = plan_time(cfg, seq_len, layout, hw, batch_size=t.batch_size, recompute=t.activation_checkpointing,
                      dtype=t.dtype, seq_chunk_tokens=t.seq_chunk_tokens)  # fmt: skip
    except ValueError as e:
        raise GenoctxError(f"--dry-run: {e}") from None
    try:  # the memory knobs' host time needs the step's plan (none for what plan_memory does not model)
        plan = plan_memory(cfg, seq_len, layout, gpu_memory_gib=hw.memory_gib, recompute=t.activation_checkpointing,
                           optimizer_offload=t.offload_optimizer, batch_size=t.batch_size, dtype=t.dtype,
                           seq_chunk_tokens=t.seq_chunk_tokens,
                           optimizer_state_dtype=t.optimizer_state_dtype,
                           offload_activations=t.offload_activations)  # fmt: skip
    except ValueError:
        plan = None
    with_host_time(p, plan, hw)
    out = {k: p[k] for k in TIME_KEYS}
    out.update(steps=t.steps, gpu_hours=gpu_hours(p["step_s"], t.steps, layout.world))
    logging.getLogger("genoctx.plan").info(
        "predicted on %s: %.2f s per step (%.0f tokens/s, MFU %.1f%%, bound: %s); %d steps = %.1f GPU-hours on %d "
        "GPUs", hw.name, p["step_s"], p["tokens_per_s"], 100 * p["mfu"], p["bound"], t.steps, out["gpu_hours"],
        layout.world,
    )  # fmt: skip
    return out


def _gpus_per_worker(value: float) -> None:
    """``--gpus-per-worker``: 0 or 1 (``genoctx.cluster.check_gpus_per_worker``), refused before anything starts."""
    from .cluster import check_gpus_per_worker

    check_gpus_per_worker(value)


def _device(name: str) -> str:
    """``--device``: ``cpu``, ``cuda``, ``cuda:N`` or ``auto`` (CUDA when there is one), checked; a CUDA device becomes
    this process's current device (``_set_cuda_device``), so that what launches on the current device (Triton
    kernels, NCCL, ``torch.cuda`` calls without a device) runs where the tensors are.

    Raises:
        GenoctxError: an unknown name, CUDA asked on a machine without it, or an index past the last device.
    """
    import torch

    if name == "auto":
        name = "cuda" if _cuda_devices() else "cpu"
    try:
        dev = torch.device(name)
    except (RuntimeError, ValueError):
        raise GenoctxError(f"--device {name!r}: expected cpu, cuda, cuda:N or auto") from None
    if dev.type not in ("cpu", "cuda"):
        raise GenoctxError(f"--device {name!r}: expected cpu, cuda, cuda:N or auto")
    if dev.type == "cuda":
        have = _cuda_devices()
        if have == 0:
            raise GenoctxError(f"--device {name}: CUDA is not available on this machine")
        if dev.index is not None and dev.index >= have:
            raise GenoctxError(f"--device {name}: this machine has {have} CUDA device{'s' * (have != 1)} "
                               f"(cuda:0 to cuda:{have - 1})")  # fmt: skip
        _expandable_segments()  # what the memory plan assumes (Ray workers: genoctx.cluster.worker_env)
        _set_cuda_device(dev.index or 0)
    return name


def _cuda_devices() -> int:
    """The CUDA devices torch sees (``torch.cuda.device_count()``), 0 without CUDA."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _expandable_segments() -> None:
    """Turn on the CUDA caching allocator's ``expandable_segments`` in this process, as the memory planner assumes,
    unless the environment (``PYTORCH_ALLOC_CONF`` or ``PYTORCH_CUDA_ALLOC_CONF``) names it already (the user's
    value is kept). The environment was read when torch was imported, so this goes through torch's settings call."""
    import os

    import torch

    from .cluster import ALLOC_CONF

    given = os.environ.get("PYTORCH_ALLOC_CONF") or os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or ""
    if "expandable_segments" not in given:
        torch._C._accelerator_setAllocatorSettings(ALLOC_CONF)


def _set_cuda_device(index: int) -> None:
    """``torch.cuda.set_device(index)``: the current CUDA device of this process."""
    import torch

    torch.cuda.set_device(index)


@app.command("eval", cls=_Command)
@_user_errors
@_absolute_paths
def eval_(
    data: Annotated[Path, typer.Option(help="Prepared data directory.")],
    checkpoint: Annotated[
        list[Path] | None,
        typer.Option(
            metavar="PATH",
            help="Checkpoint, run directory (its latest) or HF model directory (config.json + safetensors); "
            "repeatable, the first is the baseline."
        ),
    ] = None,
    by_position: Annotated[
        bool,
        typer.Option(
            "--by-position",
            show_default=False,
            help="The loss binned by how many tokens of context each token had: what eval does (the default and, so "
            "far, only mode; --copy-probe adds to it), so the flag may be left out.",
        ),
    ] = True,
    baseline: Annotated[
        Path | None, typer.Option(help="Checkpoint to compare against (same as giving it as the first --checkpoint).")
    ] = None,
    split: Annotated[str, typer.Option(help="Split of the prepared data to score.")] = "eval",
    bins: Annotated[str, typer.Option(help="log2, linear:N, or comma-separated edges in tokens.")] = "log2",
    markov: Annotated[
        int | None, typer.Option(help="Also score an order-K Markov chain fitted on the train split.")
    ] = None,
    markov_alpha: Annotated[float, typer.Option(help="Add-alpha pseudo-count of the Markov chain.")] = 1.0,
    reference: Annotated[
        str | None,
        typer.Option(
            metavar="NAME",
            help="Also score a reference that uses far context without a network: repeat (context models fitted "
            "on the train split, mixed with experts copying earlier forward and reverse-complement repeats in the "
            "window); every other model's rows get their change vs it.",
        ),
    ] = None,
    # defaults: genoctx.eval.repeat's ORDER, KMER, EXPERTS (literals here so that --help imports no numpy or torch;
    # a test holds them equal)
    repeat_order: Annotated[
        int, typer.Option(help="Order of the repeat reference's static context model (fitted on the train split).")
    ] = 10,
    repeat_kmer: Annotated[int, typer.Option(help="Seed length of the repeat reference's experts (bases).")] = 12,
    repeat_experts: Annotated[int, typer.Option(help="Most repeat experts alive at once.")] = 16,
    reverse_complement: Annotated[
        bool, typer.Option("--reverse-complement", help="Also score the reverse-complement strand.")
    ] = False,
    split_by: Annotated[
        str | None, typer.Option(help="softmask: report soft-masked and unmasked bases separately too.")
    ] = None,
    resamples: Annotated[int, typer.Option(help="Bootstrap resamples over windows (0 = no intervals).")] = 1000,
    seed: Annotated[int, typer.Option(help="Seed of the bootstrap.")] = 0,
    format_: Annotated[str, typer.Option("--format", help="table, json or csv (on stdout).")] = "table",
    plot: Annotated[
        Path | None,
        typer.Option(
            help="Write a plot of loss against position (PNG; .pdf/.svg by suffix); its folder is created. "
            "Checked before scoring; written after the result is on stdout."
        ),
    ] = None,
    plot_metric: Annotated[
        str, typer.Option(help="What --plot draws: loss or relative_change (vs the baseline).")
    ] = "loss",
    seq_chunk: Annotated[
        str | None,
        typer.Option(
            "--seq-chunk",
            metavar="SIZE",
            help="Score each window (under --cp each CP piece) as consecutive chunks of this many tokens (k/M "
            "suffixes) with the carried cache, as train's --seq-chunk; default whole windows. Old name: "
            "--chunk-tokens.",
        ),
    ] = None,
    chunk_tokens: Annotated[str | None, typer.Option("--chunk-tokens", hidden=True)] = None,
    loss_vocab: Annotated[
        str | None,
        typer.Option(
            help="For a text-vocabulary model: softmax over the full vocabulary or the nucleotide rows "
            "(default: the run's loss.vocab; full for an HF base)."
        ),
    ] = None,
    max_windows: Annotated[int | None, typer.Option(help="Score only the first N windows.")] = None,
    copy_probe: Annotated[
        bool,
        typer.Option(
            "--copy-probe",
            help="Also copy a segment to each window's end from log-spaced distances and report the loss on the "
            "copy vs in place (the model's reach).",
        ),
    ] = False,
    copy_segment: Annotated[int, typer.Option(help="Bases copied by --copy-probe.")] = 200,
    copy_distances: Annotated[int, typer.Option(help="Log-spaced distances of --copy-probe (64 to W - segment).")] = 8,
    device: Annotated[str, typer.Option(help="cpu, cuda, or auto.")] = "cpu",
    num_workers: Annotated[
        int | None,
        typer.Option(help="Score on Ray with N workers on the training mesh (FSDP x EP x CP); omit for one process."),
    ] = None,
    fsdp: Annotated[int | None, typer.Option(help="FSDP2 size: workers sharding each model's parameters.")] = None,
    ep: Annotated[int | None, typer.Option(help="Expert-parallel size: workers splitting the routed experts.")] = None,
    ep_folded: Annotated[
        bool,
        typer.Option(
            "--ep-folded/--no-ep-folded",
            help="Draw the --ep group from the --fsdp x --cp workers (MoE parallel folding) instead of an axis of "
            "its own, as train's.",
        ),
    ] = False,
    cp: Annotated[
        int | None, typer.Option(help="Context-parallel size: workers sharing one window (pieces as in training).")
    ] = None,
    cp_layout: Annotated[
        str, typer.Option(help="CP pieces: contiguous or zigzag (as train.cp_layout).")
    ] = "contiguous",
    address: RayAddress = None,
    gpus_per_worker: GpusPerWorker = 0,
    placement_timeout: PlacementTimeout = None,
    gpu_memory_gib: Annotated[
        float | None,
        typer.Option(
            "--gpu-memory-gib",
            help="Memory of one worker's device in GiB for the memory plan, as genoctx plan's (default: the GPU's; "
            "on the CPU with a local Ray, host memory / workers). Old name: --memory-gib.",
        ),
    ] = None,
    memory_gib: Annotated[float | None, typer.Option("--memory-gib", hidden=True)] = None,
    force: Annotated[
        bool, typer.Option("--force", help="Score even when the memory planner predicts a rank does not fit.")
    ] = False,
    no_verify: Annotated[
        bool,
        typer.Option(
            "--no-verify",
            help="Read genoctx checkpoints without checking their files against the sizes and digests recorded when "
            "they were written.",
        ),
    ] = False,
    verbose: Annotated[bool, typer.Option("--verbose", "-v")] = False,
) -> None:
    """Held-out next-token loss, binned by how many tokens of context each token had, with 95% bootstrap
    intervals over windows (--by-position: the default mode, the flag may be left out; --copy-probe adds a
    copy probe to it). Several --checkpoint: the first is the baseline (paired intervals of the change).
    With --num-workers the checkpoints are scored on Ray workers on the training mesh (no rank holds a model;
    forward only; the statistics are then computed here exactly as for one process).

    Every genoctx checkpoint's weight files are checked against the sizes and xxh3_64 digests recorded when it was
    written before anything is scored (--no-verify skips it); a damaged file is one line naming it (exit 2). A run
    directory whose newest checkpoint does not verify is refused, naming the newest one that does (pass that one
    explicitly): an eval measures one specific model, so an older one is never evaluated silently.

    Examples:
      genoctx eval --by-position --checkpoint runs/init --checkpoint runs/demo --data prepared --markov 8
      genoctx eval --by-position --checkpoint runs/demo --baseline runs/init --data prepared --format json
      genoctx eval --by-position --markov 12 --data prepared --reverse-complement --split-by softmask
      genoctx eval --by-position --checkpoint runs/demo --data prepared --markov 8 --reference repeat
      genoctx eval --by-position --checkpoint runs/demo --data prepared --markov 8 --copy-probe
      genoctx eval --checkpoint runs/base --checkpoint runs/post --data prepared --num-workers 4 --fsdp 2 --cp 2
    """
    _setup_logging(verbose)
    if format_ not in ("table", "json", "csv"):
        raise GenoctxError(f"--format must be table, json or csv, got {format_!r}")
    if plot_metric not in ("loss", "relative_change"):
        raise GenoctxError(f"--plot-metric must be loss or relative_change, got {plot_metric!r}")
    if plot is not None and plot_metric == "relative_change" and len(checkpoint or []) + bool(baseline) < 2:
        raise GenoctxError("--plot-metric relative_change needs a baseline (two or more checkpoints)")
    seq_chunk, chunk_flag = _alias("--seq-chunk", seq_chunk, "--chunk-tokens", chunk_tokens)
    gpu_memory_gib, memory_flag = _alias("--gpu-memory-gib", gpu_memory_gib, "--memory-gib", memory_gib)
    chunk = _size(chunk_flag, seq_chunk) if seq_chunk is not None else None
    _at_least("--copy-segment", copy_segment, 1)
    _at_least("--copy-distances", copy_distances, 1)
    if loss_vocab not in (None, "full", "nucleotide"):
        raise GenoctxError(f"--loss-vocab must be full or nucleotide, got {loss_vocab!r}")
    data = _data_dir(data)
    mesh = _eval_mesh(num_workers, fsdp, ep, cp, cp_layout, address, gpus_per_worker, gpu_memory_gib, force,
                      ep_folded, placement_timeout, memory_flag)  # fmt: skip
    from .eval.plot import prepare_plot_path, remove_folders
    from .eval.position import evaluate, to_csv, to_table
    from .eval.position import plot as write_plot

    created = prepare_plot_path(plot) if plot is not None else []  # before scoring: a bad path costs no run
    try:
        doc = evaluate(
            list(checkpoint or []),
            data,
            split=split,
            bins=bins,
            baseline=baseline,
            chunk_tokens=chunk,
            max_windows=max_windows,
            device=_device(device),
            markov=markov,
            markov_alpha=markov_alpha,
            reference=reference,
            repeat_order=repeat_order,
            repeat_kmer=repeat_kmer,
            repeat_experts=repeat_experts,
            reverse_complement=reverse_complement,
            split_by=split_by,
            resamples=resamples,
            seed=seed,
            loss_vocab=loss_vocab,
            copy_probe=copy_probe,
            copy_segment=copy_segment,
            copy_distances_n=copy_distances,
            mesh=mesh,
            verify=not no_verify,
        )
    except BaseException:
        remove_folders(created)  # no output of a failed run, not even --plot's empty folder
        raise
    # the result first: if the plot fails after all, what was computed is already out
    if format_ == "json":
        _emit_json(doc)
    elif format_ == "csv":
        sys.stdout.write(to_csv(doc))
    else:
        sys.stdout.write(to_table(doc) + "\n")
    sys.stdout.flush()
    if plot is not None:
        write_plot(doc, plot, metric=plot_metric)
        logging.getLogger("genoctx.eval").info("wrote %s", plot)


def _eval_mesh(num_workers, fsdp, ep, cp, cp_layout, address, gpus_per_worker, memory_gib, force, ep_folded=False,
               placement_timeout=None, memory_flag="--gpu-memory-gib"):  # fmt: skip
    """``genoctx.eval.distributed.MeshEval`` of eval's --num-workers flags, or None for one process. ``memory_flag``:
    the name the memory was given by (--gpu-memory-gib, or its old name --memory-gib), for messages.

    Raises:
        GenoctxError: a size below 1, a mesh flag without --num-workers, or (local Ray) more GPUs asked than this
            machine has (``genoctx.cluster.check_local``); one line naming the flag.
    """
    for flag, value in (("--num-workers", num_workers), ("--fsdp", fsdp), ("--ep", ep), ("--cp", cp)):
        _at_least(flag, value, 1)
    _gpus_per_worker(gpus_per_worker)
    _at_least("--placement-timeout", placement_timeout, 0)
    if memory_gib is not None and not 0 < memory_gib < float("inf"):
        raise GenoctxError(f"{memory_flag}: must be a positive number of GiB, got {memory_gib}")
    if num_workers is None:
        given = [f for f, v in (("--fsdp", fsdp), ("--ep", ep), ("--cp", cp), ("--address", address),
                                ("--gpus-per-worker", gpus_per_worker or None), (memory_flag, memory_gib),
                                ("--force", force or None), ("--ep-folded", ep_folded or None),
                                ("--placement-timeout", placement_timeout))
                 if v is not None]  # fmt: skip
        if given or cp_layout != "contiguous":
            raise GenoctxError(f"{(given or ['--cp-layout'])[0]} needs --num-workers (evaluation on a mesh)")
        return None
    from .cluster import check_local, run_workers
    from .eval.distributed import MeshEval

    if address is None:
        check_local(num_workers, gpus_per_worker)  # GPUs this machine lacks: refused before any checkpoint is read
    return MeshEval(run_workers, num_workers, fsdp=fsdp or 1, ep=ep or 1, cp=cp or 1, cp_layout=cp_layout,
                    address=address, gpus_per_worker=gpus_per_worker, memory_gib=memory_gib, force=force,
                    ep_folded=ep_folded, placement_timeout=placement_timeout)  # fmt: skip


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
    wait: Annotated[
        bool, typer.Option("--wait", help="If another genoctx process is writing --out, wait for it (default: exit 2).")
    ] = False,
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
    verbose: Annotated[bool, typer.Option("--verbose", "-v")] = False,
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

    from .model.groups import LORA, parse_trainable
    from .model.hf import base_config, check_export_dir, is_hf_dir, load_hf, parse_bytes, read_config, save_hf
    from .model.lora import is_lora_name, merge_lora
    from .train.checkpoint import load_model, load_recipe_of, read_state, resolve_checkpoint
    from .train.sharded import is_sharded, lazy_state

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
        from .train.integrity import refuse_unverified, run_of

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
        from .model.peft_export import base_of_run, save_peft

        name, revision, note = base_of_run(init if isinstance(init, dict) else None)
        if base is not None or no_base:
            name, revision, note = (str(base) if base is not None else None), None, None
        if note:
            log.info("%s", note)
        t = recipe.train
        if is_sharded(path):  # a mesh run's DCP checkpoint: the adapters and modules saved whole alone are read
            from .train.checkpoint import check_base, is_partial
            from .train.sharded import adapter_model

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
    from .train.checkpoint import is_partial

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


@app.command(cls=_Command)
@_user_errors
@_absolute_paths
def verify(
    path: Annotated[Path, typer.Argument(help="A run directory (every checkpoint of it) or one checkpoint directory.")],
    verbose: Annotated[bool, typer.Option("--verbose", "-v")] = False,
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
    from .train.integrity import verify_path

    doc = verify_path(path)
    _emit_json(doc)
    if not doc["ok"]:
        from .train.integrity import problem

        for report in doc["checkpoints"]:
            if (line := problem(report)) is not None:
                typer.echo(f"genoctx: {report.get('status', 'damaged')}: {_one_line(line)}", err=True)
        raise typer.Exit(1)


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
    verbose: Annotated[bool, typer.Option("--verbose", "-v")] = False,
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
    from .doctor import check

    doc = check(address=address, targets=targets, cpu_ok=cpu_ok)
    _emit_json(doc)
    if doc["missing"]:
        excused = " (--cpu-ok: not a failure)" if doc["ok"] else ""
        typer.echo(f"genoctx: doctor: missing: {_one_line('; '.join(doc['missing']))}{excused}", err=True)
    for w in doc["warnings"]:
        typer.echo(f"genoctx: doctor: warning: {_one_line(w)}", err=True)
    if not doc["ok"]:
        raise typer.Exit(1)


@app.command(cls=_Command)
@_user_errors
def plan(
    preset: Annotated[str | None, typer.Option(help="Preset name: tiny, cpu-small, glm-5.3-flash.")] = None,
    hf: Annotated[
        Path | None, typer.Option("--hf", help="The config.json of an HF glm5_next model directory (no weights).")
    ] = None,
    recipe: Annotated[
        Path | None,
        typer.Option(help="A recipe: its model (a preset, or model.init's config.json), batch, dtype and loss."),
    ] = None,
    seq_len: Annotated[
        str | None,
        typer.Option(
            "--seq-len", metavar="SIZE", help="Window length in tokens (k/M suffixes); default recipe's or 1M."
        ),
    ] = None,
    gpus: Annotated[
        int,
        typer.Option(
            "--gpus",
            "--num-workers",
            help="Number of GPUs (ranks): the layouts' world size; --num-workers as in train and eval.",
        ),
    ] = 1,
    gpu_memory_gib: Annotated[
        float | None, typer.Option(help="Memory of one GPU in GiB (default the --hardware profile's; B200: 178).")
    ] = None,
    hardware: Annotated[
        str,
        typer.Option(
            "--hardware",
            metavar="NAME|FILE",
            help="GPU profile for step time and tokens/s: h100, h200, b200, or a YAML file with the same keys "
            "(genoctx.plan.hardware).",
        ),
    ] = "b200",
    skew: Annotated[
        str,
        typer.Option(
            metavar="X|published",
            help="Expert routing skew, busiest / mean expert tokens of a rank (1 balanced; 'published' the ~4x the "
            "published run saw on real DNA).",
        ),
    ] = "1",
    rank_by: Annotated[
        str, typer.Option("--rank-by", help="Order of the layouts that fit: memory (most headroom) or throughput.")
    ] = "memory",
    dp_replicate: Annotated[int | None, typer.Option(help="Data-parallel replicas (default: the rest).")] = None,
    ep: Annotated[int | None, typer.Option(help="Expert-parallel ranks.")] = None,
    ep_folded: Annotated[
        bool,
        typer.Option(
            "--ep-folded/--no-ep-folded",
            help="The --ep group drawn from the --fsdp x --cp ranks (MoE folding) instead of an axis of its own, as "
            "train's.",
        ),
    ] = False,
    fsdp: Annotated[int | None, typer.Option("--fsdp", help="FSDP ranks (dp_shard; > 1 shards parameters).")] = None,
    cp: Annotated[int | None, typer.Option(help="Context-parallel ranks (pieces of one window).")] = None,
    no_recompute: Annotated[
        bool, typer.Option("--no-recompute", help="No activation checkpointing of the decoder layers.")
    ] = False,
    offload_optimizer: Annotated[
        bool, typer.Option("--offload-optimizer", help="Masters, gradients and AdamW state in host memory (FSDP2).")
    ] = False,
    optimizer_state_dtype: Annotated[
        str | None,
        typer.Option(help="AdamW moments in fp32 or bf16 (train.optimizer_state_dtype; default the recipe's or fp32)."),
    ] = None,
    offload_activations: Annotated[
        bool,
        typer.Option("--offload-activations", help="The checkpointed layers' inputs in host memory (train."
                     "offload_activations; needs recompute)."),  # fmt: skip
    ] = False,
    knobs: Annotated[
        str,
        typer.Option(help="none, or auto: each layout with the first memory knobs that make it fit (activation "
                     "offload, bf16 AdamW moments, both, optimizer offload; genoctx.plan.search.KNOB_COMBOS)."),
    ] = "none",  # fmt: skip
    host_memory_gib: Annotated[
        float | None,
        typer.Option(help="Host memory per GPU in GiB that offloaded state must fit in (default the --hardware "
                     "profile's, e.g. 238 on a DGX B200)."),  # fmt: skip
    ] = None,
    batch_size: Annotated[
        int | None, typer.Option(help="Windows per data-parallel rank per step (default the recipe's or 1).")
    ] = None,
    dtype: Annotated[str | None, typer.Option(help="bf16 or fp32 (default the recipe's train.dtype or bf16).")] = None,
    format_: Annotated[str, typer.Option("--format", help="table or json (on stdout).")] = "table",
    dry_run: Annotated[
        bool,
        typer.Option(
            "--dry-run",
            help="Also build the model on the layout (the given one, else the best the search picks) with a fake "
            "process group on the meta device and count rank 0's and the last rank's bytes (genoctx.train.dryrun).",
        ),
    ] = False,
    eval_: Annotated[
        bool,
        typer.Option(
            "--eval",
            help="Plan scoring one window (genoctx eval, one process or --num-workers): forward only, no gradients, "
            "no optimizer (genoctx.plan.plan_eval).",
        ),
    ] = False,
    chunk_tokens: Annotated[str | None, typer.Option("--chunk-tokens", hidden=True)] = None,
    cp_layout: Annotated[
        str, typer.Option("--cp-layout", help="With --eval: contiguous or zigzag CP pieces (genoctx eval's).")
    ] = "contiguous",
    seq_chunk: Annotated[
        str | None,
        typer.Option(
            "--seq-chunk",
            metavar="SIZE|auto",
            help="Each window as consecutive chunks of this many tokens (k/M suffixes; under CP each rank's chunk "
            "of its piece), as train's and eval's --seq-chunk. Training: train.seq_chunk_tokens; 'auto': per layout "
            "one pass if it fits, else the largest chunk that fits (default: the recipe's train.seq_chunk_tokens, "
            "else one pass). With --eval: eval's streaming chunk with the carried cache (default whole windows; "
            "old name --chunk-tokens).",
        ),
    ] = None,
    trainable: Annotated[
        str,
        typer.Option(help="What trains (train.trainable): all, or a comma list of lora and the groups kda, dsa, "
                     "indexer, router, experts, shared_experts, dense_mlp, mhc, norms, embed, head; the rest is frozen "
                     "(weights only, in --frozen-dtype)."),  # fmt: skip
    ] = "all",
    lora_rank: Annotated[
        int | None,
        typer.Option(help="LoRA rank (train.lora_rank) when --trainable names lora (default 16 then, else 0)."),
    ] = None,
    frozen_dtype: Annotated[
        str, typer.Option(help="Frozen weights in bf16 or fp8 (block-scaled e4m3, fp32 scales; train.frozen_dtype).")
    ] = "bf16",
    lora_targets: Annotated[
        str | None,
        typer.Option(help="Comma list of LoRA target modules / expert parameters by name suffix (train.lora_targets; "
                     "default what train adapts: the KDA and MLA projections, dense and shared MLPs, routed "
                     "experts)."),  # fmt: skip
    ] = None,
) -> None:
    """Predict GPU memory per rank of one training step, by component, and its step time, tokens/s, MFU and what
    bounds it, for a model x window x parallel layout x GPU (--hardware). With --eval: of scoring one window in
    evaluation instead (the peak of one forward, no gradients).

    With none of --dp-replicate/--ep/--fsdp/--cp every layout of --gpus ranks is planned and those that fit are
    listed, best first (the table shows the top 10; none fitting: those nearest to fitting on the GPU and the host,
    whatever --rank-by). When no training step fits in one pass but one in chunks would, the table and the JSON
    (`hint`) name the --seq-chunk that fits; when --knobs auto would find layouts, `knobs_hint` says so. See
    genoctx/plan/ (memory.py) for every formula and assumption, and `bench/plan_vs_measured.py` for measured errors.

    Examples:
      genoctx plan --preset glm-5.3-flash --seq-len 1M --gpus 64 --gpu-memory-gib 178
      genoctx plan --preset glm-5.3-flash --seq-len 128k --gpus 64 --ep 2 --fsdp 2 --cp 16 --format json
      genoctx plan --recipe recipes/cpu-small.yaml --seq-len 16k --gpus 4 --gpu-memory-gib 8
      genoctx plan --dry-run --preset glm-5.3-flash --seq-len 1M --gpus 64 --cp 64
      genoctx plan --eval --preset glm-5.3-flash --seq-len 512k --gpus 64 --gpu-memory-gib 178
      genoctx plan --eval --seq-chunk 4k --preset glm-5.3-flash --seq-len 1M --gpus 64 --format json
      genoctx plan --preset glm-5.3-flash --seq-len 1M --gpus 64 --seq-chunk auto
      genoctx plan --preset glm-5.3-flash --seq-len 256k --gpus 64 --rank-by throughput --skew published
      genoctx plan --preset glm-5.3-flash --seq-len 1M --gpus 64 --hardware h200 --gpu-memory-gib 139
      genoctx plan --preset glm-5.3-flash --seq-len 1M --gpus 32 --gpu-memory-gib 178 --knobs auto
      genoctx plan --preset glm-5.3-flash --seq-len 512k --gpus 8 --hardware h100 --trainable lora
        --frozen-dtype fp8 --knobs auto
    """
    from .plan import (
        best_seq_chunk,
        describe_layout,
        format_table,
        plan_eval,
        plan_memory,
        search_layouts,
        seq_chunk_hint,
    )
    from .plan.report import short_of, skew_note
    from .plan.search import AUTO_SEQ_CHUNKS, plan_with_knobs
    from .plan.time import add_time, rank_by_throughput

    _setup_logging(False)
    if format_ not in ("table", "json"):
        raise GenoctxError(f"--format must be table or json, got {format_!r}")
    if rank_by not in ("memory", "throughput"):
        raise GenoctxError(f"--rank-by must be memory or throughput, got {rank_by!r}")
    hw, skew_x = _hardware_and_skew(hardware, skew)
    gpu_memory_gib = hw.memory_gib if gpu_memory_gib is None else gpu_memory_gib
    if sum(x is not None for x in (preset, recipe, hf)) != 1:
        raise GenoctxError("give one of --preset NAME, --hf DIR and --recipe FILE")
    for flag, value in (("--gpus", gpus), ("--dp-replicate", dp_replicate), ("--ep", ep), ("--fsdp", fsdp),
                        ("--cp", cp), ("--batch-size", batch_size)):  # fmt: skip
        _at_least(flag, value, 1)
    if not 0 < gpu_memory_gib < float("inf"):
        raise GenoctxError(f"--gpu-memory-gib: must be a positive number of GiB, got {gpu_memory_gib}")
    if dtype is not None and dtype not in ("bf16", "fp32"):
        raise GenoctxError(f"--dtype must be bf16 or fp32, got {dtype!r}")
    cfg, rec = _plan_model(preset, hf, recipe)
    default_len = rec.train.seq_len if rec is not None and rec.train.seq_len else 1 << 20
    L = _size("--seq-len", seq_len) if seq_len is not None else default_len
    if L < cfg.kda_chunk_size:
        raise GenoctxError(f"--seq-len: {L} tokens is shorter than one KDA chunk ({cfg.kda_chunk_size} tokens)")
    chunk_flag = "--chunk-tokens"
    if eval_ and seq_chunk is not None:  # eval's chunk: --seq-chunk, or its old name --chunk-tokens
        if seq_chunk == "auto":
            raise GenoctxError("--seq-chunk auto chooses a training chunk; with --eval give a size (e.g. 16k)")
        (chunk_tokens, chunk_flag), seq_chunk = _alias("--seq-chunk", seq_chunk, "--chunk-tokens", chunk_tokens), None
    kwargs = _plan_kwargs(rec, eval_, gpu_memory_gib, no_recompute, offload_optimizer, batch_size, dtype, dry_run,
                          chunk_tokens, cp_layout, chunk_flag)  # fmt: skip
    if knobs not in ("none", "auto"):
        raise GenoctxError(f"--knobs must be none or auto, got {knobs!r}")
    kwargs.update(_knob_kwargs(rec, eval_, hw, optimizer_state_dtype, offload_activations, host_memory_gib, knobs,
                               no_recompute, seq_chunk))  # fmt: skip
    kwargs.update(_trainable_kwargs(eval_, dry_run, trainable, lora_rank, frozen_dtype, lora_targets))
    if not eval_:
        if seq_chunk is None:
            chunk = rec.train.seq_chunk_tokens if rec is not None else None
        else:
            chunk = "auto" if seq_chunk == "auto" else _size("--seq-chunk", seq_chunk)
        if chunk is not None:
            kwargs["seq_chunk_tokens"] = chunk
    doc: dict = {"seq_len": L, "gpus": gpus, "gpu_memory_gib": gpu_memory_gib, **({"mode": "eval"} if eval_ else {}),
                 "hardware": hw.name, "skew": skew_x, "rank_by": rank_by}  # fmt: skip
    if ep_folded and ep is None:
        raise GenoctxError("--ep-folded needs --ep (the expert-parallel size to fold into --fsdp x --cp)")
    auto, layout = kwargs.get("seq_chunk_tokens") == "auto", None
    if any(x is not None for x in (dp_replicate, ep, fsdp, cp)):
        layout = _plan_layout(cfg, L, gpus, dp_replicate, ep, fsdp, cp, offload_optimizer, eval_, ep_folded)
        try:
            if auto:
                kwargs.pop("seq_chunk_tokens")
                plans = [best_seq_chunk(cfg, L, layout, **kwargs)]
            elif knobs == "auto":
                plans = [plan_with_knobs(cfg, L, layout, seq_chunks=AUTO_SEQ_CHUNKS, **kwargs)]
            else:
                plans = [(plan_eval if eval_ else plan_memory)(cfg, L, layout, **kwargs)]
        except ValueError as e:
            raise GenoctxError(f"--ep/--fsdp/--cp: {e}") from None
        doc["layouts"] = add_time(plans, cfg, hw, skew=skew_x)
        shown = plans
    else:
        plans = search_layouts(cfg, L, gpus, mode="eval" if eval_ else "train",
                               **({"knobs": knobs} if not eval_ else {}), **kwargs)  # fmt: skip
        if not plans:
            piece = "CP pieces of >= linear_conv_kernel_dim - 1" if eval_ else f"pieces of >= {cfg.kda_chunk_size}"
            raise GenoctxError(
                f"--gpus {gpus}: no layout of this model can run a {L}-token window on {gpus} ranks (cp must divide "
                f"--seq-len and leave {piece} tokens, ep must divide {cfg.n_routed_experts} experts)"
            )
        add_time(plans, cfg, hw, skew=skew_x)
        if rank_by == "throughput":
            plans = rank_by_throughput(plans)
        fitting = [p for p in plans if p["fits"]]
        doc.update(searched=len(plans), layouts=fitting)
        if not fitting:  # plans: nearest to fitting first (GPU and host), whatever --rank-by
            doc["closest"] = plans[:10]
            logging.getLogger("genoctx.plan").warning(
                "%s; the closest, %s, is %s", _nothing_fits(gpus, gpu_memory_gib, kwargs, plans), _knobbed(plans[0]),
                short_of(plans[0]).removeprefix("#1 does not fit: ").replace("#1 ", ""))  # fmt: skip
        shown = fitting or plans
    if (note := skew_note(skew_x, shown[:10])) is not None:
        doc["skew_note"] = note
        logging.getLogger("genoctx.plan").warning("%s", note)
    if not eval_ and knobs == "none" and "seq_chunk_tokens" not in kwargs and not any(p["fits"] for p in plans):
        if (khint := _knobs_hint(cfg, L, gpus, layout, kwargs)) is not None:  # would --knobs auto find layouts?
            doc["knobs_hint"] = khint
    if not eval_ and not auto and not any(p["fits"] for p in plans):  # does chunking fit? (--seq-chunk auto's pick)
        try:
            hint = seq_chunk_hint(cfg, L, gpus, layout=layout, **kwargs)
        except ValueError as e:
            raise GenoctxError(f"--ep/--fsdp/--cp: {e}") from None
        if hint is not None:
            lay = hint["layout"]
            sizes = (("--ep", "ep"), ("--fsdp", "dp_shard"), ("--cp", "cp"))
            flags = " ".join([hint["flag"], *(f"{f} {lay[d]}" for f, d in sizes if lay[d] > 1),
                              *(["--ep-folded"] if lay["ep_folded"] else [])])  # fmt: skip
            hint["message"] = (f"no training step fits in {gpu_memory_gib:g} GiB as planned, but one in chunks does: "
                               f"{flags if layout is None else hint['flag']} ({describe_layout(hint)}, "
                               f"{hint['total_gib']:.2f} GiB per GPU); --seq-chunk auto plans every layout "
                               "chunked")  # fmt: skip
            doc["hint"] = hint
            logging.getLogger("genoctx.plan").warning("%s", hint["message"])
    if dry_run:
        from .parallel.layout import Layout
        from .train.dryrun import dry_run as run_dry

        lay = Layout(**{d: shown[0]["layout"][d] for d in ("dp_replicate", "ep", "dp_shard", "cp", "ep_folded")},
                     fsdp_one=shown[0]["layout"].get("fsdp_one", False))  # fmt: skip
        doc = {"dry_run": run_dry(cfg, lay, activation_checkpointing=not (no_recompute or eval_), dtype=kwargs["dtype"],
                                  optimizer_offload=shown[0].get("optimizer_offload", offload_optimizer),
                                  optimizer_state_dtype=shown[0].get("optimizer_state_dtype", "fp32"),
                                  **{k: kwargs[k] for k in ("trainable", "lora_rank", "frozen_dtype", "lora_targets")
                                     if k in kwargs}),
               **doc}  # fmt: skip (the plan's knobs: --knobs auto may have turned optimizer offload or bf16 moments on)
    if format_ == "json":
        _emit_json(doc)
        return
    if doc.get("layouts") == [] and "closest" in doc:
        sys.stdout.write(f"{_nothing_fits(gpus, gpu_memory_gib, kwargs, plans)}; nearest to fitting first:\n")
    sys.stdout.write(format_table(shown) + "\n")
    if "knobs_hint" in doc:
        sys.stdout.write("\nhint: " + doc["knobs_hint"]["message"] + "\n")
    if "hint" in doc:
        sys.stdout.write("\nhint: " + doc["hint"]["message"] + "\n")
    if dry_run:
        sys.stdout.write("\n" + _format_dry_run(doc["dry_run"], shown[0], eval_) + "\n")
    sys.stdout.flush()


def _knobs_hint(cfg, seq_len: int, gpus: int, layout, kwargs: dict) -> dict | None:
    """``genoctx.plan.search.knobs_hint`` with its ``"message"`` (logged as a warning), or None when ``--knobs auto``
    finds nothing that fits either.

    Raises:
        GenoctxError: the layout flags are refused (``--ep/--fsdp/--cp``).
    """
    from .plan.search import knobs_hint

    try:
        hint = knobs_hint(cfg, seq_len, gpus, layout=layout, **kwargs)
    except ValueError as e:
        raise GenoctxError(f"--ep/--fsdp/--cp: {e}") from None
    if hint is None:
        return None
    k = hint["fitting"]
    found = f"finds {k} layout{'s' if k > 1 else ''} that fit{'s' if k == 1 else ''}; first" if layout is None else (
        "fits it:")  # fmt: skip
    hint["message"] = (f"nothing fits without more memory knobs, but --knobs auto {found} {_knobbed(hint)}, "
                       f"{hint['total_gib']:.2f} GiB per GPU (host {hint['host_gib']:.1f} GiB per GPU)")  # fmt: skip
    logging.getLogger("genoctx.plan").warning("%s", hint["message"])
    return hint


def _nothing_fits(gpus: int, gpu_memory_gib: float, kwargs: dict, plans: list[dict]) -> str:
    """``"no layout of 8 GPUs fits in 178 GiB (and 238 GiB of host per GPU)"``: what `genoctx plan` searched (the
    host when one of ``plans`` offloads state to it)."""
    host = kwargs.get("host_memory_gib") if any(p.get("host_gib") for p in plans) else None
    return f"no layout of {gpus} GPUs fits in {gpu_memory_gib:g} GiB" + (
        f" (and {host:g} GiB of host per GPU)" if host else "")  # fmt: skip


def _knobbed(p: dict) -> str:
    """A plan's (or hint's) layout in words, with its memory knobs and chunk when it has them."""
    from .plan.report import KNOB_SHORT, describe_layout

    knobs = ",".join(KNOB_SHORT.get(k, k) for k in p.get("knobs") or [])
    chunk = p.get("seq_chunk_tokens")
    return describe_layout(p) + (f" with {knobs}" if knobs else "") + (
        f" in {chunk >> 10 if chunk % 1024 == 0 else chunk}{'k' if chunk % 1024 == 0 else ''}-token chunks"
        if chunk else "")  # fmt: skip


def _trainable_kwargs(eval_, dry_run, trainable, lora_rank, frozen_dtype, lora_targets) -> dict:
    """``plan_memory``'s ``trainable``, ``lora_rank``, ``frozen_dtype``, ``lora_targets`` from ``genoctx plan``'s flags
    (empty when every parameter trains: the plan as before).

    Raises:
        GenoctxError: the flags with --eval, a bad group list, rank or dtype
            (``genoctx.plan.trainable.check_trainable``).
    """
    from .plan.trainable import check_trainable

    given = trainable != "all" or lora_rank or frozen_dtype != "bf16" or lora_targets is not None
    if not given:
        return {}
    if eval_:
        raise GenoctxError("--trainable, --lora-rank, --frozen-dtype and --lora-targets are about a training step; "
                           "--eval plans scoring one window")  # fmt: skip
    rank = lora_rank if lora_rank is not None else (16 if "lora" in trainable.replace(" ", "").split(",") else 0)
    targets = tuple(t.strip() for t in lora_targets.split(",") if t.strip()) if lora_targets is not None else None
    try:
        tr = check_trainable(trainable, rank, frozen_dtype, targets)
    except ValueError as e:
        raise GenoctxError(f"--trainable/--lora-rank/--frozen-dtype/--lora-targets: {e}") from None
    return dict(trainable=tr.spec, lora_rank=tr.lora_rank, frozen_dtype=tr.frozen_dtype, lora_targets=tr.lora_targets)


def _knob_kwargs(rec, eval_, hw, optimizer_state_dtype, offload_activations, host_memory_gib, knobs, no_recompute,
                 seq_chunk) -> dict:  # fmt: skip
    """``plan_memory``'s memory-knob arguments from ``genoctx plan``'s flags, the recipe and the hardware profile.

    Raises:
        GenoctxError: a knob flag with --eval, a bad --optimizer-state-dtype or --host-memory-gib, activation offload
            with --no-recompute, --knobs auto with --seq-chunk.
    """
    given = optimizer_state_dtype is not None or offload_activations or knobs != "none"
    if eval_:
        if given:
            raise GenoctxError("--optimizer-state-dtype, --offload-activations and --knobs are about a training step; "
                               "--eval plans scoring one window")  # fmt: skip
        return {}
    t = rec.train if rec is not None else None
    osd = optimizer_state_dtype or (t.optimizer_state_dtype if t is not None else "fp32")
    if osd not in ("fp32", "bf16"):
        raise GenoctxError(f"--optimizer-state-dtype must be fp32 or bf16, got {osd!r}")
    off = offload_activations or (t is not None and t.offload_activations)
    if off and no_recompute:
        raise GenoctxError("--offload-activations offloads the checkpointed layers' inputs: not with --no-recompute")
    if knobs == "auto" and seq_chunk is not None:
        raise GenoctxError("--knobs auto plans one pass per layout: not with --seq-chunk")
    host = hw.host_memory_gib if host_memory_gib is None else host_memory_gib
    if host is not None and not 0 < host < float("inf"):
        raise GenoctxError(f"--host-memory-gib: must be a positive number of GiB, got {host}")
    return dict(optimizer_state_dtype=osd, offload_activations=off, host_memory_gib=host)


def _hardware_and_skew(hardware: str, skew: str):
    """``genoctx plan``'s ``--hardware`` profile and ``--skew`` (a number >= 1, or ``published``).

    Raises:
        GenoctxError: an unknown profile or a bad file (``genoctx.plan.hardware.load_hardware``), a bad skew.
    """
    from .plan.flops import PUBLISHED_SKEW
    from .plan.hardware import load_hardware

    hw = load_hardware(hardware)
    if skew == "published":
        return hw, PUBLISHED_SKEW
    try:
        x = float(skew)
    except ValueError:
        x = float("nan")
    if not 1 <= x < float("inf"):
        raise GenoctxError(f"--skew: a number >= 1 (busiest / mean expert tokens) or 'published', got {skew!r}")
    return hw, x


def _plan_kwargs(rec, eval_, gpu_memory_gib, no_recompute, offload, batch_size, dtype, dry_run, chunk_tokens,
                 cp_layout, chunk_flag="--seq-chunk") -> dict:  # fmt: skip
    """The keyword arguments of ``plan_memory`` (``plan_eval`` with --eval) from ``genoctx plan``'s flags and recipe.
    ``chunk_tokens``: eval's chunk, given as ``chunk_flag`` (--seq-chunk with --eval, or the old --chunk-tokens).

    Raises:
        GenoctxError: a training flag with --eval, an eval flag without it, a bad --chunk-tokens or --cp-layout.
    """
    head = dict(loss_vocab_rows=5 if rec is not None and rec.loss.vocab == "nucleotide" else None,
                loss_chunk_tokens=rec.loss.chunk_tokens if rec is not None else 2048)  # fmt: skip
    if not eval_:
        if chunk_tokens is not None or cp_layout != "contiguous":
            raise GenoctxError(f"{'--chunk-tokens' if chunk_tokens is not None else '--cp-layout'} plans evaluation: "
                               "add --eval")  # fmt: skip
        return dict(gpu_memory_gib=gpu_memory_gib, recompute=not no_recompute, optimizer_offload=offload,
                    batch_size=batch_size or (rec.train.batch_size if rec is not None else 1),
                    dtype=dtype or (rec.train.dtype if rec is not None else "bf16"), **head)  # fmt: skip
    for flag, on in (("--no-recompute", no_recompute), ("--offload-optimizer", offload),
                     ("--batch-size", batch_size is not None)):  # fmt: skip
        if on:
            raise GenoctxError(f"{flag} is about a training step; --eval plans scoring one window (no gradients, no "
                               "optimizer)")  # fmt: skip
    if cp_layout not in ("contiguous", "zigzag"):
        raise GenoctxError(f"--cp-layout must be contiguous or zigzag, got {cp_layout!r}")
    chunk = _size(chunk_flag, chunk_tokens) if chunk_tokens is not None else None
    # eval runs bf16 under autocast on the GPU whatever the recipe trained in: --dtype only
    return dict(gpu_memory_gib=gpu_memory_gib, chunk_tokens=chunk, dtype=dtype or "bf16", cp_layout=cp_layout,
                **head)  # fmt: skip


def _format_dry_run(dr: dict, plan: dict, eval_: bool = False) -> str:
    """A few human lines of ``genoctx plan --dry-run``: per simulated rank its counted GiB next to the plan's (with
    --eval only what evaluation holds: the weights and the all-gathers; no gradients, no optimizer state)."""
    from .parallel.layout import Layout

    gib = 2**30
    lay = Layout(**{k: v for k, v in dr["layout"].items() if k != "world"}).describe()
    lines = [f"dry run ({lay}, {dr['dtype']}, built on the meta device in {dr['seconds']:.1f} s), GiB per rank "
             "counted from the built model (plan in brackets):"]  # fmt: skip
    per = plan["persistent_gib"]
    for r in dr["ranks"]:
        g = r["largest_unsharded_group"]
        train = "" if eval_ else (f"gradients {r['gradients'] / gib:.3f} [{per['gradients']:.3f}]  optimizer "
                                  f"{r['optimizer_state'] / gib:.3f} [{per['optimizer_state']:.3f}]  ")  # fmt: skip
        if "frozen" in r:  # train.trainable: the frozen weights (in weights) and what trains, each
            train = (f"frozen {r['frozen'] / gib:.3f} [{per.get('frozen', 0.0):.3f}]  trainable params "
                     f"{r['trainable_params_local']:.4g}  " + train)  # fmt: skip
        lines.append(
            f"  rank {r['rank']:>3}: params {r['params_local']:.4g}  weights {r['weights'] / gib:.3f} "
            f"[{per['weights']:.3f}]  {train}buffers "
            f"{r['buffers'] / gib:.4f}  largest all-gather {g['bytes'] / gib:.3f} ({g['module']}; layer "
            f"{r['largest_unsharded_layer']['bytes'] / gib:.3f} [{plan['largest_layer_unsharded_gib']:.3f}])"
        )
    if plan.get("optimizer_offload") and not eval_:
        lines.append("  (weights, gradients and optimizer state above live in host memory: FSDP2's CPUOffloadPolicy)")
    return "\n".join(lines)


def _plan_model(preset, hf, recipe):
    """``(ModelConfig, Recipe or None)`` of ``genoctx plan``'s --preset / --hf / --recipe (one of them)."""
    from .model.config import preset as get_preset

    if preset is not None:
        try:
            return get_preset(preset), None
        except KeyError as e:
            raise GenoctxError(f"--preset: {e.args[0]}") from None
    from .model.hf import read_config

    if hf is not None:
        try:
            return read_config(hf)[0], None
        except GenoctxError as e:
            raise GenoctxError(f"--hf {e}") from None
    from .recipes import load_recipe

    rec = load_recipe(recipe)
    return _recipe_model(rec, f"--recipe {recipe}"), rec


def _recipe_model(rec, where: str):
    """The ``ModelConfig`` a recipe trains, without loading weights: its model, or ``model.init``'s config (an HF
    directory, a genoctx run or checkpoint, or a Hub repo's config.json already in the local cache) with the
    recipe's compute knobs. ``where`` names the recipe in errors.

    Raises:
        GenoctxError: a Hub repo whose config.json is not cached (a branch, tag, full or short commit of the cache:
            ``genoctx.train.init.expand_revision``), an ambiguous short commit, or an unreadable config (named).
    """
    import dataclasses

    from .model.hf import read_config

    if rec.init is None:
        return rec.model
    init = Path(rec.init).expanduser()
    if (init / "config.json").is_file():
        cfg = read_config(init)[0]
    elif init.is_dir():  # a genoctx run or checkpoint
        from .train.checkpoint import load_recipe_of, resolve_checkpoint

        cfg = load_recipe_of(resolve_checkpoint(init)).model
    else:  # a Hub repo id: its config.json from the local cache only (nothing is downloaded)
        from .train.init import expand_revision

        repo, _, revision = rec.init.partition("@")
        revision = expand_revision(repo, revision or None, f"{where}: model.init {rec.init!r}")  # a short commit
        try:
            from huggingface_hub import try_to_load_from_cache

            cached = try_to_load_from_cache(repo, "config.json", revision=revision)
        except Exception:  # noqa: BLE001 -- an invalid repo id or no huggingface_hub: not in the cache
            cached = None
        if not isinstance(cached, str):
            raise GenoctxError(
                f"{where}: model.init {rec.init!r} is a Hub repo whose config.json is not in the local "
                "cache; give --hf DIR (a directory with its config.json) or --preset glm-5.3-flash (the published one)"
            )
        cfg = read_config(Path(cached).parent)[0]
    return dataclasses.replace(cfg, **rec.model_knobs)


def _plan_layout(cfg, seq_len, gpus, dp_replicate, ep, fsdp, cp, offload, eval_=False, ep_folded=False):
    """The ``Layout`` of ``genoctx plan``'s layout flags (unset ones 1; --dp-replicate unset: the rest of --gpus).
    With ``eval_`` a CP piece may be shorter than a KDA chunk (``plan_eval`` checks the pieces of its CP layout).
    ``ep_folded``: the EP group drawn from ``fsdp x cp`` (``Layout.ep_folded``).

    Raises:
        GenoctxError: the sizes do not make --gpus ranks, or the model cannot run them (the flag is named).
    """
    from .parallel.layout import Layout

    ep, fsdp, cp = ep or 1, fsdp or 1, cp or 1
    try:
        layout = Layout.for_world(gpus, ep=ep, dp_shard=fsdp, cp=cp, ep_folded=ep_folded, world_flag="--gpus")
    except ValueError as e:
        raise GenoctxError(str(e)) from None
    if dp_replicate is not None and dp_replicate != layout.dp_replicate:
        raise GenoctxError(
            f"--dp-replicate {dp_replicate} x --ep {layout.ep_axis} x --fsdp {fsdp} x --cp {cp} = "
            f"{dp_replicate * layout.world // layout.dp_replicate} ranks, not --gpus {gpus}"
        )
    moe = "sparse" in cfg.mlp_layer_types
    if (moe and cfg.n_routed_experts % ep) or (not moe and ep > 1):
        raise GenoctxError(f"--ep {ep}: must divide the {cfg.n_routed_experts if moe else 0} routed experts")
    if seq_len % cp:
        raise GenoctxError(f"--cp {cp}: must divide --seq-len {seq_len}")
    if seq_len // cp < cfg.kda_chunk_size and not eval_:
        raise GenoctxError(
            f"--cp {cp}: pieces of {seq_len // cp} tokens are shorter than one KDA chunk ({cfg.kda_chunk_size})"
        )
    if offload and not layout.fsdp:
        raise GenoctxError("--offload-optimizer needs FSDP, --fsdp > 1 or --cp > 1 (it is FSDP2's CPUOffloadPolicy)")
    return layout


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
    from .model.config import DSA, KDA
    from .model.config import preset as get_preset
    from .plan.flops import flops_per_token

    if sum(x is not None for x in (preset, recipe, hf)) > 1:
        raise GenoctxError("give one of --preset, --recipe and --hf")
    if hf is not None:
        from .model.hf import read_config

        cfg, _ = read_config(hf)
        source = {"preset": None, "recipe": None, "hf": str(hf)}
    elif recipe is not None:
        from .recipes import load_recipe

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

    from .model.model import HybridLM

    with torch.device("meta"):
        return HybridLM(cfg).num_parameters()


def main() -> None:  # pragma: no cover
    app()


if __name__ == "__main__":  # pragma: no cover
    main()

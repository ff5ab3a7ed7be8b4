"""What every verb of the ``genoctx`` command line shares: the Typer ``app`` (and ``model`` group), the help
formatter, logging setup, the user-error wrapper, JSON output, and the checks of paths, sizes and devices."""

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

from ..errors import GenoctxError

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
            from .. import __version__ as v
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
    from .. import progress

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
    from ..data.windows import parse_size

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


def _gpus_per_worker(value: float) -> None:
    """``--gpus-per-worker``: 0 or 1 (``genoctx.cluster.check_gpus_per_worker``), refused before anything starts."""
    from ..cluster import check_gpus_per_worker

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
    if dev.type == "cpu":  # the run's activations live in this process's heap: keep it (genoctx.heap)
        from ..heap import keep_freed_memory

        keep_freed_memory()
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

    from ..cluster import ALLOC_CONF

    given = os.environ.get("PYTORCH_ALLOC_CONF") or os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or ""
    if "expandable_segments" not in given:
        torch._C._accelerator_setAllocatorSettings(ALLOC_CONF)


def _set_cuda_device(index: int) -> None:
    """``torch.cuda.set_device(index)``: the current CUDA device of this process."""
    import torch

    torch.cuda.set_device(index)

"""Help that fits a terminal, and help and messages that are literal text.

Every verb's and sub-verb's ``--help`` at 80 columns in a pipe keeps every option name whole and every help text
whole (wrapped, not truncated) in lines of at most 80 characters. Every bracketed piece of a verb's docstring or an
option's help (``org/name[@revision]``, ``[--set train.cp_layout=zigzag]``) comes out as written (typer's rich help
read them as markup); user strings (paths, FASTA record names) printed through rich (log lines on a terminal, the
download bar) too. In-process through typer's CliRunner."""

import io
import logging
import re

import pytest
import typer
from typer.main import get_command_name
from typer.testing import CliRunner
from typer.utils import get_params_from_function

from genoctx.cli import app

BRACKETED = re.compile(r"\[[^\[\]]*\]")
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
BOX = re.compile(r"[\u2500-\u257f]")  # the panels' box-drawing characters


def _flat(text: str) -> str:
    """``text`` without ANSI codes and box lines, its whitespace (line breaks of wrapping included) one space."""
    return " ".join(BOX.sub(" ", ANSI.sub("", text)).split())


def _help_sources(t: typer.Typer, path: tuple[str, ...] = (), help_: str | None = None):
    """``(command path, [source help texts])`` of ``t`` and, recursively, of every command and group registered on
    it: the group's help, each command's docstring (or ``help=``) and each of its options' and arguments' help."""
    yield path, [help_ or t.info.help or ""]
    for c in t.registered_commands:
        texts = [c.help or c.callback.__doc__ or ""]
        texts += [getattr(p.default, "help", None) or "" for p in get_params_from_function(c.callback).values()]
        yield (*path, c.name or get_command_name(c.callback.__name__)), texts
    for g in t.registered_groups:
        yield from _help_sources(g.typer_instance, (*path, g.name), g.help if isinstance(g.help, str) else None)


def _sources() -> list[tuple[tuple[str, ...], list[str]]]:
    return list(_help_sources(app))


def _click_commands(cmd=None, path=()):
    """``(path, click command)`` of the built app and, recursively, of every verb and sub-verb."""
    cmd = typer.main.get_command(app) if cmd is None else cmd
    yield path, cmd
    for name, sub in getattr(cmd, "commands", {}).items():
        yield from _click_commands(sub, (*path, name))


COMMANDS = dict(_click_commands())


@pytest.mark.parametrize("path", list(COMMANDS), ids=lambda p: " ".join(p) or "genoctx")
def test_help_fits_80_columns_with_every_name_and_text_whole(path):
    """``COLUMNS=80``, stdout not a terminal (a pipe): no line over 80 characters; every option name the click
    command declares (its flags, their ``--no-`` forms, short flags; hidden old names excepted) appears whole, not
    followed or preceded by more of a name; every option's help and the verb's own text appear whole once the
    wrapping's whitespace is folded; a group lists each of its verbs."""
    cmd = COMMANDS[path]
    res = CliRunner().invoke(app, [*path, "--help"], env={"COLUMNS": "80"})
    assert res.exit_code == 0, res.output
    out = res.stdout
    too_long = [ln for ln in out.splitlines() if len(ln) > 80]
    assert not too_long, too_long
    assert "\u2026" not in out and not BOX.search(out) and not ANSI.search(out)  # no ellipsis, panel or colour
    names = [n for p in cmd.params if not getattr(p, "hidden", False) for n in (*p.opts, *p.secondary_opts)]
    names = [n for n in names if n.startswith("-")] + ["--help"]
    assert len(names) == len(set(names))
    missing = [n for n in names if not re.search(rf"(?<![\w-]){re.escape(n)}(?![\w-])", out)]
    assert not missing, f"genoctx {' '.join(path)} --help cut or lost {missing}"
    flat = _flat(out)
    for p in cmd.params:
        if getattr(p, "help", None) and not getattr(p, "hidden", False):
            assert _flat(p.help) in flat, p.name
    assert _flat(cmd.help or "") in flat
    for name in getattr(cmd, "commands", {}):
        assert re.search(rf"^  {name} ", out, re.M), name


def test_the_80_column_walk_sees_every_verb_and_long_names():
    """The walk above is not vacuous: it covers the sub-verb and the names that rich's panels cut at 80 columns."""
    assert {("model", "info"), ("train",), ("eval",), ("plan",), ("prepare",)} <= set(COMMANDS)
    prepare = [n for p in COMMANDS[("prepare",)].params for n in (*p.opts, *p.secondary_opts)]
    assert {"--keep-partial", "--pad-last", "--drop-partial", "--drop-last"} <= set(prepare)
    assert "--no-ep-folded" in [n for p in COMMANDS[("eval",)].params for n in p.secondary_opts]


def test_version():
    from importlib.metadata import version

    res = CliRunner().invoke(app, ["--version"])
    assert res.exit_code == 0 and res.stdout == f"genoctx {version('genoctx')}\n", res.output
    assert version("genoctx") == __import__("genoctx").__version__


def test_every_verb_is_found():
    """The walk over the registered commands sees every verb and sub-verb the built click app has."""

    def click_paths(cmd, path=()):
        yield path
        for name, sub in getattr(cmd, "commands", {}).items():
            yield from click_paths(sub, (*path, name))

    built = set(click_paths(typer.main.get_command(app)))
    assert {p for p, _ in _sources()} == built
    assert {("train",), ("prepare",), ("eval",), ("model",), ("model", "info")} <= built


@pytest.mark.parametrize("path", [p for p, _ in _sources()], ids=lambda p: " ".join(p) or "genoctx")
def test_help_keeps_every_bracketed_text(path):
    texts = dict(_sources())[path]
    res = CliRunner().invoke(app, [*path, "--help"], env={"COLUMNS": "300"})
    assert res.exit_code == 0, res.output
    out = _flat(res.stdout)
    wanted = {_flat(b) for t in texts for b in BRACKETED.findall(t)}
    missing = sorted(b for b in wanted if b not in out)
    assert not missing, f"genoctx {' '.join(path)} --help lost {missing}"
    assert "\\[" not in out  # the escaping never shows


def test_the_bracketed_texts_of_issue_24_are_checked():
    """The test above is not vacuous: the two pieces rich swallowed are among the checked ones."""
    texts = [b for _, ts in _sources() for t in ts for b in BRACKETED.findall(t)]
    assert "[@revision]" in texts and "[--set train.cp_layout=zigzag]" in texts
    res = CliRunner().invoke(app, ["train", "--help"], env={"COLUMNS": "300"})
    assert "org/name[@revision]" in _flat(res.stdout)


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture
def terminal_log(monkeypatch):
    """A function that sets genoctx's log up as on a terminal (RichHandler) writing into a returned buffer (called
    in the test itself: pytest swaps sys.stderr between phases); the root logger is restored after."""
    from genoctx.cli import _setup_logging

    root = logging.getLogger()
    saved = root.handlers[:], root.level

    def setup() -> io.StringIO:
        buf = _Terminal()
        monkeypatch.setattr("sys.stderr", buf)
        monkeypatch.setenv("COLUMNS", "400")
        _setup_logging(False)
        assert type(root.handlers[0]).__name__ == "RichHandler"
        return buf

    yield setup
    root.handlers[:] = saved[0]
    root.setLevel(saved[1])


def test_log_lines_print_fasta_names_and_paths_literally(terminal_log, tmp_path):
    """``genoctx prepare``'s log lines name the record and the output path: both as written, brackets and all."""
    from genoctx.data.windows import prepare

    name = "chrZ[bold]x[/bold][@rev]"
    fasta = tmp_path / "[red]input.fa"
    fasta.write_text(f">{name} a [i]comment[/i]\n" + "ACGT" * 64 + "\n")
    out = tmp_path / "out[1]" / "[bold]prepared[/bold]"
    buf = terminal_log()
    prepare([fasta], out, window=64, train_chroms=[name], eval_chroms=[], progress=True)
    text = _flat(buf.getvalue())
    assert f"{name}: wrote {out / 'shards'}" in text
    assert f"{name} -> train: 256 bases, 4 of 4 windows kept" in text
    assert f"{out / 'manifest.json'}: 4 train and 0 eval windows" in text


def test_download_bar_prints_the_file_name_literally():
    from genoctx.data.download import progress_bar

    bar = progress_bar()
    bar.add_task("chr[bold]1[/bold].fa.gz", total=10)
    text = bar.columns[0].render(bar.tasks[0])
    assert text.plain == "chr[bold]1[/bold].fa.gz"

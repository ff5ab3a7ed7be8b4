"""Help and messages are literal text: typer's rich help reads help strings as rich markup, so every bracketed piece
of a verb's docstring or an option's help (``org/name[@revision]``, ``[--set train.cp_layout=zigzag]``) must come out
as written; user strings (paths, FASTA record names) printed through rich (log lines on a terminal, the download
bar) too. In-process through typer's CliRunner, with a wide terminal so that rich wraps little."""

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

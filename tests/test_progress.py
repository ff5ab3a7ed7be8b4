"""Progress bars: on a terminal, train's steps and eval's windows with tokens/s, log lines above them; in a pipe, no
bar and no escape code, the log lines as plain as before."""

import io
import logging
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from rich.console import Console
from rich.logging import RichHandler

from genoctx import progress
from genoctx.eval.position import evaluate
from genoctx.recipes import load_recipe
from genoctx.train.loop import train

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "recipes" / "tiny.yaml"
BAR_CHARS = re.compile("[\u2500-\u259f]")  # box drawing and block elements: rich's bar
LOG_LINE = re.compile(r"^\d\d:\d\d:\d\d (DEBUG|INFO|WARNING) genoctx[.\w]*: ")


def plain(terminal_output: str) -> str:
    """What a terminal showed, one line per redraw: escape codes removed, carriage returns as line breaks."""
    return re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", terminal_output).replace("\r", "\n")


@pytest.fixture
def terminal():
    """A forced terminal console for the bars and genoctx's log (a RichHandler on it), as the CLI sets them up on a
    tty; yields the text it showed, escape codes removed."""
    buf = io.StringIO()
    console = Console(file=buf, force_terminal=True, width=150, color_system=None)
    handler = RichHandler(console=console, show_path=False, markup=False, show_time=False)
    glog = logging.getLogger("genoctx")
    glog.addHandler(handler)
    progress.use_console(console)
    try:
        yield lambda: plain(buf.getvalue())
    finally:
        progress.use_console(None)
        glog.removeHandler(handler)


def _rate(text: str, done: str) -> float:
    """tokens/s on the bar's last line that shows ``done`` (``2/2 steps``)."""
    line = [ln for ln in text.splitlines() if done in ln][-1]
    return float(re.search(r"([\d,]+) tok/s", line).group(1).replace(",", ""))


def test_train_bar_shows_steps_and_tokens_per_s(prepared, tmp_path, terminal, caplog):
    with caplog.at_level(logging.INFO, logger="genoctx"):
        train(prepared, load_recipe(TINY, ["train.steps=2"]), tmp_path / "run")
    lines = terminal().splitlines()
    text = "\n".join(lines)
    assert re.search(r"^train .* 2/2 steps .* tok/s", text, re.M), text
    assert _rate(text, "2/2 steps") > 0
    # the step log lines print whole above the live bar, which is drawn again below them
    logged = [i for i, ln in enumerate(lines) if re.match(r"\s*INFO\s+step 1/2  loss [\d.]+ nats", ln)]
    assert len(logged) == 1 and "steps" not in lines[logged[0]], text
    assert any(re.match(r"^train .* [01]/2 steps", ln) for ln in lines[: logged[0]]), text
    assert any(re.match(r"^train .* [12]/2 steps", ln) for ln in lines[logged[0] + 1 :]), text


def test_eval_bar_shows_windows_and_tokens_per_s(prepared, terminal):
    evaluate(None, prepared, markov=2, resamples=0, max_windows=3)
    text = terminal()
    assert re.search(r"^markov-2 .* 3/3 windows .* tok/s", text, re.M), text
    assert _rate(text, "3/3 windows") > 0


def test_no_bar_without_a_console(prepared, tmp_path, capsys):
    assert progress.console() is None  # the default: library callers, pipes, Ray workers
    with progress.bar("x", 2, "steps") as b:
        b.advance(tokens=5)
    evaluate(None, prepared, markov=2, resamples=0, max_windows=1)
    err = capsys.readouterr().err
    assert "\x1b[" not in err and not BAR_CHARS.search(err)


def genoctx(*args, **kw):
    return subprocess.run([sys.executable, "-m", "genoctx", *map(str, args)], cwd=REPO, timeout=600, **kw)


def test_in_a_pipe_plain_log_lines_and_no_bar(prepared):
    """eval in a pipe (train in a pipe: tests/train/test_loggers.py's CLI run)."""
    r = genoctx("eval", "--by-position", "--markov", "2", "--data", prepared, "--resamples", "0", "--max-windows",
                "2", "--format", "json", capture_output=True, text=True)  # fmt: skip
    assert r.returncode == 0 and r.stdout.startswith("{"), r.stderr[-2000:]
    assert "\x1b[" not in r.stderr and not BAR_CHARS.search(r.stderr), r.stderr
    lines = r.stderr.splitlines()
    assert lines and all(LOG_LINE.match(ln) for ln in lines), r.stderr
    assert any(ln.endswith(f"fitting an order-2 Markov chain on the train split of {prepared}") for ln in lines)


def test_on_a_terminal_the_cli_draws_the_bar_below_its_logs(prepared):
    """stderr a real pseudo-terminal: the eval bar (windows, tokens/s) and the log lines on one console; stdout (a
    pipe) holds the JSON alone."""
    master, slave = os.openpty()
    chunks: list[bytes] = []

    def read():
        while True:
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: the child closed the terminal
                return
            if not data:
                return
            chunks.append(data)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    env = {**os.environ, "TERM": "xterm-256color", "COLUMNS": "150", "LINES": "40"}
    env.pop("FORCE_COLOR", None), env.pop("NO_COLOR", None), env.pop("TTY_COMPATIBLE", None)
    try:
        args = ["--markov", "2", "--data", prepared, "--resamples", "0", "--max-windows", "3", "--format", "json"]
        r = genoctx("eval", "--by-position", *args, stdout=subprocess.PIPE, stderr=slave, env=env)
    finally:
        os.close(slave)
    reader.join(timeout=60)
    os.close(master)
    text = plain(b"".join(chunks).decode("utf-8", "replace"))
    assert r.returncode == 0 and r.stdout.startswith(b"{") and b"\x1b" not in r.stdout, text
    assert re.search(r"markov-2 .* 3/3 windows .* tok/s", text), text
    assert "fitting an order-2 Markov chain" in text  # the log line, through the same console, above the bar
    assert text.index("fitting an order-2 Markov chain") < text.index("3/3 windows")

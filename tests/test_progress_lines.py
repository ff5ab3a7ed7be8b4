"""Every long job shows it is alive (issue 45): without a terminal, ``genoctx.progress`` bars are plain INFO lines on
stderr, at most one per task every ``GENOCTX_PROGRESS_SECONDS`` (done/total, rate, ETA); a chunked training step,
eval's windows and a long window's chunks, the Markov fit, the copy probe and compiling say what they do."""

import copy
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from rich.console import Console

from genoctx import progress
from genoctx.eval import scoring
from genoctx.eval.copyprobe import probe_windows
from genoctx.eval.markov import MarkovModel
from genoctx.eval.position import evaluate
from genoctx.model.config import preset
from genoctx.model.model import HybridLM

REPO = Path(__file__).resolve().parents[1]
LOG_LINE = re.compile(r"^\d\d:\d\d:\d\d (DEBUG|INFO|WARNING) genoctx[.\w]*: ")
# "<task>: done/total unit (pct%), rate unit/s[, tok/s], elapsed E, eta T"
PLAIN = re.compile(r"^(?P<task>.+): (?P<done>[\d,]+)/(?P<total>[\d,]+) (?P<unit>\w+) \(\d+%\), [\d.e+-]+ (?P=unit)/s"
                   r"(, [\d,]+ tok/s)?, elapsed (?P<elapsed>[\d.]+)s, eta ([\d.]+s|\?)$")  # fmt: skip


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def clock(monkeypatch):
    fake = FakeClock()
    monkeypatch.setattr(progress, "_clock", fake)
    return fake


def _lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "genoctx.progress"]


def test_rate_limiter_with_a_fake_clock():
    clock = FakeClock()
    lines = progress.Lines("train", 100, "steps", every=10.0, clock=clock)
    out = []
    for _ in range(100):  # one step a second
        clock.t += 1.0
        line = lines.advance(1, tokens=50)
        if line is not None:
            out.append((clock.t, line))
    assert [t for t, _ in out] == [10.0 * k for k in range(1, 11)]  # one line per 10 s, the first after 10 s
    assert out[0][1] == "train: 10/100 steps (10%), 1 steps/s, 50 tok/s, elapsed 10.0s, eta 0:01:30"
    assert out[-1][1].startswith("train: 100/100 steps (100%)") and out[-1][1].endswith("eta 0.0s")
    assert lines.close() is None  # the last line already showed 100/100

    clock.t = 0.0
    resumed = progress.Lines("train", 10, "steps", completed=6, every=10.0, clock=clock)
    clock.t = 3.0
    assert resumed.advance(1) is None  # 3 s < 10 s
    clock.t = 12.0
    assert resumed.advance(1) == "train: 8/10 steps (80%), 0.167 steps/s, elapsed 12.0s, eta 12.0s"  # rate: 2 in 12 s
    clock.t = 13.0
    assert resumed.advance(2) is None
    assert resumed.close() == "train: 10/10 steps (100%), 0.308 steps/s, elapsed 13.0s, eta 0.0s"  # the end, once
    assert resumed.close() is None

    short = progress.Lines("x", 5, "windows", every=10.0, clock=clock)
    for _ in range(5):
        clock.t += 1.0
        assert short.advance() is None
    assert short.close() is None  # a task shorter than the interval stays silent


def test_bars_nest_and_rank_zero_speaks(clock, monkeypatch, caplog):
    monkeypatch.setenv(progress.ENV, "2")
    with caplog.at_level(logging.INFO, logger="genoctx.progress"):
        with progress.bar("eval", 3, "windows") as windows:
            for _ in range(3):
                with progress.bar("window chunks", 4, "chunks") as chunks:
                    for _ in range(4):
                        clock.t += 1.0
                        chunks.advance(tokens=10)
                windows.advance(tokens=40)
    lines = _lines(caplog)
    # each window's chunks: a line at 2 s and 4 s of its 4 s; the windows: at 4, 8, 12 s (at most one per 2 s each)
    chunk_lines = [ln for ln in lines if ln.startswith("window chunks")]
    assert [ln.split(", ")[0] for ln in chunk_lines] == [
        "window chunks: 2/4 chunks (50%)",
        "window chunks: 4/4 chunks (100%)",
    ] * 3
    assert [ln.split(", ")[0] for ln in lines if ln.startswith("eval")] == [
        "eval: 1/3 windows (33%)", "eval: 2/3 windows (67%)", "eval: 3/3 windows (100%)"]  # fmt: skip
    assert all(PLAIN.match(ln) for ln in lines), lines

    caplog.clear()
    progress.plain_lines(False)  # a Ray worker of rank > 0
    try:
        with caplog.at_level(logging.INFO, logger="genoctx.progress"), progress.bar("eval", 3, "windows") as b:
            for _ in range(3):
                clock.t += 5.0
                b.advance()
    finally:
        progress.plain_lines(True)
    assert _lines(caplog) == []


def test_interval_from_the_environment(monkeypatch):
    monkeypatch.delenv(progress.ENV, raising=False)
    assert progress.interval() == progress.MIN_SECONDS
    monkeypatch.setenv(progress.ENV, "0.25")
    assert progress.interval() == 0.25
    for bad in ("abc", "-1", "inf", "nan"):
        monkeypatch.setenv(progress.ENV, bad)
        with pytest.raises(ValueError, match=progress.ENV):
            progress.interval()


def test_a_bad_interval_is_one_line_exit_2(tmp_path):
    from cli_runner import run_genoctx  # tests/cli_runner.py

    r = run_genoctx("eval", "--by-position", "--markov", "2", "--data", tmp_path,
                    env={**os.environ, progress.ENV: "soon"})  # fmt: skip
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip().splitlines() == [
        "genoctx: error: GENOCTX_PROGRESS_SECONDS='soon': must be a number of seconds >= 0"
    ]


def test_rank_zero_of_ray_workers_keeps_the_lines(monkeypatch):
    import torch.distributed as dist

    from genoctx.train.distributed import worker_logging

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    try:
        for rank, on in ((1, False), (0, True)):
            monkeypatch.setattr(dist, "get_rank", lambda r=rank: r)
            worker_logging()
            assert progress._lines is on
    finally:
        progress.plain_lines(True)
        glog = logging.getLogger("genoctx")
        glog.propagate = True
        glog.setLevel(logging.NOTSET)
        for h in list(glog.handlers):
            glog.removeHandler(h)


def test_chunked_train_step_in_a_pipe(prepared, tmp_path):
    """One training step of a 2048-token window in 16 chunks of 128, stderr a pipe: the sweeps' lines come at most
    one per 0.02 s (a sweep takes 0.1-0.5 s here: idle, each sweep prints), each with done/total, and end at
    16/16."""
    every = 0.02
    env = {**os.environ, progress.ENV: str(every), "PYTHONPATH": str(REPO)}
    r = subprocess.run([sys.executable, "-m", "genoctx", "train", "--recipe", REPO / "recipes" / "tiny.yaml",
                        "--data", prepared, "--out", tmp_path / "run", "--steps", "1", "--seq-chunk", "128",
                        "--set", "train.seq_len=2048"],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=300)  # fmt: skip # stderr: a pipe
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stderr.splitlines()
    assert lines and all(LOG_LINE.match(ln) for ln in lines) and "\x1b[" not in r.stderr, r.stderr
    plain = [ln.split(": ", 1)[1] for ln in lines if " genoctx.progress: " in ln]
    for sweep in ("forward", "backward"):
        task = f"train step ({sweep} sweep)"
        mine = [PLAIN.match(ln) for ln in plain if ln.startswith(task + ":")]
        assert mine and all(mine), plain
        done = [int(m["done"]) for m in mine]
        assert all(m["total"] == "16" and m["unit"] == "chunks" for m in mine)
        assert done == sorted(set(done)) and done[-1] == 16, done  # progress, then the end
        # the promised rate: at most one line per `every` seconds of the sweep, plus its last line
        elapsed = float(mine[-1]["elapsed"])
        assert len(mine) <= (elapsed + 0.05) / every + 1.5, (elapsed, [m[0] for m in mine])  # (elapsed: 0.1 s)


def test_eval_reports_windows_a_long_windows_chunks_the_fit_and_the_probe(prepared, monkeypatch, caplog):
    monkeypatch.setenv(progress.ENV, "0")  # a line per advance: what each task reports
    model = HybridLM(preset("tiny")).eval()
    kw = dict(resamples=0, max_windows=1, chunk_tokens=512, models=[("tiny", model)])
    with caplog.at_level(logging.INFO, logger="genoctx.progress"):
        doc = evaluate(None, prepared, **kw)
    assert not any(ln.startswith("window chunks") for ln in _lines(caplog))  # 2048 tokens: not a long window
    caplog.clear()
    monkeypatch.setattr(scoring, "CHUNK_PROGRESS_TOKENS", 1024)
    with caplog.at_level(logging.INFO, logger="genoctx.progress"):
        again = evaluate(None, prepared, markov=2, **kw)
    lines = _lines(caplog)
    a, b = again["models"][0], doc["models"][0]
    for x, y in zip([a["overall"], *a["bins"]], [b["overall"], *b["bins"]], strict=True):
        assert (x["loss"], x["tokens"]) == (y["loss"], y["tokens"])  # the numbers do not change
    heads = [ln.split(", ")[0] for ln in lines]
    chunks = [ln.split(", ")[0] for ln in lines if ln.startswith("window chunks (2,048 tokens)")]
    assert chunks[:4] == [f"window chunks (2,048 tokens): {k}/4 chunks ({25 * k}%)" for k in range(1, 5)]
    assert "tiny: 1/1 windows (100%)" in heads and "markov-2: 1/1 windows (100%)" in heads
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="genoctx.progress"):
        probe_windows(lambda t: np.ones(len(t)), [np.zeros(2048, np.int64)] * 3, [512, 1024], 128)
    assert [ln.split(", ")[0] for ln in _lines(caplog)] == [
        "copy probe: 1/3 windows (33%)", "copy probe: 2/3 windows (67%)", "copy probe: 3/3 windows (100%)"]  # fmt: skip
    fit = [ln for ln in lines if ln.startswith("markov-2 fit: ")]
    assert len(fit) == 1 and PLAIN.match(fit[0]), fit
    n = int(PLAIN.match(fit[0])["done"].replace(",", ""))
    assert PLAIN.match(fit[0])["total"].replace(",", "") == str(n) and n > 10_000  # chrM: all its bases


def test_markov_fit_reports_blocks(monkeypatch, clock, caplog):
    monkeypatch.setenv(progress.ENV, "1")
    monkeypatch.setattr("genoctx.eval.markov.FIT_BLOCK", 1000)
    segs = [np.random.default_rng(0).integers(0, 4, 2500)]
    orig = progress.Bar.advance

    def advance(self, n=1, tokens=0):  # each block takes a second of the fake clock
        clock.t += 1.0
        orig(self, n, tokens)

    monkeypatch.setattr(progress.Bar, "advance", advance)
    with caplog.at_level(logging.INFO, logger="genoctx.progress"):
        MarkovModel.fit(segs, 2)
    assert [ln.split(", ")[0] for ln in _lines(caplog)] == [
        "markov-2 fit: 1,000/2,500 bases (40%)", "markov-2 fit: 2,000/2,500 bases (80%)",
        "markov-2 fit: 2,500/2,500 bases (100%)"]  # fmt: skip


def test_compile_says_it_is_compiling(caplog):
    """apply_compile leaves one-shot hooks on every layer; a layer's first call (where torch.compile compiles, lazily)
    is announced before and timed after, at INFO for the first layer of each kind (hooks tested on eager layers:
    compiling takes ~20 s here; tests/parallel/test_compile.py runs compiled models through them)."""
    from genoctx.parallel.compile import announce_first_call, apply_compile

    model = HybridLM(preset("tiny")).eval()
    model.layers.append(copy.deepcopy(model.layers[0]))  # kinds: kda+mlp, dsa-full+moe, kda+mlp again
    kinds: set[str] = set()
    for i, layer in enumerate(model.layers):
        announce_first_call(layer, i, "inductor", kinds)
    tokens = torch.randint(0, 4, (1, 64))
    with caplog.at_level(logging.DEBUG, logger="genoctx.parallel"), torch.no_grad():
        model(tokens, None)
        model(tokens, None)  # no more lines: the hooks removed themselves
    said = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "genoctx.parallel"]
    assert [m.split(" (")[0] for _, m in said] == ["compiling decoder layer 0", "decoder layer 0",
        "compiling decoder layer 1", "decoder layer 1", "compiling decoder layer 2", "decoder layer 2"]  # fmt: skip
    assert said[0] == (
        logging.INFO,
        "compiling decoder layer 0 (kda+mlp; torch.compile, inductor) at its first call ...",
    )
    assert re.fullmatch(r"decoder layer 1 \(dsa-full\+moe\) compiled and ran its first forward in [\d.]+ s", said[3][1])
    assert [level for level, _ in said] == [logging.INFO] * 4 + [logging.DEBUG] * 2  # layer 2: a kind seen before
    assert kinds == {"kda+mlp", "dsa-full+moe"}
    assert not any(la._forward_pre_hooks or la._forward_hooks for la in model.layers)
    compiled = HybridLM(preset("tiny"))
    assert apply_compile(compiled, backend="eager") == 2
    assert all(len(la._forward_pre_hooks) == len(la._forward_hooks) == 1 for la in compiled.layers)


def test_nested_bars_share_a_terminal(monkeypatch):
    buf = __import__("io").StringIO()
    monkeypatch.setenv(progress.ENV, "0")
    progress.use_console(Console(file=buf, force_terminal=True, width=150, color_system=None))
    try:
        with progress.bar("eval", 2, "windows") as outer:
            for _ in range(2):
                with progress.bar("window chunks", 3, "chunks") as inner:
                    for _ in range(3):
                        inner.advance(tokens=5)
                outer.advance(tokens=15)
    finally:
        progress.use_console(None)
    assert progress._live is None
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", buf.getvalue()).replace("\r", "\n")
    assert re.search(r"^window chunks .* [0-3]/3 chunks", text, re.M), text  # a row of the same display
    # the last frame: the outer bar complete, the inner row removed (it would be drawn below it)
    assert re.match(r"^eval .* 2/2 windows .* tok/s", text.rstrip().splitlines()[-1]), text

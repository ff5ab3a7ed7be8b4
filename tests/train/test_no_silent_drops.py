"""A train flag that another setting makes inert is one line (issue 45 item 2): a warning, or exit 2 where the run
would not be what was asked. The reported case: ``--seq-chunk 64k`` with recipes/tiny.yaml (``train.seq_len: 256``)
on 1M windows trained one 256-token crop in one pass while the log said "windows of 1048576 tokens"."""

import json
import logging

import pytest
from cli_runner import run_genoctx  # tests/cli_runner.py: tests/ is on sys.path (its conftest.py)

from genoctx.recipes import load_recipe
from genoctx.train.loop import describe_window, train, unused_seq_chunk


def _cfg(*sets):
    return load_recipe("recipes/tiny.yaml", list(sets)).train  # train.seq_len: 256


def test_unused_seq_chunk_says_when_and_why_the_chunk_is_inert():
    M = 1 << 20
    assert unused_seq_chunk(_cfg(), M) is None  # no chunk asked
    assert unused_seq_chunk(_cfg("train.seq_chunk_tokens=128"), M) is None  # the 256-token crop in 2 chunks
    line, by_crop = unused_seq_chunk(_cfg("train.seq_chunk_tokens=65536"), M)
    assert by_crop  # the whole windows would be chunked: it is the crop that stops it
    assert line == ("train.seq_chunk_tokens 65536 has no effect: the 256-token crops (train.seq_len) of the "
                    "1048576-token windows are at or below it and train in one pass; --set train.seq_len=null "
                    "trains the whole windows in chunks of 65536")  # fmt: skip
    line, by_crop = unused_seq_chunk(_cfg("train.seq_len=null", "train.seq_chunk_tokens=4096"), 2048)
    assert not by_crop and "the 2048-token windows are at or below it" in line and "seq_len=null" not in line
    # under --cp 2 each worker chunks its half: 128 per worker is at or below a 128 chunk, not below a 64 one
    line, _ = unused_seq_chunk(_cfg("train.seq_chunk_tokens=128", "train.cp=2"), 2048)
    assert ", 128 tokens per worker under --cp 2," in line
    assert unused_seq_chunk(_cfg("train.seq_chunk_tokens=64", "train.cp=2"), 2048) is None


def test_the_windows_line_says_crop_and_chunks():
    M = 1 << 20
    assert describe_window(_cfg("train.seq_chunk_tokens=65536"), M) == (
        "windows of 1048576 tokens, random 256-token crops (train.seq_len), one pass"
    )
    assert describe_window(_cfg("train.seq_len=null", "train.seq_chunk_tokens=65536"), M) == (
        "windows of 1048576 tokens, in chunks of 65536 tokens (train.seq_chunk_tokens)"
    )


def test_seq_chunk_above_the_recipes_crop_is_exit_2_and_writes_nothing(prepared, tmp_path):
    out = tmp_path / "run"
    r = run_genoctx("train", "--data", str(prepared), "--recipe", "recipes/tiny.yaml", "--out", str(out),
                    "--seq-chunk", "1k", "--steps", "1")  # fmt: skip
    assert r.returncode == 2, r.stderr[-2000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr and r.stdout == ""
    assert lines[0].endswith("--seq-chunk: train.seq_chunk_tokens 1024 has no effect: the 256-token crops "
                             "(train.seq_len) of the 2048-token windows are at or below it and train in one pass; "
                             "--set train.seq_len=null trains the whole windows in chunks of 1024; or drop "
                             "--seq-chunk")  # fmt: skip
    assert not out.exists()
    # what the line says to do is taken: whole windows in chunks, and the log says so (--steps 0: the chunked step
    # itself is tests/train/test_chunked.py's)
    r = run_genoctx("train", "--data", str(prepared), "--recipe", "recipes/tiny.yaml", "--out", str(out),
                    "--seq-chunk", "1k", "--steps", "0", "--set", "train.seq_len=null")  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    assert "train windows of 2048 tokens, in chunks of 1024 tokens (train.seq_chunk_tokens); steps 0..0" in r.stderr
    assert "has no effect" not in r.stderr


def test_a_recipes_inert_chunk_warns_once_and_the_log_says_crop(prepared, tmp_path, caplog):
    rec = load_recipe("recipes/tiny.yaml", ["train.seq_chunk_tokens=1024", "train.steps=1"])
    with caplog.at_level(logging.INFO, logger="genoctx.train"):
        train(prepared, rec, tmp_path / "run")
    said = [r.getMessage() for r in caplog.records]
    assert sum("train.seq_chunk_tokens 1024 has no effect" in m for m in said) == 1
    assert any("train windows of 2048 tokens, random 256-token crops (train.seq_len), one pass" in m for m in said)
    row = json.loads((tmp_path / "run" / "metrics.jsonl").read_text())
    assert row["seq_chunk_tokens"] is None and row["tokens"] == 256  # what ran: one 256-token pass


def test_inert_flags_warn_one_line_each(prepared, tmp_path):
    r = run_genoctx("train", "--data", str(prepared), "--recipe", "recipes/tiny.yaml", "--out", str(tmp_path / "r"),
                    "--steps", "1", "--hardware", "h100", "--cp-layout", "zigzag", "--allow-batch-change",
                    "--stop-after", "3", "--force")  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    for line in ("--hardware h100 has no effect without --dry-run",
                 "--cp-layout zigzag has no effect with --cp 1",
                 "--allow-batch-change has no effect without --resume",
                 "--stop-after 3 has no effect: the run ends at train.steps 1",
                 "--force: no effect: the memory plan before launch runs for GPU workers only"):  # fmt: skip
        assert sum(line in ln for ln in r.stderr.splitlines()) == 1, line
    assert json.loads(r.stdout)["steps_run"] == 1


@pytest.mark.parametrize("device", ["cuda", "cuda:0"])
def test_device_cuda_with_cpu_workers_is_exit_2(prepared, tmp_path, device):
    r = run_genoctx("train", "--data", str(prepared), "--recipe", "recipes/tiny.yaml", "--out", str(tmp_path / "r"),
                    "--num-workers", "2", "--device", device)  # fmt: skip
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1
    assert f"--device {device} with --num-workers" in r.stderr and "--gpus-per-worker 1" in r.stderr
    assert not (tmp_path / "r").exists()

"""Fixtures for eval tests: a prepared set whose windows repeat themselves, trained tiny checkpoints, a
copy "model" that implements the chunk contract without any network."""

from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
REALDNA = REPO / "data" / "hg38"
PERIOD = 1536  # the repeated unit of repeat_prepared's windows


def _real_bases(n: int, skip: int = 0) -> str:
    """``n`` real bases (case kept) from the chr22 piece, no N."""
    seq = "".join(line.strip() for line in (REALDNA / "hg38_chr22_32000001-32300000.fa").read_text().splitlines()[1:])
    seq = seq[skip:].replace("N", "").replace("n", "")
    return seq[:n]


@pytest.fixture(scope="session")
def repeat_prepared(tmp_path_factory) -> Path:
    """Eval windows of 4096 bases: X (1536 real bases), X again, X again, then 1024 bases of X (so from
    position 1536 on every base is the copy of the base 1536 before it). Train: 20 kb of other real DNA."""
    from genoctx.data.windows import prepare

    root = tmp_path_factory.mktemp("repeat")
    x = _real_bases(PERIOD, skip=100_000)
    win = (x * 3)[:4096]
    fa = root / "rep.fa"
    train = _real_bases(20_000, skip=150_000)
    fa.write_text(f">chrR\n{win * 2}\n>chrT\n{train}\n")
    out = root / "prepared"
    prepare([fa], out, window=4096, train_chroms=["chrT"], eval_chroms=["chrR"], progress=False)
    return out


class CopyModel:
    """A controlled scorer with the chunk contract: predicts the base ``period`` positions back, exactly.

    ``forward(inputs [B, T] int64, cache) -> (logits [B, T, 8] float32, cache)``; the cache is the tensor of
    all inputs seen so far [B, t]. Input index s (absolute) holds the window base s - 1 (index 0 is <bos>),
    and its logit predicts window base s; the copy source is window base s - period = input s - period + 1.
    Before ``period`` bases of context, the logits are uniform (loss ln 8).
    """

    def __init__(self, period: int, confidence: float = 30.0):
        self.period = period
        self.confidence = confidence

    def forward(self, inputs: torch.Tensor, cache=None):
        hist = inputs if cache is None else torch.cat([cache, inputs], dim=1)
        B, T = inputs.shape
        start = hist.shape[1] - T
        logits = torch.zeros(B, T, 8)
        pos = torch.arange(start, start + T)
        ok = pos >= self.period
        src = hist[:, pos[ok] - self.period + 1]  # [B, n_ok]
        logits[:, ok] = torch.nn.functional.one_hot(src, 8).float() * self.confidence
        return logits, hist


@pytest.fixture
def copy_model() -> CopyModel:
    """A :class:`CopyModel` with the period of ``repeat_prepared``."""
    return CopyModel(PERIOD)


@pytest.fixture(scope="session")
def small_prepared(tmp_path_factory) -> Path:
    """Like the shared ``prepared`` set (train chrM, eval the chr22 piece) with windows of 512 bases, so that
    the tiny model scores a window quickly."""
    from genoctx.data.windows import prepare

    out = tmp_path_factory.mktemp("small") / "prepared"
    prepare(
        [REALDNA / "hg38_chrM.fa", REALDNA / "hg38_chr22_32000001-32300000.fa"],
        out,
        window=512,
        train_chroms=["chrM"],
        eval_chroms=["chr22"],
        progress=False,
    )
    return out


@pytest.fixture(scope="session")
def two_checkpoints(small_prepared, tmp_path_factory):
    """(trained run, its untrained init) of the tiny recipe on ``small_prepared``."""
    from genoctx.recipes import load_recipe
    from genoctx.train.loop import train

    root = tmp_path_factory.mktemp("runs")
    over = ["train.seq_len=256", "train.warmup_steps=1"]
    train(small_prepared, load_recipe("recipes/tiny.yaml", ["train.steps=0", *over]), root / "init")
    train(small_prepared, load_recipe("recipes/tiny.yaml", ["train.steps=3", *over]), root / "run")
    return root / "run", root / "init"

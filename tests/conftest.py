"""Shared test setup. TRITON_INTERPRET must be set before any @triton.jit is defined: without CUDA the Triton
kernels (kernels/) run under the interpreter on CPU tensors. ``import torch`` imports no Triton."""

import os

# One OpenMP thread per process unless the caller chose: set before torch is imported, so that subprocesses, gloo
# ranks and Ray workers inherit it. On 2 cores, 2+ ranks each running 2 threads oversubscribe (~3x slower suite).
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
REALDNA = REPO / "data" / "hg38"


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture
def realdna() -> Path:
    """Folder with the embedded real hg38 pieces (chr1, chr2, chr22, chrM)."""
    return REALDNA


@pytest.fixture(scope="session")
def prepared(tmp_path_factory) -> Path:
    """A small prepared data set from real DNA: train = chrM (2k windows), eval = the chr22 piece."""
    from genoctx.data.windows import prepare

    out = tmp_path_factory.mktemp("prepared")
    prepare(
        [REALDNA / "hg38_chrM.fa", REALDNA / "hg38_chr22_32000001-32300000.fa"],
        out,
        window=2048,
        train_chroms=["chrM"],
        eval_chroms=["chr22"],
        progress=False,
    )
    return out

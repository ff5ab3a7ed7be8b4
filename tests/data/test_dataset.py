"""WindowDataset: windows equal pyfaidx slices of the source (bgzip chr2, plain chr22); padding; errors."""

import json
import pickle
import shutil

import numpy as np
import pyfaidx
import pytest
import torch

from genoctx.data.dataset import WindowDataset, load_manifest, scored_mask
from genoctx.data.tokenizer import PAD, decode
from genoctx.data.windows import prepare
from genoctx.errors import GenoctxError

CHR2 = "hg38_chr2_1-2333275.fa.gz"
CHR22 = "hg38_chr22_32000001-32300000.fa"
CHRM = "hg38_chrM.fa"


@pytest.fixture
def dna(realdna, tmp_path):
    folder = tmp_path / "dna"
    folder.mkdir()
    for f in realdna.glob("hg38_*"):  # pyfaidx may write indexes: use a copy
        shutil.copy2(f, folder / f.name)
    return folder


@pytest.fixture
def prepared(dna, tmp_path):
    out = tmp_path / "out"
    prepare([dna / CHR2, dna / CHR22], out, 8192, stride=5000, progress=False)
    return out


@pytest.mark.parametrize(("split", "fname", "chrom"), [("train", CHR2, "chr2"), ("eval", CHR22, "chr22")])
def test_windows_equal_pyfaidx_slices(dna, prepared, split, fname, chrom):
    ds = WindowDataset(prepared, split)
    assert ds.window == 8192 and len(ds) == load_manifest(prepared)["counts"][split]["windows"]
    fa = pyfaidx.Fasta(str(dna / fname), sequence_always_upper=False)
    softmasked = 0
    for i in sorted({0, 1, len(ds) // 3, len(ds) // 2, len(ds) - 1}):
        item = ds[i]
        assert item["chrom"] == chrom and item["end"] - item["start"] == 8192
        assert item["start"] % 5000 == 0
        ref = str(fa[chrom][item["start"] : item["end"]])
        assert item["tokens"].dtype == torch.long and item["tokens"].shape == (8192,)
        assert item["softmask"].dtype == torch.bool and item["softmask"].shape == (8192,)
        assert decode(item["tokens"].numpy()) == ref.upper()
        assert item["softmask"].tolist() == [c.islower() for c in ref]
        assert decode(item["tokens"].numpy(), item["softmask"].numpy()) == ref
        softmasked += int(item["softmask"].sum())
    if chrom == "chr2":
        assert softmasked > 0  # the bgzip chr2 piece is soft-masked: the channel is exercised


def test_partial_window_is_padded(dna, tmp_path):
    out = tmp_path / "out"
    prepare([dna / CHRM], out, 4096, drop_last=False, progress=False)
    ds = WindowDataset(out, "train")
    item = ds[len(ds) - 1]
    assert (item["start"], item["end"]) == (16384, 16569)
    n = 16569 - 16384
    ref = str(pyfaidx.Fasta(str(dna / CHRM), sequence_always_upper=False)["chrM"][16384:16569])
    assert decode(item["tokens"][:n].numpy(), item["softmask"][:n].numpy()) == ref
    assert (item["tokens"][n:] == PAD).all() and not item["softmask"][n:].any()
    assert scored_mask(item["tokens"]).sum() == sum(c in "ACGTacgt" for c in ref)


def test_dataloader_and_pickle(prepared):
    ds = WindowDataset(prepared, "eval")
    first = ds[0]
    clone = pickle.loads(pickle.dumps(ds))  # what a DataLoader worker receives
    assert torch.equal(clone[0]["tokens"], first["tokens"])
    batch = next(iter(torch.utils.data.DataLoader(ds, batch_size=3)))
    assert batch["tokens"].shape == (3, 8192) and batch["chrom"] == ["chr22"] * 3
    assert batch["start"].tolist() == [0, 5000, 10000]


def test_scored_mask():
    tokens = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7]])
    assert scored_mask(tokens).tolist() == [[True] * 4 + [False] * 4]


def test_errors(prepared, tmp_path):
    with pytest.raises(GenoctxError, match="'test'.*available: eval, train"):
        WindowDataset(prepared, "test")
    with pytest.raises(GenoctxError, match="no manifest"):
        load_manifest(tmp_path / "nowhere")
    with pytest.raises(GenoctxError, match="no manifest"):
        WindowDataset(tmp_path / "nowhere", "train")
    manifest = load_manifest(prepared)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "manifest.json").write_text(json.dumps({**manifest, "vocabulary": ["A", "C", "G", "T"]}))
    with pytest.raises(GenoctxError, match="vocabulary"):
        load_manifest(bad)
    shard = prepared / manifest["shards"][1]["tokens"]
    shard.write_bytes(np.zeros(10, np.uint8).tobytes())
    with pytest.raises(GenoctxError, match="shard missing or not"):
        WindowDataset(prepared, "eval")

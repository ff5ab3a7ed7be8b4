"""Tokenizer: values, exact round trips on real hg38 (soft-masked chr2, chrM with its N), IUPAC, bad bytes."""

import shutil

import numpy as np
import pyfaidx
import pytest

from genoctx.data import tokenizer as tk
from genoctx.errors import GenoctxError


@pytest.fixture
def faidx(realdna, tmp_path):
    """Open a real FASTA with pyfaidx from a copy, so no index is written into the repository."""

    def open_(name):
        for f in realdna.glob(name + "*"):
            shutil.copy2(f, tmp_path / f.name)
        return pyfaidx.Fasta(str(tmp_path / name), sequence_always_upper=False)

    return open_


def test_vocabulary_ids():
    assert tk.VOCAB == ("A", "C", "G", "T", "N", "<pad>", "<bos>", "<eos>")
    assert (tk.A, tk.C, tk.G, tk.T, tk.N, tk.PAD, tk.BOS, tk.EOS) == tuple(range(8))
    assert tk.VOCAB_SIZE == 8 and tk.SCORED_IDS == (0, 1, 2, 3)
    for base, comp in zip("ACGT", "TGCA", strict=True):  # complement = 3 - id
        assert 3 - tk.VOCAB.index(base) == tk.VOCAB.index(comp)


def test_encode_values():
    tokens, softmask = tk.encode(b"ACGTNacgtn")
    assert tokens.dtype == np.uint8 and softmask.dtype == np.bool_
    assert tokens.tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3, 4]
    assert softmask.tolist() == [False] * 5 + [True] * 5
    # str and uint8 arrays give the same result as bytes
    for seq in ("ACGTNacgtn", np.frombuffer(b"ACGTNacgtn", dtype=np.uint8)):
        t2, s2 = tk.encode(seq)
        assert np.array_equal(t2, tokens) and np.array_equal(s2, softmask)
    t0, s0 = tk.encode(b"")
    assert t0.shape == (0,) and s0.shape == (0,)


def test_round_trip_softmasked_chr2(faidx):
    fa = faidx("hg38_chr2_1-2333275.fa.gz")
    seq = str(fa["chr2"][1_000_000:1_200_000])
    assert any(c.islower() for c in seq) and any(c.isupper() for c in seq)
    tokens, softmask = tk.encode(seq)
    assert tk.decode(tokens, softmask) == seq
    assert tk.decode(tokens) == seq.upper()
    assert softmask.tolist() == [c.islower() for c in seq]
    counts = np.bincount(tokens, minlength=5)
    assert counts.tolist() == [seq.upper().count(b) for b in "ACGTN"]


def test_round_trip_chrM_with_n(faidx):
    seq = str(faidx("hg38_chrM.fa")["chrM"][:])
    assert len(seq) == 16569 and seq.startswith("GATCACAGGTCTATCACCCT")
    tokens, softmask = tk.encode(seq.encode())
    assert tk.decode(tokens, softmask) == seq
    assert np.flatnonzero(tokens == tk.N).tolist() == [3106]  # the rCRS N at 3,107 (1-based)


def test_iupac_as_n():
    tokens, softmask = tk.encode("ACRYKMSWBDHVryk")
    assert tokens.tolist() == [0, 1] + [tk.N] * 13
    assert softmask.tolist() == [False] * 12 + [True] * 3
    assert tk.decode(tokens, softmask) == "ACNNNNNNNNNNnnn"
    assert tk.count_iupac("ACRYKMSWBDHVryk") == 13


@pytest.mark.parametrize(("seq", "offset", "byte"), [(b"ACGX", 3, "X"), (b"-ACG", 0, "-"), (b"AC GT", 2, " ")])
def test_bad_byte_names_offset(seq, offset, byte):
    with pytest.raises(tk.InvalidBaseError) as info:
        tk.encode(seq)
    assert isinstance(info.value, GenoctxError)
    assert info.value.offset == offset and info.value.byte == ord(byte)
    assert f"offset {offset}" in str(info.value) and repr(byte) in str(info.value)


def test_non_ascii_str_raises():
    with pytest.raises(tk.InvalidBaseError) as info:
        tk.encode("ACGé")
    assert info.value.offset == 3


def test_decode_rejects_specials():
    for special in (tk.PAD, tk.BOS, tk.EOS, 9, -1):
        with pytest.raises(ValueError):
            tk.decode(np.array([0, 1, special]))
    with pytest.raises(ValueError):
        tk.decode(np.array([0, 1]), np.array([True]))


def test_reverse_complement_matches_string_reference(faidx):
    seq = str(faidx("hg38_chrM.fa")["chrM"][3000:3300]).upper()
    expected = seq[::-1].translate(str.maketrans("ACGTN", "TGCAN"))
    tokens, _ = tk.encode(seq)
    rc = tk.reverse_complement(tokens)
    assert rc.dtype == np.uint8
    assert tk.decode(rc) == expected
    assert np.array_equal(tk.reverse_complement(rc), tokens)
    specials = np.array([tk.PAD, tk.A, tk.BOS, tk.EOS], dtype=np.uint8)
    assert tk.reverse_complement(specials).tolist() == [tk.EOS, tk.BOS, tk.T, tk.PAD]

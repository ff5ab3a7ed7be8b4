"""Context and data parallelism on gloo with 2 and 4 processes equal one process (DESIGN.md correctness rules).

Two runs of ``cp_worker.py``'s ranks (two and four gloo processes, ``mesh_runner.fork_ranks``) compute every
distributed case: CP=2 in the contiguous and zigzag layouts, DP=2, and CP=4 in both layouts (the KDA fold over 4 and
8 pieces). The tests compare them with the single-process loop (``forward_backward`` with no parallel dims), forward
and backward.

The model (``cp_worker.cp_config``) has a full DSA layer followed by a shared one (which reuses the full layer's
selection across the pieces), pools of ``KPOOL`` = 4 tokens with the tail on, and top-16 tokens out of windows of
324 and 264: the selection is a strict subset, and no piece length (162, 81, 66, 33) is a multiple of the pool
size, so pools straddle the pieces.
"""

import sys
import tempfile
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch

from genoctx.data.fasta import iter_records
from genoctx.data.tokenizer import N, encode
from genoctx.model.dsa import DSASelection
from genoctx.parallel.context import cat_selections, cp_pieces, shard_sequence
from genoctx.train.chunked import chunk_bounds
from genoctx.train.loop import forward_backward

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "eval"))
import cp_worker  # noqa: E402
from cp_worker import cp_config, tiny_model  # noqa: E402
from mesh_runner import fork_ranks  # noqa: E402

L = 324  # window tokens: CP=2 pieces of 162 (contiguous) or 81 (zigzag); top-16 tokens of up to 324
L4 = 264  # CP=4 window: pieces of 66 (contiguous) or 33 (zigzag) tokens
KPOOL = 4  # index_kpool of cp_config(): no piece length above is a multiple of it
FULL, SHARED = 1, 2  # cp_config()'s full and shared DSA layers


def _pools_scored(cp: int, rank: int, layout: str, length: int) -> int:
    """(query, pool) pairs a rank's indexer scores: every query at position t scores its (t + 1) // KPOOL
    complete pools (one window)."""
    pos = shard_sequence(torch.arange(length)[None], cp, rank, layout)[0]
    return int(((pos + 1) // KPOOL).sum())


def _reference(tokens: torch.Tensor) -> dict:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the workers: tiny ops, and no spinning against other processes
    try:
        model = tiny_model()
        loss_sum, count, aux = forward_backward(model, tokens, nullcontext())
        stats = model.layer_stats()
    finally:
        torch.set_num_threads(threads)
    return {
        "loss_sum": float(loss_sum),
        "count": int(count),
        "aux": aux,
        "grads": {n: p.grad.detach().clone() for n, p in model.named_parameters()},
        "keys_scored": [s.get("keys_scored") for s in stats],
        "keys_attended": [s.get("keys_attended") for s in stats],
    }


@pytest.fixture(scope="module")
def windows() -> dict:
    """Real hg38 windows: chrM bases; chr1 around base 10,000 where the leading N run ends (first half N)."""
    realdna = Path(__file__).resolve().parents[2] / "data" / "hg38"  # the realdna fixture's folder (module scope)
    ((_, chrm),) = iter_records(realdna / "hg38_chrM.fa")
    ((_, chr1),) = iter_records(realdna / "hg38_chr1_1-1000000.fa.gz")
    m = torch.from_numpy(encode(chrm)[0].astype("int64"))
    c1 = torch.from_numpy(encode(chr1[:20_000])[0].astype("int64"))
    n_start = c1[10_000 - L // 2 : 10_000 + L // 2]
    assert bool((n_start[: L // 2] == N).all()) and not bool((n_start[L // 2 :] == N).any())
    return {
        "dna": m[1000 : 1000 + L],
        "n_start": n_start,
        "pair": torch.stack([m[5000 : 5000 + L], m[9000 : 9000 + L]]),
        "short": m[12000 : 12000 + L4],
    }


@pytest.fixture(scope="module")
def reference(windows):
    """One-process results per window name (computed once)."""
    cache: dict[str, dict] = {}

    def get(name: str) -> dict:
        if name not in cache:
            w = windows[name]
            cache[name] = _reference(w if w.dim() == 2 else w[None])
        return cache[name]

    return get


def _spawn(windows, out: Path, world: int) -> list[dict]:
    torch.save(windows, out / "windows.pt")
    # cp_worker.py's ranks, forked from the preloaded server (as ``python cp_worker.py OUT WINDOWS WORLD``)
    init = tempfile.mktemp(prefix="genoctx-gloo-")
    fork_ranks(cp_worker.run, (world, init, str(out), str(out / "windows.pt")), world, timeout=300)
    return [torch.load(out / f"rank{r}.pt") for r in range(world)]


@pytest.fixture(scope="module")
def distributed(windows, tmp_path_factory) -> list[dict]:
    return _spawn(windows, tmp_path_factory.mktemp("cp"), 2)


@pytest.fixture(scope="module")
def distributed4(windows, tmp_path_factory) -> list[dict]:
    return _spawn(windows, tmp_path_factory.mktemp("cp4"), 4)


def _assert_same(dist_case: dict, ref: dict) -> None:
    assert dist_case["count"] == ref["count"]
    loss, loss_ref = dist_case["loss_sum"] / ref["count"], ref["loss_sum"] / ref["count"]
    assert loss == pytest.approx(loss_ref, rel=1e-5)
    # the indexer KL is ~1e-6 here (near-uniform pool scores at init), a difference of fp32 sums of ~1: its
    # rounding is ~1e-9 (0.2% of it, measured); abs 1e-8 still catches a 1% error
    assert dist_case["aux"] == pytest.approx(ref["aux"], rel=1e-5, abs=1e-8)
    for name, g_ref in ref["grads"].items():
        g = dist_case["grads"][name]
        torch.testing.assert_close(g, g_ref, rtol=1e-4, atol=1e-4 * float(g_ref.abs().max()) + 1e-9, msg=name)


@pytest.mark.parametrize("name", ["dna", "n_start"])
def test_cp_pieces_streamed_in_chunks_equal_one_process(distributed, reference, name):
    """Eval's CP path: each zigzag piece (81 tokens) streamed through every mixing layer in chunks of 13 tokens with
    the carried cache gives the one-process forward loss (the N window: rank 0's first piece all N), and the
    mixers really ran chunk by chunk: per piece 6 chunks of 13 and one of 3."""
    from cp_worker import STREAM_CHUNK

    ref = reference(name)
    total = sum(r[f"stream_{name}"]["loss_sum"] for r in distributed)
    assert sum(r[f"stream_{name}"]["count"] for r in distributed) == ref["count"]
    assert total / ref["count"] == pytest.approx(ref["loss_sum"] / ref["count"], rel=1e-5)
    per_piece = [STREAM_CHUNK] * (81 // STREAM_CHUNK) + [81 % STREAM_CHUNK]
    for r in distributed:
        chunks = r[f"stream_{name}"]["chunks"]
        assert chunks["kda"] == per_piece  # one KDA layer: the two local pieces run batched, chunk by chunk
        assert chunks["dsa"] == (per_piece + per_piece) * 2  # two DSA layers, one call per chunk of each piece


def _dsa_keys(case: dict) -> int:
    """(query, pool) pairs scored by one rank's indexer (the full DSA layer; the shared layer scores none)."""
    assert case["keys_scored"][SHARED] == 0
    return case["keys_scored"][FULL]


def test_cp_pieces_and_shard_sequence_layouts():
    assert cp_pieces(2) == [[0], [1]]
    assert cp_pieces(2, "zigzag") == [[0, 3], [1, 2]]
    assert cp_pieces(4, "zigzag") == [[0, 7], [1, 6], [2, 5], [3, 4]]
    x = torch.arange(16).view(1, 8, 2)
    assert shard_sequence(x, 2, 0, "zigzag")[0, :, 0].tolist() == [0, 2, 12, 14]
    assert shard_sequence(x, 2, 1, "zigzag")[0, :, 0].tolist() == [4, 6, 8, 10]
    assert shard_sequence(x, 2, 1)[0, :, 0].tolist() == [8, 10, 12, 14]
    for layout in ("contiguous", "zigzag"):  # the ranks' pieces together are the window, each token once
        for cp in (1, 2, 4):
            y = torch.arange(24).view(1, 24)
            got = torch.cat([shard_sequence(y, cp, r, layout) for r in range(cp)], dim=1)
            assert sorted(got[0].tolist()) == list(range(24))
    with pytest.raises(ValueError, match="sequence length 10 is not a multiple of 4 pieces"):
        shard_sequence(torch.zeros(1, 10), 2, 0, "zigzag")
    with pytest.raises(ValueError, match="cp_layout"):
        cp_pieces(2, "diagonal")


def test_cat_selections_pads_narrow_pieces_and_keeps_positions():
    """An early piece sees fewer pools than top-k: its rows are padded with empty (-1) slots."""
    a = DSASelection(torch.tensor([[[0], [1]]], dtype=torch.int32), torch.tensor([4, 5]), 4, True)
    b = DSASelection(torch.tensor([[[7, 2], [8, 7]]], dtype=torch.int32), torch.tensor([33, 34]), 4, True)
    got = cat_selections([a, b])
    assert got.pools.dtype == torch.int32 and got.pools.tolist() == [[[0, -1], [1, -1], [7, 2], [8, 7]]]
    assert got.pos.tolist() == [4, 5, 33, 34] and (got.kpool, got.tail) == (4, True)
    assert got.rows(2, 4).tokens().tolist() == b.tokens().tolist()  # the tail follows each row's position
    with pytest.raises(ValueError, match="different kpool"):
        cat_selections([a, DSASelection(b.pools, b.pos, 2, True)])


def test_windows_make_sparse_selections_and_straddling_pools(reference):
    """The setting the CP tests need: a strict-subset selection and pieces that cut pools."""
    cfg = cp_config()
    assert (cfg.index_kpool, cfg.index_kpool_always_select_tail, cfg.index_topk) == (KPOOL, True, 16)
    assert [cfg.layer_types[i] for i in (FULL, SHARED)] == ["indexed_attention"] * 2
    assert (cfg.indexer_types[FULL], cfg.indexer_types[SHARED]) == ("full", "shared")
    for cp, length in ((2, L), (4, L4)):
        for layout in ("contiguous", "zigzag"):
            n = sum(len(p) for p in cp_pieces(cp, layout))
            assert length % n == 0 and (length // n) % KPOOL != 0
    ref = reference("dna")
    attended = ref["keys_attended"][FULL]
    assert attended == ref["keys_attended"][SHARED]  # the shared layer attends the full layer's selection
    assert attended < 20 * L < L * (L + 1) // 2  # at most 16 + 3 tail tokens per query: far from dense


def _split_reads(bounds: list[tuple[int, int]], world: int, passes: int) -> int:
    """Host reads of the MoE split sizes on a CP rank (``genoctx.model.host``): per MoE layer, per pass over a round's
    local tokens, one per ``moe_chunk_tokens`` chunk on the per-expert loop; none on the grouped dispatch (its
    offsets stay on the device: the CPU's default for this fp32 config); nothing else of the CP path reads (no read
    per piece)."""
    from genoctx.model.moe import Experts

    cfg = cp_config()
    if Experts(cfg).path(torch.zeros(1, cfg.hidden_size)) == "grouped_mm":
        return 0
    n_moe = sum(t == "sparse" for t in cfg.mlp_layer_types)
    return n_moe * passes * sum(-(-((e - s) // world) // cfg.moe_chunk_tokens) for s, e in bounds)


def _want_syncs(split_reads: int) -> tuple[dict, dict]:
    """A CP rank's host reads (labelled, unlabelled): the step's metrics and the MoE split reads, if any."""
    return {"step.aux": 1, **({"moe.split": split_reads} if split_reads else {})}, {}


@pytest.mark.parametrize("case", ["cp2", "cp2z"])
def test_cp2_equals_cp1_loss_and_every_gradient(distributed, reference, case):
    ref = reference("dna")
    assert ref["count"] == L and all(g.abs().max() > 0 for g in ref["grads"].values())
    assert ref["aux"] > 0 and any(".indexer." in n for n in ref["grads"])  # the indexer KL and its gradients
    for rank in range(2):  # gradients are all-reduced: both ranks must hold the one-process gradient
        got = distributed[rank][case]
        assert got["indexer"][FULL:] == ["full", "shared"] and got["path"][FULL:] == ["sparse", "sparse"]
        _assert_same(got, ref)
        assert got["syncs"] == _want_syncs(_split_reads([(0, L)], 2, passes=2))
    for layer in (FULL, SHARED):  # the ranks' selections together attend exactly the one-process tokens
        assert sum(distributed[r][case]["keys_attended"][layer] for r in range(2)) == ref["keys_attended"][layer]


def test_cp_splits_dsa_keys_scored_unevenly(distributed, reference):
    """Causal imbalance: rank 1's queries see rank 0's pools too, so it scores (3x here) more pools."""
    k0, k1 = (_dsa_keys(distributed[r]["cp2"]) for r in range(2))
    T = L // 2
    assert k0 == sum((t + 1) // KPOOL for t in range(T)) == 3240
    assert k1 == sum((t + 1) // KPOOL for t in range(T, L)) == 9801
    assert k0 + k1 == _dsa_keys(reference("dna"))  # together exactly the one-process (query, pool) pairs


def test_zigzag_splits_dsa_keys_scored_evenly(distributed, reference):
    """Zigzag: rank 0 holds pieces 0 and 3, rank 1 pieces 1 and 2 (of 81 tokens): both score about
    (3 c^2 + c (c + 1)) / KPOOL pools, equal up to rounding (t + 1) / KPOOL down (< 1 per query)."""
    c = L // 4
    k0, k1 = (_dsa_keys(distributed[r]["cp2z"]) for r in range(2))
    assert (k0, k1) == (_pools_scored(2, 0, "zigzag", L), _pools_scored(2, 1, "zigzag", L)) == (6521, 6520)
    exact = (3 * c * c + c * (c + 1)) / KPOOL
    assert all(exact - 2 * c < k <= exact for k in (k0, k1))
    assert k0 + k1 == _dsa_keys(reference("dna"))


@pytest.mark.parametrize("case", ["cp2_n", "cp2z_n"])
def test_all_n_slice_on_one_rank_gives_the_cp1_loss(distributed, reference, case):
    """The window's first half is N: contiguous, rank 0's whole slice; zigzag, pieces 0 and 1 (one per rank)."""
    ref = reference("n_start")
    assert ref["count"] == L // 2
    for rank in range(2):
        got = distributed[rank][case]
        assert all(torch.isfinite(g).all() for g in got["grads"].values())
        _assert_same(got, ref)


def test_dp2_equals_one_process_with_both_windows_batched(distributed, reference):
    ref = reference("pair")
    for rank in range(2):
        _assert_same(distributed[rank]["dp2"], ref)


@pytest.mark.parametrize("case", ["cp4", "cp4z"])
def test_cp4_equals_cp1_loss_and_every_gradient(distributed4, reference, case):
    """Four ranks: the KDA state is folded over 4 (contiguous) or 8 (zigzag) pieces in natural order."""
    ref = reference("short")
    assert ref["count"] == L4
    for rank in range(4):
        _assert_same(distributed4[rank][case], ref)
    for layer in (FULL, SHARED):
        assert sum(distributed4[r][case]["keys_attended"][layer] for r in range(4)) == ref["keys_attended"][layer]


def test_cp4_dsa_keys_scored_per_rank(distributed4, reference):
    c = L4 // 8
    contiguous = [_dsa_keys(distributed4[r]["cp4"]) for r in range(4)]
    zigzag = [_dsa_keys(distributed4[r]["cp4z"]) for r in range(4)]
    assert contiguous == [_pools_scored(4, r, "contiguous", L4) for r in range(4)] == [528, 1617, 2706, 3795]
    assert zigzag == [_pools_scored(4, r, "zigzag", L4) for r in range(4)] == [2162, 2161, 2161, 2162]
    exact = (7 * c * c + c * (c + 1)) / KPOOL
    assert all(exact - 2 * c < k <= exact for k in zigzag)
    assert sum(contiguous) == sum(zigzag) == _dsa_keys(reference("short"))


@pytest.mark.parametrize("case,window", [("cp2_chunk", "dna"), ("cp2z_chunk", "dna"), ("cp2_n_chunk", "n_start"),
                                         ("cp2z_n_chunk", "n_start"), ("cp4z_chunk", "short")])  # fmt: skip
def test_each_cp_rank_chunks_its_piece_as_one_process(request, reference, case, window):
    """Chunked training under CP (``genoctx.train.chunked`` with ``cp``): rounds of ``cp`` x ``SEQ_CHUNK`` tokens, the
    last one shorter, each cut into the layout's pieces and run after the round before's cache (KDA state and conv
    tail, DSA latents and pooled keys: the same on every rank); the reverse sweep hands each round's incoming-cache
    gradient to the round before. Loss, indexer KL and every gradient equal one process over the whole window, and
    the ranks' selections together attend exactly its tokens."""
    from cp_worker import SEQ_CHUNK

    ranks = request.getfixturevalue("distributed4" if case.startswith("cp4") else "distributed")
    world = len(ranks)
    layout = "zigzag" if case.split("_")[0].endswith("z") else "contiguous"
    length = L4 if world == 4 else L
    rounds = -(-length // (SEQ_CHUNK[world, layout] * world))
    assert rounds == 3 if world == 2 and layout == "contiguous" else rounds == 4
    ref = reference(window)
    bounds = chunk_bounds(length, SEQ_CHUNK[world, layout] * world)
    for rank in range(world):
        assert ranks[rank][case]["mixer_calls"] == 2 * rounds  # the forward sweep, then each round again
        no_grad, grad = ranks[rank][case]["topk_calls"]
        assert no_grad >= rounds and grad == 0  # the grad pass takes the sweep's top-k selections
        _assert_same(ranks[rank][case], ref)
        # host reads: the aux loss, and the MoE split sizes of each round's forward sweep, forward and recomputation
        assert ranks[rank][case]["syncs"] == _want_syncs(_split_reads(bounds, world, passes=3))
    for layer in (FULL, SHARED):
        assert sum(ranks[r][case]["keys_attended"][layer] for r in range(world)) == ref["keys_attended"][layer]

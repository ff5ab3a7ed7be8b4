"""Host memory counts the pinned allocator's rounding (issue 43 item 5): PyTorch's CUDA caching host allocator takes
the next power of two for every pinned tensor, so the plan's ``host_gib`` on CUDA counts each pinned block
(an offloaded layer input; under ``optimizer_offload`` each parameter's master shard and its gradient) at that size;
the AdamW moments are pageable and a CPU run pins nothing."""

import pytest

from genoctx.model.config import preset
from genoctx.parallel.layout import Layout
from genoctx.plan import plan_memory
from genoctx.plan.memory import pinned_block_bytes
from genoctx.plan.sizes import param_counts, shard_numel


def test_pinned_block_bytes_is_the_next_power_of_two():
    assert [pinned_block_bytes(n) for n in (0, 1, 2, 3, 4096, 4097, 3 * 2**29, 2**30)] == [
        0.0, 1.0, 2.0, 4.0, 4096.0, 8192.0, 2.0**31, 2.0**30]  # fmt: skip


def test_host_bytes_count_each_pinned_block_rounded():
    """``cpu-small`` on FSDP=2 x CP=2 with both offloads, counted by hand from its parameters' shard sizes: on CUDA
    the masters and gradients (one pinned block each per parameter) and every layer input (one block per layer)
    round up, the moments do not; on a CPU the same plan holds the exact bytes."""
    cfg = preset("cpu-small")
    lay = Layout(dp_replicate=1, ep=1, dp_shard=2, cp=2)
    kw = dict(gpu_memory_gib=80, optimizer_offload=True, offload_activations=True, dtype="bf16", seq_len=3000)
    cuda = plan_memory(cfg, layout=lay, device="cuda", **kw)
    cpu = plan_memory(cfg, layout=lay, device="cpu", **kw)
    shards = [sum(shard_numel([sh], lay).values()) for sh in param_counts(cfg)["shapes"]]
    P = sum(shards)
    assert P == sum(cuda["params_per_rank"].values())
    acts = cuda["host_device_bytes"]["activations"]
    per_layer = acts / cfg.num_hidden_layers
    assert per_layer == 1500 * cfg.hc_mult * cfg.hidden_size * 4  # [1, 1500, n, D] fp32 per layer (CP piece)
    exact = 4 * P + 4 * P + 8 * P + acts
    rounded = sum(2 * pinned_block_bytes(4 * n) for n in shards) + 8 * P + cfg.num_hidden_layers * 2 ** (
        int(per_layer - 1).bit_length())  # fmt: skip
    assert cpu["host_gib"] == pytest.approx(exact / 2**30, abs=1e-6)  # host_gib is rounded to 1e-6 GiB
    assert cuda["host_gib"] == pytest.approx(rounded / 2**30, abs=1e-6)
    assert cuda["host_gib"] > cpu["host_gib"] + 1e-3  # 20.6 vs 16.3 MiB

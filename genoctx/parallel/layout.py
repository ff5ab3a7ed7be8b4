"""The parallel layout: how many ranks each of the four mesh dimensions has (no torch.distributed here).

The device mesh (``genoctx.parallel.mesh``) has four dimensions, outermost first:

    dp_replicate x ep x dp_shard x cp          (world size = their product)

- ``dp_replicate``: data-parallel replicas (HSDP's replicate dimension): each holds a full copy of the
  (sharded) model of its group and sees its own windows.
- ``ep``: expert parallel: the routed experts of every MoE layer are split into ``ep`` contiguous blocks of
  ``n_routed_experts / ep`` experts; tokens travel to their experts with ``all_to_all_single``. EP ranks see
  different windows (they are data parallel for everything but the routed experts).
- ``dp_shard``: FSDP2 (``fully_shard``) sharding; its ranks see different windows.
- ``cp``: context parallel: the ranks of a CP group hold pieces of the same windows.

Folded expert parallelism (``ep_folded``; MoE parallel folding, Megatron-Core's EP x ETP groups inside DP x CP,
torchtitan's ``efsdp = dp_shard * cp / ep``): the EP group is drawn from the ``dp_shard x cp`` ranks instead of an
axis of its own, so the mesh is ``dp_replicate x 1 x dp_shard x cp`` and ``ep`` must divide ``dp_shard x cp``. The
EP groups are contiguous blocks of ``ep`` ranks (``cp`` fastest, as Megatron's expert rank order ``tp-ep-dp-pp``);
each rank's block of ``E / ep`` experts is FSDP-sharded over the ``efsdp = dp_shard x cp / ep`` ranks holding the
same block (``expert_shard``). Attention runs CP while the experts run EP on the same ranks, and the tokens a rank
holds are not multiplied by ``ep``.

Data: a rank's windows are chosen by its data-parallel rank over ``dp_replicate x ep x dp_shard`` (``dp``,
``dp_rank``; folded: ``dp_replicate x dp_shard``). Sharding (FSDP2), when ``dp_shard > 1`` or ``cp > 1``
(torchtitan shards over ``dp_shard_cp`` the same way: CP ranks hold different tokens, so they shard parameters like
data-parallel ranks): every dense
parameter is sharded over all ``ep x dp_shard x cp`` ranks of its replica, every routed expert over the
``dp_shard x cp`` ranks that hold the same experts; replicas all-reduce. Otherwise (replicas and EP only)
parameters are replicated (routed experts only across the ranks holding the same block) and gradients are
all-reduced.

``fsdp_one`` (``train.fsdp_one``, ``--fsdp-one``): FSDP2 on a mesh of one rank (``fully_shard`` over a 1-rank
``dp_shard``: each "shard" is the whole tensor), so that one GPU runs what a sharded layout runs (bf16
``MixedPrecisionPolicy``, the ``CPUOffloadPolicy`` of ``offload_optimizer``, DTensor parameters, DCP checkpoints).
Only at world size 1: with more ranks ``dp_shard``/``cp`` say how parameters are sharded.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

DIMS = ("dp_replicate", "ep", "dp_shard", "cp")  # mesh dimension names, outermost first
LAYOUTS = ("contiguous", "zigzag")  # how a CP rank's pieces of a window are chosen (genoctx.parallel.context)


def cp_pieces(cp: int, layout: str = "contiguous") -> list[list[int]]:
    """For each CP rank, the natural-order indices of the window pieces it holds, in its local order.

    Args:
        cp: context-parallel size (>= 1).
        layout: ``"contiguous"`` (``cp`` pieces: ``[[0], [1], ..., [cp - 1]]``) or ``"zigzag"`` (``2 cp``
            pieces: ``[[0, 2cp - 1], [1, 2cp - 2], ..., [cp - 1, cp]]``).

    Raises:
        ValueError: ``cp < 1`` or an unknown layout.
    """
    if cp < 1:
        raise ValueError(f"context parallelism: cp must be >= 1, got {cp}")
    if layout == "contiguous":
        return [[r] for r in range(cp)]
    if layout == "zigzag":
        return [[r, 2 * cp - 1 - r] for r in range(cp)]
    raise ValueError(f"cp_layout must be one of {', '.join(LAYOUTS)}; got {layout!r}")


def uneven_seq_chunk_round(length: int, chunk_tokens: int, cp: int, layout: str, min_piece: int) -> int | None:
    """Chunked training under CP (``genoctx.train.chunked``) cuts a window of ``length`` tokens into rounds of
    ``cp x chunk_tokens`` tokens (the last one shorter) and each round into the ``cp_pieces`` of ``layout``: the
    length in tokens of the first round that does not split into equal pieces of at least ``min_piece`` tokens
    (the full round, or else the last one), or None when every round splits.

    Raises:
        ValueError: as ``cp_pieces``.
    """
    pieces = sum(len(p) for p in cp_pieces(cp, layout))
    full = cp * chunk_tokens
    for r in (full, length % full or full):
        if r % pieces or r // pieces < min_piece:
            return r
    return None


@dataclass(frozen=True)
class Layout:
    """Sizes of the four mesh dimensions (each >= 1), whether EP is folded into ``dp_shard x cp`` (``ep_folded``)
    and whether one rank applies FSDP2 (``fsdp_one``; module docstring). ``world`` is the number of ranks."""

    dp_replicate: int = 1
    ep: int = 1
    dp_shard: int = 1
    cp: int = 1
    ep_folded: bool = False
    fsdp_one: bool = False

    def __post_init__(self) -> None:
        for name in DIMS:
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"parallel layout: {name} must be an integer >= 1, got {v!r}")
        for name in ("ep_folded", "fsdp_one"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"parallel layout: {name} must be true or false, got {getattr(self, name)!r}")
        if self.fsdp_one and self.world > 1:
            raise ValueError(f"parallel layout: fsdp_one is FSDP2 on one rank; {self.world} ranks shard with "
                             "dp_shard (--fsdp) or cp")  # fmt: skip
        if self.ep_folded and (self.dp_shard * self.cp) % self.ep:
            raise ValueError(f"parallel layout: folded ep={self.ep} must divide dp_shard x cp = "
                             f"{self.dp_shard} x {self.cp} = {self.dp_shard * self.cp}")  # fmt: skip

    @property
    def ep_axis(self) -> int:
        """Size of the mesh's ``ep`` dimension: ``ep``, or 1 when EP is folded into ``dp_shard x cp``."""
        return 1 if self.ep_folded else self.ep

    @property
    def world(self) -> int:
        """Ranks in the mesh: dp_replicate x ep x dp_shard x cp (folded: dp_replicate x dp_shard x cp)."""
        return self.dp_replicate * self.ep_axis * self.dp_shard * self.cp

    @property
    def dp(self) -> int:
        """Data-parallel ranks (ranks that see different windows): dp_replicate x ep x dp_shard (folded: no ep)."""
        return self.dp_replicate * self.ep_axis * self.dp_shard

    @property
    def fsdp(self) -> bool:
        """True when FSDP2 is applied: ``dp_shard > 1`` or ``cp > 1`` (parameters sharded), or ``fsdp_one`` (one
        rank: each shard is the whole tensor)."""
        return self.dp_shard > 1 or self.cp > 1 or self.fsdp_one

    @property
    def dense_shard(self) -> int:
        """Ranks a dense parameter is sharded over (1 = replicated): ep x dp_shard x cp under FSDP (folded: no ep)."""
        return self.ep_axis * self.dp_shard * self.cp if self.fsdp else 1

    @property
    def expert_shard(self) -> int:
        """Ranks one block of routed experts is sharded over (1 = replicated): dp_shard x cp under FSDP; folded,
        ``efsdp = dp_shard x cp / ep``."""
        if not self.fsdp:
            return 1
        return self.dp_shard * self.cp // self.ep if self.ep_folded else self.dp_shard * self.cp

    def to_dict(self) -> dict:
        """The fields as a dict (``fsdp_one`` only when set: the dict of every other layout is as before it)."""
        return {k: v for k, v in asdict(self).items() if k != "fsdp_one" or v}

    def describe(self) -> str:
        """``"dp_replicate=1 ep=2 dp_shard=2 cp=1"`` (folded: ``ep=32 (folded)``; fsdp_one: ``dp_shard=1 (fsdp)``)."""
        tags = {"ep": " (folded)" if self.ep_folded else "", "dp_shard": " (fsdp)" if self.fsdp_one else ""}
        return " ".join(f"{k}={getattr(self, k)}{tags.get(k, '')}" for k in DIMS)

    @classmethod
    def for_world(cls, world: int, ep: int = 1, dp_shard: int = 1, cp: int = 1, ep_folded: bool = False,
                  world_flag: str = "--num-workers", fsdp_one: bool = False) -> Layout:  # fmt: skip
        """The layout of ``world`` ranks with these ``ep``, ``dp_shard`` and ``cp``; the rest is ``dp_replicate``.
        ``fsdp_one``: FSDP2 at world size 1 (``Layout.fsdp_one``; dropped where ``dp_shard x cp > 1`` shards anyway).
        ``world_flag`` names the flag that gave ``world`` in the messages (``--num-workers``, ``genoctx plan``'s
        ``--gpus``).

        Raises:
            ValueError: ``ep * dp_shard * cp`` (folded: ``dp_shard * cp``) does not divide ``world`` (with a hint to
                fold EP where folding would fit), or a folded ``ep`` does not divide ``dp_shard * cp`` (the message
                names the sizes), or ``fsdp_one`` on several ranks that ``dp_shard``/``cp`` do not shard over.
        """
        shard_cp = dp_shard * cp
        inner = (1 if ep_folded else ep) * shard_cp
        if ep_folded and shard_cp % ep:
            raise ValueError(f"--ep {ep} (folded) must divide --fsdp {dp_shard} x --cp {cp} = {shard_cp}")
        if world < 1 or inner < 1 or world % inner:
            what = f"--fsdp {dp_shard} x --cp {cp}" if ep_folded else f"--ep {ep} x --fsdp {dp_shard} x --cp {cp}"
            folds = not ep_folded and ep > 1 and shard_cp % ep == 0 and world >= 1 and world % shard_cp == 0
            hint = f" (or add --ep-folded: --ep {ep} drawn from the --fsdp x --cp ranks)" if folds else ""
            raise ValueError(f"{what} = {inner} must divide {world_flag} {world}{hint}")
        if fsdp_one and world > 1 and shard_cp == 1:
            raise ValueError(f"--fsdp-one is FSDP2 on one rank: {world_flag} {world} shards with --fsdp or --cp")
        return cls(dp_replicate=world // inner, ep=ep, dp_shard=dp_shard, cp=cp, ep_folded=ep_folded,
                   fsdp_one=fsdp_one and shard_cp == 1)  # fmt: skip

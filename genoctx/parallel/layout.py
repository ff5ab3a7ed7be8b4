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

Data: a rank's windows are chosen by its data-parallel rank over ``dp_replicate x ep x dp_shard`` (``dp``,
``dp_rank``). Sharding (FSDP2), when ``dp_shard > 1`` or ``cp > 1`` (torchtitan shards over ``dp_shard_cp`` the
same way: CP ranks hold different tokens, so they shard parameters like data-parallel ranks): every dense
parameter is sharded over all ``ep x dp_shard x cp`` ranks of its replica, every routed expert over the
``dp_shard x cp`` ranks that hold the same experts; replicas all-reduce. Otherwise (replicas and EP only)
parameters are replicated (routed experts only across the ranks holding the same block) and gradients are
all-reduced.
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


@dataclass(frozen=True)
class Layout:
    """Sizes of the four mesh dimensions (each >= 1). ``world`` is their product."""

    dp_replicate: int = 1
    ep: int = 1
    dp_shard: int = 1
    cp: int = 1

    def __post_init__(self) -> None:
        for name in DIMS:
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"parallel layout: {name} must be an integer >= 1, got {v!r}")

    @property
    def world(self) -> int:
        """Ranks in the mesh: dp_replicate x ep x dp_shard x cp."""
        return self.dp_replicate * self.ep * self.dp_shard * self.cp

    @property
    def dp(self) -> int:
        """Data-parallel ranks (ranks that see different windows): dp_replicate x ep x dp_shard."""
        return self.dp_replicate * self.ep * self.dp_shard

    @property
    def fsdp(self) -> bool:
        """True when parameters are sharded (FSDP2): ``dp_shard > 1`` or ``cp > 1``."""
        return self.dp_shard > 1 or self.cp > 1

    @property
    def dense_shard(self) -> int:
        """Ranks a dense parameter is sharded over (1 = replicated): ep x dp_shard x cp under FSDP."""
        return self.ep * self.dp_shard * self.cp if self.fsdp else 1

    @property
    def expert_shard(self) -> int:
        """Ranks one block of routed experts is sharded over (1 = replicated): dp_shard x cp under FSDP."""
        return self.dp_shard * self.cp if self.fsdp else 1

    def to_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        """``"dp_replicate=1 ep=2 dp_shard=2 cp=1"``."""
        return " ".join(f"{k}={getattr(self, k)}" for k in DIMS)

    @classmethod
    def for_world(cls, world: int, ep: int = 1, dp_shard: int = 1, cp: int = 1) -> Layout:
        """The layout of ``world`` ranks with these ``ep``, ``dp_shard`` and ``cp``; the rest is ``dp_replicate``.

        Raises:
            ValueError: ``ep * dp_shard * cp`` does not divide ``world`` (the message names the sizes).
        """
        inner = ep * dp_shard * cp
        if world < 1 or inner < 1 or world % inner:
            raise ValueError(f"--ep {ep} x --fsdp {dp_shard} x --cp {cp} = {inner} must divide --num-workers {world}")
        return cls(dp_replicate=world // inner, ep=ep, dp_shard=dp_shard, cp=cp)

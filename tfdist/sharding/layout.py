"""How one variable is cut into N equal shards, and which variables are cut (no TensorFlow).

A variable of n elements is flattened and padded with zeros to N * S
elements, S = ceil(n / N); replica rank r owns elements [r*S, (r+1)*S).
Equal shards keep every collective a single fixed-shape op; the padding
costs at most N - 1 elements per variable.

Variables smaller than `min_bytes` stay replicated: sharding a bias or a
norm's scale saves a few bytes and costs a collective launch per use.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Iterable, Sequence


@dataclasses.dataclass(frozen=True)
class ShardLayout:
    """One variable's split over `num_shards` replicas.

    Attributes:
      shape: the variable's (logical, whole) shape.
      num_shards: N, the replicas in sync.
    """

    shape: tuple[int, ...]
    num_shards: int

    def __post_init__(self):
        if self.num_shards < 1:
            raise ValueError(f"num_shards must be >= 1. Received: num_shards={self.num_shards}")
        if any(d < 0 for d in self.shape):
            raise ValueError(f"shape must be fully known. Received: shape={self.shape}")

    @property
    def num_elements(self) -> int:
        return math.prod(self.shape)

    @property
    def shard_size(self) -> int:
        """S: elements each replica holds (the last shards may end in padding)."""
        return -(-self.num_elements // self.num_shards)

    @property
    def padded_size(self) -> int:
        return self.shard_size * self.num_shards

    def shard_range(self, rank: int) -> tuple[int, int]:
        """[start, stop) of rank's shard in the flattened, padded variable."""
        if not 0 <= rank < self.num_shards:
            raise ValueError(f"rank must be in [0, {self.num_shards}). Received: rank={rank}")
        return rank * self.shard_size, (rank + 1) * self.shard_size


def is_sharded(shape: Sequence[int], dtype_bytes: int, *, min_bytes: int) -> bool:
    """True if a variable of this shape and element size is split (not replicated)."""
    return math.prod(int(d) for d in shape) * dtype_bytes >= max(min_bytes, 1)


def sharded_elements(sizes: Iterable[int], num_shards: int) -> int:
    """Elements one replica holds of variables of these sizes, each cut into equal shards."""
    return sum(-(-int(n) // num_shards) for n in sizes)

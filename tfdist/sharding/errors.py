"""The errors ZeRO sharding raises for what a user asked (both ValueErrors)."""

from __future__ import annotations


class ShardingUnavailableError(ValueError):
    """The strategy has no collective implementation tfdist can shard with."""


class EagerStepError(ValueError):
    """A sharded training step runs eagerly (its collectives would deadlock)."""

"""Which strategies (and variables) tfdist made: the only objects its fixes may change.

Every fix in tfdist.compat passes straight through to the original code unless
the object it is called on belongs to a strategy made by `tfdist.make_strategy`
(or a variable created under one). A user's own `tf.distribute.MirroredStrategy`
in the same process, or a plain model with no strategy, runs stock Keras. The
record of what tfdist made is `tfdist.state` (one `StrategyState` per strategy).
"""

from __future__ import annotations

from typing import Any

from tfdist import state as state_lib


def is_default_strategy(strategy: Any) -> bool:
    """True for TensorFlow's default (no-distribution) strategy, which tfdist never adopts."""
    from tfdist._tf import import_tensorflow

    import_tensorflow()
    from tensorflow.python.distribute import distribute_lib

    return isinstance(strategy, distribute_lib._DefaultDistributionStrategy)


def owns(strategy: Any) -> bool:
    """True if tfdist made `strategy` (None and the default strategy: False)."""
    return state_lib.state_of(strategy) is not None


def current_strategy() -> Any:
    """The strategy in scope (replica or cross-replica context), or None for the default."""
    from tfdist._tf import import_tensorflow

    tf = import_tensorflow()
    return tf.distribute.get_strategy() if tf.distribute.has_strategy() else None


def strategy_of_variable(variable: Any) -> Any:
    """The strategy a (Keras or TensorFlow) variable was created under, or None.

    Keras variables wrap a TensorFlow variable in `_value`; distributed and
    parameter-server variables record their strategy in `_distribute_strategy`;
    a ShardedVariable's shards do; a sharded (ZeRO) variable's storage names it.
    """
    value = getattr(variable, "_value", variable)
    strategy = getattr(value, "_distribute_strategy", None)
    if strategy is None:
        shards = getattr(value, "variables", None)
        if isinstance(shards, (list, tuple)) and shards:
            strategy = getattr(shards[0], "_distribute_strategy", None)
    if strategy is None:  # a variable tfdist.sharding stores as one shard per replica
        from tfdist.compat import sharding_variables

        storage = sharding_variables.sharded_storage(variable)
        strategy = storage.strategy if storage is not None else None
    return strategy

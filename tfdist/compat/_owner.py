"""Which strategies (and variables) tfdist made: the only objects its fixes may change.

Every fix in tfdist.compat passes straight through to the original code unless
the object it is called on belongs to a strategy made by `tfdist.make_strategy`
(or a variable created under one). A user's own `tf.distribute.MirroredStrategy`
in the same process, or a plain model with no strategy, runs stock Keras.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

_lock = threading.Lock()
_strategies: "weakref.WeakSet[Any]" = weakref.WeakSet()


def adopt(strategy: Any) -> Any:
    """Marks `strategy` as made by tfdist (so tfdist's fixes apply to it); returns it.

    Raises:
      ValueError: for TensorFlow's default strategy (shared by every plain model).
    """
    if is_default_strategy(strategy):
        raise ValueError("tfdist never adopts TensorFlow's default strategy: plain models "
                         "in this process must keep running stock Keras.")
    with _lock:
        _strategies.add(strategy)
    return strategy


def is_default_strategy(strategy: Any) -> bool:
    """True for TensorFlow's default (no-distribution) strategy, which tfdist never adopts."""
    from tfdist._tf import import_tensorflow

    import_tensorflow()
    from tensorflow.python.distribute import distribute_lib

    return isinstance(strategy, distribute_lib._DefaultDistributionStrategy)


def owns(strategy: Any) -> bool:
    """True if tfdist made `strategy` (None and the default strategy: False)."""
    if strategy is None:
        return False
    try:
        return strategy in _strategies
    except TypeError:  # unhashable or not weak-referenceable: not ours
        return False


def current_strategy() -> Any:
    """The strategy in scope (replica or cross-replica context), or None for the default."""
    from tfdist._tf import import_tensorflow

    tf = import_tensorflow()
    return tf.distribute.get_strategy() if tf.distribute.has_strategy() else None


def strategy_of_variable(variable: Any) -> Any:
    """The strategy a (Keras or TensorFlow) variable was created under, or None.

    Keras variables wrap a TensorFlow variable in `_value`; distributed and
    parameter-server variables record their strategy in `_distribute_strategy`;
    a ShardedVariable's shards do.
    """
    value = getattr(variable, "_value", variable)
    strategy = getattr(value, "_distribute_strategy", None)
    if strategy is None:
        shards = getattr(value, "variables", None)
        if isinstance(shards, (list, tuple)) and shards:
            strategy = getattr(shards[0], "_distribute_strategy", None)
    return strategy

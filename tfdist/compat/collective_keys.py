"""Fresh collective group keys for every MirroredStrategy in one process.

Upstream: every MirroredStrategy starts its collective group keys at 1, so
a second strategy with another device count in the same process collides
with the first ("Device CPU:1 is joining a group with size4, but that group
has size 2 ... Restart your program to reset"), and the process stays
poisoned. TensorFlow's own tests work around it the same way, in
tensorflow/python/distribute/strategy_combinations.py
(`_mirrored_strategy_with_collective_key_base`): bump the class attribute
`_collective_key_base` before each new strategy. Verified on TF 2.21.
"""

from __future__ import annotations

import itertools

from tfdist._tf import import_tensorflow

_STRIDE = 100_000  # as in TF's strategy_combinations.py; one strategy uses few keys
_counter = itertools.count(1)


def fresh_collective_key_base() -> int:
    """Moves MirroredStrategy's group-key base past every earlier strategy's keys.

    Returns:
      The new base (for logging and tests).

    Raises:
      RuntimeError: if TensorFlow no longer has the attribute this relies on
        (upstream changed; see tests/test_compat.py).
    """
    tf = import_tensorflow()
    from tensorflow.python.distribute import mirrored_strategy

    classes = (mirrored_strategy.MirroredStrategy, mirrored_strategy.MirroredStrategyV1)
    if not all(hasattr(cls, "_collective_key_base") for cls in classes):
        raise RuntimeError(
            "tf.distribute.MirroredStrategy has no _collective_key_base in TensorFlow "
            f"{tf.__version__}; tfdist.compat.collective_keys needs updating."
        )
    base = next(_counter) * _STRIDE
    for cls in classes:
        cls._collective_key_base = base
    return base

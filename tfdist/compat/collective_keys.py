"""Fresh collective group keys for every MirroredStrategy tfdist makes, and only those.

Upstream: every MirroredStrategy starts its collective group keys at
`1 + _collective_key_base` (0), so a second strategy with another device
count in the same process collides with the first ("Device CPU:1 is joining
a group with size4, but that group has size 2 ... Restart your program to
reset"), and the process stays poisoned. No upstream issue tracks it:
TensorFlow marks the attribute "Only set this in tests" and its own tests
bump the *class* attribute before each strategy
(tensorflow/python/distribute/strategy_combinations.py,
`_mirrored_strategy_with_collective_key_base`).

Changing the class attribute would change what a user's own
`tf.distribute.MirroredStrategy` in the same process uses. TensorFlow reads
the base from the strategy *instance* (`MirroredExtended.__init__`:
`self._collective_key_base = container_strategy._collective_key_base`), so
tfdist sets it on its own instance before running the constructor: tfdist's
strategies get keys of their own, every other strategy sees TensorFlow's
defaults. Nothing of TensorFlow's is replaced, so there is nothing to
uninstall. Shape relied on (checked, `CompatError` otherwise): the
constructor takes (devices, cross_device_ops), the class has
`_collective_key_base`, and the constructed strategy's extended object
recorded the instance's base. The canary (tests/compat/test_collective_keys.py) shows two
stock strategies with different device counts still collide.
"""

from __future__ import annotations

import itertools
import threading

from tfdist.compat import _patch

_STRIDE = 100_000  # as in TF's strategy_combinations.py; one strategy uses few keys
_counter = itertools.count(1)
_lock = threading.Lock()


def _next_base() -> int:
    with _lock:
        return next(_counter) * _STRIDE


def _check(mirrored_strategy_class) -> None:
    _patch.require_signature(mirrored_strategy_class.__init__, "devices", "cross_device_ops",
                             what="tf.distribute.MirroredStrategy.__init__")
    _patch.require_attributes(mirrored_strategy_class, "_collective_key_base",
                              what="tf.distribute.MirroredStrategy")


def _ring_all_reduce(devices: tuple[str, ...], key_base: int):
    """Collective ring all-reduce over `devices`, its group keys starting after `key_base`."""
    from tensorflow.python.distribute import collective_util, cross_device_ops, \
        cross_device_utils

    _patch.require_signature(cross_device_utils.CollectiveKeys.__init__, "group_key_start",
                             what="CollectiveKeys.__init__")
    return cross_device_ops.CollectiveAllReduce(
        devices=devices,
        group_size=len(devices),
        options=collective_util.Options(
            implementation=collective_util.CommunicationImplementation.RING),
        collective_keys=cross_device_utils.CollectiveKeys(group_key_start=1 + key_base),
    )


def mirrored_strategy(devices: tuple[str, ...], *, cross_device_ops=None, ring: bool = False):
    """A `tf.distribute.MirroredStrategy` whose collective keys no other strategy uses.

    Args:
      devices: the replicas' devices.
      cross_device_ops: passed to MirroredStrategy (None: TensorFlow picks).
      ring: build a collective ring all-reduce with this strategy's keys
        instead (`cross_device_ops` must then be None).

    Returns:
      The strategy.

    Raises:
      CompatError: TensorFlow's MirroredStrategy is not shaped as this expects.
    """
    from tfdist._tf import import_tensorflow

    tf = import_tensorflow()
    cls = tf.distribute.MirroredStrategy
    _check(cls)
    base = _next_base()
    if ring:
        if cross_device_ops is not None:
            raise ValueError("Pass either ring=True or cross_device_ops, not both.")
        cross_device_ops = _ring_all_reduce(devices, base)
    strategy = cls.__new__(cls)
    # Read by MirroredExtended.__init__ from this instance; the class keeps TF's 0.
    strategy._collective_key_base = base
    strategy.__init__(devices, cross_device_ops)
    if getattr(strategy.extended, "_collective_key_base", None) != base:
        raise _patch.CompatError(
            "tf.distribute.MirroredStrategy no longer reads its collective key base from the "
            "instance (MirroredExtended._collective_key_base); tfdist cannot give its "
            "strategies their own keys. See tfdist.compat.SUPPORTED for the tested versions.")
    return strategy

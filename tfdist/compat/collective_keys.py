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


# --- a further MultiWorkerMirroredStrategy in a process that already joined its cluster ------

_multi_worker_counter = itertools.count(1)


def _check_multi_worker(strategy_class, extended_class) -> None:
    _patch.require_signature(strategy_class.__init__, "cluster_resolver",
                             "communication_options",
                             what="tf.distribute.MultiWorkerMirroredStrategy.__init__")
    _patch.require_signature(extended_class.__init__, "container_strategy", "cluster_resolver",
                             "communication_options", "devices",
                             what="CollectiveAllReduceExtended.__init__")
    _patch.require_attributes(strategy_class, "_collective_key_base",
                              what="tf.distribute.MultiWorkerMirroredStrategy")
    _patch.require_attributes(extended_class, "_initialize_multi_worker",
                              what="CollectiveAllReduceExtended")


def joined_multi_worker_strategy(communication_options):
    """Another `tf.distribute.MultiWorkerMirroredStrategy` on the server this process runs.

    TensorFlow's constructor configures collective ops and starts this task's
    server (`context.enable_collective_ops`), which works once per process:
    a later constructor reconfigures the running server under the collectives
    of the earlier strategy ("Enabling collective ops after program startup may
    cause error"; peers then log "Delete called on non-empty BufRendezvous").
    The strategy made here joins the server the first strategy started (its
    extended object says the server is started, `_std_server_started`, which
    TensorFlow's `_initialize_multi_worker` checks; configuring collective ops
    again with the same leader is a no-op there), and its collective group keys
    start after a base no earlier strategy of this process used, so its
    collectives never meet those of an earlier strategy. Every task makes its
    strategies in the same order, so every task picks the same base.

    Args:
      communication_options: `tf.distribute.experimental.CommunicationOptions`.

    Returns:
      The strategy (this process's TF_CONFIG cluster, one replica per local device).

    Raises:
      CompatError: TensorFlow's MultiWorkerMirroredStrategy is not shaped as this expects.
    """
    from tfdist._tf import import_tensorflow

    tf = import_tensorflow()
    from tensorflow.python.distribute import collective_all_reduce_strategy as cars
    from tensorflow.python.distribute import distribute_lib

    cls = tf.distribute.MultiWorkerMirroredStrategy
    _check_multi_worker(cls, cars.CollectiveAllReduceExtended)

    class _JoinedExtended(cars.CollectiveAllReduceExtended):
        _std_server_started = True  # the first strategy's server serves this one too

    with _lock:
        # Above the bases of tfdist's MirroredStrategies, which a worker never shares devices
        # with, and the same on every task (its own counter, advanced only here).
        base = (1_000 + next(_multi_worker_counter)) * _STRIDE
    strategy = cls.__new__(cls)
    strategy._collective_key_base = base  # read by the extended object's constructor
    distribute_lib.Strategy.__init__(
        strategy, _JoinedExtended(strategy, cluster_resolver=None,
                                  communication_options=communication_options))
    if getattr(strategy.extended, "_collective_key_base", None) != base:
        raise _patch.CompatError(
            "tf.distribute.MultiWorkerMirroredStrategy no longer reads its collective key base "
            "from the instance; tfdist cannot make a second strategy in this process. See "
            "tfdist.compat.SUPPORTED for the tested versions.")
    return strategy

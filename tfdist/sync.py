"""`GradientSync`: how the replicas of a strategy tfdist made exchange and apply gradients.

The one extension point of the optimizer update. Keras 3's TensorFlow
optimizer all-reduces the gradients in each replica and then applies them
(`TFOptimizer._backend_update_step`); under a strategy tfdist made, that step
(the fix in tfdist.compat.optimizer_update) asks the strategy's GradientSync
instead:

    class KeepLocal(tfdist.sync.GradientSync):     # e.g. communication removed
        def reduce(self, optimizer, grads_and_vars, keras_all_reduce):
            return grads_and_vars

    tfdist.sync.set_gradient_sync(strategy, KeepLocal())

tfdist's own: the default (Keras's all-reduce, duplicate sparse indices
summed), `tfdist.comm.CommSync` (compression, buckets) and
`tfdist.sharding.sync.ShardedSync` (ZeRO). Strategies tfdist did not make have
none: Keras's code runs unchanged.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Callable, Sequence

from tfdist import state as state_lib

GradsAndVars = Sequence[tuple[Any, Any]]


class GradientSync:
    """How the replicas of one strategy combine their gradients and apply them.

    Subclasses override `reduce` (what crosses the wire) and/or `apply` (how
    the reduced gradients update the variables). Both run in replica context.
    """

    #: `reduce` returns every variable's whole summed gradient, so clipping
    #: (clipnorm, global_clipnorm, clipvalue) runs on it as on one device.
    #: False for syncs that hand each replica a shard (Keras's per-replica
    #: clipping then stays).
    reduces_whole_gradients = True

    #: A LossScaleOptimizer's update sums the (scaled) gradients with `reduce` before
    #: it decides whether they are finite, instead of inside the update it may skip
    #: (tfdist.compat.loss_scale): for syncs whose `reduce` is a plain sum over
    #: replicas that keeps no state a skipped step would corrupt. Off unless a sync
    #: says so (a sync that leaves gradients local must not: each replica would then
    #: decide alone).
    reduces_before_loss_scale = False

    def reduce(self, optimizer: Any, grads_and_vars: GradsAndVars,
               keras_all_reduce: Callable[[GradsAndVars], GradsAndVars]) -> GradsAndVars:
        """The all-reduced (summed over replicas) gradients, duplicates summed.

        Duplicates stay slice by slice for an optimizer passed to `keep_sparse_slices`.
        """
        summing = sums_duplicates(optimizer)
        return [(sum_duplicate_indices(g) if summing else g, v)
                for g, v in keras_all_reduce(grads_and_vars)]

    def apply(self, optimizer: Any, grads_and_vars: GradsAndVars, learning_rate: Any,
              keras_apply: Callable[[GradsAndVars, Any], None]) -> None:
        """Applies the reduced gradients (default: Keras's own distributed update)."""
        keras_apply(grads_and_vars, learning_rate)


class _KerasSum(GradientSync):
    """Keras's own all-reduce (a sum over replicas), duplicate sparse indices summed."""

    reduces_before_loss_scale = True


DEFAULT_SYNC = _KerasSum()


def set_gradient_sync(strategy: Any, sync: GradientSync) -> None:
    """Makes `sync` the way `strategy` (one tfdist made) exchanges and applies gradients.

    Raises:
      ValueError: `strategy` was not made by `tfdist.make_strategy`.
    """
    state = state_lib.state_of(strategy)
    if state is None:
        raise ValueError(
            "set_gradient_sync takes a strategy made by tfdist.make_strategy; tfdist never "
            f"changes how other strategies train. Received: {type(strategy).__name__}.")
    state.gradient_sync = sync


def gradient_sync(strategy: Any) -> GradientSync | None:
    """The GradientSync of a strategy tfdist made (DEFAULT_SYNC unless set); None otherwise."""
    state = state_lib.state_of(strategy)
    if state is None:
        return None
    return DEFAULT_SYNC if state.gradient_sync is None else state.gradient_sync


_kept_slices: "weakref.WeakSet[Any]" = weakref.WeakSet()
_kept_lock = threading.Lock()


def keep_sparse_slices(optimizer: Any) -> Any:
    """Leaves `optimizer`'s sparse gradients as Keras applies them (slice by slice); returns it.

    The opt-out of the duplicate-index sum that the GradientSyncs of tfdist's
    strategies apply: the run then reproduces a plain single-device TensorFlow
    run's arithmetic. Users call `tfdist.keep_duplicate_sparse_slices`.
    """
    with _kept_lock:
        _kept_slices.add(optimizer)
    return optimizer


def sums_duplicates(optimizer: Any) -> bool:
    """False for an optimizer passed to `keep_sparse_slices` (its sparse gradients stay)."""
    with _kept_lock:
        return optimizer not in _kept_slices


def sum_duplicate_indices(gradient: Any) -> Any:
    """An IndexedSlices gradient with each index once (its slices summed); others unchanged.

    Any value dtype (float16/bfloat16 are summed in their own dtype, as
    TensorFlow's optimizers do) and int32/int64 indices; `dense_shape` is kept.
    """
    from tfdist._tf import import_tensorflow

    tf = import_tensorflow()
    if not isinstance(gradient, tf.IndexedSlices):
        return gradient
    unique, positions = tf.unique(gradient.indices)
    values = tf.math.unsorted_segment_sum(gradient.values, positions, tf.shape(unique)[0])
    return tf.IndexedSlices(values, unique, gradient.dense_shape)

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

    #: `reduce` returns every variable's whole summed gradient. False for syncs that
    #: hand each replica a shard.
    reduces_whole_gradients = True

    #: A LossScaleOptimizer's update sums the (scaled) gradients with `reduce` before
    #: it decides whether they are finite, instead of inside the update it may skip
    #: (tfdist.compat.loss_scale): for syncs whose `reduce` is a plain sum over
    #: replicas that keeps no state a skipped step would corrupt. Off unless a sync
    #: says so (a sync that leaves gradients local must not: each replica would then
    #: decide alone).
    reduces_before_loss_scale = False

    #: `reduce_counted` sums each replica's example count in the collective that sums its
    #: gradients, so a step whose replicas hold different numbers of examples (an epoch's
    #: last, partial batch) averages over examples as one device does
    #: (`sum_over_replicas`). Off unless a sync implements it: the replicas' means are
    #: then averaged with equal weights, as TensorFlow's strategies do.
    weights_examples = False

    def reduce(self, optimizer: Any, grads_and_vars: GradsAndVars,
               keras_all_reduce: Callable[[GradsAndVars], GradsAndVars]) -> GradsAndVars:
        """The all-reduced (summed over replicas) gradients, duplicates summed.

        Duplicates stay slice by slice for an optimizer passed to `keep_sparse_slices`.
        """
        summing = sums_duplicates(optimizer)
        return [(sum_duplicate_indices(g) if summing else g, v)
                for g, v in keras_all_reduce(grads_and_vars)]

    def reduce_counted(self, optimizer: Any, grads_and_vars: GradsAndVars, count: Any,
                       keras_all_reduce: Callable[[GradsAndVars], GradsAndVars]
                       ) -> tuple[GradsAndVars, Any]:
        """`reduce`, with the float32 scalar `count` summed over replicas by a collective it
        already runs (no collective of its own). Returns (reduced, summed count). Only
        called where `weights_examples` is True."""
        raise NotImplementedError(f"{type(self).__name__} does not weight examples")

    @property
    def clips_reduced_gradients(self) -> bool:
        """Clipping (clipnorm, global_clipnorm, clipvalue) runs on the summed gradients, after
        `reduce`, through `clip`, as one device clips; otherwise Keras's own clipping of each
        replica's share stays. By default where `reduce` returns whole gradients."""
        return self.reduces_whole_gradients

    def clip(self, optimizer: Any, grads_and_vars: GradsAndVars,
             keras_clip: Callable[[list], list]) -> list:
        """The reduced gradients clipped as one device clips the whole summed gradients.

        `keras_clip` is the optimizer's own clipping of a list of whole gradients (None
        entries pass). Called in replica context where `clips_reduced_gradients`.
        """
        pairs = list(grads_and_vars)
        return list(zip(keras_clip([g for g, _ in pairs]), [v for _, v in pairs]))

    def apply(self, optimizer: Any, grads_and_vars: GradsAndVars, learning_rate: Any,
              keras_apply: Callable[[GradsAndVars, Any], None]) -> None:
        """Applies the reduced gradients (default: Keras's own distributed update)."""
        keras_apply(grads_and_vars, learning_rate)


class _KerasSum(GradientSync):
    """Keras's own all-reduce (a sum over replicas), duplicate sparse indices summed."""

    reduces_before_loss_scale = True
    weights_examples = True

    def reduce_counted(self, optimizer, grads_and_vars, count, keras_all_reduce):
        # Keras's all-reduce sums every dense value it is given in one packed collective
        # and never reads the variable of a pair: the count rides along as one more value.
        reduced = self.reduce(optimizer, list(grads_and_vars) + [(count, None)],
                              keras_all_reduce)
        return reduced[:-1], reduced[-1][0]


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


def sum_over_replicas(sync: GradientSync, optimizer: Any, grads_and_vars: GradsAndVars,
                      keras_all_reduce: Callable[[GradsAndVars], GradsAndVars], *,
                      examples: Any = None, replicas: int = 0) -> list:
    """`sync.reduce` of one replica's gradients, as a mean over the step's examples.

    Inside `fit`'s step under a tfdist mirrored / multi_worker_mirrored strategy, each
    replica's gradient arrives as the gradient of the mean loss over its own examples,
    times 1/`replicas` (tfdist.compat.keras_losses). Summed, that averages the replicas'
    means: right where every replica holds as many examples as the others, and not for a
    batch split unevenly, where one device takes the mean over all of them. An epoch's
    last batch of 25 on 2 replicas is 13 + 12 (each of the 12 then weighs 1/24 instead of
    1/25); 2 workers that read their own shard can end an epoch on 32 + 8.

    With `examples` (this replica's example count, a scalar tensor) and a sync that
    `weights_examples`, each gradient is multiplied by examples x replicas (the sum over
    this replica's examples), summed together with the count in the collective that sums
    the gradients anyway, and divided by the summed count: the mean over every example of
    the step, as one device computes it, at no extra collective. With equal shares the
    factor is the summed count, so the result is the unweighted one up to rounding (the
    same bits for a power-of-two batch). Left unweighted (equal weights per replica, as
    TensorFlow's strategies do): syncs that do not implement it (ZeRO-3, PowerSGD,
    fp16/bf16 compression, a user's own), gradients other than float32, and no `examples`:
    updates outside the step's replica thread, and optimizers with variables whose
    "gradient" is a new value (`overwrite_with_gradient`, float8 scales; the caller,
    tfdist.compat.optimizer_update, passes none for them).
    """
    grads_and_vars = list(grads_and_vars)
    if examples is None or replicas < 2 or not sync.weights_examples:
        return list(sync.reduce(optimizer, grads_and_vars, keras_all_reduce))
    from tfdist._tf import import_tensorflow

    tf = import_tensorflow()
    present = [g for g, _ in grads_and_vars if g is not None]
    if (not present
            or any((g.values if isinstance(g, tf.IndexedSlices) else g).dtype != tf.float32
                   for g in present)):
        return list(sync.reduce(optimizer, grads_and_vars, keras_all_reduce))
    count = tf.cast(examples, tf.float32)
    weight = count * float(replicas)
    summed, total = sync.reduce_counted(
        optimizer, [(map_values(g, lambda t: t * weight), v) for g, v in grads_and_vars],
        count, keras_all_reduce)
    return [(map_values(g, lambda t: tf.math.divide_no_nan(t, total)), v) for g, v in summed]


def map_values(gradient: Any, fn: Callable[[Any], Any]) -> Any:
    """`fn` applied to a gradient's values: a dense tensor's, or an IndexedSlices' slices
    (indices and shape kept); None stays None."""
    from tfdist._tf import import_tensorflow

    tf = import_tensorflow()
    if gradient is None:
        return None
    if isinstance(gradient, tf.IndexedSlices):
        return tf.IndexedSlices(fn(gradient.values), gradient.indices, gradient.dense_shape)
    return fn(tf.convert_to_tensor(gradient))

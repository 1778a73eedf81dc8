"""The optimizer's distributed update step, for strategies tfdist made: one hook, one fix.

Keras 3's TensorFlow optimizer (`keras/src/backend/tensorflow/optimizer.py`,
`TFOptimizer._backend_update_step`) runs, in each replica:

    grads_and_vars = self._all_reduce_sum_gradients(grads_and_vars)   # SUM over replicas
    maybe_merge_call(self._distributed_tf_update_step, strategy, grads_and_vars, lr)

That is the only place where replicas exchange gradients, so it is where
tfdist plugs in how they are exchanged (compression, bucketing: tfdist.comm;
reduce-scatter and sharded updates: tfdist.sharding). Each strategy tfdist
made carries a `GradientSync`; strategies tfdist did not make (a user's own
MirroredStrategy, the default strategy) run Keras's code unchanged.

The default `GradientSync` fixes one upstream bug on the way (no upstream
issue yet; introduced with sparse optimizer support in keras-team/keras#18692;
minimal reproduction in docs/numerics.md for an upstream report): Keras's TF-backend
optimizers update an `IndexedSlices` gradient one slice at a time, so an index
that appears twice gets Adam's second moment g1^2 + g2^2 instead of
(g1 + g2)^2; and a cross-replica all-reduce of `IndexedSlices` concatenates
the replicas' slices, so every index a batch touches is duplicated across
replicas (TensorFlow's CollectiveAllReduce, MirroredStrategy's and
MultiWorkerMirroredStrategy's default on CPUs, all-gathers the slices;
ReductionToOneDevice concatenates them). TensorFlow's own optimizers and
tf_keras sum duplicate indices first (`_deduplicate_indexed_slices`); so
does tfdist, after the all-reduce. Gradients that arrive dense (an embedding
tied to an output layer) are left alone. The public single-device opt-in is
`tfdist.sum_duplicate_sparse_gradients(optimizer)` (tfdist/numerics.py).
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Callable, Sequence

from tfdist.compat import _owner, _patch

UPSTREAM_ISSUE = "keras-team/keras#18692 (sparse updates slice by slice; not yet reported)"

GradsAndVars = Sequence[tuple[Any, Any]]


class GradientSync:
    """How the replicas of one strategy combine their gradients and apply them.

    Subclasses override `reduce` (what crosses the wire) and/or `apply` (how
    the reduced gradients update the variables). Both run in replica context.
    """

    def reduce(self, optimizer: Any, grads_and_vars: GradsAndVars,
               keras_all_reduce: Callable[[GradsAndVars], GradsAndVars]) -> GradsAndVars:
        """The all-reduced (summed over replicas) gradients, duplicates summed."""
        return [(sum_duplicate_indices(g), v) for g, v in keras_all_reduce(grads_and_vars)]

    def apply(self, optimizer: Any, grads_and_vars: GradsAndVars, learning_rate: Any,
              keras_apply: Callable[[GradsAndVars, Any], None]) -> None:
        """Applies the reduced gradients (default: Keras's own distributed update)."""
        keras_apply(grads_and_vars, learning_rate)


DEFAULT_SYNC = GradientSync()

_syncs: "weakref.WeakKeyDictionary[Any, GradientSync]" = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def set_gradient_sync(strategy: Any, sync: GradientSync) -> None:
    """Makes `sync` the way `strategy` (one tfdist made) exchanges and applies gradients."""
    if not _owner.owns(strategy):
        raise ValueError(
            "set_gradient_sync takes a strategy made by tfdist.make_strategy; tfdist never "
            f"changes how other strategies train. Received: {type(strategy).__name__}.")
    with _lock:
        _syncs[strategy] = sync


_opted_in: "weakref.WeakSet[Any]" = weakref.WeakSet()


def opt_in(optimizer: Any) -> Any:
    """Sums duplicate sparse-gradient indices for `optimizer` under any strategy; returns it.

    Strategies tfdist made do this already; this is the explicit opt-in for an
    optimizer used without one (plain single-device Keras keeps Keras's
    behaviour unless asked). Users call `tfdist.sum_duplicate_sparse_gradients`,
    which validates its argument and includes a LossScaleOptimizer's inner one.
    """
    install()
    with _lock:
        _opted_in.add(optimizer)
    return optimizer


def gradient_sync(strategy: Any, optimizer: Any = None) -> GradientSync | None:
    """The GradientSync for `strategy`; None where Keras's own code must run.

    Strategies tfdist made have one (DEFAULT_SYNC unless set); other
    strategies have none, unless `optimizer` was passed to `opt_in`.
    """
    with _lock:
        if _owner.owns(strategy):
            return _syncs.get(strategy, DEFAULT_SYNC)
        if optimizer is not None and optimizer in _opted_in:
            return DEFAULT_SYNC
    return None


def variable_key(optimizer: Any, variable: Any) -> str:
    """The key a Keras optimizer files `variable`'s state under (its private `_var_key`).

    The same for the Keras variable and the tf.Variable the update step
    receives, so a GradientSync can find per-variable state it keeps.
    """
    return optimizer._var_key(variable)


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


# --- the fix ---------------------------------------------------------------------


def _target():
    from tfdist._tf import import_tensorflow

    import_tensorflow()
    from keras.src.backend.tensorflow import optimizer as tf_optimizer

    return tf_optimizer.TFOptimizer, "_backend_update_step"


def _check(original) -> None:
    from keras.src.backend.tensorflow import optimizer as tf_optimizer

    _patch.require_signature(original, "grads", "trainable_variables", "learning_rate",
                             what="TFOptimizer._backend_update_step")
    _patch.require_attributes(tf_optimizer.TFOptimizer, "_all_reduce_sum_gradients",
                              "_distributed_tf_update_step")


def _make(original):
    from tfdist._tf import import_tensorflow

    tf = import_tensorflow()
    from keras.src import backend

    def applies(self, grads, trainable_variables, learning_rate):
        return gradient_sync(getattr(self, "_distribution_strategy", None), self) is not None

    @_patch.passthrough(original, applies)
    def _backend_update_step(self, grads, trainable_variables, learning_rate):
        sync = gradient_sync(self._distribution_strategy, self)
        variables = [v.value if isinstance(v, backend.Variable) else v
                     for v in trainable_variables]
        grads_and_vars = sync.reduce(self, list(zip(grads, variables)),
                                     self._all_reduce_sum_gradients)

        def keras_apply(reduced, lr):
            tf.__internal__.distribute.interim.maybe_merge_call(
                self._distributed_tf_update_step, self._distribution_strategy,
                list(reduced), lr)

        sync.apply(self, grads_and_vars, learning_rate, keras_apply)

    return _backend_update_step


FIX = _patch.Fix(
    name="optimizer_update.backend_update_step",
    issue=UPSTREAM_ISSUE,
    target=_target,
    check=_check,
    make=_make,
)


def install() -> bool:
    """Routes the optimizer update of tfdist's strategies through their GradientSync."""
    return _patch.install(FIX)

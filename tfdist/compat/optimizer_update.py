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

A second fix moves gradient clipping after the all-reduce. Keras 3's
`BaseOptimizer.apply` clips (`clipnorm`, `global_clipnorm`, `clipvalue`) in
`_clip_gradients` before `_backend_update_step`, so under a strategy each
replica clips its own share and the shares are summed: with 2 replicas the
update is neither one device's nor bounded by the clip (tests/test_clipping.py's
negative control: the same tfdist strategy with this fix taken out). The TensorFlow team's
view, when tf.keras 2.2 refused clipping under strategies for this reason
(tensorflow/tensorflow#33929; also #25806): clipping after aggregation is
"usually right & what people expect"; keras-team/keras#20585 tracks Keras 3
under tf.distribute. Under a strategy tfdist made with more than one replica whose
GradientSync returns whole gradients, `_clip_gradients` passes the
gradients through unchanged and the update step clips the summed ones with
Keras's own `_clip_gradients`; everywhere else Keras's code runs.
"""

from __future__ import annotations

import functools
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

    #: `reduce` returns every variable's whole summed gradient, so clipping
    #: (clipnorm, global_clipnorm, clipvalue) runs on it as on one device.
    #: False for syncs that hand each replica a shard (Keras's per-replica
    #: clipping then stays).
    reduces_whole_gradients = True

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


def clips_after_reduce(optimizer: Any) -> bool:
    """True if `optimizer`'s gradients are clipped after the all-reduce (see the module doc).

    Only under a strategy tfdist made, with more than one replica, whose
    GradientSync returns whole gradients; False for every other optimizer.
    """
    strategy = getattr(optimizer, "_distribution_strategy", None)
    if not _owner.owns(strategy) or strategy.num_replicas_in_sync < 2:
        return False
    sync = gradient_sync(strategy, optimizer)
    return sync is not None and sync.reduces_whole_gradients


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
        clip = _deferred_clip(self)
        if clip is not None:  # the clip_gradients fix let this replica's share through
            reduced = list(grads_and_vars)
            grads_and_vars = list(zip(clip([g for g, _ in reduced]), [v for _, v in reduced]))

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

CLIP_ISSUE = ("keras-team/keras#20585 (Keras 3 under tf.distribute); tensorflow/tensorflow#33929 "
              "and #25806 (gradients clipped per replica before aggregation)")


def _clip_target():
    from tfdist._tf import import_tensorflow

    import_tensorflow()
    from keras.src.optimizers import base_optimizer

    return base_optimizer.BaseOptimizer, "_clip_gradients"


def _clip_check(original) -> None:
    import inspect

    from keras.src.optimizers import base_optimizer

    _patch.require_signature(original, "grads", what="BaseOptimizer._clip_gradients")
    options = inspect.signature(base_optimizer.BaseOptimizer.__init__).parameters
    missing = [name for name in ("clipnorm", "global_clipnorm", "clipvalue") if name not in options]
    if missing:
        raise _patch.CompatError(
            f"BaseOptimizer.__init__ has no {', '.join(missing)}; the tfdist clipping fix was "
            "written for Keras optimizers that clip by clipnorm, global_clipnorm and clipvalue. "
            "See tfdist.compat.SUPPORTED for the tested versions.")


# Per thread (MirroredStrategy traces each replica in its own thread): optimizer id ->
# Keras's clipping, bound to the optimizer, that `_clip_gradients` deferred in this step.
_pending = threading.local()


def _deferred_clip(optimizer: Any) -> Callable[[list], list] | None:
    return getattr(_pending, "clips", {}).pop(id(optimizer), None)


def _make_clip(original):
    def _clip_gradients(self, grads):
        clips = _pending.__dict__.setdefault("clips", {})
        clips.pop(id(self), None)
        if not clips_after_reduce(self):
            return original(self, grads)
        clips[id(self)] = lambda reduced: original(self, reduced)
        return grads  # clipped after the all-reduce, in _backend_update_step

    return functools.wraps(original)(_clip_gradients)


CLIP_FIX = _patch.Fix(
    name="optimizer_update.clip_gradients",
    issue=CLIP_ISSUE,
    target=_clip_target,
    check=_clip_check,
    make=_make_clip,
)


def install() -> bool:
    """Routes the optimizer update of tfdist's strategies through their GradientSync.

    Also installs the clipping fix (clip after the all-reduce); both or neither.
    """
    return bool(_patch.install_all((FIX, CLIP_FIX)))

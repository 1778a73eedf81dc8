"""BatchNormalization (and every replica-updated state) under tfdist's synchronous strategies.

Two fixes, both for strategies tfdist made only (a user's own strategy and
plain single-device Keras run stock Keras):

1. **Replica copies stay identical (always on).** Keras 3 creates layer
   state such as BatchNormalization's `moving_mean` / `moving_variance` with
   aggregation NONE; a MirroredVariable with aggregation NONE assigned in
   replica context updates only that replica's copy (TensorFlow's
   `values._on_write_update_replica`), and each replica assigns the
   statistics of its own slice of the batch, so the copies drift apart
   (Keras 3.15.1 + TF 2.21 MirroredStrategy, 2 replicas, Dense -> BN ->
   Dense, 4 steps: 1.4e-2). Which copy a saved model, `evaluate` or
   `predict` sees is then an accident. tf_keras avoided it by making the
   moving statistics sync-on-read MEAN variables; that keeps the read
   value right but still lets each replica normalise with its own copy in
   `evaluate` and `predict`. tfdist instead averages the assigned value
   across replicas at each assignment: every copy holds the same number (so
   saving, checkpoints, `evaluate` and `predict` see one value), and for an
   exponential moving average the result equals tf_keras's read value
   (the average of per-replica averages is the average of the averages).
   Scope: Keras variables whose TensorFlow variable is a mirrored
   (ON_WRITE) distributed variable with aggregation NONE and a floating
   dtype, assigned in replica context with more than one replica in sync.
   Integer state (seed generators, counters) advances identically on every
   replica and is left alone; variables with another aggregation (metrics,
   `optimizer.iterations`) already have TensorFlow's own rule.
   Cost: one all-reduce of the variable's size per assignment (two per BN
   layer per training step, C floats each).

2. **Global-batch statistics (opt-in: `sync_batch_norm=True`).** With it,
   `BatchNormalization` computes the batch mean and variance over the global
   batch (every replica's slice), so a replicated step equals the
   single-device step on the same global batch. Keras has
   `BatchNormalization(synchronized=True)`; tfdist computes the same thing
   itself so that it applies to layers it did not configure (keras.applications,
   KerasHub) without changing their saved config, supports masks (Keras's
   synchronized path ignores them), and uses a two-pass variance (Keras's
   E[x^2] - E[x]^2 loses digits when |mean| >> std). Cost: two all-reduces
   per BN layer per training step (sum and count, then squared deviations;
   2C + 1 and C floats), on the forward pass and again on the backward pass.

Upstream: the moving-statistics drift is not yet reported to keras-team/keras
(related: keras-team/keras#18667 and #18671, which added `synchronized`;
tensorflow/tensorflow#46488 is the tf.keras-era symptom). Minimal
reproduction: docs/numerics.md.
"""

from __future__ import annotations

from typing import Any

from tfdist import state as state_lib
from tfdist.compat import _owner, _patch

UPSTREAM_ISSUE = ("not yet reported to keras-team/keras (moving statistics are NONE-aggregated "
                  "MirroredVariables updated per replica); related keras-team/keras#18667")

def configure(strategy: Any, *, sync_batch_norm: bool) -> None:
    """Installs both fixes and sets whether `strategy` uses global-batch BN statistics.

    Args:
      strategy: a strategy made by `tfdist.make_strategy`.
      sync_batch_norm: compute BatchNormalization's batch statistics over the
        global batch (all replicas) instead of each replica's slice.

    Raises:
      ValueError: `strategy` was not made by tfdist.
    """
    state = state_lib.state_of(strategy)
    if state is None:
        raise ValueError(
            "batch_norm.configure takes a strategy made by tfdist.make_strategy; tfdist never "
            f"changes how other strategies train. Received: {type(strategy).__name__}.")
    install()
    state.sync_batch_norm = bool(sync_batch_norm)


def syncs_batch_norm(strategy: Any) -> bool:
    """True if `strategy` (one tfdist made) computes BN statistics over the global batch."""
    state = state_lib.state_of(strategy)
    return state is not None and state.sync_batch_norm


# --- shared helpers ----------------------------------------------------------------


def _tf():
    from tfdist._tf import import_tensorflow

    return import_tensorflow()


def _replica_context_of_owned_strategy():
    """The replica context of a tfdist strategy with >1 replica where replicas can sync, or None.

    None also inside a `tf.cond` / `tf.while_loop` branch opened in a
    MirroredStrategy replica function: TensorFlow allows no cross-replica
    `merge_call` there (Keras's LossScaleOptimizer updates its loss scale in
    such a branch). Assignments there keep Keras's per-replica behaviour.
    """
    tf = _tf()
    if not tf.distribute.has_strategy() or tf.distribute.in_cross_replica_context():
        return None
    context = tf.distribute.get_replica_context()
    if context is None or not _owner.owns(context.strategy):
        return None
    if context.num_replicas_in_sync <= 1 or not _can_sync_here(context):
        return None
    return context


def _can_sync_here(context) -> bool:
    """Whether `context.all_reduce` may run here (mirrors TensorFlow's merge_call check)."""
    if not context.strategy.extended._use_merge_call():  # collectives without merge_call
        return True
    import threading

    from tensorflow.python.framework import ops

    # MirroredStrategy runs each replica in a thread that records the graph it traces
    # into; merge_call raises when the default graph is another (a control-flow branch).
    replica_graph = getattr(threading.current_thread(), "graph", None)
    return replica_graph is None or ops.get_default_graph() is replica_graph


# --- fix 1: replica-updated variables are averaged at each assignment ------------------


def _mirrored_none_aggregation(value: Any) -> bool:
    """True for a floating mirrored (ON_WRITE) distributed variable with aggregation NONE."""
    tf = _tf()
    from tensorflow.python.distribute import values as values_lib

    return (isinstance(value, values_lib.MirroredVariable)
            and value.aggregation == tf.VariableAggregation.NONE
            and value.dtype.is_floating)


def _assign_target():
    _tf()
    from keras.src.backend.tensorflow import core

    return core.Variable, "_direct_assign"


def _check_sync_points() -> None:
    from tensorflow.python.distribute import mirrored_run, mirrored_strategy

    _patch.require_attributes(mirrored_strategy.MirroredExtended, "_use_merge_call",
                              what="MirroredStrategy's extended")
    _patch.require_attributes(mirrored_run, "_MirroredReplicaThread",
                              what="tensorflow.python.distribute.mirrored_run")


def _assign_check(original) -> None:
    from keras.src.backend.tensorflow import core

    _check_sync_points()

    _patch.require_signature(original, "value", what="keras TF Variable._direct_assign")
    # assign/assign_add/assign_sub all end in _direct_assign (BatchNormalization's moving-statistics
    # updates in tests/numerics/ go through it); the replacement reads the TF variable `_initialize`
    # stores in `_value`.
    _patch.require_attributes(core.Variable, "assign", "assign_add", "assign_sub", "_initialize",
                              what="keras TF Variable")


def _assign_make(original):
    def applies(self, value):
        return (_replica_context_of_owned_strategy() is not None
                and _mirrored_none_aggregation(getattr(self, "_value", None)))

    @_patch.passthrough(original, applies)
    def _direct_assign(self, value):
        tf = _tf()
        context = _replica_context_of_owned_strategy()
        value = tf.cast(value, self._value.dtype)
        # Every replica assigns the same (averaged) value, so the copies stay equal.
        return original(self, context.all_reduce(tf.distribute.ReduceOp.MEAN, value))

    return _direct_assign


REPLICA_STATE_FIX = _patch.Fix(
    name="batch_norm.replica_state_mean",
    issue=UPSTREAM_ISSUE,
    target=_assign_target,
    check=_assign_check,
    make=_assign_make,
)


# --- fix 2: global-batch statistics (sync_batch_norm) ------------------------------------


def global_moments(inputs: Any, axes: list[int] | tuple[int, ...], mask: Any = None,
                   *, mask_epsilon: float = 0.0):
    """Mean and variance of `inputs` over `axes` and over every replica in sync.

    Two all-reduces: (sum, count), then the sum of squared deviations from the
    global mean. With `mask` (shape of `inputs` minus the last axis), only
    unmasked positions count, as in Keras's masked BatchNormalization
    (`mask_epsilon` is added to the count there, as Keras does).
    Outside a replica context of a multi-replica strategy: one replica's moments.

    Returns:
      (mean, variance), each shaped like `inputs` reduced over `axes`.
    """
    tf = _tf()
    context = tf.distribute.get_replica_context()
    dtype = inputs.dtype
    x = tf.cast(inputs, tf.float32) if dtype in (tf.float16, tf.bfloat16) else inputs
    if mask is None:
        weights = tf.ones_like(x)
    else:
        weights = tf.cast(tf.broadcast_to(tf.expand_dims(mask, -1), tf.shape(x)), x.dtype)
    local_sum = tf.reduce_sum(x * weights, axis=axes)
    local_count = tf.reduce_sum(weights, axis=axes)
    packed = tf.concat([local_sum, local_count], axis=0)
    if context is not None and context.num_replicas_in_sync > 1:
        packed = context.all_reduce(tf.distribute.ReduceOp.SUM, packed)
    total, count = tf.split(packed, 2, axis=0)
    count = count + mask_epsilon
    mean = total / count
    deviations = tf.reduce_sum(tf.square(x - tf.stop_gradient(mean)) * weights, axis=axes)
    if context is not None and context.num_replicas_in_sync > 1:
        deviations = context.all_reduce(tf.distribute.ReduceOp.SUM, deviations)
    variance = deviations / count
    if x.dtype != dtype:
        mean = tf.cast(tf.clip_by_value(mean, dtype.min, dtype.max), dtype)
        variance = tf.cast(tf.clip_by_value(variance, dtype.min, dtype.max), dtype)
    return mean, variance


def _moments_target():
    _tf()
    from keras.src.layers.normalization import batch_normalization

    return batch_normalization.BatchNormalization, "_moments"


def _moments_check(original) -> None:
    from keras.src.layers.normalization import batch_normalization

    _check_sync_points()
    _patch.require_signature(original, "inputs", "mask", what="BatchNormalization._moments")
    # What the replacement reads from the layer (set in __init__ / build).
    layer = batch_normalization.BatchNormalization()
    _patch.require_attributes(layer, "synchronized", "_reduction_axes",
                              what="BatchNormalization")


def _moments_make(original):
    def applies(self, inputs, mask):
        context = _replica_context_of_owned_strategy()
        return (context is not None and syncs_batch_norm(context.strategy)
                and not self.synchronized)  # synchronized=True: Keras already syncs

    @_patch.passthrough(original, applies)
    def _moments(self, inputs, mask):
        from keras.src import backend

        epsilon = 0.0 if mask is None else backend.epsilon()
        return global_moments(inputs, self._reduction_axes, mask, mask_epsilon=epsilon)

    return _moments


SYNC_MOMENTS_FIX = _patch.Fix(
    name="batch_norm.sync_moments",
    issue="keras-team/keras#18667 (synchronized is per layer; tfdist applies it per strategy)",
    target=_moments_target,
    check=_moments_check,
    make=_moments_make,
)


def install() -> tuple[str, ...]:
    """Installs both fixes (idempotent); they act only under strategies tfdist made.

    Returns:
      The names of the fixes this call installed (none when both already were).
    """
    return tuple(fix.name for fix in (REPLICA_STATE_FIX, SYNC_MOMENTS_FIX)
                 if _patch.install(fix))

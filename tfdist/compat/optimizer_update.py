"""The optimizer's distributed update step, for strategies tfdist made: one hook, one fix.

Keras 3's TensorFlow optimizer (`keras/src/backend/tensorflow/optimizer.py`,
`TFOptimizer._backend_update_step`) runs, in each replica:

    grads_and_vars = self._all_reduce_sum_gradients(grads_and_vars)   # SUM over replicas
    maybe_merge_call(self._distributed_tf_update_step, strategy, grads_and_vars, lr)

That is the only place where replicas exchange gradients, so it is where
tfdist plugs in how they are exchanged (compression, bucketing: tfdist.comm;
reduce-scatter and sharded updates: tfdist.sharding). Each strategy tfdist
made carries a `GradientSync` (tfdist/sync.py, the public extension point);
strategies tfdist did not make (a user's own MirroredStrategy, the default
strategy) run Keras's code unchanged.

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
update is neither one device's nor bounded by the clip (tests/numerics/test_clipping.py's
negative control: the same tfdist strategy with this fix taken out). The TensorFlow team's
view, when tf.keras 2.2 refused clipping under strategies for this reason
(tensorflow/tensorflow#33929; also #25806): clipping after aggregation is
"usually right & what people expect"; keras-team/keras#20585 tracks Keras 3
under tf.distribute. Under a strategy tfdist made with more than one replica whose
GradientSync clips the summed gradients (`clips_reduced_gradients`: the default
exchange, and ZeRO-1/2, whose `clip` sums the squares of the shards over replicas),
`_clip_gradients` passes the gradients through unchanged and the update step has
the GradientSync clip the summed ones with Keras's own `_clip_gradients`;
everywhere else Keras's code runs.

A third fix makes `gradient_accumulation_steps` train under tfdist's mirrored
strategies (keras-team/keras#20582, open: "the conditional in the gradient
accumulation precludes its usage under a distributed strategy"). Keras's
`BaseOptimizer._backend_apply_gradients` runs `ops.cond(is_update_step, update,
accumulate)` in replica context, and both branches reach a `merge_call`
(the all-reduce, Keras's accumulator update), which TensorFlow refuses inside a
cond: every MirroredStrategy fails at the first step, tfdist or not. The fix
does what Keras's own LossScaleOptimizer does with its cond: it all-reduces
the step's gradients through the strategy's GradientSync in replica context,
computes `(gradient + accumulated) / steps` and clips it (Keras's own
clipping) there, then takes the cond in cross-replica context (`merge_call`):
the update branch runs Keras's weight decay and its cross-replica update
(`_distributed_tf_update_step`) and zeroes the accumulators, the other adds
the summed gradients to them. The accumulators hold *summed* gradients, so
every replica's copy stays identical and a checkpoint taken between updates
resumes exactly; the price is an all-reduce at every micro-step (as PyTorch
DDP without `no_sync`), not only at updates. Syncs that apply gradients their
own way (sharding) are left to Keras's code, which sharding refuses with
accumulation. An optimizer first built inside a tf.function gets a clear error
(TensorFlow cannot run that first call's cross-replica update).
"""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref
from typing import Any, Callable, Sequence

from tfdist import sync as sync_lib
from tfdist.compat import _owner, _patch, keras_losses
from tfdist.sync import (  # noqa: F401 (the update step's names, and their former home)
    DEFAULT_SYNC,
    GradientSync,
    GradsAndVars,
    set_gradient_sync,
    sum_duplicate_indices,
)

UPSTREAM_ISSUE = "keras-team/keras#18692 (sparse updates slice by slice; not yet reported)"

_lock = threading.Lock()


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
    sync = sync_lib.gradient_sync(strategy)
    if sync is not None:
        return sync
    with _lock:
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
    return sync is not None and sync.clips_reduced_gradients


# Optimizer id -> how many of its applies are running on gradients already summed over
# replicas (a LossScaleOptimizer's, tfdist.compat.loss_scale). A count, not a thread-local:
# MirroredStrategy traces each replica in its own thread and Keras's merge_call runs the
# update in another, and all of them are inside the LossScaleOptimizer's apply meanwhile.
_reduced_already: dict[int, int] = {}


@contextlib.contextmanager
def gradients_reduced(optimizer: Any):
    """Within the block, `optimizer`'s update step takes its gradients as already summed
    over replicas (its GradientSync's `reduce` is skipped; clipping still runs)."""
    with _lock:
        _reduced_already[id(optimizer)] = _reduced_already.get(id(optimizer), 0) + 1
    try:
        yield
    finally:
        with _lock:
            _reduced_already[id(optimizer)] -= 1
            if not _reduced_already[id(optimizer)]:
                del _reduced_already[id(optimizer)]


def reduced_already(optimizer: Any) -> bool:
    """True inside `gradients_reduced(optimizer)`."""
    with _lock:
        return id(optimizer) in _reduced_already


def _reduce(sync: GradientSync, optimizer: Any, grads_and_vars: list) -> list:
    """`sum_over_replicas`, unless the gradients are summed already (`gradients_reduced`)."""
    if reduced_already(optimizer):
        return list(grads_and_vars)
    return sum_over_replicas(sync, optimizer, grads_and_vars)


def sum_over_replicas(sync: GradientSync, optimizer: Any, grads_and_vars: list) -> list:
    """`sync`'s sum of this replica's gradients, weighted by examples inside a tfdist
    strategy's `fit` step (`tfdist.sync.sum_over_replicas`; the count comes from
    tfdist.compat.keras_losses, which marks the step). Unweighted for an optimizer with
    variables whose "gradient" is a new value (`overwrite_with_gradient`, float8 scales):
    keras_losses leaves those unscaled, and so must the weighting."""
    examples = keras_losses.examples_here()
    variables = getattr(optimizer, "_trainable_variables", None) or ()
    if examples is not None and any(getattr(v, "overwrite_with_gradient", False)
                                    for v in variables):
        examples = None
    return sync_lib.sum_over_replicas(
        sync, optimizer, grads_and_vars, optimizer._all_reduce_sum_gradients,
        examples=examples, replicas=keras_losses.replicas_here())


def variable_key(optimizer: Any, variable: Any) -> str:
    """The key a Keras optimizer files `variable`'s state under (its private `_var_key`).

    The same for the Keras variable and the tf.Variable the update step
    receives, so a GradientSync can find per-variable state it keeps.
    """
    return optimizer._var_key(variable)


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

    import_tensorflow()
    from keras.src import backend

    def applies(self, grads, trainable_variables, learning_rate):
        return gradient_sync(getattr(self, "_distribution_strategy", None), self) is not None

    @_patch.passthrough(original, applies)
    def _backend_update_step(self, grads, trainable_variables, learning_rate):
        sync = gradient_sync(self._distribution_strategy, self)
        variables = [v.value if isinstance(v, backend.Variable) else v
                     for v in trainable_variables]
        grads_and_vars = _reduce(sync, self, list(zip(grads, variables)))
        clip = _deferred_clip(self)
        if clip is not None:  # the clip_gradients fix let this replica's share through
            grads_and_vars = sync.clip(self, grads_and_vars, clip)
        sync.apply(self, grads_and_vars, learning_rate, functools.partial(_keras_apply, self))

    return _backend_update_step


def _keras_apply(optimizer: Any, reduced: GradsAndVars, learning_rate: Any) -> None:
    """Keras's own distributed update (TFOptimizer._distributed_tf_update_step), from a replica."""
    from tfdist._tf import import_tensorflow

    tf = import_tensorflow()
    tf.__internal__.distribute.interim.maybe_merge_call(
        optimizer._distributed_tf_update_step, optimizer._distribution_strategy,
        list(reduced), learning_rate)


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


ACCUMULATE_ISSUE = ("https://github.com/keras-team/keras/issues/20582 (gradient accumulation's "
                    "cond reaches merge_call under a distribution strategy)")


def _accumulate_target():
    from tfdist._tf import import_tensorflow

    import_tensorflow()
    from keras.src.optimizers import base_optimizer

    return base_optimizer.BaseOptimizer, "_backend_apply_gradients"


def _accumulate_check(original) -> None:
    import inspect

    from keras.src.backend.tensorflow import optimizer as tf_optimizer
    from keras.src.optimizers import base_optimizer

    _patch.require_signature(original, "grads", "trainable_variables",
                             what="BaseOptimizer._backend_apply_gradients")
    if "gradient_accumulation_steps" not in inspect.signature(
            base_optimizer.BaseOptimizer.__init__).parameters:
        raise _patch.CompatError(
            "BaseOptimizer.__init__ has no gradient_accumulation_steps; the tfdist accumulation "
            "fix was written for Keras optimizers that accumulate into _accumulated_gradients. "
            "See tfdist.compat.SUPPORTED for the tested versions.")
    _patch.require_attributes(
        base_optimizer.BaseOptimizer, "_get_variable_index", "_clip_gradients",
        "_use_weight_decay", "_update_model_variables_moving_average",
        "_overwrite_model_variables_with_average_value", what="BaseOptimizer")
    _patch.require_attributes(tf_optimizer.TFOptimizer, "_apply_weight_decay",
                              "_all_reduce_sum_gradients", "_distributed_tf_update_step",
                              what="TFOptimizer")
    from tensorflow.python.eager.polymorphic_function import polymorphic_function

    _patch.require_attributes(polymorphic_function, "UnliftedInitializerVariable",
                              what="tensorflow.python.eager.polymorphic_function")


def _built_in_this_trace(strategy: Any, variables: Sequence[Any]) -> bool:
    """True if `variables` were created inside the tf.function being traced (lazily)."""
    from tensorflow.python.eager.polymorphic_function import polymorphic_function

    return any(isinstance(local, polymorphic_function.UnliftedInitializerVariable)
               for variable in variables
               for local in strategy.experimental_local_results(variable))


def _accumulation_route(optimizer: Any) -> str | None:
    """Where the accumulation fix takes over from Keras (see the module doc).

    "accumulate": an accumulating optimizer of a tfdist mirrored or
    multi_worker_mirrored strategy whose sync applies gradients Keras's way
    (not sharding's), in replica context; "refuse": one of tfdist's
    parameter_server preset; None: Keras's own code.
    """
    from tfdist._tf import import_tensorflow

    tf = import_tensorflow()
    strategy = getattr(optimizer, "_distribution_strategy", None)
    if not getattr(optimizer, "gradient_accumulation_steps", None) or not _owner.owns(strategy):
        return None
    if isinstance(strategy, tf.distribute.experimental.ParameterServerStrategy):
        return "refuse"
    if not isinstance(strategy, (tf.distribute.MirroredStrategy,
                                 tf.distribute.MultiWorkerMirroredStrategy)):
        return None
    sync = gradient_sync(strategy, optimizer)
    if (sync is not None and sync.reduces_whole_gradients
            and type(sync).apply is GradientSync.apply
            and tf.distribute.get_replica_context() is not None
            and not tf.distribute.in_cross_replica_context()):
        return "accumulate"
    return None


def refuse_accumulation_under_parameter_server(optimizer: Any) -> None:
    """Raises a clear ValueError for an accumulating optimizer under tfdist's parameter_server.

    Called where `fit` builds the model (tfdist/ps/trainer.py) and, for custom
    loops, where the update runs. A LossScaleOptimizer is judged by its inner one.
    """
    optimizer = getattr(optimizer, "inner_optimizer", optimizer)
    if _accumulation_route(optimizer) == "refuse":
        raise ValueError(
            f"gradient_accumulation_steps={optimizer.gradient_accumulation_steps} is not "
            "supported under tfdist's parameter_server preset: its workers train "
            "asynchronously and would share one set of accumulators on the parameter servers, "
            "so no update would be the mean of a defined set of micro-steps (and Keras's own "
            "accumulation fails there, keras-team/keras#20582). Fix: drop "
            "gradient_accumulation_steps and raise the global batch size, or train with the "
            "mirrored or multi_worker_mirrored preset, where accumulation works as on one "
            "device.")


def _make_accumulate(original):
    from tfdist._tf import import_tensorflow

    tf = import_tensorflow()
    from keras.src import backend, ops

    def applies(self, grads, trainable_variables):
        return _accumulation_route(self) is not None

    @_patch.passthrough(original, applies)
    def _backend_apply_gradients(self, grads, trainable_variables):
        refuse_accumulation_under_parameter_server(self)
        strategy = self._distribution_strategy
        sync = gradient_sync(strategy, self)
        steps = self.gradient_accumulation_steps
        variables = [v.value if isinstance(v, backend.Variable) else v
                     for v in trainable_variables]
        accumulators = [self._accumulated_gradients[self._get_variable_index(v)].value
                        for v in trainable_variables]
        if _built_in_this_trace(strategy, accumulators):
            raise ValueError(
                "gradient_accumulation_steps under a tfdist mirrored strategy: the optimizer "
                "was built inside the first call of a tf.function (a custom training loop "
                "calling apply_gradients before the optimizer had variables). TensorFlow "
                "cannot run that first call's cross-replica update (Keras's own "
                "LossScaleOptimizer stops the same way). Fix: build the optimizer before the "
                "loop, under strategy.scope(): optimizer.build(model.trainable_variables). "
                "(model.fit builds it itself.)")
        # 1. This micro-step's gradients, summed over replicas (identical on every replica).
        reduced = [g for g, _ in _reduce(sync, self, list(zip(grads, variables)))]

        # Keras's update branch, one device's arithmetic: (g + accumulated) / steps, clipped.
        # Computed in replica context at every micro-step (cheap next to the all-reduce) and
        # used by the update branch only.
        combined = [None if g is None else _dense_add(tf, g, acc) / steps
                    for g, acc in zip(reduced, accumulators)]
        combined = self._clip_gradients(combined)
        clip = _deferred_clip(self)  # the clip fix deferred: these are already reduced
        if clip is not None:
            combined = clip(combined)

        def in_cross_replica(distribution, reduced, combined):
            def update():
                _weight_decay(self, distribution, variables)
                self._distributed_tf_update_step(
                    distribution, [(g, v) for g, v in zip(combined, variables) if g is not None],
                    self.learning_rate)
                for acc in accumulators:
                    distribution.extended.update(
                        acc, lambda a: a.assign(tf.zeros_like(a)), group=False)

            def accumulate():
                for g, acc in zip(reduced, accumulators):
                    if g is not None:
                        distribution.extended.update(acc, _add_into, args=(g,), group=False)

            # In cross-replica context: a cond in replica context may not merge_call.
            ops.cond((self._iterations + 1) % steps == 0, update, accumulate)

        tf.distribute.get_replica_context().merge_call(in_cross_replica, args=(reduced, combined))

        # Keras's moving average, unchanged (BaseOptimizer._backend_apply_gradients's tail).
        if self.use_ema:
            self._update_model_variables_moving_average(self._trainable_variables)
            if self.ema_overwrite_frequency:
                ops.cond(
                    (self.iterations + 1) % self.ema_overwrite_frequency == 0,
                    lambda: self._overwrite_model_variables_with_average_value(
                        self._trainable_variables),
                    lambda: None)

    return _backend_apply_gradients


def _weight_decay(optimizer: Any, distribution: Any, variables: list) -> None:
    """TFOptimizer._apply_weight_decay's update, from cross-replica context (its own merges)."""
    from tfdist._tf import import_tensorflow

    tf = import_tensorflow()
    if optimizer.weight_decay is None:
        return

    def decay(variable):
        if optimizer._use_weight_decay(variable):
            lr = tf.cast(optimizer.learning_rate, variable.dtype)
            wd = tf.cast(optimizer.weight_decay, variable.dtype)
            variable.assign_sub(variable * wd * lr)

    for variable in variables:
        distribution.extended.update(variable, decay, group=False)


def _dense_add(tf: Any, gradient: Any, accumulator: Any) -> Any:
    """accumulator + gradient as a dense tensor (an IndexedSlices gradient scattered in)."""
    value = tf.convert_to_tensor(accumulator)
    if isinstance(gradient, tf.IndexedSlices):
        return tf.tensor_scatter_nd_add(value, tf.expand_dims(gradient.indices, -1),
                                        tf.cast(gradient.values, value.dtype))
    return value + tf.cast(gradient, value.dtype)


def _add_into(accumulator: Any, gradient: Any) -> Any:
    from tfdist._tf import import_tensorflow

    tf = import_tensorflow()
    if isinstance(gradient, tf.IndexedSlices):
        return accumulator.scatter_add(
            tf.IndexedSlices(tf.cast(gradient.values, accumulator.dtype), gradient.indices,
                             gradient.dense_shape))
    return accumulator.assign_add(tf.cast(gradient, accumulator.dtype))


ACCUMULATE_FIX = _patch.Fix(
    name="optimizer_update.gradient_accumulation",
    issue=ACCUMULATE_ISSUE,
    target=_accumulate_target,
    check=_accumulate_check,
    make=_make_accumulate,
)


def install() -> tuple[str, ...]:
    """Routes the optimizer update of tfdist's strategies through their GradientSync.

    Also installs the clipping fix (clip after the all-reduce) and the gradient
    accumulation fix; all or none.

    Returns:
      The names of the fixes this call installed.
    """
    return _patch.install_all((FIX, CLIP_FIX, ACCUMULATE_FIX))

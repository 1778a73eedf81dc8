"""Inside `fit`/`evaluate`, every loss as one device computes it; the replicas' gradients averaged.

Keras's TF backend makes a strategy's replicas agree with one device by
scaling each loss by 1/replicas where it is computed
(`keras.src.losses.loss.scale_loss_for_distribution`: every `Loss` object
calls it, and the trainer calls it again for the `add_loss` terms) and then
summing the replicas' gradients. A loss that is not computed exactly that way
trains differently from one device, silently:

- `add_loss(SomeLossObject(...)(y, p))` (keras.io's `LogisticEndpoint`) is
  scaled twice: 2 replicas log half the loss and move the weights half as far;
- a `train_step` with a loss of its own: keras.io's VAE writes its means by
  hand (never scaled: 2 replicas apply twice the gradient), keras.io's GAN uses
  `BinaryCrossentropy` objects (right gradients, but the losses it logs are
  halved); a `compute_loss` override written as Keras's docstring shows
  (`ops.mean(...)`) is never scaled either.

Under a tfdist `mirrored` / `multi_worker_mirrored` strategy with several
replicas, while the train and test steps that `fit` and `evaluate` run are
traced, these replacements make Keras's per-replica scaling a no-op, so every
loss is the value one device computes for the same examples (and is logged as
such), and they make each optimizer average the gradients it applies over the
replicas (Keras then sums them: sum/N is the mean; weighted by each replica's
examples where the batch is split unevenly, see `step_function` below). For the
losses Keras computes itself the update is the one Keras makes (for 2, 4, 8
replicas and a power-of-two batch bit for bit: halving is exact, and so is the
weighting of equal shares); the cases above now equal one device too. Custom
training loops (`strategy.run` written by the user) keep TensorFlow's rule:
scale the loss yourself (`tf.nn.compute_average_loss`), gradients are summed.
Inside a `train_step`, write the loss as for one device: dividing it by the
replicas or the global batch would divide twice.

Fixes (each passes straight through outside such a step, and for strategies
tfdist did not make):

- `keras_losses.step_function`: `TensorFlowTrainer._make_function` wraps the
  train/test step it compiles so that, while it runs on a replica, this
  replica's thread is marked (with the replica's batch: `examples_here` counts
  it, and the optimizer's update weights each replica's gradient by that count,
  `tfdist.sync.sum_over_replicas`, so a batch split unevenly averages over
  examples as one device does);
- `keras_losses.scale_loss`, `keras_losses.unscale_loss`: Keras's
  `scale_loss_for_distribution` / `unscale_loss_for_distribution` return the
  loss unchanged on a marked thread;
- `keras_losses.apply`, `keras_losses.loss_scale_apply`: `BaseOptimizer.apply`
  and `LossScaleOptimizer.apply` multiply the gradients by 1/replicas on a
  marked thread, once per update (the loss-scale optimizer's inner `apply` runs
  on threads of its own, unmarked). Variables whose "gradient" is a new value
  (`overwrite_with_gradient`, float8 scales) are left alone.

Upstream: none reported for the double scaling of `add_loss` terms; the
per-replica semantics of losses in a custom `train_step` are
keras-team/keras#14104 (open) and #15509 (closed by adding
`distribute_reduction_method`, which changes how logs are reduced, not the gradients).
"""

from __future__ import annotations

import functools
import threading

from tfdist.compat import _owner, _patch

ISSUE = ("not yet reported (add_loss of a Loss object scaled twice); keras-team/keras#15509, "
         "#14104 (per-replica losses in a custom train_step)")
STEP = "keras_losses.step_function"
SCALE = "keras_losses.scale_loss"
UNSCALE = "keras_losses.unscale_loss"
APPLY = "keras_losses.apply"
LOSS_SCALE_APPLY = "keras_losses.loss_scale_apply"

_state = threading.local()


def replicas_here() -> int:
    """The marked replica count of this thread's step (0 outside a marked step)."""
    return getattr(_state, "replicas", 0)


def examples_here():
    """This replica's example count in this thread's marked step, as a tensor (None outside
    one, or where the batch's first value has no batch dimension to count).

    Counted as Keras's trainer counts a batch for its loss metric: the first dimension of
    the first value of the step's data (`x` comes first), a sparse or ragged value's rows.
    """
    if not replicas_here():
        return None
    from tfdist._tf import import_tensorflow

    tf = import_tensorflow()
    leaves = tf.nest.flatten(getattr(_state, "data", None))
    first = leaves[0] if leaves else None
    if isinstance(first, tf.SparseTensor):
        return first.dense_shape[0]
    if isinstance(first, tf.RaggedTensor):
        return first.nrows()
    if isinstance(first, tf.Tensor) and first.shape.rank != 0:
        return tf.shape(first, out_type=tf.int64)[0]
    return None


def _synchronous_replicas(strategy) -> int:
    """Replicas of a tfdist mirrored / multi_worker_mirrored strategy (0 for anything else)."""
    if not _owner.owns(strategy):
        return 0
    from tfdist._tf import import_tensorflow

    tf = import_tensorflow()
    if not isinstance(strategy, (tf.distribute.MirroredStrategy,
                                 tf.distribute.MultiWorkerMirroredStrategy)):
        return 0
    replicas = strategy.num_replicas_in_sync
    return replicas if replicas > 1 else 0


# --- the step -----------------------------------------------------------------------------


def _trainer_module():
    return _patch.upstream("keras.src.backend.tensorflow.trainer")


def _check_step(original) -> None:
    _patch.require_signature(original, "step_function", what="TensorFlowTrainer._make_function")


def _make_step(original):
    def _make_function(self, step_function):
        replicas = _synchronous_replicas(getattr(self, "_distribute_strategy", None))
        if not replicas:
            return original(self, step_function)

        @functools.wraps(step_function)
        def marked_step(data):
            outer = replicas_here(), getattr(_state, "data", None)
            _state.replicas, _state.data = replicas, data
            try:
                return step_function(data)
            finally:
                _state.replicas, _state.data = outer

        return original(self, marked_step)

    return _make_function


STEP_FIX = _patch.Fix(
    name=STEP, issue=ISSUE,
    target=lambda: (_trainer_module().TensorFlowTrainer, "_make_function"),
    check=_check_step, make=_make_step)


# --- Keras's scaling -----------------------------------------------------------------------


def _loss_module():
    return _patch.upstream("keras.src.losses.loss")


def _check_scale(original) -> None:
    _patch.require_signature(original, "value", what="keras.src.losses.loss scaling function")


def _make_scale(original):
    @_patch.passthrough(original, lambda value: replicas_here() > 0)
    def scaling(value):
        return value  # as one device computes it

    return scaling


SCALE_FIX = _patch.Fix(
    name=SCALE, issue=ISSUE,
    target=lambda: (_loss_module(), "scale_loss_for_distribution"),
    check=_check_scale, make=_make_scale)
UNSCALE_FIX = _patch.Fix(
    name=UNSCALE, issue=ISSUE,
    target=lambda: (_loss_module(), "unscale_loss_for_distribution"),
    check=_check_scale, make=_make_scale)


# --- the update -----------------------------------------------------------------------------


def _base_optimizer_class():
    return _patch.upstream("keras.src.optimizers.base_optimizer.BaseOptimizer")


def _loss_scale_optimizer_class():
    return _patch.upstream("keras.src.optimizers.loss_scale_optimizer.LossScaleOptimizer")


def _check_apply(original) -> None:
    _patch.require_signature(original, "grads", "trainable_variables",
                             what="Optimizer.apply")


def _averaged(grads, variables, replicas):
    from tfdist._tf import import_tensorflow
    from tfdist.sync import map_values

    tf = import_tensorflow()

    def scale(grad, variable):
        if getattr(variable, "overwrite_with_gradient", False):
            return grad
        return map_values(grad, lambda t: t * tf.cast(1.0 / replicas, t.dtype))

    return [scale(g, v) for g, v in zip(grads, variables)]


def _make_apply(original):
    from tfdist._tf import import_tensorflow

    tf = import_tensorflow()

    def applies(self, grads, trainable_variables=None):
        # The marked step is a tfdist strategy's (see _make_step), whatever strategy the
        # optimizer recorded: one made outside the scope and compiled inside it (a
        # SequenceParallelModel compiles in its strategy's scope) records the default
        # strategy, and its loss was left unscaled all the same.
        return (replicas_here() > 0 and not getattr(_state, "applying", False)
                and not tf.distribute.in_cross_replica_context())

    @_patch.passthrough(original, applies)
    def apply(self, grads, trainable_variables=None):
        grads = list(grads)
        if trainable_variables is not None:
            trainable_variables = list(trainable_variables)
        variables = (trainable_variables if trainable_variables is not None
                     else self._trainable_variables)
        grads = _averaged(grads, variables, replicas_here())
        _state.applying = True
        try:
            return original(self, grads, trainable_variables)
        finally:
            _state.applying = False

    return apply


APPLY_FIX = _patch.Fix(
    name=APPLY, issue=ISSUE,
    target=lambda: (_base_optimizer_class(), "apply"),
    check=_check_apply, make=_make_apply)
LOSS_SCALE_APPLY_FIX = _patch.Fix(
    name=LOSS_SCALE_APPLY, issue=ISSUE,
    target=lambda: (_loss_scale_optimizer_class(), "apply"),
    check=_check_apply, make=_make_apply)

FIXES = (STEP_FIX, SCALE_FIX, UNSCALE_FIX, APPLY_FIX, LOSS_SCALE_APPLY_FIX)


def install() -> tuple[str, ...]:
    """Installs the five fixes, or none (idempotent, thread-safe).

    Returns:
      The names of the fixes this call installed (() if they already were).

    Raises:
      CompatError: Keras's code is not shaped as the fixes expect (nothing is
        installed then); UnsupportedVersionError outside the supported range.
    """
    return _patch.install_all(FIXES)

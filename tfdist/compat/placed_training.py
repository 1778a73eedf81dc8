"""Backward pass and optimizer slots that follow layer placement (Keras 3, TF backend).

Two gaps, both seen on TF 2.16-2.21 with Keras 3.10-3.15, for models whose
layers tfdist placed on devices (tfdist.split):

1. Keras's TensorFlow trainer computes gradients with `tf.GradientTape`.
   Tape gradients ignore the device of the forward op, so every gradient op
   (MatMul grad, ReluGrad, BiasAddGrad) runs on the default device (CPU:0)
   however the forward pass was placed. `tf.gradients` (TF2 always sets
   colocate_gradients_with_ops=True) puts each gradient op on its forward
   op's device, but only in graph mode, so `placed_train_step` mirrors
   keras/src/backend/tensorflow/trainer.py `TensorFlowTrainer.train_step`
   with `tf.gradients`. It is tfdist's own train step (called by tfdist's
   split model), not a replacement of Keras code; it uses the private
   members Keras's step uses, checked once (`CompatError` if missing):
   `Trainer._compute_loss(x, y, y_pred, sample_weight, training)`,
   `Trainer._loss_tracker` and
   `keras.src.losses.loss.unscale_loss_for_distribution` (Keras >= 3.8).
2. Keras's TF optimizer creates slot variables (Adam's m and v, momentum)
   under `strategy.extended.colocate_vars_with(var)`, which does nothing
   under the default strategy, so all slots land on CPU:0
   (keras/src/backend/tensorflow/optimizer.py `add_variable_from_reference`).
   The fix `placed_training.optimizer_slots` replaces
   `TFOptimizer.add_variable_from_reference(reference_variable, name,
   initializer)` with one that creates each slot under
   `tf.device(variable.device)`, for the optimizers passed to
   `colocate_optimizer_slots` only; every other optimizer runs Keras's code.

Upstream has no issue for either that we know of; the Keras TF backend's
`distribution_lib` (which would own this) is marked "DO NOT USE". The
canaries in tests/compat/test_placed_training.py show both gaps on stock Keras.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
import weakref
from typing import Any

from tfdist._tf import import_tensorflow
from tfdist.compat import _patch

UPSTREAM_ISSUE = "none known (Keras TF backend places neither tape gradients nor slots)"
OPTIMIZER_SLOTS = "placed_training.optimizer_slots"

_lock = threading.Lock()
_colocated: "weakref.WeakSet[Any]" = weakref.WeakSet()
_checked_train_step: set[type] = set()


# --- 1. the train step ------------------------------------------------------------


def _loss_module():
    import_tensorflow()
    from keras.src.losses import loss as loss_module

    return loss_module


def _check_train_step(model) -> None:
    """Raises CompatError unless `model` has the Keras members `placed_train_step` uses."""
    cls = type(model)
    if cls in _checked_train_step:
        return
    _patch.require_attributes(model, "_compute_loss", "_loss_tracker", "compute_metrics",
                              what=f"{cls.__name__} (keras.Model)")
    _patch.require_signature(cls._compute_loss, "x", "y", "y_pred", "sample_weight", "training",
                             what="keras.Model._compute_loss")
    _patch.require_attributes(_loss_module(), "unscale_loss_for_distribution",
                              what="keras.src.losses.loss")
    with _lock:
        _checked_train_step.add(cls)


def placed_train_step(model, data):
    """Keras's TF `train_step`, with gradients colocated with their forward ops.

    Falls back to a GradientTape (unplaced backward) when run eagerly, where
    `tf.gradients` is unavailable.

    Raises:
      CompatError: the model lacks the Keras members this mirrors.
    """
    tf = import_tensorflow()
    from keras import tree
    from keras.utils import unpack_x_y_sample_weight

    _check_train_step(model)
    loss_module = _loss_module()
    x, y, sample_weight = unpack_x_y_sample_weight(data)
    eager = tf.executing_eagerly()
    tape = tf.GradientTape() if eager else contextlib.nullcontext()
    with tape:
        y_pred = model(x, training=True)
        loss = model._compute_loss(x=x, y=y, y_pred=y_pred,
                                   sample_weight=sample_weight, training=True)
        model._loss_tracker.update_state(
            loss_module.unscale_loss_for_distribution(loss),
            sample_weight=tf.shape(next(i for i in tree.flatten(x) if i is not None))[0],
        )
        if model.optimizer is not None:
            loss = model.optimizer.scale_loss(loss)
    variables = model.trainable_weights
    if variables:
        if eager:
            grads = tape.gradient(loss, variables)
        else:
            grads = tf.gradients(loss, [v.value for v in variables])
        model.optimizer.apply_gradients(zip(grads, variables))
    else:
        warnings.warn("The model does not have any trainable weights.", stacklevel=2)
    return model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)


# --- 2. optimizer slots -------------------------------------------------------------


def _slots_target():
    import_tensorflow()
    from keras.src.backend.tensorflow import optimizer as tf_optimizer

    return tf_optimizer.TFOptimizer, "add_variable_from_reference"


def _check_slots(original) -> None:
    _patch.require_signature(original, "reference_variable", "name", "initializer",
                             what="TFOptimizer.add_variable_from_reference")


def _make_slots(original):
    tf = import_tensorflow()

    def applies(self, reference_variable, name=None, initializer="zeros"):
        return self in _colocated

    @_patch.passthrough(original, applies)
    def add_variable_from_reference(self, reference_variable, name=None, initializer="zeros"):
        ref = getattr(reference_variable, "value", reference_variable)
        # Distributed variables (they have .values) are colocated by their strategy.
        device = getattr(ref, "device", "") if not hasattr(ref, "values") else ""
        if not device:
            return original(self, reference_variable, name=name, initializer=initializer)
        with tf.device(device):
            return original(self, reference_variable, name=name, initializer=initializer)

    return add_variable_from_reference


OPTIMIZER_SLOTS_FIX = _patch.Fix(
    name=OPTIMIZER_SLOTS,
    issue=UPSTREAM_ISSUE,
    target=_slots_target,
    check=_check_slots,
    make=_make_slots,
)


def colocate_optimizer_slots(optimizer) -> None:
    """Makes this optimizer create each slot variable on its model variable's device.

    Installs the `placed_training.optimizer_slots` fix (idempotent); other
    optimizers keep Keras's behaviour. Under a tf.distribute strategy other
    than the default one Keras's own colocation already works, and the fix
    leaves distributed variables alone.

    Raises:
      CompatError: Keras's optimizer is not shaped as the fix expects.
    """
    _patch.install(OPTIMIZER_SLOTS_FIX)
    with _lock:
        _colocated.add(optimizer)


def compiled_loss(model, y, y_pred, sample_weight):
    """The loss given to `compile()` on (y, y_pred), without `model.losses`.

    Keras's `compute_loss` adds every `add_loss` loss recorded so far, which a
    pipeline computing one micro-batch's loss at a time must not repeat.

    Raises:
      CompatError: the model has no `_compile_loss` (Keras changed).
    """
    _patch.require_attributes(model, "_compile_loss", what=f"{type(model).__name__} (keras.Model)")
    if model._compile_loss is None:
        raise ValueError("No loss to compute. Provide a `loss` argument in `compile()`.")
    return model._compile_loss(y, y_pred, sample_weight)


def track_loss(model, loss, batch_size) -> None:
    """Feeds the step's loss to the model's loss metric (what `fit` reports)."""
    _check_train_step(model)
    model._loss_tracker.update_state(_loss_module().unscale_loss_for_distribution(loss),
                                     sample_weight=batch_size)

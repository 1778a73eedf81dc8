"""Backward pass and optimizer slots that follow layer placement (Keras 3, TF backend).

Two gaps, both seen on TF 2.21 + Keras 3.15 (reference/probe q4b, q4d):

1. Keras's TensorFlow trainer computes gradients with `tf.GradientTape`.
   Tape gradients ignore the device of the forward op, so every gradient op
   (MatMul grad, ReluGrad, BiasAddGrad) runs on the default device (CPU:0)
   however the forward pass was placed. `tf.gradients` (TF2 always sets
   colocate_gradients_with_ops=True) puts each gradient op on its forward
   op's device, but only in graph mode, so `placed_train_step` mirrors
   keras/src/backend/tensorflow/trainer.py `TensorFlowTrainer.train_step`
   with `tf.gradients` and uses the private members it needs for that:
   `Trainer._compute_loss`, `Trainer._loss_tracker` and
   `keras.src.losses.loss.unscale_loss_for_distribution`.
2. Keras's TF optimizer creates slot variables (Adam's m and v, momentum)
   under `strategy.extended.colocate_vars_with(var)`, which does nothing
   under the default strategy, so all slots land on CPU:0
   (keras/src/backend/tensorflow/optimizer.py `add_variable_from_reference`).
   `colocate_optimizer_slots` makes one optimizer instance create each slot
   under `tf.device(variable.device)`.

Upstream has no issue for either that we know of; the Keras TF backend's
`distribution_lib` (which would own this) is marked "DO NOT USE". Verified
on the versions in `tfdist.compat.TESTED`; tests/test_split_compat.py fails
if upstream starts placing either correctly (then these can go).
"""

from __future__ import annotations

import contextlib
import types
import warnings

from tfdist._tf import import_tensorflow


def _check_trainer_privates(model) -> None:
    for name in ("_compute_loss", "_loss_tracker"):
        if not hasattr(model, name):
            raise RuntimeError(
                f"keras.Model has no {name} in this Keras version; "
                "tfdist.compat.placed_training needs updating (see tests/test_split_compat.py)."
            )


def placed_train_step(model, data):
    """Keras's TF `train_step`, with gradients colocated with their forward ops.

    Falls back to a GradientTape (unplaced backward) when run eagerly, where
    `tf.gradients` is unavailable.
    """
    tf = import_tensorflow()
    from keras import tree
    from keras.src.losses import loss as loss_module
    from keras.utils import unpack_x_y_sample_weight

    _check_trainer_privates(model)
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


def colocate_optimizer_slots(optimizer) -> None:
    """Makes this optimizer create each slot variable on its model variable's device.

    Under a tf.distribute strategy other than the default one, Keras's own
    colocation already works, and this leaves the optimizer alone.
    """
    tf = import_tensorflow()
    if getattr(optimizer, "_tfdist_colocated", False):
        return
    original = optimizer.add_variable_from_reference
    if not hasattr(original, "__func__"):
        raise RuntimeError(
            "Optimizer.add_variable_from_reference is not a method in this Keras version; "
            "tfdist.compat.placed_training needs updating."
        )

    def add_variable_from_reference(self, reference_variable, name=None, initializer="zeros"):
        ref = getattr(reference_variable, "value", reference_variable)
        device = getattr(ref, "device", "") if not hasattr(ref, "values") else ""
        if not device:
            return original(reference_variable, name=name, initializer=initializer)
        with tf.device(device):
            return original(reference_variable, name=name, initializer=initializer)

    optimizer.add_variable_from_reference = types.MethodType(add_variable_from_reference,
                                                             optimizer)
    optimizer._tfdist_colocated = True


def compiled_loss(model, y, y_pred, sample_weight):
    """The loss given to `compile()` on (y, y_pred), without `model.losses`.

    Keras's `compute_loss` adds every `add_loss` loss recorded so far, which a
    pipeline computing one micro-batch's loss at a time must not repeat.
    """
    if not hasattr(model, "_compile_loss"):
        raise RuntimeError("keras.Model has no _compile_loss in this Keras version; "
                           "tfdist.compat.placed_training needs updating.")
    if model._compile_loss is None:
        raise ValueError("No loss to compute. Provide a `loss` argument in `compile()`.")
    return model._compile_loss(y, y_pred, sample_weight)


def track_loss(model, loss, batch_size) -> None:
    """Feeds the step's loss to the model's loss metric (what `fit` reports)."""
    from keras.src.losses import loss as loss_module

    _check_trainer_privates(model)
    model._loss_tracker.update_state(loss_module.unscale_loss_for_distribution(loss),
                                     sample_weight=batch_size)

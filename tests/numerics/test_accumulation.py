"""Gradient accumulation (`gradient_accumulation_steps`) under tfdist's mirrored presets.

Keras 3 takes `ops.cond(is_update_step, update, accumulate)` in replica context
and both branches merge_call, which TensorFlow refuses: under any
MirroredStrategy the first step fails (keras-team/keras#20582). tfdist takes
the cond in cross-replica context (tfdist/compat/optimizer_update.py, the
gradient_accumulation fix) and accumulates the all-reduced gradients.

Reference: the same model, seed, initial weights and global batch on one
device, where Keras's own accumulation runs. The model has the shapes real
ones have: an Embedding (sparse gradients), LayerNormalization, a custom layer
with a nested Dense, a Dense head. Every test also checks that the
accumulation is active (the run without it ends far from the one with it),
and that every replica's copy of every model and optimizer variable (the
accumulators included, mid-accumulation) is identical.

Negative control: with the fix taken out, the same tfdist strategy fails at
the first step with TensorFlow's merge_call error (the upstream behaviour).
"""

import numpy as np
import pytest

import tfdist
from tests.support import (embedding_gated_model, max_abs_difference as _max_diff,
                          model_state as _state, one_device as _one_device,
                          tutorial_custom_loop)

TOLERANCE = 1e-5  # float32 summation order across 2-4 replicas over 8 steps
STEPS, GLOBAL_BATCH, VOCAB, LENGTH = 8, 16, 40, 3


def _data():
    rng = np.random.default_rng(0)
    ids = rng.integers(0, VOCAB, size=(STEPS * GLOBAL_BATCH, LENGTH)).astype("int32")
    features = rng.normal(size=(STEPS * GLOBAL_BATCH, 6)).astype("float32")
    targets = rng.normal(size=(STEPS * GLOBAL_BATCH, 3)).astype("float32")
    return (ids, features), targets


def _build():
    return embedding_gated_model(VOCAB, LENGTH)


OPTIMIZERS = {
    "sgd_momentum": lambda **kw: __import__("keras").optimizers.SGD(0.1, momentum=0.9, **kw),
    "adam": lambda **kw: __import__("keras").optimizers.Adam(0.01, **kw),
    "adamw_clipnorm": lambda **kw: __import__("keras").optimizers.AdamW(
        0.01, weight_decay=0.05, global_clipnorm=0.05, **kw),
}


def _fit(strategy, optimizer, accumulate):
    kwargs = {"gradient_accumulation_steps": accumulate} if accumulate else {}
    (ids, features), targets = _data()
    with strategy.scope():
        model = _build()
        model.compile(OPTIMIZERS[optimizer](**kwargs), "mse")
    model.fit([ids, features], targets, batch_size=GLOBAL_BATCH, epochs=1, shuffle=False,
              verbose=0)
    return model


def _assert_replicas_identical(strategy, model):
    for variable in list(model.variables) + list(model.optimizer.variables):
        copies = strategy.experimental_local_results(variable.value)
        for copy in copies[1:]:
            np.testing.assert_array_equal(np.asarray(copy), np.asarray(copies[0]),
                                          err_msg=variable.path)


@pytest.mark.parametrize("optimizer, accumulate, num_devices", [
    ("sgd_momentum", 2, 2), ("adam", 3, 4), ("adamw_clipnorm", 4, 2)])
def test_mirrored_accumulates_like_one_device(optimizer, accumulate, num_devices):
    reference = _fit(_one_device(), optimizer, accumulate)
    plain = _fit(_one_device(), optimizer, None)
    assert _max_diff(reference.get_weights(), plain.get_weights()) > 100 * TOLERANCE
    strategy = tfdist.make_strategy("mirrored", num_devices=num_devices)
    model = _fit(strategy, optimizer, accumulate)
    # Weights, slots, the accumulators (8 steps: 8 % 3 = 2 micro-steps still accumulated
    # for Adam) and the iteration count all equal one device's.
    assert _max_diff(_state(model), _state(reference)) < TOLERANCE
    _assert_replicas_identical(strategy, model)


def test_gradient_compression_composes_with_accumulation():
    # The micro-step gradients cross the wire through tfdist.comm's sync (bf16 here): the
    # replicas stay identical and the run stays near one device's (bf16 rounding).
    strategy = tfdist.make_strategy("mirrored", num_devices=2, gradient_compression="bf16")
    model = _fit(strategy, "adam", 2)
    _assert_replicas_identical(strategy, model)
    reference = _fit(_one_device(), "adam", 2)
    assert _max_diff(model.get_weights(), reference.get_weights()) < 1e-2


def test_custom_training_loop_accumulates_like_one_device():
    # The custom-training tutorial's loop: strategy.run, a loss scaled by the global batch,
    # optimizer.apply_gradients in each replica. The optimizer is built before the loop; a
    # lazily built one gets a clear error (TensorFlow cannot run the first call's
    # cross-replica update; stock Keras's LossScaleOptimizer fails there too, with
    # "You must feed a value for placeholder tensor").
    import keras

    def train(strategy, build_first=True):
        (ids, features), targets = _data()
        with strategy.scope():
            model = _build()
            optimizer = keras.optimizers.Adam(0.01, gradient_accumulation_steps=3)
            if build_first:
                optimizer.build(model.trainable_variables)
        tutorial_custom_loop(strategy, model, optimizer, (ids, features), targets, GLOBAL_BATCH)
        return model.get_weights() + [np.asarray(v) for v in optimizer.variables]

    reference = train(_one_device(), build_first=False)
    strategy = tfdist.make_strategy("mirrored", num_devices=2)
    assert _max_diff(train(strategy), reference) < TOLERANCE
    with pytest.raises(ValueError, match=r"optimizer.build\(model.trainable_variables\)"):
        train(strategy, build_first=False)


def test_without_the_fix_keras_fails_at_the_first_step():
    # Negative control and canary: with the fix taken out, a tfdist strategy runs Keras's own
    # cond and TensorFlow refuses the merge_call inside it (keras-team/keras#20582). When this
    # starts passing upstream, the fix can go.
    from tfdist.compat import _patch, optimizer_update

    strategy = tfdist.make_strategy("mirrored", num_devices=2)
    assert optimizer_update.ACCUMULATE_FIX.name in _patch.installed()
    _patch.uninstall([optimizer_update.ACCUMULATE_FIX.name])
    try:
        with pytest.raises(RuntimeError, match="merge_call"):
            _fit(strategy, "adam", 2)
    finally:
        optimizer_update.install()
    assert optimizer_update.ACCUMULATE_FIX.name in _patch.installed()
    _fit(strategy, "adam", 2)


def test_the_fix_refuses_a_keras_shaped_differently(monkeypatch):
    # The shape check: a different signature, or a Keras without a method the fix calls,
    # is refused with a CompatError naming it (the preset then warns and installs nothing).
    from keras.src.optimizers import base_optimizer

    from tfdist.compat import _patch, optimizer_update

    original = base_optimizer.BaseOptimizer._backend_apply_gradients
    optimizer_update.ACCUMULATE_FIX.check(original)  # today's Keras passes
    with pytest.raises(_patch.CompatError, match="_backend_apply_gradients"):
        optimizer_update.ACCUMULATE_FIX.check(lambda self, grads, variables, extra: None)
    monkeypatch.delattr(base_optimizer.BaseOptimizer, "_use_weight_decay")
    with pytest.raises(_patch.CompatError, match="_use_weight_decay"):
        optimizer_update.ACCUMULATE_FIX.check(original)

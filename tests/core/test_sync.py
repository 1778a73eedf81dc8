"""tfdist.sync.GradientSync, the public extension point of the optimizer update."""

import numpy as np
import pytest

import tfdist
from tfdist import sync as sync_lib


def _fit(strategy, x, y):
    import keras

    keras.utils.set_random_seed(3)
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3),
                                  keras.layers.Dense(1)])
        model.compile(keras.optimizers.Adam(0.01), "mse")
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    return [w.numpy() for w in model.weights]


def test_a_users_gradient_sync_runs_in_every_update():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((32, 4)).astype("float32")
    y = x.sum(axis=1, keepdims=True)
    reference = _fit(tfdist.make_strategy("mirrored", num_devices=2), x, y)

    class Counting(tfdist.GradientSync):
        calls = 0

        def reduce(self, optimizer, grads_and_vars, keras_all_reduce):
            Counting.calls += 1  # at trace time: once per traced replica step
            return super().reduce(optimizer, grads_and_vars, keras_all_reduce)

    strategy = tfdist.make_strategy("mirrored", num_devices=2)
    assert sync_lib.gradient_sync(strategy) is sync_lib.DEFAULT_SYNC
    sync_lib.set_gradient_sync(strategy, Counting())
    assert tfdist.state_of(strategy).gradient_sync is sync_lib.gradient_sync(strategy)
    weights = _fit(strategy, x, y)
    assert Counting.calls >= 2  # one trace per replica
    for a, b in zip(weights, reference):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)


def test_only_strategies_tfdist_made_take_a_gradient_sync():
    import tensorflow as tf

    users = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    assert sync_lib.gradient_sync(users) is None
    with pytest.raises(ValueError, match="set_gradient_sync takes a strategy made by "
                                         "tfdist.make_strategy.*Received: MirroredStrategy"):
        sync_lib.set_gradient_sync(users, sync_lib.GradientSync())

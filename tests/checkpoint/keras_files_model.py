"""The model and data of the multi-worker file-writer tests (importable without tfdist).

`build()` makes an MLP whose first layer keeps a sync-on-read statistic (the
mean of its inputs, aggregated MEAN across replicas): reading that variable
in cross-replica context is an all-reduce, so a save that some worker skips
would leave the others blocked in a collective. The loader of the saved files
runs in a plain process that imports only Keras and this module.
"""

from __future__ import annotations

import numpy as np

FEATURES, N, GLOBAL_BATCH = 8, 64, 16


def data():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((N, FEATURES)).astype("float32")
    y = (x @ rng.standard_normal((FEATURES, 1))).astype("float32")
    return x, y


def probe():
    """Inputs the tests compare predictions on."""
    return np.random.default_rng(1).standard_normal((5, FEATURES)).astype("float32")


def _keras():
    import keras

    return keras


def _register():
    keras = _keras()

    @keras.saving.register_keras_serializable(package="tfdist_tests")
    class InputMean(keras.layers.Layer):
        """Identity that records its inputs' mean in a sync-on-read variable."""

        def build(self, input_shape):
            self.mean = keras.Variable(np.zeros((input_shape[-1],), "float32"),
                                       trainable=False, synchronization="on_read",
                                       aggregation="mean", name="input_mean")

        def call(self, x, training=False):
            if training:
                self.mean.assign(keras.ops.mean(x, axis=0))
            return x

    return InputMean


_InputMean = None


def input_mean_layer():
    global _InputMean
    if _InputMean is None:
        _InputMean = _register()
    return _InputMean


def build(seed: int = 0, *, on_read: bool = True):
    """The test model, weights drawn from `seed` (compile it yourself)."""
    keras = _keras()
    layers = [keras.Input((FEATURES,))]
    if on_read:
        layers.append(input_mean_layer()())
    layers += [keras.layers.Dense(16, activation="relu"), keras.layers.Dense(1)]
    model = keras.Sequential(layers)
    rng = np.random.default_rng(seed)
    model.set_weights([(0.3 * rng.standard_normal(w.shape)).astype("float32")
                       for w in model.get_weights()])
    return model

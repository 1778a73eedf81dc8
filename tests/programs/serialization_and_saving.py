"""Save, serialization and export.

Exercises: .keras files, custom objects, weights-only files, and a SavedModel for serving.

Source: https://github.com/keras-team/keras-io/blob/master/guides/serialization_and_saving.py
(sections "Saving", "Custom objects", "Saving & loading only the model's weights values");
the export for TF Serving as in
https://github.com/keras-team/keras-io/blob/master/examples/keras_recipes/tf_serving.py
(`model.export`, then `tf.saved_model.load(...).serve`).
Changed: 128 random samples of 32 features -> 128 of 8; paths ("my_model.keras", ...) ->
`run.workdir`; each model made and compiled under `strategy.scope()`.
Checks: every reloaded model, weights file and exported SavedModel predicts what the trained
model predicts.
"""

import os

import keras
import numpy as np
import tensorflow as tf

from tests.programs.corpus import KERAS_IO, Exact, Outcome, logged

SOURCE = KERAS_IO + "guides/serialization_and_saving.py"
COMPARE = Exact()


def get_model():
    inputs = keras.Input(shape=(8,))
    outputs = keras.layers.Dense(1)(inputs)
    model = keras.Model(inputs, outputs)
    model.compile(optimizer=keras.optimizers.Adam(learning_rate=0.01),
                  loss="mean_squared_error")
    return model


@keras.saving.register_keras_serializable(package="corpus_saving")
class CustomLayer(keras.layers.Layer):
    def __init__(self, factor, **kwargs):
        super().__init__(**kwargs)
        self.factor = factor

    def call(self, x):
        return x * self.factor

    def get_config(self):
        return {**super().get_config(), "factor": self.factor}


@keras.saving.register_keras_serializable(package="corpus_saving", name="custom_fn")
def custom_fn(x):
    return x**2


def max_difference(a, b):
    return float(np.max(np.abs(np.asarray(a) - np.asarray(b))))


def main(run):
    strategy = run.make_strategy()
    rng = np.random.default_rng(0)
    test_input = rng.random((128, 8))
    test_target = rng.random((128, 1))
    def path(name):
        return os.path.join(run.workdir, name)

    losses, checks = [], {}

    # The whole model: architecture, weights, optimizer state, compile arguments.
    with strategy.scope():
        model = get_model()
    losses += logged(model.fit(test_input, test_target))
    model.save(path("my_model.keras"))
    reconstructed_model = keras.models.load_model(path("my_model.keras"))
    checks["load_model"] = max_difference(model.predict(test_input),
                                          reconstructed_model.predict(test_input))
    # The reconstructed model is compiled and keeps training where the original stopped.
    losses += logged(reconstructed_model.fit(test_input, test_target))

    # Custom objects: a registered layer and a registered activation.
    with strategy.scope():
        inputs = keras.Input(shape=(8,))
        x = CustomLayer(0.5)(inputs)
        outputs = keras.layers.Activation(custom_fn)(x)
        custom = keras.Model(inputs, outputs)
        custom.compile(optimizer="rmsprop", loss="mean_squared_error")
    losses += logged(custom.fit(test_input, test_target))
    custom.save(path("custom_model.keras"))
    reconstructed = keras.models.load_model(path("custom_model.keras"))
    checks["custom_objects"] = max_difference(custom.predict(test_input),
                                              reconstructed.predict(test_input))

    # Weights only: into a fresh model of the same architecture.
    model.save_weights(path("my_model.weights.h5"))
    with strategy.scope():
        fresh = get_model()
    fresh.load_weights(path("my_model.weights.h5"))
    checks["load_weights"] = max_difference(model.predict(test_input), fresh.predict(test_input))

    # A SavedModel for TF Serving: its serving function answers as predict does.
    model.export(path("exported"))
    served = tf.saved_model.load(path("exported"))
    checks["export_serve"] = max_difference(
        model.predict(test_input), served.serve(tf.constant(test_input, "float32")))
    return Outcome(models=[model, reconstructed_model, custom], losses=losses, checks=checks)

"""Endpoint layer pattern: a layer that adds its own loss (a Loss object) and updates a metric.

Source: https://github.com/keras-team/keras-io/blob/master/examples/keras_recipes/endpoint_layer_pattern.py
Changed: 1,000 random samples of 764 features -> 256 of 16 (same distributions: uniform
inputs, targets and sample weights, fixed NumPy seed); both models made and compiled under
`strategy.scope()`.
"""

import keras
import numpy as np
import tensorflow as tf

from tests.programs.corpus import KERAS_IO, Exact, Outcome, logged

SOURCE = KERAS_IO + "examples/keras_recipes/endpoint_layer_pattern.py"
COMPARE = Exact()


class LogisticEndpoint(keras.layers.Layer):
    def __init__(self, name=None):
        super().__init__(name=name)
        self.loss_fn = keras.losses.BinaryCrossentropy(from_logits=True)
        self.accuracy_metric = keras.metrics.BinaryAccuracy(name="accuracy")

    def call(self, logits, targets=None, sample_weight=None):
        if targets is not None:
            # The training-time loss, added with add_loss; accuracy tracked as a metric.
            loss = self.loss_fn(targets, logits, sample_weight)
            self.add_loss(loss)
            self.accuracy_metric.update_state(targets, logits, sample_weight)
        # What predict() returns.
        return tf.nn.softmax(logits)


class LogReg(keras.Model):
    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(1)
        self.logistic_endpoint = LogisticEndpoint()

    def call(self, inputs):
        # Every input in the first argument, so that fit(inputs) works.
        logits = self.dense(inputs["inputs"])
        return self.logistic_endpoint(logits=logits, targets=inputs["targets"],
                                      sample_weight=inputs["sample_weight"])


def data(rng, n=256, features=16):
    return {"inputs": rng.random((n, features)), "targets": rng.random((n, 1)),
            "sample_weight": rng.random((n, 1))}


def main(run):
    strategy = run.make_strategy()
    rng = np.random.default_rng(0)
    losses = []

    # The Functional API: targets and sample weights are model inputs.
    with strategy.scope():
        inputs = keras.Input((16,), name="inputs")
        logits = keras.layers.Dense(1)(inputs)
        targets = keras.Input((1,), name="targets")
        sample_weight = keras.Input((1,), name="sample_weight")
        preds = LogisticEndpoint()(logits, targets, sample_weight)
        model = keras.Model([inputs, targets, sample_weight], preds)
        model.compile(keras.optimizers.Adam(1e-3))
    losses += logged(model.fit(data(rng), epochs=2))

    # An inference-only model: the same weights, no targets.
    inputs = keras.Input((16,), name="inputs")
    logits = keras.layers.Dense(1)(inputs)
    preds = LogisticEndpoint()(logits, targets=None, sample_weight=None)
    inference_model = keras.Model(inputs, preds)
    inference_model.set_weights(model.get_weights())
    preds = inference_model.predict(rng.random((256, 16)))
    assert preds.shape == (256, 1), preds.shape

    # The same endpoint in a subclassed model.
    with strategy.scope():
        subclassed = LogReg()
        subclassed.compile(keras.optimizers.Adam(1e-3))
    losses += logged(subclassed.fit(data(rng), epochs=2))
    return Outcome(models=[model, subclassed], losses=losses)

"""Customizing what happens in fit().

Exercises: train_step with compute_loss, with its own loss and metrics, with sample weights, and
a custom test_step.

Source: https://github.com/keras-team/keras-io/blob/master/guides/custom_train_step_in_tensorflow.py
(sections "A first simple example", "Going lower-level", "Supporting sample_weight &
class_weight", "Providing your own evaluation step"; the GAN is gan_train_step).
Changed: 1,000 random samples of 32 features -> 256 of 8 (the same uniform distributions,
fixed NumPy seed); epochs 3/5/3 -> 2/2/2; each model made and compiled under
`strategy.scope()`.
"""

import keras
import numpy as np
import tensorflow as tf

from tests.programs.corpus import KERAS_IO, Exact, Outcome, logged

SOURCE = KERAS_IO + "guides/custom_train_step_in_tensorflow.py"
COMPARE = Exact()


class CustomModel(keras.Model):
    """The loss from compile() through self.compute_loss, metrics from self.metrics."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(y=y, y_pred=y_pred)
        trainable_vars = self.trainable_variables
        gradients = tape.gradient(loss, trainable_vars)
        self.optimizer.apply(gradients, trainable_vars)
        for metric in self.metrics:
            if metric.name == "loss":
                metric.update_state(loss)
            else:
                metric.update_state(y, y_pred)
        return {m.name: m.result() for m in self.metrics}


class LowLevelModel(keras.Model):
    """Its own loss and metric objects; compile() only sets the optimizer."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.loss_tracker = keras.metrics.Mean(name="loss")
        self.mae_metric = keras.metrics.MeanAbsoluteError(name="mae")
        self.loss_fn = keras.losses.MeanSquaredError()

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.loss_fn(y, y_pred)
        trainable_vars = self.trainable_variables
        gradients = tape.gradient(loss, trainable_vars)
        self.optimizer.apply(gradients, trainable_vars)
        self.loss_tracker.update_state(loss)
        self.mae_metric.update_state(y, y_pred)
        return {"loss": self.loss_tracker.result(), "mae": self.mae_metric.result()}

    @property
    def metrics(self):
        # Listed so that their state is reset at each epoch and at evaluate().
        return [self.loss_tracker, self.mae_metric]


class WeightedModel(keras.Model):
    """Unpacks sample_weight and passes it to compute_loss and the metrics."""

    def train_step(self, data):
        if len(data) == 3:
            x, y, sample_weight = data
        else:
            sample_weight = None
            x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(y=y, y_pred=y_pred, sample_weight=sample_weight)
        trainable_vars = self.trainable_variables
        gradients = tape.gradient(loss, trainable_vars)
        self.optimizer.apply(gradients, trainable_vars)
        for metric in self.metrics:
            if metric.name == "loss":
                metric.update_state(loss)
            else:
                metric.update_state(y, y_pred, sample_weight=sample_weight)
        return {m.name: m.result() for m in self.metrics}


class EvalModel(keras.Model):
    """A custom test_step for evaluate()."""

    def test_step(self, data):
        x, y = data
        y_pred = self(x, training=False)
        loss = self.compute_loss(y=y, y_pred=y_pred)
        for metric in self.metrics:
            if metric.name == "loss":
                metric.update_state(loss)
            else:
                metric.update_state(y, y_pred)
        return {m.name: m.result() for m in self.metrics}


def main(run):
    strategy = run.make_strategy()
    rng = np.random.default_rng(0)
    x = rng.random((256, 8))
    y = rng.random((256, 1))
    losses, models = [], []

    with strategy.scope():
        inputs = keras.Input(shape=(8,))
        outputs = keras.layers.Dense(1)(inputs)
        model = CustomModel(inputs, outputs)
        model.compile(optimizer="adam", loss="mse", metrics=["mae"])
    losses += logged(model.fit(x, y, epochs=2))
    models.append(model)

    with strategy.scope():
        inputs = keras.Input(shape=(8,))
        outputs = keras.layers.Dense(1)(inputs)
        model = LowLevelModel(inputs, outputs)
        model.compile(optimizer="adam")  # no loss, no metrics
    losses += logged(model.fit(x, y, epochs=2))
    models.append(model)

    sw = rng.random((256, 1))
    with strategy.scope():
        inputs = keras.Input(shape=(8,))
        outputs = keras.layers.Dense(1)(inputs)
        model = WeightedModel(inputs, outputs)
        model.compile(optimizer="adam", loss="mse", metrics=["mae"])
    losses += logged(model.fit(x, y, sample_weight=sw, epochs=2))
    models.append(model)

    with strategy.scope():
        inputs = keras.Input(shape=(8,))
        outputs = keras.layers.Dense(1)(inputs)
        model = EvalModel(inputs, outputs)
        model.compile(loss="mse", metrics=["mae"])
    losses += list(model.evaluate(x, y))
    models.append(model)
    return Outcome(models=models, losses=losses)

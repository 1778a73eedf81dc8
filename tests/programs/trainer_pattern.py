"""Trainer pattern.

Exercises: one custom train_step and test_step shared by a Sequential and a Functional model.

Source: https://github.com/keras-team/keras-io/blob/master/examples/keras_recipes/trainer_pattern.py
Changed: MNIST (60,000 + 10,000 images of 28x28) -> 512 + 128 synthetic 8x8 digits; Dense widths
256/512 -> 32/64; epochs 5 -> 2; the trainers made and compiled under `strategy.scope()`.
"""

import keras
import tensorflow as tf

from tests.programs.corpus import KERAS_IO, Outcome, Property, images, logged

SOURCE = KERAS_IO + "examples/keras_recipes/trainer_pattern.py"
COMPARE = Property(reason="Dropout: each replica draws its own mask", trend="rising")


class MyTrainer(keras.Model):
    def __init__(self, model):
        super().__init__()
        self.model = model
        # The loss and metrics live here.
        self.loss_fn = keras.losses.SparseCategoricalCrossentropy()
        self.accuracy_metric = keras.metrics.SparseCategoricalAccuracy()

    @property
    def metrics(self):
        return [self.accuracy_metric]

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self.model(x, training=True)
            loss = self.loss_fn(y, y_pred)
        trainable_vars = self.trainable_variables
        gradients = tape.gradient(loss, trainable_vars)
        self.optimizer.apply_gradients(zip(gradients, trainable_vars))
        for metric in self.metrics:
            metric.update_state(y, y_pred)
        return {m.name: m.result() for m in self.metrics}

    def test_step(self, data):
        x, y = data
        y_pred = self.model(x, training=False)
        loss = self.loss_fn(y, y_pred)  # noqa: F841 - unused, as in the recipe
        for metric in self.metrics:
            metric.update_state(y, y_pred)
        return {m.name: m.result() for m in self.metrics}

    def call(self, x):
        # The wrapped model's call.
        return self.model(x)


def main(run):
    strategy = run.make_strategy()
    x_train, y_train = images(512, shape=(8, 8), seed=1)
    x_test, y_test = images(128, shape=(8, 8), seed=2)
    with strategy.scope():
        model_a = keras.models.Sequential([
            keras.layers.Input(shape=(8, 8)),
            keras.layers.Flatten(),
            keras.layers.Dense(32, activation="relu"),
            keras.layers.Dropout(0.2),
            keras.layers.Dense(10, activation="softmax"),
        ])
        func_input = keras.Input(shape=(8, 8, 1))
        x = keras.layers.Flatten()(func_input)
        x = keras.layers.Dense(64, activation="relu")(x)
        x = keras.layers.Dropout(0.4)(x)
        func_output = keras.layers.Dense(10, activation="softmax")(x)
        model_b = keras.Model(func_input, func_output)
        trainer_1 = MyTrainer(model_a)
        trainer_2 = MyTrainer(model_b)
        trainer_1.compile(optimizer=keras.optimizers.SGD())
        trainer_2.compile(optimizer=keras.optimizers.Adam())
    # The trainers log accuracy only (no loss): the property is judged on it.
    history_1 = trainer_1.fit(x_train, y_train, epochs=2, batch_size=64,
                              validation_data=(x_test, y_test))
    history_2 = trainer_2.fit(x_train, y_train, epochs=2, batch_size=64,
                              validation_data=(x_test, y_test))
    accuracy = logged(history_1, "sparse_categorical_accuracy") + logged(
        history_2, "sparse_categorical_accuracy")
    return Outcome(models=[trainer_1, trainer_2], losses=accuracy,
                   trend=logged(history_2, "sparse_categorical_accuracy"))

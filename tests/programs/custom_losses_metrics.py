"""Custom losses, a custom metric and add_loss, from the built-in training guide.

Source: https://github.com/keras-team/keras-io/blob/master/guides/training_with_built_in_methods.py
(sections "Custom losses", "Custom metrics", "Handling losses and metrics that don't fit the
standard signature").
Changed: MNIST (50,000 images of 784 pixels) -> 512 synthetic digits of 64 features; Dense widths
64 -> 32; epochs 1/1/3/1 -> 1/1/2/1; each model made and compiled under `strategy.scope()`.
The metric is the guide's `CategoricalTruePositives`, whose `result()` returns its own variable.
"""

import keras
from keras import layers, ops

from tests.programs.corpus import KERAS_IO, Exact, Outcome, digits, logged

SOURCE = KERAS_IO + "guides/training_with_built_in_methods.py"
COMPARE = Exact()


def get_uncompiled_model():
    inputs = keras.Input(shape=(64,), name="digits")
    x = layers.Dense(32, activation="relu", name="dense_1")(inputs)
    x = layers.Dense(32, activation="relu", name="dense_2")(x)
    outputs = layers.Dense(10, activation="softmax", name="predictions")(x)
    return keras.Model(inputs=inputs, outputs=outputs)


def custom_mean_squared_error(y_true, y_pred):
    return ops.mean(ops.square(y_true - y_pred), axis=-1)


class CustomMSE(keras.losses.Loss):
    def __init__(self, regularization_factor=0.1, name="custom_mse"):
        super().__init__(name=name)
        self.regularization_factor = regularization_factor

    def call(self, y_true, y_pred):
        mse = ops.mean(ops.square(y_true - y_pred), axis=-1)
        reg = ops.mean(ops.square(0.5 - y_pred), axis=-1)
        return mse + reg * self.regularization_factor


class CategoricalTruePositives(keras.metrics.Metric):
    def __init__(self, name="categorical_true_positives", **kwargs):
        super().__init__(name=name, **kwargs)
        self.true_positives = self.add_variable(shape=(), name="ctp", initializer="zeros")

    def update_state(self, y_true, y_pred, sample_weight=None):
        y_pred = ops.reshape(ops.argmax(y_pred, axis=1), (-1, 1))
        values = ops.cast(y_true, "int32") == ops.cast(y_pred, "int32")
        values = ops.cast(values, "float32")
        if sample_weight is not None:
            sample_weight = ops.cast(sample_weight, "float32")
            values = ops.multiply(values, sample_weight)
        self.true_positives.assign_add(ops.sum(values))

    def result(self):
        return self.true_positives

    def reset_state(self):
        # Reset at the start of each epoch.
        self.true_positives.assign(0.0)


class ActivityRegularizationLayer(layers.Layer):
    def call(self, inputs):
        self.add_loss(ops.sum(inputs) * 0.1)
        return inputs  # A pass-through layer.


def main(run):
    strategy = run.make_strategy()
    x_train, y_train = digits(512, seed=1)
    y_train = y_train.astype("float32")
    y_train_one_hot = ops.one_hot(y_train, num_classes=10)
    losses, models = [], []

    # A loss function of (y_true, y_pred).
    with strategy.scope():
        model = get_uncompiled_model()
        model.compile(optimizer=keras.optimizers.Adam(), loss=custom_mean_squared_error)
    losses += logged(model.fit(x_train, y_train_one_hot, batch_size=64, epochs=1))
    models.append(model)

    # A Loss subclass with a parameter.
    with strategy.scope():
        model = get_uncompiled_model()
        model.compile(optimizer=keras.optimizers.Adam(), loss=CustomMSE())
    losses += logged(model.fit(x_train, y_train_one_hot, batch_size=64, epochs=1))
    models.append(model)

    # A custom metric: the count of correctly classified samples.
    with strategy.scope():
        model = get_uncompiled_model()
        model.compile(optimizer=keras.optimizers.RMSprop(learning_rate=1e-3),
                      loss=keras.losses.SparseCategoricalCrossentropy(),
                      metrics=[CategoricalTruePositives()])
    history = model.fit(x_train, y_train, batch_size=64, epochs=2)
    losses += logged(history) + logged(history, "categorical_true_positives")
    models.append(model)

    # A regularization loss added in a layer's call().
    with strategy.scope():
        inputs = keras.Input(shape=(64,), name="digits")
        x = layers.Dense(32, activation="relu", name="dense_1")(inputs)
        x = ActivityRegularizationLayer()(x)
        x = layers.Dense(32, activation="relu", name="dense_2")(x)
        outputs = layers.Dense(10, name="predictions")(x)
        model = keras.Model(inputs=inputs, outputs=outputs)
        model.compile(optimizer=keras.optimizers.RMSprop(learning_rate=1e-3),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    # The logged loss includes the regularization term.
    losses += logged(model.fit(x_train, y_train, batch_size=64, epochs=1))
    models.append(model)
    return Outcome(models=models, losses=losses)

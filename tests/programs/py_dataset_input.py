"""A `keras.utils.PyDataset` as fit's, evaluate's and predict's input, and a Python generator.

Source: https://github.com/keras-team/keras-io/blob/master/guides/training_with_built_in_methods.py
(sections "Using a `keras.utils.PyDataset` instance as input" and "Other input formats
supported": Python generators yielding batches).
Changed: MNIST (50,000 + 10,000 images of 784 pixels) -> synthetic digits, 512 + 128 of 64
features; Dense widths 64 -> 32; each model made and compiled under `strategy.scope()`; the
guide's `workers=4, use_multiprocessing=True` variant runs with `workers=2` in threads (one
process per worker keeps the test light; the batches are the same); the generator section
trains with `steps_per_epoch`, as a generator has no length. Left out: the PyTorch
DataLoader section (no torch here).
"""

import keras
import numpy as np
from keras import layers

from tests.programs.corpus import KERAS_IO, Exact, Outcome, digits, logged

SOURCE = KERAS_IO + "guides/training_with_built_in_methods.py"
COMPARE = Exact()


def get_compiled_model():
    inputs = keras.Input(shape=(64,), name="digits")
    x = layers.Dense(32, activation="relu", name="dense_1")(inputs)
    x = layers.Dense(32, activation="relu", name="dense_2")(x)
    outputs = layers.Dense(10, activation="softmax", name="predictions")(x)
    model = keras.Model(inputs=inputs, outputs=outputs)
    model.compile(optimizer=keras.optimizers.RMSprop(learning_rate=1e-3),
                  loss="sparse_categorical_crossentropy",
                  metrics=["sparse_categorical_accuracy"])
    return model


class ExamplePyDataset(keras.utils.PyDataset):
    def __init__(self, x, y, batch_size, **kwargs):
        super().__init__(**kwargs)
        self.x = x
        self.y = y
        self.batch_size = batch_size

    def __len__(self):
        return int(np.ceil(len(self.x) / float(self.batch_size)))

    def __getitem__(self, idx):
        batch_x = self.x[idx * self.batch_size:(idx + 1) * self.batch_size]
        batch_y = self.y[idx * self.batch_size:(idx + 1) * self.batch_size]
        return batch_x, batch_y


def main(run):
    strategy = run.make_strategy()
    x_train, y_train = digits(512, seed=1)
    x_val, y_val = digits(128, seed=2)
    losses, models = [], []

    train_py_dataset = ExamplePyDataset(x_train, y_train, batch_size=32)
    val_py_dataset = ExamplePyDataset(x_val, y_val, batch_size=32)
    with strategy.scope():
        model = get_compiled_model()
    history = model.fit(train_py_dataset, batch_size=64, validation_data=val_py_dataset,
                        epochs=2)
    losses += logged(history) + logged(history, "val_loss")
    losses.append(float(model.evaluate(val_py_dataset)[0]))
    predictions = model.predict(ExamplePyDataset(x_val, y_val, batch_size=32))
    # one row per example, in order: as predicting on the arrays
    checks = {"predict(PyDataset) vs predict(arrays)": float(np.abs(
        predictions - model.predict(x_val, batch_size=32)).max())}
    models.append(model)

    # The guide's parallel variant: the same batches, read by a pool of workers.
    train_py_dataset = ExamplePyDataset(x_train, y_train, batch_size=32, workers=2)
    with strategy.scope():
        model = get_compiled_model()
    losses += logged(model.fit(train_py_dataset, epochs=1))
    models.append(model)

    # A Python generator yielding batches forever: steps_per_epoch says where an epoch ends.
    def batches():
        while True:
            for i in range(0, len(x_train), 32):
                yield x_train[i:i + 32], y_train[i:i + 32]

    with strategy.scope():
        model = get_compiled_model()
    losses += logged(model.fit(batches(), steps_per_epoch=16, epochs=2))
    models.append(model)
    return Outcome(models=models, losses=losses, checks=checks)

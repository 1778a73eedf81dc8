"""Timeseries classification from scratch.

Exercises: a 1D convnet with BatchNormalization, ModelCheckpoint (best only), ReduceLROnPlateau
and EarlyStopping, then the best model reloaded.

Source: https://github.com/keras-team/keras-io/blob/master/examples/timeseries/timeseries_classification_from_scratch.py
Changed: the FordA archive (3,601 + 1,320 series of 500 steps, labels -1/1) -> 256 + 64
synthetic series of 32 steps in the same TSV layout, read with the example's `readucr`;
filters 64 -> 8; epochs 500 -> 4 (patience 20/50 -> 1/2); "best_model.keras" ->
`run.workdir`; the model made and compiled under `strategy.scope()`.
"""

import os
import tempfile

import keras
import numpy as np

from tests.programs.corpus import KERAS_IO, Outcome, Property, logged

SOURCE = KERAS_IO + "examples/timeseries/timeseries_classification_from_scratch.py"
COMPARE = Property(reason="BatchNormalization normalizes each replica's part of the batch "
                          "(sync_batch_norm=True makes it the global batch)")


def write_forda_like(root):
    """FordA_TRAIN.tsv / FordA_TEST.tsv: label (-1 or 1), then 32 values per line."""
    paths = []
    for name, n, seed in (("FordA_TRAIN.tsv", 256, 1), ("FordA_TEST.tsv", 64, 2)):
        rng = np.random.default_rng(seed)
        labels = rng.choice([-1, 1], size=n)
        t = np.linspace(0, 4 * np.pi, 32)
        series = np.sin(t[None, :] * (1.0 + 0.5 * (labels[:, None] > 0))) + \
            0.3 * rng.standard_normal((n, 32))
        path = os.path.join(root, name)
        np.savetxt(path, np.column_stack([labels, series]), delimiter="\t")
        paths.append(path)
    return paths


def readucr(filename):
    data = np.loadtxt(filename, delimiter="\t")
    y = data[:, 0]
    x = data[:, 1:]
    return x, y.astype(int)


def make_model(input_shape, num_classes):
    input_layer = keras.layers.Input(input_shape)
    conv1 = keras.layers.Conv1D(filters=8, kernel_size=3, padding="same")(input_layer)
    conv1 = keras.layers.BatchNormalization()(conv1)
    conv1 = keras.layers.ReLU()(conv1)
    conv2 = keras.layers.Conv1D(filters=8, kernel_size=3, padding="same")(conv1)
    conv2 = keras.layers.BatchNormalization()(conv2)
    conv2 = keras.layers.ReLU()(conv2)
    conv3 = keras.layers.Conv1D(filters=8, kernel_size=3, padding="same")(conv2)
    conv3 = keras.layers.BatchNormalization()(conv3)
    conv3 = keras.layers.ReLU()(conv3)
    gap = keras.layers.GlobalAveragePooling1D()(conv3)
    output_layer = keras.layers.Dense(num_classes, activation="softmax")(gap)
    return keras.models.Model(inputs=input_layer, outputs=output_layer)


def main(run):
    strategy = run.make_strategy()
    train_file, test_file = write_forda_like(tempfile.mkdtemp(prefix="corpus-forda-"))
    x_train, y_train = readucr(train_file)
    x_test, y_test = readucr(test_file)
    x_train = x_train.reshape((x_train.shape[0], x_train.shape[1], 1))
    x_test = x_test.reshape((x_test.shape[0], x_test.shape[1], 1))
    num_classes = len(np.unique(y_train))
    idx = np.random.permutation(len(x_train))
    x_train, y_train = x_train[idx], y_train[idx]
    y_train[y_train == -1] = 0
    y_test[y_test == -1] = 0

    best = os.path.join(run.workdir, "best_model.keras")
    with strategy.scope():
        model = make_model(input_shape=x_train.shape[1:], num_classes=num_classes)
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy",
                      metrics=["sparse_categorical_accuracy"])
    callbacks = [
        keras.callbacks.ModelCheckpoint(best, save_best_only=True, monitor="val_loss"),
        keras.callbacks.ReduceLROnPlateau(monitor="val_loss", factor=0.5, patience=1,
                                          min_lr=0.0001),
        keras.callbacks.EarlyStopping(monitor="val_loss", patience=2, verbose=1),
    ]
    history = model.fit(x_train, y_train, batch_size=32, epochs=4, callbacks=callbacks,
                        validation_split=0.2, verbose=1)
    model = keras.models.load_model(best)
    test_loss, test_acc = model.evaluate(x_test, y_test)
    print("Test accuracy", test_acc)
    print("Test loss", test_loss)
    return Outcome(models=[model], losses=logged(history) + [test_loss],
                   trend=logged(history))

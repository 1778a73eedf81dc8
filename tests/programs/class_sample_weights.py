"""Class weights and sample weights (NumPy and tf.data), from the built-in training guide.

Source: https://github.com/keras-team/keras-io/blob/master/guides/training_with_built_in_methods.py
(section "Using sample weighting and class weighting").
Changed: MNIST (50,000 images of 784 pixels) -> 512 synthetic digits of 64 features; Dense widths
64 -> 32; each model made and compiled under `strategy.scope()`; the tf.data shuffle has
buffer 1024 as in the guide.
"""

import keras
import numpy as np
import tensorflow as tf
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
    model.compile(optimizer="rmsprop", loss="sparse_categorical_crossentropy",
                  metrics=["sparse_categorical_accuracy"])
    return model


def main(run):
    strategy = run.make_strategy()
    x_train, y_train = digits(512, seed=1)
    y_train = y_train.astype("float32")
    losses, models = [], []

    # Class "5" counts twice.
    class_weight = {0: 1.0, 1: 1.0, 2: 1.0, 3: 1.0, 4: 1.0,
                    5: 2.0, 6: 1.0, 7: 1.0, 8: 1.0, 9: 1.0}
    print("Fit with class weight")
    with strategy.scope():
        model = get_compiled_model()
    losses += logged(model.fit(x_train, y_train, class_weight=class_weight, batch_size=64,
                               epochs=1))
    models.append(model)

    # The same with sample weights.
    sample_weight = np.ones(shape=(len(y_train),))
    sample_weight[y_train == 5] = 2.0
    print("Fit with sample weight")
    with strategy.scope():
        model = get_compiled_model()
    losses += logged(model.fit(x_train, y_train, sample_weight=sample_weight, batch_size=64,
                               epochs=1))
    models.append(model)

    # A Dataset yielding (input, label, sample weight).
    train_dataset = tf.data.Dataset.from_tensor_slices((x_train, y_train, sample_weight))
    train_dataset = train_dataset.shuffle(buffer_size=1024).batch(64)
    with strategy.scope():
        model = get_compiled_model()
    losses += logged(model.fit(train_dataset, epochs=1))
    models.append(model)
    return Outcome(models=models, losses=losses)

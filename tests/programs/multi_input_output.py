"""Multi-input, multi-output models.

Exercises: losses and metrics per output, loss weights, lists, dicts and datasets.

Source: https://github.com/keras-team/keras-io/blob/master/guides/training_with_built_in_methods.py
(section "Passing data to multi-input, multi-output models").
Changed: 100 random samples of 32x32x3 images and 20x10 series -> 64 of 8x8x3 and 6x4 (the
same uniform distributions, fixed NumPy seed); the model made and compiled under
`strategy.scope()` (the guide compiles it several times to show the forms; the compile with
dict losses, dict metrics and loss_weights is the one trained here, and the last fit uses the
list form of `loss` as the guide's data section does); `plot_model` left out (needs pydot).
"""

import keras
import numpy as np
import tensorflow as tf
from keras import layers

from tests.programs.corpus import KERAS_IO, Exact, Outcome, logged

SOURCE = KERAS_IO + "guides/training_with_built_in_methods.py"
COMPARE = Exact()


def main(run):
    strategy = run.make_strategy()
    with strategy.scope():
        image_input = keras.Input(shape=(8, 8, 3), name="img_input")
        timeseries_input = keras.Input(shape=(None, 4), name="ts_input")
        x1 = layers.Conv2D(3, 3)(image_input)
        x1 = layers.GlobalMaxPooling2D()(x1)
        x2 = layers.Conv1D(3, 3)(timeseries_input)
        x2 = layers.GlobalMaxPooling1D()(x2)
        x = layers.concatenate([x1, x2])
        score_output = layers.Dense(1, name="score_output")(x)
        class_output = layers.Dense(5, name="class_output")(x)
        model = keras.Model(inputs=[image_input, timeseries_input],
                            outputs=[score_output, class_output])
        # Per-output losses and metrics by name, the score counting twice.
        model.compile(
            optimizer=keras.optimizers.RMSprop(1e-3),
            loss={"score_output": keras.losses.MeanSquaredError(),
                  "class_output": keras.losses.CategoricalCrossentropy()},
            metrics={"score_output": [keras.metrics.MeanAbsolutePercentageError(),
                                      keras.metrics.MeanAbsoluteError()],
                     "class_output": [keras.metrics.CategoricalAccuracy()]},
            loss_weights={"score_output": 2.0, "class_output": 1.0},
        )

    rng = np.random.default_rng(0)
    img_data = rng.random(size=(64, 8, 8, 3))
    ts_data = rng.random(size=(64, 6, 4))
    score_targets = rng.random(size=(64, 1))
    class_targets = rng.random(size=(64, 5))
    losses = []

    # Lists, then dicts.
    losses += logged(model.fit([img_data, ts_data], [score_targets, class_targets],
                               batch_size=32, epochs=1))
    losses += logged(model.fit({"img_input": img_data, "ts_input": ts_data},
                               {"score_output": score_targets, "class_output": class_targets},
                               batch_size=32, epochs=1))

    # A Dataset of (dict of inputs, dict of targets), compiled with a list of losses.
    with strategy.scope():
        model.compile(optimizer=keras.optimizers.RMSprop(1e-3),
                      loss=[keras.losses.MeanSquaredError(),
                            keras.losses.CategoricalCrossentropy()])
    train_dataset = tf.data.Dataset.from_tensor_slices(
        ({"img_input": img_data, "ts_input": ts_data},
         {"score_output": score_targets, "class_output": class_targets}))
    train_dataset = train_dataset.shuffle(buffer_size=1024).batch(32)
    losses += logged(model.fit(train_dataset, epochs=1))
    return Outcome(models=[model], losses=losses)

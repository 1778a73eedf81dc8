"""Training & evaluation with the built-in methods.

Exercises: the end-to-end workflow and the tf.data sections.

Source: https://github.com/keras-team/keras-io/blob/master/guides/training_with_built_in_methods.py
(sections "API overview", "Training & evaluation from tf.data Datasets", "Using a validation
dataset").
Changed: MNIST (50,000 + 10,000 + 10,000 images of 784 pixels) -> synthetic digits, 512 + 128 + 128
of 64 features; Dense widths 64 -> 32; epochs 2/3/1 -> 2/2/1, validation_steps 10 -> 1; each
model made and compiled under `strategy.scope()`; the two-model validation section trains one
model twice (all of the validation set, then its first batch). Left out: the
steps_per_epoch and validation_split variants (built_in_callbacks has validation_split); the
guide's other sections are programs of their own (custom_losses_metrics, class_sample_weights,
multi_input_output, built_in_callbacks).
"""

import keras
import tensorflow as tf
from keras import layers

from tests.programs.corpus import KERAS_IO, Exact, Outcome, digits, logged

SOURCE = KERAS_IO + "guides/training_with_built_in_methods.py"
COMPARE = Exact()


def get_uncompiled_model():
    inputs = keras.Input(shape=(64,), name="digits")
    x = layers.Dense(32, activation="relu", name="dense_1")(inputs)
    x = layers.Dense(32, activation="relu", name="dense_2")(x)
    outputs = layers.Dense(10, activation="softmax", name="predictions")(x)
    return keras.Model(inputs=inputs, outputs=outputs)


def get_compiled_model():
    model = get_uncompiled_model()
    model.compile(optimizer="rmsprop", loss="sparse_categorical_crossentropy",
                  metrics=["sparse_categorical_accuracy"])
    return model


def main(run):
    strategy = run.make_strategy()
    x_train, y_train = digits(640, seed=1)
    x_test, y_test = digits(128, seed=2)
    y_train, y_test = y_train.astype("float32"), y_test.astype("float32")
    x_val, y_val = x_train[-128:], y_train[-128:]
    x_train, y_train = x_train[:-128], y_train[:-128]
    losses, models = [], []

    # The end-to-end workflow: NumPy data, validation data, evaluate, predict.
    with strategy.scope():
        model = get_uncompiled_model()
        model.compile(optimizer=keras.optimizers.RMSprop(),
                      loss=keras.losses.SparseCategoricalCrossentropy(),
                      metrics=[keras.metrics.SparseCategoricalAccuracy()])
    history = model.fit(x_train, y_train, batch_size=64, epochs=2,
                        validation_data=(x_val, y_val))
    losses += logged(history) + logged(history, "val_loss")
    results = model.evaluate(x_test, y_test, batch_size=128)
    predictions = model.predict(x_test[:3])
    assert predictions.shape == (3, 10), predictions.shape
    losses += list(results)
    models.append(model)

    # A tf.data Dataset for fit and evaluate.
    with strategy.scope():
        model = get_compiled_model()
    train_dataset = tf.data.Dataset.from_tensor_slices((x_train, y_train))
    train_dataset = train_dataset.shuffle(buffer_size=1024).batch(64)
    test_dataset = tf.data.Dataset.from_tensor_slices((x_test, y_test)).batch(64)
    history = model.fit(train_dataset, epochs=2)
    losses += logged(history) + list(model.evaluate(test_dataset))
    models.append(model)

    # A validation dataset: all of it, then only its first batch (validation_steps).
    with strategy.scope():
        model = get_compiled_model()
    val_dataset = tf.data.Dataset.from_tensor_slices((x_val, y_val)).batch(64)
    history = model.fit(train_dataset, epochs=1, validation_data=val_dataset)
    losses += logged(history) + logged(history, "val_loss")
    history = model.fit(train_dataset, epochs=1, validation_data=val_dataset,
                        validation_steps=1)
    losses += logged(history) + logged(history, "val_loss")
    models.append(model)
    return Outcome(models=models, losses=losses)

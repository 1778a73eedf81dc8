"""Built-in callbacks.

Exercises: EarlyStopping, ModelCheckpoint (best only, and every N batches with the loss in the
name), a learning-rate schedule, TensorBoard.

Source: https://github.com/keras-team/keras-io/blob/master/guides/training_with_built_in_methods.py
(sections "Using callbacks", "Checkpointing models", "Using learning rate schedules",
"Using the TensorBoard callback").
Changed: MNIST (50,000 images of 784 pixels) -> 512 synthetic digits of 64 features; Dense widths
64 -> 32; EarlyStopping's epochs 20 -> 4; ModelCheckpoint's `save_freq` 100 -> 3 batches;
paths ("mymodel_{epoch}.keras", "./ckpt", "/full_path_to_your_logs") -> `run.workdir`; the
ExponentialDecay schedule (the guide only builds it) and the TensorBoard callback (the guide
only builds it) are used in a last fit; each model made and compiled under `strategy.scope()`.
Checks: the latest checkpoint restores (the guide's `make_or_restore_model`), and the trained
model saved and reloaded predicts what it predicts.
"""

import os

import keras
import numpy as np
from keras import layers

from tests.programs.corpus import KERAS_IO, Exact, Outcome, digits, logged

SOURCE = KERAS_IO + "guides/training_with_built_in_methods.py"
COMPARE = Exact(weights=1e-4)  # RMSprop at a learning rate of 0.1 amplifies rounding


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
    x_train, y_train = digits(512, seed=1)
    y_train = y_train.astype("float32")
    losses, models, checks = [], [], {}

    # Stop when val_loss no longer improves by 1e-2 for 2 epochs.
    with strategy.scope():
        model = get_compiled_model()
    callbacks = [keras.callbacks.EarlyStopping(monitor="val_loss", min_delta=1e-2, patience=2,
                                               verbose=1)]
    history = model.fit(x_train, y_train, epochs=4, batch_size=64, callbacks=callbacks,
                        validation_split=0.2)
    losses += logged(history) + logged(history, "val_loss")
    models.append(model)

    # Save a model whenever val_loss improves.
    with strategy.scope():
        model = get_compiled_model()
    callbacks = [keras.callbacks.ModelCheckpoint(
        filepath=os.path.join(run.workdir, "mymodel_{epoch}.keras"), save_best_only=True,
        monitor="val_loss", verbose=1)]
    history = model.fit(x_train, y_train, epochs=2, batch_size=64, callbacks=callbacks,
                        validation_split=0.2)
    losses += logged(history) + logged(history, "val_loss")
    models.append(model)

    # Fault tolerance: restore the latest checkpoint, or start fresh.
    checkpoint_dir = os.path.join(run.workdir, "ckpt")
    if not os.path.exists(checkpoint_dir):
        os.makedirs(checkpoint_dir)

    def make_or_restore_model():
        checkpoints = [checkpoint_dir + "/" + name for name in os.listdir(checkpoint_dir)]
        if checkpoints:
            latest_checkpoint = max(checkpoints, key=os.path.getctime)
            print("Restoring from", latest_checkpoint)
            return keras.models.load_model(latest_checkpoint)
        print("Creating a new model")
        return get_compiled_model()

    with strategy.scope():
        model = make_or_restore_model()
    callbacks = [keras.callbacks.ModelCheckpoint(
        filepath=checkpoint_dir + "/model-loss={loss:.2f}.keras", save_freq=3)]
    losses += logged(model.fit(x_train, y_train, epochs=1, callbacks=callbacks))
    models.append(model)
    with strategy.scope():
        restored = make_or_restore_model()  # the latest checkpoint loads
    assert restored.optimizer is not None
    model.save(os.path.join(run.workdir, "final.keras"))
    reloaded = keras.models.load_model(os.path.join(run.workdir, "final.keras"))
    checks["reloaded_predictions"] = float(np.max(np.abs(
        reloaded.predict(x_train[:32]) - model.predict(x_train[:32]))))

    # A learning-rate schedule, logged to TensorBoard.
    lr_schedule = keras.optimizers.schedules.ExponentialDecay(
        0.1, decay_steps=4, decay_rate=0.96, staircase=True)
    with strategy.scope():
        model = get_uncompiled_model()
        model.compile(optimizer=keras.optimizers.RMSprop(learning_rate=lr_schedule),
                      loss="sparse_categorical_crossentropy",
                      metrics=["sparse_categorical_accuracy"])
    tensorboard = keras.callbacks.TensorBoard(log_dir=os.path.join(run.workdir, "logs"),
                                              histogram_freq=0, embeddings_freq=0,
                                              update_freq="epoch")
    losses += logged(model.fit(x_train, y_train, epochs=2, batch_size=64,
                               callbacks=[tensorboard]))
    models.append(model)
    return Outcome(models=models, losses=losses, checks=checks)

"""Multi-GPU distributed training with TensorFlow.

Exercises: the guide's end-to-end example and its fault-tolerance section.

Source: https://github.com/keras-team/keras-io/blob/master/guides/distributed_training_with_tensorflow.py
Changed: MNIST (50,000 + 10,000 + 10,000 images of 784 pixels) -> synthetic digits, 512 + 128 + 128
of 64 features; Dense widths 256 -> 32; epochs 2 -> 1; `tf.distribute.MirroredStrategy()` ->
`run.make_strategy()` (both times `run_training` makes one); the checkpoint folder "./ckpt" ->
a folder in `run.workdir`. As in the guide, `run_training` is called twice: the second call
restores the first call's checkpoint and trains on.
"""

import os

import keras
import tensorflow as tf

from tests.programs.corpus import KERAS_IO, Exact, Outcome, digits, logged

SOURCE = KERAS_IO + "guides/distributed_training_with_tensorflow.py"
COMPARE = Exact()


def get_compiled_model():
    # A simple 2-layer densely-connected network.
    inputs = keras.Input(shape=(64,))
    x = keras.layers.Dense(32, activation="relu")(inputs)
    x = keras.layers.Dense(32, activation="relu")(x)
    outputs = keras.layers.Dense(10)(x)
    model = keras.Model(inputs, outputs)
    model.compile(
        optimizer=keras.optimizers.Adam(),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=[keras.metrics.SparseCategoricalAccuracy()],
    )
    return model


def get_dataset():
    batch_size = 32
    num_val_samples = 128
    x_train, y_train = digits(640, seed=1)
    x_test, y_test = digits(128, seed=2)
    y_train, y_test = y_train.astype("float32"), y_test.astype("float32")
    # Reserve num_val_samples samples for validation.
    x_val, y_val = x_train[-num_val_samples:], y_train[-num_val_samples:]
    x_train, y_train = x_train[:-num_val_samples], y_train[:-num_val_samples]
    return (
        tf.data.Dataset.from_tensor_slices((x_train, y_train)).batch(batch_size),
        tf.data.Dataset.from_tensor_slices((x_val, y_val)).batch(batch_size),
        tf.data.Dataset.from_tensor_slices((x_test, y_test)).batch(batch_size),
    )


def main(run):
    losses = []

    # The end-to-end example: everything that creates variables under the scope.
    strategy = run.make_strategy()
    print("Number of devices: {}".format(strategy.num_replicas_in_sync))
    with strategy.scope():
        model = get_compiled_model()
        train_dataset, val_dataset, test_dataset = get_dataset()
        history = model.fit(train_dataset, epochs=1, validation_data=val_dataset)
        losses += logged(history) + logged(history, "val_loss")
        losses += list(model.evaluate(test_dataset))

    # Fault tolerance: a checkpoint per epoch; a second run restores the latest one.
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

    trained = []

    def run_training(epochs=1):
        strategy = run.make_strategy()
        with strategy.scope():
            model = make_or_restore_model()
            callbacks = [
                keras.callbacks.ModelCheckpoint(
                    filepath=checkpoint_dir + "/ckpt-{epoch}.keras", save_freq="epoch")
            ]
            history = model.fit(train_dataset, epochs=epochs, callbacks=callbacks,
                                validation_data=val_dataset, verbose=2)
        losses.extend(logged(history) + logged(history, "val_loss"))
        trained.append(model)

    # The first run creates the model; the second resumes from its checkpoint.
    run_training(epochs=1)
    run_training(epochs=1)
    return Outcome(models=[model, *trained], losses=losses)

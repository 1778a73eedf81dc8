"""Transfer learning & fine-tuning.

Exercises: a frozen base model called with training=False (its BatchNormalization in inference
mode), data augmentation, then the base unfrozen and the model recompiled with a low learning
rate.

Source: https://github.com/keras-team/keras-io/blob/master/guides/transfer_learning.py
(section "An end-to-end example: fine-tuning an image classification model on a cats vs. dogs
dataset").
Changed: cats_vs_dogs from TensorFlow Datasets (150x150 images) -> 512 + 64 synthetic 16x16 RGB
images in [0, 255], two classes told apart by colour; the ImageNet Xception base (downloaded
weights) -> a small convolutional base with BatchNormalization layers, built and "pre-trained"
here on other synthetic images of the same kind for two epochs (nothing is downloaded); batch
64 -> 32; epochs 2 + 1 as in the guide; the models made and compiled under `strategy.scope()`.
"""

import keras
import numpy as np
import tensorflow as tf
from keras import layers

from tests.programs.corpus import KERAS_IO, Outcome, Property, logged

SOURCE = KERAS_IO + "guides/transfer_learning.py"
COMPARE = Property(reason="random flips and rotations in the input pipeline, Dropout")


def pets(n, seed):
    """(images in [0, 1], labels): two classes told apart by colour, as cats and dogs are not."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 2, size=n)
    x = rng.uniform(0.0, 0.7, size=(n, 16, 16, 3))
    x[..., 0] += 0.3 * y[:, None, None]
    return x.astype("float32"), y


def pretrained_base(strategy):
    """Stands in for `keras.applications.Xception(weights="imagenet", include_top=False)`."""
    with strategy.scope():
        base = keras.Sequential([
            keras.Input(shape=(16, 16, 3)),
            layers.Conv2D(8, 3, padding="same"), layers.BatchNormalization(), layers.ReLU(),
            layers.MaxPooling2D(),
            layers.Conv2D(16, 3, padding="same"), layers.BatchNormalization(), layers.ReLU(),
        ], name="base")
        pretraining = keras.Sequential([base, layers.GlobalAveragePooling2D(),
                                        layers.Dense(10)])
        pretraining.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = pets(512, seed=3)
    pretraining.fit(x * 2.0 - 1.0, y, batch_size=32, epochs=2)
    return base


def main(run):
    strategy = run.make_strategy()
    x, y = pets(576, seed=1)
    x = x * 255.0
    train_ds = tf.data.Dataset.from_tensor_slices((x[:512], y[:512]))
    validation_ds = tf.data.Dataset.from_tensor_slices((x[512:], y[512:]))

    augmentation_layers = [layers.RandomFlip("horizontal"), layers.RandomRotation(0.1)]

    def data_augmentation(x):
        for layer in augmentation_layers:
            x = layer(x)
        return x

    batch_size = 32
    train_ds = train_ds.map(lambda x, y: (data_augmentation(x), y))
    train_ds = train_ds.batch(batch_size).prefetch(tf.data.AUTOTUNE).cache()
    validation_ds = validation_ds.batch(batch_size).prefetch(tf.data.AUTOTUNE).cache()

    base_model = pretrained_base(strategy)
    # Freeze the base model.
    base_model.trainable = False
    with strategy.scope():
        inputs = keras.Input(shape=(16, 16, 3))
        # Pixels from [0, 255] to [-1, 1].
        scale_layer = keras.layers.Rescaling(scale=1 / 127.5, offset=-1)
        x = scale_layer(inputs)
        # The base runs in inference mode: its BatchNormalization statistics do not move
        # when it is unfrozen for fine-tuning.
        x = base_model(x, training=False)
        x = keras.layers.GlobalAveragePooling2D()(x)
        x = keras.layers.Dropout(0.2)(x)
        outputs = keras.layers.Dense(1)(x)
        model = keras.Model(inputs, outputs)
        model.compile(optimizer=keras.optimizers.Adam(),
                      loss=keras.losses.BinaryCrossentropy(from_logits=True),
                      metrics=[keras.metrics.BinaryAccuracy()])
    print("Fitting the top layer of the model")
    history = model.fit(train_ds, epochs=2, validation_data=validation_ds)
    losses = logged(history)
    trend = list(losses)

    # Fine-tuning: unfreeze the base, recompile (the change takes effect), low learning rate.
    base_model.trainable = True
    with strategy.scope():
        model.compile(optimizer=keras.optimizers.Adam(1e-5),
                      loss=keras.losses.BinaryCrossentropy(from_logits=True),
                      metrics=[keras.metrics.BinaryAccuracy()])
    print("Fitting the end-to-end model")
    history = model.fit(train_ds, epochs=1, validation_data=validation_ds)
    losses += logged(history)
    moving = [w for w in base_model.non_trainable_weights if "moving" in w.path]
    assert moving, [w.path for w in base_model.weights]
    return Outcome(models=[model], losses=losses + [model.evaluate(validation_ds)[0]],
                   trend=trend)

"""Simple MNIST convnet.

Source: https://github.com/keras-team/keras-io/blob/master/examples/vision/mnist_convnet.py
Changed: MNIST (60,000 + 10,000 images of 28x28) -> 512 + 128 synthetic 12x12 digits; filters
32/64 -> 8/16; epochs 15 -> 3; the model made and compiled under `strategy.scope()`.
"""

import keras
import numpy as np
from keras import layers

from tests.programs.corpus import KERAS_IO, Outcome, Property, images, logged

SOURCE = KERAS_IO + "examples/vision/mnist_convnet.py"
COMPARE = Property(reason="Dropout: each replica draws its own mask")


def main(run):
    strategy = run.make_strategy()
    num_classes = 10
    input_shape = (12, 12, 1)
    x_train, y_train = images(512, shape=input_shape, seed=1)
    x_test, y_test = images(128, shape=input_shape, seed=2)
    x_train, x_test = x_train.astype("float32"), x_test.astype("float32")
    print("x_train shape:", x_train.shape)
    y_train = keras.utils.to_categorical(y_train, num_classes)
    y_test = keras.utils.to_categorical(y_test, num_classes)

    with strategy.scope():
        model = keras.Sequential([
            keras.Input(shape=input_shape),
            layers.Conv2D(8, kernel_size=(3, 3), activation="relu"),
            layers.MaxPooling2D(pool_size=(2, 2)),
            layers.Conv2D(16, kernel_size=(3, 3), activation="relu"),
            layers.MaxPooling2D(pool_size=(2, 2)),
            layers.Flatten(),
            layers.Dropout(0.5),
            layers.Dense(num_classes, activation="softmax"),
        ])
        model.compile(loss="categorical_crossentropy", optimizer="adam", metrics=["accuracy"])
    model.summary()
    history = model.fit(x_train, y_train, batch_size=128, epochs=3, validation_split=0.1)
    score = model.evaluate(x_test, y_test, verbose=0)
    print("Test loss:", score[0])
    print("Test accuracy:", score[1])
    assert np.isfinite(score[0])
    return Outcome(models=[model], losses=logged(history) + list(score),
                   trend=logged(history))

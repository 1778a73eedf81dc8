"""Working with preprocessing layers.

Exercises: the quick recipes (Normalization, StringLookup, N-gram multi-hot and TF-IDF text, an
end-to-end model on strings).

Source: https://github.com/keras-team/keras-io/blob/master/guides/preprocessing_layers.py
(section "Quick recipes": "Normalizing numerical features", "Encoding string categorical
features via one-hot encoding", "Encoding text as a dense matrix of N-grams with multi-hot
encoding" and "... with TF-IDF weighting").
Changed: CIFAR-10 (50,000 images of 3,072 values) -> 256 synthetic samples of 48 features;
each model made and compiled under `strategy.scope()`, the preprocessing layers too, as the
guide's section on `tf.distribute` advises; the end-to-end model's string input shape (1,) ->
() (with Keras 3.15 the multi-hot output of a (batch, 1) string tensor is (batch, 1, vocabulary),
which the Dense model refuses). Left out: the image augmentation recipe (random),
the hashing and integer-lookup recipes (no training) and the token-index recipe (Embedding +
RMSprop: see functional_api).
"""

import keras
import numpy as np
import tensorflow as tf
from keras import layers

from tests.programs.corpus import KERAS_IO, Exact, Outcome, digits, logged

SOURCE = KERAS_IO + "guides/preprocessing_layers.py"
COMPARE = Exact()

ADAPT_DATA = ["The Brain is wider than the Sky", "For put them side by side",
              "The one the other will contain", "With ease and You beside"]
TRAIN_TEXT = (["The Brain is deeper than the sea", "for if they are held Blue to Blue"], [1, 0])


def text_model(strategy, output_mode, losses, outputs_seen):
    with strategy.scope():
        text_vectorizer = layers.TextVectorization(output_mode=output_mode, ngrams=2)
    text_vectorizer.adapt(tf.constant(ADAPT_DATA))
    print("Encoded text:\n", text_vectorizer(["The Brain is deeper than the sea"]).numpy())
    with strategy.scope():
        inputs = keras.Input(shape=(text_vectorizer.vocabulary_size(),))
        outputs = layers.Dense(1)(inputs)
        model = keras.Model(inputs, outputs)
        model.compile(optimizer="rmsprop", loss="mse")
    train_dataset = tf.data.Dataset.from_tensor_slices(TRAIN_TEXT)
    train_dataset = train_dataset.batch(2).map(lambda x, y: (text_vectorizer(x), y))
    print("\nTraining model...")
    losses += logged(model.fit(train_dataset))
    # For inference, a model that takes strings.
    inputs = keras.Input(shape=(), dtype="string")
    x = text_vectorizer(inputs)
    outputs = model(x)
    end_to_end_model = keras.Model(inputs, outputs)
    test_output = end_to_end_model(tf.constant(["The one the other will absorb"]))
    print("Model output:", test_output)
    outputs_seen.append(float(np.asarray(test_output).ravel()[0]))
    return model


def main(run):
    strategy = run.make_strategy()
    losses, models, outputs_seen = [], [], []

    # Normalizing numerical features: adapt, then a model that includes the layer.
    x_train, y_train = digits(256, features=48, seed=1)
    with strategy.scope():
        normalizer = layers.Normalization()
    normalizer.adapt(x_train)
    with strategy.scope():
        inputs = keras.Input(shape=x_train.shape[1:])
        x = normalizer(inputs)
        outputs = layers.Dense(10, activation="softmax")(x)
        model = keras.Model(inputs, outputs)
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    losses += logged(model.fit(x_train, y_train))
    models.append(model)

    # One-hot encoding of string categories (index 0: out of vocabulary).
    with strategy.scope():
        lookup = layers.StringLookup(output_mode="one_hot")
    lookup.adapt(tf.constant([["a"], ["b"], ["c"], ["b"], ["c"], ["a"]]))
    encoded = lookup(tf.constant([["a"], ["b"], ["c"], ["d"], ["e"], [""]]))
    print(encoded)
    assert np.asarray(encoded).shape == (6, 4), np.asarray(encoded).shape

    # Text as N-gram multi-hot vectors, then with TF-IDF weights.
    models.append(text_model(strategy, "multi_hot", losses, outputs_seen))
    models.append(text_model(strategy, "tf_idf", losses, outputs_seen))
    return Outcome(models=models, losses=losses + outputs_seen)

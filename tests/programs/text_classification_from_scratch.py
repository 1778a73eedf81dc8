"""Text classification from scratch.

Exercises: TextVectorization in the tf.data pipeline, a 1D convnet, and an end-to-end model on
raw strings.

Source: https://github.com/keras-team/keras-io/blob/master/examples/nlp/text_classification_from_scratch.py
Changed: the IMDB archive (25,000 + 25,000 reviews) -> 960 + 64 synthetic reviews written as
text files in the same aclImdb/{train,test}/{pos,neg} layout, read with the same
`text_dataset_from_directory` calls; max_features 20,000 -> 200, embedding_dim 128 -> 32,
sequence_length 500 -> 16, Conv1D 128 filters of 7 -> 32 of 3, Dense 128 -> 32; epochs 3 as in
the example;
the models made and compiled under `strategy.scope()`.
"""

import os
import re
import string
import tempfile

import keras
import tensorflow as tf
from keras import layers

from tests.programs.corpus import KERAS_IO, Outcome, Property, logged, reviews

SOURCE = KERAS_IO + "examples/nlp/text_classification_from_scratch.py"
COMPARE = Property(reason="Dropout: each replica draws its own mask")


def write_imdb_like(root):
    """aclImdb/{train,test}/{pos,neg}/*.txt of synthetic reviews (the download's layout)."""
    for split, n, seed in (("train", 960, 1), ("test", 64, 2)):
        texts, labels = reviews(n, seed=seed)
        for i, (text, label) in enumerate(zip(texts, labels)):
            folder = os.path.join(root, "aclImdb", split, "pos" if label else "neg")
            os.makedirs(folder, exist_ok=True)
            with open(os.path.join(folder, f"{i}_{label}.txt"), "w") as f:
                f.write(f"{text}<br />")
    return os.path.join(root, "aclImdb")


def custom_standardization(input_data):
    lowercase = tf.strings.lower(input_data)
    stripped_html = tf.strings.regex_replace(lowercase, "<br />", " ")
    return tf.strings.regex_replace(stripped_html, f"[{re.escape(string.punctuation)}]", "")


def main(run):
    strategy = run.make_strategy()
    data = write_imdb_like(tempfile.mkdtemp(prefix="corpus-imdb-"))
    batch_size = 32
    raw_train_ds = keras.utils.text_dataset_from_directory(
        os.path.join(data, "train"), batch_size=batch_size, validation_split=0.2,
        subset="training", seed=1337)
    raw_val_ds = keras.utils.text_dataset_from_directory(
        os.path.join(data, "train"), batch_size=batch_size, validation_split=0.2,
        subset="validation", seed=1337)
    raw_test_ds = keras.utils.text_dataset_from_directory(os.path.join(data, "test"),
                                                          batch_size=batch_size)

    max_features = 200
    embedding_dim = 32
    sequence_length = 16
    with strategy.scope():
        vectorize_layer = keras.layers.TextVectorization(
            standardize=custom_standardization, max_tokens=max_features, output_mode="int",
            output_sequence_length=sequence_length)
    text_ds = raw_train_ds.map(lambda x, y: x)
    vectorize_layer.adapt(text_ds)

    def vectorize_text(text, label):
        text = tf.expand_dims(text, -1)
        return vectorize_layer(text), label

    train_ds = raw_train_ds.map(vectorize_text).cache().prefetch(buffer_size=10)
    val_ds = raw_val_ds.map(vectorize_text).cache().prefetch(buffer_size=10)
    test_ds = raw_test_ds.map(vectorize_text).cache().prefetch(buffer_size=10)

    with strategy.scope():
        inputs = keras.Input(shape=(None,), dtype="int64")
        x = layers.Embedding(max_features, embedding_dim)(inputs)
        x = layers.Dropout(0.5)(x)
        x = layers.Conv1D(32, 3, padding="valid", activation="relu", strides=3)(x)
        x = layers.Conv1D(32, 3, padding="valid", activation="relu", strides=3)(x)
        x = layers.GlobalMaxPooling1D()(x)
        x = layers.Dense(32, activation="relu")(x)
        x = layers.Dropout(0.5)(x)
        predictions = layers.Dense(1, activation="sigmoid", name="predictions")(x)
        model = keras.Model(inputs, predictions)
        model.compile(loss="binary_crossentropy", optimizer="adam", metrics=["accuracy"])
    history = model.fit(train_ds, validation_data=val_ds, epochs=3)
    losses = logged(history) + list(model.evaluate(test_ds))

    # A model that takes raw strings: the vectorizer, then the trained model.
    with strategy.scope():
        inputs = keras.Input(shape=(1,), dtype="string")
        indices = vectorize_layer(inputs)
        outputs = model(indices)
        end_to_end_model = keras.Model(inputs, outputs)
        end_to_end_model.compile(loss="binary_crossentropy", optimizer="adam",
                                 metrics=["accuracy"])
    end_to_end = end_to_end_model.evaluate(raw_test_ds)
    checks = {"end_to_end_equals_vectorized": abs(end_to_end[0] - losses[-2])}
    return Outcome(models=[model], losses=losses + list(end_to_end), checks=checks,
                   trend=logged(history))

"""Bidirectional LSTM on IMDB.

Exercises: variable-length integer sequences (`keras.Input(shape=(None,), dtype="int32")`),
`keras.utils.pad_sequences`, Embedding, two stacked Bidirectional LSTMs (a recurrent loop in
every replica's step), validation data, and a training set that is not a multiple of the
batch (the last batch is split unevenly).

Source: https://github.com/keras-team/keras-io/blob/master/examples/nlp/bidirectional_lstm_imdb.py
Changed: `keras.datasets.imdb.load_data(num_words=20000)` (25,000 + 25,000 reviews) -> 301 +
64 synthetic reviews of 12 words (`corpus.reviews`) mapped to word ids as the IMDB loader maps
them (1 starts a review, ids from 3); maxlen 200 -> 16; vocabulary 20,000 -> the reviews' 36
words; Embedding 128 -> 16 and LSTM units 64 -> 8; the model made and compiled under
`strategy.scope()`.
"""

import keras
import numpy as np
from keras import layers

from tests.programs.corpus import KERAS_IO, Outcome, Property, logged, reviews, word_vocabulary

SOURCE = KERAS_IO + "examples/nlp/bidirectional_lstm_imdb.py"
# Measured: under `mirrored` the weights equal a one-device run whose Adam sums repeated ids
# (`tfdist.sum_duplicate_sparse_gradients`) to 3e-8, and with `keep_duplicate_sparse_slices` a
# plain one-device run to 1.2e-7; the plain run itself is 0.035 away from the summed one.
COMPARE = Property(reason="Embedding + Adam: tfdist's presets sum the gradients of repeated "
                          "ids, a plain one-device run does not (docs/numerics.md)")

maxlen = 16  # Only consider the first 16 words of each movie review


def load_data(n, seed):
    """IMDB's encoding: 1 starts a sequence, word ids from 3 (0 pads, 2 is out of vocabulary)."""
    texts, labels = reviews(n, seed=seed)
    index = {word: i + 3 for i, word in enumerate(word_vocabulary())}
    return [[1] + [index[w] for w in text.split()] for text in texts], labels


def main(run):
    strategy = run.make_strategy()
    max_features = len(word_vocabulary()) + 3  # Only consider the top words

    with strategy.scope():
        # Input for variable-length sequences of integers
        inputs = keras.Input(shape=(None,), dtype="int32")
        # Embed each integer in a 16-dimensional vector
        x = layers.Embedding(max_features, 16)(inputs)
        # Add 2 bidirectional LSTMs
        x = layers.Bidirectional(layers.LSTM(8, return_sequences=True))(x)
        x = layers.Bidirectional(layers.LSTM(8))(x)
        # Add a classifier
        outputs = layers.Dense(1, activation="sigmoid")(x)
        model = keras.Model(inputs, outputs)
    model.summary()

    (x_train, y_train), (x_val, y_val) = load_data(301, seed=1), load_data(64, seed=2)
    print(len(x_train), "Training sequences")
    print(len(x_val), "Validation sequences")
    # Use pad_sequence to standardize sequence length:
    # this will truncate sequences longer than 16 words and pad shorter ones with zeros.
    x_train = keras.utils.pad_sequences(x_train, maxlen=maxlen)
    x_val = keras.utils.pad_sequences(x_val, maxlen=maxlen)

    with strategy.scope():
        model.compile(optimizer="adam", loss="binary_crossentropy", metrics=["accuracy"])
    history = model.fit(x_train, y_train, batch_size=32, epochs=2,
                        validation_data=(x_val, y_val))
    assert np.isfinite(history.history["val_loss"]).all()
    return Outcome(models=[model], losses=logged(history) + logged(history, "val_loss"),
                   trend=logged(history))

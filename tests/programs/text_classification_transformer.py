"""Text classification with a Transformer.

Exercises: a TransformerBlock layer and token + position embeddings of your own.

Source: https://github.com/keras-team/keras-io/blob/master/examples/nlp/text_classification_with_transformer.py
Changed: the IMDB dataset (25,000 + 25,000 reviews as word ids) -> 320 + 64 synthetic reviews
turned into word ids with an in-memory index; vocab_size 20,000 -> 64, maxlen 200 -> 16,
embed_dim 32 -> 8, ff_dim 32 -> 8, Dense 20 -> 8; epochs 2 -> 2; the model made and compiled
under `strategy.scope()`.
"""

import keras
import numpy as np
from keras import layers, ops

from tests.programs.corpus import (
    FILLER,
    KERAS_IO,
    NEGATIVE,
    POSITIVE,
    Outcome,
    Property,
    logged,
    reviews,
)

SOURCE = KERAS_IO + "examples/nlp/text_classification_with_transformer.py"
COMPARE = Property(reason="Dropout: each replica draws its own mask")


class TransformerBlock(layers.Layer):
    def __init__(self, embed_dim, num_heads, ff_dim, rate=0.1):
        super().__init__()
        self.att = layers.MultiHeadAttention(num_heads=num_heads, key_dim=embed_dim)
        self.ffn = keras.Sequential([layers.Dense(ff_dim, activation="relu"),
                                     layers.Dense(embed_dim)])
        self.layernorm1 = layers.LayerNormalization(epsilon=1e-6)
        self.layernorm2 = layers.LayerNormalization(epsilon=1e-6)
        self.dropout1 = layers.Dropout(rate)
        self.dropout2 = layers.Dropout(rate)

    def call(self, inputs):
        attn_output = self.att(inputs, inputs)
        attn_output = self.dropout1(attn_output)
        out1 = self.layernorm1(inputs + attn_output)
        ffn_output = self.ffn(out1)
        ffn_output = self.dropout2(ffn_output)
        return self.layernorm2(out1 + ffn_output)


class TokenAndPositionEmbedding(layers.Layer):
    def __init__(self, maxlen, vocab_size, embed_dim):
        super().__init__()
        self.token_emb = layers.Embedding(input_dim=vocab_size, output_dim=embed_dim)
        self.pos_emb = layers.Embedding(input_dim=maxlen, output_dim=embed_dim)

    def call(self, x):
        maxlen = ops.shape(x)[-1]
        positions = ops.arange(start=0, stop=maxlen, step=1)
        positions = self.pos_emb(positions)
        x = self.token_emb(x)
        return x + positions


def imdb_like(n, seed):
    """Word ids as keras.datasets.imdb gives them (1 = start, 2 = out of vocabulary)."""
    index = {w: i + 3 for i, w in enumerate(FILLER + POSITIVE + NEGATIVE)}
    texts, labels = reviews(n, seed=seed)
    return [[1] + [index.get(w, 2) for w in t.split()] for t in texts], labels


def main(run):
    strategy = run.make_strategy()
    vocab_size = 64
    maxlen = 16
    x_train, y_train = imdb_like(320, seed=1)
    x_val, y_val = imdb_like(64, seed=2)
    print(len(x_train), "Training sequences")
    print(len(x_val), "Validation sequences")
    x_train = keras.utils.pad_sequences(x_train, maxlen=maxlen)
    x_val = keras.utils.pad_sequences(x_val, maxlen=maxlen)

    embed_dim = 8  # Embedding size for each token
    num_heads = 2  # Number of attention heads
    ff_dim = 8  # Hidden layer size in feed forward network inside transformer
    with strategy.scope():
        inputs = layers.Input(shape=(maxlen,))
        embedding_layer = TokenAndPositionEmbedding(maxlen, vocab_size, embed_dim)
        x = embedding_layer(inputs)
        transformer_block = TransformerBlock(embed_dim, num_heads, ff_dim)
        x = transformer_block(x)
        x = layers.GlobalAveragePooling1D()(x)
        x = layers.Dropout(0.1)(x)
        x = layers.Dense(8, activation="relu")(x)
        x = layers.Dropout(0.1)(x)
        outputs = layers.Dense(2, activation="softmax")(x)
        model = keras.Model(inputs=inputs, outputs=outputs)
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy",
                      metrics=["accuracy"])
    history = model.fit(x_train, np.asarray(y_train), batch_size=32, epochs=2,
                        validation_data=(x_val, np.asarray(y_val)))
    return Outcome(models=[model], losses=logged(history) + logged(history, "val_loss"),
                   trend=logged(history))

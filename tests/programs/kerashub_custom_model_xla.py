"""Getting started with KerasHub.

Exercises: a frozen BERT backbone under two new TransformerEncoder layers, preprocessing in
tf.data, compiled with jit_compile=True.

Source: https://github.com/keras-team/keras-io/blob/master/guides/keras_hub/getting_started.py
(section "Fine tuning with a custom model"; the guide's global mixed_float16 policy kept).
Changed: `BertPreprocessor.from_preset` / `BertBackbone.from_preset("bert_tiny_en_uncased")`
(downloaded) -> the same classes built from config, tiny (1 layer, 2 heads, hidden 8, sequence
length 16), random weights, the WordPiece vocabulary held in memory; TransformerEncoder
intermediate_dim 512 -> 16; IMDB (25,000 + 25,000 reviews) -> 512 + 64 synthetic reviews,
batch 16 and epochs 3 as in the guide; the model made and compiled under `strategy.scope()`.
"""

import keras
import keras_hub
import tensorflow as tf

from tests.programs.corpus import (
    KERAS_IO,
    Outcome,
    Property,
    logged,
    reviews,
    word_vocabulary,
)

SOURCE = KERAS_IO + "guides/keras_hub/getting_started.py"
COMPARE = Property(reason="Dropout in the backbone and the new TransformerEncoder layers")


def main(run):
    keras.mixed_precision.set_global_policy("mixed_float16")
    strategy = run.make_strategy()
    texts, labels = reviews(512, seed=1)
    test_texts, test_labels = reviews(64, seed=2)
    imdb_train = tf.data.Dataset.from_tensor_slices((texts, labels)).batch(16)
    imdb_test = tf.data.Dataset.from_tensor_slices((test_texts, test_labels)).batch(16)

    vocabulary = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + word_vocabulary()
    with strategy.scope():
        tokenizer = keras_hub.models.BertTokenizer(vocabulary=vocabulary, lowercase=True)
        preprocessor = keras_hub.models.BertPreprocessor(tokenizer, sequence_length=16)
        backbone = keras_hub.models.BertBackbone(
            vocabulary_size=len(vocabulary), num_layers=1, num_heads=2, hidden_dim=8,
            intermediate_dim=16, max_sequence_length=16)
    imdb_train_preprocessed = (
        imdb_train.map(preprocessor, tf.data.AUTOTUNE).cache().prefetch(tf.data.AUTOTUNE))
    imdb_test_preprocessed = (
        imdb_test.map(preprocessor, tf.data.AUTOTUNE).cache().prefetch(tf.data.AUTOTUNE))

    with strategy.scope():
        backbone.trainable = False
        inputs = backbone.input
        sequence = backbone(inputs)["sequence_output"]
        for _ in range(2):
            sequence = keras_hub.layers.TransformerEncoder(
                num_heads=2, intermediate_dim=16, dropout=0.1)(sequence)
        # Classify from the [CLS] token's output.
        outputs = keras.layers.Dense(2)(sequence[:, backbone.cls_token_index, :])
        model = keras.Model(inputs, outputs)
        model.compile(
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            optimizer=keras.optimizers.AdamW(5e-5),
            metrics=[keras.metrics.SparseCategoricalAccuracy()],
            jit_compile=True,
        )
    model.summary()
    history = model.fit(imdb_train_preprocessed, validation_data=imdb_test_preprocessed,
                        epochs=3)
    return Outcome(models=[model], losses=logged(history) + logged(history, "val_loss"),
                   trend=logged(history))

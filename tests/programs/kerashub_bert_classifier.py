"""Getting started with KerasHub.

Exercises: a BertClassifier (backbone + WordPiece preprocessor) predicting, evaluating and fine-
tuning on raw strings.

Source: https://github.com/keras-team/keras-io/blob/master/guides/keras_hub/getting_started.py
(sections "Inference with a pretrained classifier", "Fine tuning a pretrained BERT backbone";
the guide's global mixed_float16 policy kept).
Changed: `BertClassifier.from_preset("bert_tiny_en_uncased", num_classes=2)` (downloaded) ->
the same classes built from config, tiny (1 layer, 2 heads, hidden 8, sequence length 16),
random weights, dropout 0.1 -> 0 (so the run is deterministic), the WordPiece vocabulary held
in memory; IMDB read with `text_dataset_from_directory` (25,000 + 25,000 reviews) -> 256 +
64 synthetic reviews from `tf.data.Dataset.from_tensor_slices`, batch 16 as in the guide;
the classifier made under `strategy.scope()`.
"""

import keras
import keras_hub
import tensorflow as tf

from tests.programs.corpus import (
    KERAS_IO,
    Exact,
    Outcome,
    logged,
    reviews,
    word_vocabulary,
)

SOURCE = KERAS_IO + "guides/keras_hub/getting_started.py"
COMPARE = Exact(weights=1e-3, loss=1e-3)  # mixed_float16: float16 activations


def main(run):
    keras.mixed_precision.set_global_policy("mixed_float16")
    strategy = run.make_strategy()
    BATCH_SIZE = 16
    texts, labels = reviews(256, seed=1)
    test_texts, test_labels = reviews(64, seed=2)
    imdb_train = tf.data.Dataset.from_tensor_slices((texts, labels)).batch(BATCH_SIZE)
    imdb_test = tf.data.Dataset.from_tensor_slices((test_texts, test_labels)).batch(BATCH_SIZE)
    print(imdb_train.unbatch().take(1).get_single_element())

    vocabulary = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + word_vocabulary()
    with strategy.scope():
        tokenizer = keras_hub.models.BertTokenizer(vocabulary=vocabulary, lowercase=True)
        preprocessor = keras_hub.models.BertPreprocessor(tokenizer, sequence_length=16)
        backbone = keras_hub.models.BertBackbone(
            vocabulary_size=len(vocabulary), num_layers=1, num_heads=2, hidden_dim=8,
            intermediate_dim=16, max_sequence_length=16, dropout=0.0)
        classifier = keras_hub.models.BertClassifier(backbone=backbone, num_classes=2,
                                                     preprocessor=preprocessor, dropout=0.0)
    # Inference on strings, then evaluation with the task's default compile.
    print(classifier.predict(["I love modular workflows in keras-hub!"]))
    losses = list(classifier.evaluate(imdb_test))
    # Fine-tuning, still on raw strings.
    history = classifier.fit(imdb_train, validation_data=imdb_test, epochs=1)
    losses += logged(history) + logged(history, "val_loss")
    return Outcome(models=[classifier], losses=losses)

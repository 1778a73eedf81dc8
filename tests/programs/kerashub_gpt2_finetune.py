"""GPT2 text generation with KerasHub.

Exercises: generate, fine-tune a GPT2CausalLM on raw strings with a decaying learning rate,
generate with other samplers.

Source: https://github.com/keras-team/keras-io/blob/master/examples/generative/gpt2_text_generation_with_keras_hub.py
Changed: `GPT2CausalLM.from_preset("gpt2_base_en")` with its preprocessor (downloaded) -> the
same classes built from config, tiny (1 layer, 2 heads, hidden 8, sequence length 16),
random weights, dropout 0.1 -> 0 (so the run is deterministic), a byte-level BPE vocabulary
and merges held in memory; Reddit TIFU from TensorFlow Datasets (`take(500)` batches of 32)
-> 64 synthetic reviews in batches of 8; the learning rate 5e-5 -> 5e-3 (8 steps, not 500);
max_length 200 -> 16; the model made and compiled under `strategy.scope()`.
"""

import keras
import keras_hub
import tensorflow as tf

from tests.programs.corpus import (
    KERAS_IO,
    Exact,
    Outcome,
    gpt2_vocabulary,
    logged,
    reviews,
    word_vocabulary,
)

SOURCE = KERAS_IO + "examples/generative/gpt2_text_generation_with_keras_hub.py"
COMPARE = Exact(weights=1e-4, loss=1e-5)  # Adam amplifies rounding where gradients are ~0


def main(run):
    strategy = run.make_strategy()
    vocabulary, merges = gpt2_vocabulary(word_vocabulary())
    with strategy.scope():
        tokenizer = keras_hub.models.GPT2Tokenizer(vocabulary=vocabulary, merges=merges)
        preprocessor = keras_hub.models.GPT2CausalLMPreprocessor(tokenizer, sequence_length=16)
        backbone = keras_hub.models.GPT2Backbone(
            vocabulary_size=tokenizer.vocabulary_size(), num_layers=1, num_heads=2,
            hidden_dim=8, intermediate_dim=16, max_sequence_length=16, dropout=0.0)
        gpt2_lm = keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=preprocessor)
    output = gpt2_lm.generate("the movie was", max_length=16)
    print("GPT-2 output:", output)

    texts, _ = reviews(64, seed=1)
    train_ds = (tf.data.Dataset.from_tensor_slices(texts).batch(8).cache()
                .prefetch(tf.data.AUTOTUNE))
    num_epochs = 1
    # Linearly decaying learning rate.
    learning_rate = keras.optimizers.schedules.PolynomialDecay(
        5e-3, decay_steps=train_ds.cardinality() * num_epochs, end_learning_rate=0.0)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    with strategy.scope():
        gpt2_lm.compile(optimizer=keras.optimizers.Adam(learning_rate), loss=loss,
                        weighted_metrics=["accuracy"])
    history = gpt2_lm.fit(train_ds, epochs=num_epochs)
    print("GPT-2 output:", gpt2_lm.generate("the movie was", max_length=16))

    # Other samplers: greedy by name, top-p as an object.
    with strategy.scope():
        gpt2_lm.compile(sampler="greedy")
    print("GPT-2 output:", gpt2_lm.generate("the movie was", max_length=16))
    with strategy.scope():
        gpt2_lm.compile(sampler=keras_hub.samplers.TopPSampler(p=0.1))
    print("GPT-2 output:", gpt2_lm.generate("the movie was", max_length=16))
    return Outcome(models=[gpt2_lm], losses=logged(history))

"""The Functional API.

Exercises: a multi-input, multi-output model (ticket priority and department) with Embedding and
LSTM branches.

Source: https://github.com/keras-team/keras-io/blob/master/guides/functional_api.py
(section "Models with multiple inputs and outputs").
Changed: 1,280 random tickets -> 256; vocabulary 10,000 -> 200 words, titles and bodies of
10 and 100 -> 6 and 12 tokens; Embedding 64 -> 8, LSTM 128/32 -> 8/4; epochs 2 -> 2;
the model made and compiled under `strategy.scope()`; `plot_model` left out (needs pydot).
"""

import keras
import numpy as np
from keras import layers

from tests.programs.corpus import KERAS_IO, Outcome, Property, logged

SOURCE = KERAS_IO + "guides/functional_api.py"
COMPARE = Property(reason="Embedding + RMSprop: tfdist's presets sum the gradients of "
                          "repeated ids, a plain one-device run does not (docs/numerics.md)")

num_tags = 12
num_words = 200
num_departments = 4


def main(run):
    strategy = run.make_strategy()
    with strategy.scope():
        title_input = keras.Input(shape=(None,), name="title")
        body_input = keras.Input(shape=(None,), name="body")
        tags_input = keras.Input(shape=(num_tags,), name="tags")
        title_features = layers.Embedding(num_words, 8)(title_input)
        body_features = layers.Embedding(num_words, 8)(body_input)
        title_features = layers.LSTM(8)(title_features)
        body_features = layers.LSTM(4)(body_features)
        x = layers.concatenate([title_features, body_features, tags_input])
        priority_pred = layers.Dense(1, name="priority")(x)
        department_pred = layers.Dense(num_departments, name="department")(x)
        model = keras.Model(inputs=[title_input, body_input, tags_input],
                            outputs={"priority": priority_pred, "department": department_pred})
        model.compile(
            optimizer=keras.optimizers.RMSprop(1e-3),
            loss={"priority": keras.losses.BinaryCrossentropy(from_logits=True),
                  "department": keras.losses.CategoricalCrossentropy(from_logits=True)},
            loss_weights={"priority": 1.0, "department": 0.2},
        )
    rng = np.random.default_rng(0)
    title_data = rng.integers(num_words, size=(256, 6))
    body_data = rng.integers(num_words, size=(256, 12))
    tags_data = rng.integers(2, size=(256, num_tags)).astype("float32")
    priority_targets = rng.random(size=(256, 1))
    dept_targets = rng.integers(2, size=(256, num_departments))
    history = model.fit({"title": title_data, "body": body_data, "tags": tags_data},
                        {"priority": priority_targets, "department": dept_targets},
                        epochs=2, batch_size=32)
    return Outcome(models=[model], losses=logged(history))

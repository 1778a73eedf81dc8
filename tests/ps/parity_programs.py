"""Users' programs that run under the parameter_server preset as under one device.

Each program is what keras.io, KerasHub's guides or TensorFlow's
parameter_server_training tutorial write, shrunk and offline; it takes the
strategy (None: one device, no strategy) and a work directory, and returns
what it logged: `losses` (every epoch's loss, then validation and evaluation
values, in order), `steps` (how far `optimizer.iterations` moved) and
`weights` (the final weights). Under one parameter-server worker the run is
synchronous and must equal one device; under two it is asynchronous and must
keep the step count with a finite, falling loss.

Used by tests/ps/run_parity_cases.py (in-process cluster, two workers) and
tests/ps/run_parity_launch.py (`tfdist launch`, one worker, against one device
in the same process).
"""

from __future__ import annotations

import contextlib
import os
import warnings

import numpy as np

SEED = 7

# A byte-pair vocabulary in GPT-2's format ("Ġ" is a leading space), built offline.
_WORDS = ("the", "cat", "sat", "on", "mat", "dog", "ran", "to", "a", "hat")
_MERGES = ("t h", "th e", "a t", "Ġ c", "Ġc at", "Ġ s", "Ġs at", "o n", "Ġ on", "Ġ m", "Ġm at",
           "Ġ t", "Ġt h", "Ġth e")


def _bpe_vocabulary() -> tuple[dict, list]:
    symbols = sorted({c for w in _WORDS for c in w} | {"Ġ"})
    merged = [m.replace(" ", "") for m in _MERGES]
    tokens = ["<|endoftext|>", *symbols, *[m for m in merged if m not in symbols]]
    return {t: i for i, t in enumerate(tokens)}, list(_MERGES)


def _sentences(n: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(_WORDS, size=5)) for _ in range(n)]


def _scope(strategy):
    return strategy.scope() if strategy is not None else contextlib.nullcontext()


def _classification(n: int = 192, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, 8)).astype("float32")
    y = (x[:, :3].sum(1) > 0.6).astype("int64")  # imbalanced: about a third positive
    return x, y


def _classifier(strategy, *, lr=0.05, jit_compile="auto", metrics=("accuracy",)):
    import keras

    keras.utils.set_random_seed(SEED)
    with _scope(strategy):
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                                  keras.layers.Dense(2, activation="softmax")])
        model.compile(keras.optimizers.Adam(lr), "sparse_categorical_crossentropy",
                      metrics=list(metrics), jit_compile=jit_compile)
    return model


def _result(model, losses, **extra) -> dict:
    return {"losses": [float(v) for v in losses],
            "steps": int(model.optimizer.iterations.numpy()),
            "weights": [np.asarray(w) for w in model.get_weights()], **extra}


def class_weights(strategy, workdir):
    """keras.io's "Training & evaluation with the built-in methods": class_weight on arrays and
    on a dataset."""
    import tensorflow as tf

    x, y = _classification()
    model = _classifier(strategy)
    history = model.fit(x, y, batch_size=32, epochs=3, shuffle=False, verbose=0,
                        class_weight={0: 1.0, 1: 3.0})
    losses = list(history.history["loss"])
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(32)
    history = model.fit(dataset, epochs=2, verbose=0, class_weight={0: 1.0, 1: 3.0})
    losses += history.history["loss"]
    # A shuffled finite dataset, an epoch one pass: every epoch in its own order.
    shuffled = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(len(x)).batch(32)
    history = model.fit(shuffled, epochs=3, verbose=0, class_weight={0: 1.0, 1: 3.0})
    losses += history.history["loss"]
    # steps_per_epoch on a finite, shuffled dataset of 6 batches: Keras reads 4, then the 2
    # left (that epoch ends early, with Keras's "ran out of data" warning), then a new pass.
    shuffled = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(len(x)).batch(32)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Your input ran out of data")
        history = model.fit(shuffled, epochs=3, steps_per_epoch=4, verbose=0,
                            class_weight={0: 1.0, 1: 3.0})
    losses += history.history["loss"]
    return _result(model, losses)


def validation_callbacks(strategy, workdir):
    """NumPy validation data with EarlyStopping, ReduceLROnPlateau and TensorBoard."""
    import keras

    x, y = _classification(seed=1)
    x_val, y_val = _classification(96, seed=2)
    model = _classifier(strategy, lr=0.1)
    callbacks = [
        keras.callbacks.EarlyStopping(monitor="val_loss", patience=2, min_delta=0.02),
        # Halves the rate after every epoch but the first (no epoch improves by 1.0).
        keras.callbacks.ReduceLROnPlateau(monitor="val_loss", factor=0.5, patience=0,
                                          min_delta=1.0),
        keras.callbacks.TensorBoard(os.path.join(workdir, "logs")),
    ]
    history = model.fit(x, y, batch_size=32, epochs=12, verbose=0,  # shuffled, as by default
                        validation_data=(x_val, y_val), callbacks=callbacks)
    h = history.history
    return _result(model, list(h["loss"]) + list(h["val_loss"]),
                   epochs=len(h["loss"]), learning_rates=[float(v) for v in h["learning_rate"]],
                   tensorboard=sorted(os.listdir(os.path.join(workdir, "logs"))))


def py_dataset(strategy, workdir):
    """A keras.utils.PyDataset as x (keras.io's "Using a PyDataset"), not shuffled."""
    import keras

    x, y = _classification()

    class Batches(keras.utils.PyDataset):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)

        def __len__(self):
            return len(x) // 24

        def __getitem__(self, i):
            return x[i * 24:(i + 1) * 24], y[i * 24:(i + 1) * 24]

    model = _classifier(strategy)
    history = model.fit(Batches(), epochs=3, shuffle=False, verbose=0,
                        validation_data=Batches())
    h = history.history
    return _result(model, list(h["loss"]) + list(h["val_loss"]))


def inside_scope(strategy, workdir):
    """keras.io's distributed training guide: fit, evaluate, predict inside `strategy.scope()`."""
    import tensorflow as tf

    x, y = _classification()
    x_test, y_test = _classification(64, seed=3)
    train = tf.data.Dataset.from_tensor_slices((x, y)).batch(32)
    val = tf.data.Dataset.from_tensor_slices((x_test, y_test)).batch(32)
    with _scope(strategy):
        model = _classifier(strategy)
        history = model.fit(train, epochs=2, validation_data=val, verbose=0)
        evaluated = model.evaluate(val, verbose=0)
        predictions = model.predict(val, verbose=0)
    h = history.history
    return _result(model, list(h["loss"]) + list(h["val_loss"]) + list(evaluated),
                   predictions=predictions)


def optimizer_outside_scope(strategy, workdir):
    """keras.io's examples make the optimizer before the model (keras-team/keras#17187):
    AdamW with weight decay and global_clipnorm made outside `strategy.scope()`, the model
    and compile inside it."""
    import keras
    import tensorflow as tf

    x, y = _classification()
    optimizer = keras.optimizers.AdamW(0.05, weight_decay=0.01, global_clipnorm=0.5)
    keras.utils.set_random_seed(SEED)
    with _scope(strategy):
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                                  keras.layers.Dense(2, activation="softmax")])
        model.compile(optimizer, "sparse_categorical_crossentropy", metrics=["accuracy"])
    history = model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(32), epochs=2,
                        verbose=0)
    if strategy is not None and model.optimizer._distribution_strategy is not strategy:
        raise AssertionError("the optimizer was not moved onto the parameter-server strategy")
    return _result(model, history.history["loss"])


def jit_compiled(strategy, workdir):
    """compile(jit_compile=True): fit with validation, evaluate and predict."""
    import tensorflow as tf

    x, y = _classification()
    train = tf.data.Dataset.from_tensor_slices((x, y)).batch(32)
    model = _classifier(strategy, jit_compile=True)
    history = model.fit(train, epochs=2, validation_data=(x[:64], y[:64]), verbose=0)
    evaluated = model.evaluate(x, y, verbose=0)
    predictions = model.predict(x[:16], verbose=0)
    h = history.history
    return _result(model, list(h["loss"]) + list(h["val_loss"]) + list(evaluated),
                   predictions=predictions)


def captured_dataset(strategy, workdir):
    """A dataset function that uses a dataset built outside it (one device: that dataset)."""
    import tensorflow as tf

    x, y = _classification()
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(32)
    data = (lambda input_context: dataset.repeat()) if strategy is not None else dataset.repeat()
    model = _classifier(strategy)
    history = model.fit(data, epochs=2, steps_per_epoch=6, verbose=0)
    return _result(model, history.history["loss"])


def checkpoint_with_loss(strategy, workdir):
    """ModelCheckpoint("model-loss={loss:.2f}.keras", save_freq=N); the last file loaded."""
    import keras

    x, y = _classification()
    model = _classifier(strategy)
    pattern = os.path.join(workdir, "model-loss={loss:.2f}.keras")
    history = model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0,
                        callbacks=[keras.callbacks.ModelCheckpoint(pattern, save_freq=4)])
    names = sorted((f for f in os.listdir(workdir) if f.startswith("model-loss=")),
                   key=lambda f: os.path.getmtime(os.path.join(workdir, f)))
    loaded = keras.models.load_model(os.path.join(workdir, names[-1]))
    evaluated = loaded.evaluate(x, y, verbose=0)
    return _result(model, history.history["loss"], checkpoints=names,
                   loaded_losses=[float(v) for v in evaluated])


def saved_and_loaded(strategy, workdir):
    """model.save after training, keras.models.load_model outside the scope, evaluate both."""
    import keras

    x, y = _classification()
    model = _classifier(strategy)
    model.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    path = os.path.join(workdir, "trained.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    return _result(model, list(model.evaluate(x, y, verbose=0))
                   + list(loaded.evaluate(x, y, verbose=0)), loaded_compiled=loaded.compiled)


def _gpt2(strategy):
    import keras
    import keras_hub

    vocabulary, merges = _bpe_vocabulary()
    keras.utils.set_random_seed(SEED)
    with _scope(strategy):  # as KerasHub's guides build it: preprocessor included
        tokenizer = keras_hub.models.GPT2Tokenizer(vocabulary=vocabulary, merges=merges)
        preprocessor = keras_hub.models.GPT2CausalLMPreprocessor(tokenizer, sequence_length=8)
        backbone = keras_hub.models.GPT2Backbone(
            vocabulary_size=len(vocabulary), num_layers=1, num_heads=2, hidden_dim=8,
            intermediate_dim=16, max_sequence_length=8, dropout=0.0)
        model = keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=preprocessor)
        model.compile(optimizer=keras.optimizers.Adam(0.01),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      weighted_metrics=["accuracy"])
    return model


def gpt2_causal_lm_dataset(strategy, workdir):
    """KerasHub GPT-2 CausalLM with its byte-pair preprocessor, fit on a dataset of strings."""
    import tensorflow as tf

    model = _gpt2(strategy)
    texts = tf.data.Dataset.from_tensor_slices(_sentences(48, seed=4)).batch(8)
    history = model.fit(texts, epochs=3, verbose=0)
    return _result(model, history.history["loss"])


def gpt2_causal_lm_per_worker(strategy, workdir):
    """The same through tfdist.PerWorkerDataset(fn) (one device: the dataset fn builds)."""
    import tensorflow as tf

    import tfdist

    sentences = _sentences(48, seed=4)

    def dataset_fn(input_context):
        return tf.data.Dataset.from_tensor_slices(sentences).batch(8)

    model = _gpt2(strategy)
    data = tfdist.PerWorkerDataset(dataset_fn) if strategy is not None else dataset_fn(None)
    history = model.fit(data, epochs=3, verbose=0)
    return _result(model, history.history["loss"])


_FEATURES = ("avenger", "ironman", "batman", "hulk", "spiderman", "kingkong", "wonder_woman")


def _string_lookup(strategy, route):
    """TensorFlow's parameter_server_training tutorial: StringLookup layers in the pipeline."""
    import keras
    import tensorflow as tf

    rng = np.random.default_rng(5)
    features = rng.choice(_FEATURES, size=(160, 3))
    examples = {"features": features,
                "label": np.where((features == "avenger").any(1), "yes", "no")[:, None]}
    keras.utils.set_random_seed(SEED)
    with _scope(strategy):  # the tutorial creates the lookup layers here: tables per worker
        feature_lookup = keras.layers.StringLookup(vocabulary=list(_FEATURES), mask_token=None)
        label_lookup = keras.layers.StringLookup(vocabulary=["yes", "no"], num_oov_indices=0,
                                                 mask_token=None)

    def dataset_fn(_):
        raw = tf.data.Dataset.from_tensor_slices(examples)
        return raw.map(lambda e: ({"features": feature_lookup(e["features"])},
                                  label_lookup(e["label"]))).batch(32).repeat()

    with _scope(strategy):
        model_input = keras.Input(shape=(3,), dtype="int64", name="features")
        embedded = keras.layers.Embedding(len(feature_lookup.get_vocabulary()), 16)(model_input)
        pooled = keras.layers.GlobalAveragePooling1D()(embedded)
        output = keras.layers.Dense(1, activation="sigmoid")(pooled)
        model = keras.Model({"features": model_input}, output)
        model.compile(keras.optimizers.SGD(0.5), "binary_crossentropy", metrics=["accuracy"])
    if strategy is None or route == "dataset":
        data = dataset_fn(None)
    else:
        data = dataset_fn
    history = model.fit(data, epochs=3, steps_per_epoch=5, verbose=0)
    return _result(model, history.history["loss"])


def string_lookup_function(strategy, workdir):
    return _string_lookup(strategy, "function")


def string_lookup_dataset(strategy, workdir):
    return _string_lookup(strategy, "dataset")


# name -> (program, optimizer steps it takes)
PROGRAMS = {
    "class_weights": (class_weights, 3 * 6 + 2 * 6 + 3 * 6 + 4 + 2 + 4),
    "validation_callbacks": (validation_callbacks, None),  # EarlyStopping decides
    "py_dataset": (py_dataset, 3 * 8),
    "inside_scope": (inside_scope, 2 * 6),
    "optimizer_outside_scope": (optimizer_outside_scope, 2 * 6),
    "jit_compiled": (jit_compiled, 2 * 6),
    "captured_dataset": (captured_dataset, 2 * 6),
    "checkpoint_with_loss": (checkpoint_with_loss, 2 * 6),
    "saved_and_loaded": (saved_and_loaded, 6),
    "gpt2_causal_lm_dataset": (gpt2_causal_lm_dataset, 3 * 6),
    "gpt2_causal_lm_per_worker": (gpt2_causal_lm_per_worker, 3 * 6),
    "string_lookup_function": (string_lookup_function, 3 * 5),
    "string_lookup_dataset": (string_lookup_dataset, 3 * 5),
}

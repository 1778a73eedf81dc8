"""Users' program patterns under the synchronous presets, each against one device, in one process.

    python tests/compat/run_sync_programs.py mirrored    # 2 logical CPUs; prints RESULTS {json}

Run by tests/compat/test_sync_programs.py (which asserts on the numbers) and
reusable by hand. Each pattern is a shrunk, offline version of what keras.io
and KerasHub programs write; each is trained under `mirrored` (2 replicas) and
its ZeRO-1/ZeRO-2 variants, and under ONE device with the same initial weights,
seed and global batch (the independent reference). Negative controls run the
same pattern under a stock `tf.distribute.MirroredStrategy` (Keras as
released) and record its error or its difference from one device.

Keys of the printed object: `<pattern>.<preset>.<what>`:
  vs_one_device  largest |weight difference| against one device after training
  spread         largest difference between the replicas' copies of any variable
  error          `<ErrorType>: <first line>` where the run raised
plus pattern-specific values (evaluate's loss, logged losses).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

GLOBAL_BATCH = 8
STEPS = 3
N = GLOBAL_BATCH * STEPS


# --- patterns: each `build()` returns an uncompiled model, `data()` a tf.data.Dataset ----------


def _texts():
    import numpy as np

    words = np.array(["good", "bad", "film", "plot", "great", "awful", "actor", "dull"])
    rng = np.random.default_rng(0)
    texts = [" ".join(rng.choice(words, size=rng.integers(2, 6))) for _ in range(N)]
    labels = np.array([[float(("good" in t) or ("great" in t))] for t in texts], "float32")
    return np.array(texts), labels


class StringInput:
    """keras.io's end-to-end text classifier: TextVectorization inside the model, raw strings in."""

    name = "string"

    def build(self):
        import keras

        texts, _ = _texts()
        vectorize = keras.layers.TextVectorization(max_tokens=12, output_mode="int",
                                                   output_sequence_length=5)
        vectorize.adapt(texts)
        inputs = keras.Input((1,), dtype="string")
        x = keras.layers.Embedding(12, 4)(vectorize(inputs))
        x = keras.layers.GlobalAveragePooling1D()(x)
        return keras.Model(inputs, keras.layers.Dense(1, activation="sigmoid")(x))

    def compile(self, model):
        import keras

        model.compile(keras.optimizers.SGD(0.5), "binary_crossentropy", metrics=["accuracy"])

    def data(self):
        import tensorflow as tf

        texts, labels = _texts()
        return tf.data.Dataset.from_tensor_slices((texts[:, None], labels)).batch(GLOBAL_BATCH)


class BoolMask:
    """KerasHub's preprocessor output: a dict of int32 token ids and a bool padding mask."""

    name = "bool"

    def build(self):
        import keras
        from keras import ops

        ids = keras.Input((6,), dtype="int32", name="token_ids")
        mask = keras.Input((6,), dtype="bool", name="padding_mask")
        x = keras.layers.Embedding(10, 4)(ids)
        weights = ops.expand_dims(ops.cast(mask, "float32"), -1)
        pooled = ops.sum(x * weights, axis=1) / ops.maximum(ops.sum(weights, axis=1), 1.0)
        return keras.Model({"token_ids": ids, "padding_mask": mask},
                           keras.layers.Dense(1)(pooled))

    def compile(self, model):
        import keras

        model.compile(keras.optimizers.SGD(0.5), "mse")

    def data(self):
        import numpy as np
        import tensorflow as tf

        rng = np.random.default_rng(1)
        ids = rng.integers(1, 10, size=(N, 6)).astype("int32")
        lengths = rng.integers(2, 7, size=N)
        mask = np.arange(6)[None, :] < lengths[:, None]
        ids = np.where(mask, ids, 0).astype("int32")
        y = rng.standard_normal((N, 1)).astype("float32")
        return tf.data.Dataset.from_tensor_slices(
            ({"token_ids": ids, "padding_mask": mask}, y)).batch(GLOBAL_BATCH)


PATTERNS = {p.name: p for p in (StringInput(), BoolMask())}


# --- running one pattern under one strategy ----------------------------------------------


def _error(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0][:300] if text else ''}"


def _initial_weights(pattern):
    import keras

    keras.utils.set_random_seed(1)
    return pattern.build().get_weights()


def run(pattern, strategy, initial) -> dict:
    """Builds (same initial weights), compiles, fits and evaluates `pattern` under `strategy`."""
    import keras

    import tfdist

    out: dict = {}
    try:
        with strategy.scope():
            keras.utils.set_random_seed(1)
            model = pattern.build()
            model.set_weights(initial)
            pattern.compile(model)
        history = model.fit(pattern.data(), epochs=1, verbose=0)
        out["loss"] = [float(v) for v in history.history["loss"]]
        out["evaluate"] = float(model.evaluate(pattern.data(), verbose=0, return_dict=True)["loss"])
        out["predict"] = model.predict(pattern.data(), verbose=0)
        out["weights"] = model.get_weights()
        out["spread"] = tfdist.replica_spread(model)
    except Exception as e:  # noqa: BLE001 - negative controls record what stock Keras raises
        out["error"] = _error(e)
    return out


def _difference(a, b) -> float:
    import numpy as np

    return max(float(np.max(np.abs(np.asarray(u, "float64") - np.asarray(v, "float64"))))
               for u, v in zip(a, b))


def compare(results: dict, name: str, preset: str, run_out: dict, reference: dict) -> None:
    key = f"{name}.{preset}"
    if "error" in run_out:
        results[f"{key}.error"] = run_out["error"]
        return
    results[f"{key}.vs_one_device"] = _difference(run_out["weights"], reference["weights"])
    results[f"{key}.loss_vs_one_device"] = _difference(run_out["loss"], reference["loss"])
    results[f"{key}.evaluate_vs_one_device"] = abs(run_out["evaluate"] - reference["evaluate"])
    results[f"{key}.predict_vs_one_device"] = _difference([run_out["predict"]],
                                                          [reference["predict"]])
    results[f"{key}.spread"] = run_out["spread"]


# --- modes -------------------------------------------------------------------------------


def mirrored() -> dict:
    import tfdist

    tfdist.configure_logical_devices(2)
    import tensorflow as tf

    strategies = {
        "mirrored": tfdist.make_strategy("mirrored", num_devices=2),
        "zero1": tfdist.make_strategy("mirrored", num_devices=2, shard="optimizer",
                                      shard_min_bytes=0),
        "zero2": tfdist.make_strategy("mirrored", num_devices=2, shard="gradients",
                                      shard_min_bytes=0),
        # Negative control: Keras as released, under TensorFlow's own strategy.
        "stock": tf.distribute.MirroredStrategy(
            ["/cpu:0", "/cpu:1"], cross_device_ops=tf.distribute.ReductionToOneDevice()),
    }
    one = tf.distribute.get_strategy()
    results: dict = {}
    for name, pattern in PATTERNS.items():
        initial = _initial_weights(pattern)
        reference = run(pattern, one, initial)
        if "error" in reference:
            results[f"{name}.one_device.error"] = reference["error"]
            continue
        for preset, strategy in strategies.items():
            compare(results, name, preset, run(pattern, strategy, initial), reference)
    # Negative control of the fix itself: tfdist's own strategy with it taken out.
    from tfdist.compat import _patch, keras_build

    _patch.uninstall([keras_build.SYMBOLIC_BUILD])
    for name in ("string", "bool"):
        pattern = PATTERNS[name]
        compare(results, name, "unfixed", run(pattern, strategies["mirrored"],
                                              _initial_weights(pattern)), {})
    keras_build.install()
    return results


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["mirrored"])
    args = parser.parse_args()
    results = {"mirrored": mirrored}[args.mode]()
    print("RESULTS " + json.dumps(results))


if __name__ == "__main__":
    main()

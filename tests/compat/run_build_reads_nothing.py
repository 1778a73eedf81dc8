"""Keras's symbolic build under a strategy, with Python-code and shuffled input (a fresh process).

    python tests/compat/run_build_reads_nothing.py

For each input (a one-pass generator, a shuffled `keras.utils.PyDataset`, a shuffled tf.data
pipeline) and each way of running it (one device; tfdist `mirrored` x2; a stock
`tf.distribute.MirroredStrategy` x2, Keras as released; tfdist `mirrored` with
`keras_build.symbolic_build` taken out), one `fit` of one epoch from the same seed and initial
weights. Prints `RESULTS {json}`: per input and way, the optimizer's steps, the first loss,
the batches the Python code served (in order), and the largest weight difference from one
device's run.
"""

from __future__ import annotations

import json

import numpy as np

import tfdist

BATCHES, BATCH = 16, 32


def main() -> None:
    tfdist.configure_logical_devices(2)
    import keras
    import tensorflow as tf

    from tfdist.compat import _patch, keras_build

    rng = np.random.default_rng(0)
    x = rng.standard_normal((BATCHES * BATCH, 8)).astype("float32")
    y = rng.integers(0, 4, BATCHES * BATCH)
    served: list[int] = []

    def generator():
        for i in range(BATCHES):  # one pass: what a reader of files or a queue gives
            served.append(i)
            yield x[i * BATCH:(i + 1) * BATCH], y[i * BATCH:(i + 1) * BATCH]

    class Batches(keras.utils.PyDataset):
        def __len__(self):
            return BATCHES

        def __getitem__(self, i):
            served.append(i)
            return x[i * BATCH:(i + 1) * BATCH], y[i * BATCH:(i + 1) * BATCH]

    inputs = {
        "generator": lambda: (generator(), {"steps_per_epoch": BATCHES}),
        "py_dataset": lambda: (Batches(), {"shuffle": True}),
        "tf_data": lambda: (tf.data.Dataset.from_tensor_slices((x, y)).shuffle(len(x))
                            .batch(BATCH), {}),
    }
    ways = {
        "one_device": tf.distribute.get_strategy,
        "tfdist": lambda: tfdist.make_strategy("mirrored", num_devices=2),
        "stock": lambda: tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"]),
        "unfixed": lambda: tfdist.make_strategy("mirrored", num_devices=2),
    }
    results: dict = {}
    for name, make_input in inputs.items():
        reference = None
        for way, make_strategy in ways.items():
            strategy = make_strategy()
            if way == "unfixed":
                tfdist.compat.uninstall([keras_build.SYMBOLIC_BUILD])
            keras.utils.set_random_seed(7)
            with strategy.scope():
                model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, "relu"),
                                          keras.layers.Dense(4, "softmax")])
                model.compile(keras.optimizers.SGD(0.1), "sparse_categorical_crossentropy")
            data, kwargs = make_input()
            del served[:]
            history = model.fit(data, epochs=1, verbose=0, **kwargs)
            weights = [np.asarray(w) for w in model.get_weights()]
            reference = weights if way == "one_device" else reference
            results[f"{name}.{way}"] = {
                "steps": int(model.optimizer.iterations.numpy()),
                "loss": float(history.history["loss"][0]),
                "served": list(served),
                "vs_one_device": max(float(np.abs(a - b).max())
                                     for a, b in zip(weights, reference)),
            }
            if way == "unfixed":
                _patch.install(keras_build.SYMBOLIC_BUILD_FIX)
    print("RESULTS " + json.dumps(results), flush=True)


if __name__ == "__main__":
    main()

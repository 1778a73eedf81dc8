"""One task of the keras_array_input test (test_array_input.py), run by `tfdist launch`.

Each worker makes the multi_worker_mirrored preset (no global seed) and fits
on NumPy examples whose feature 0 is the example's index, global batch 8,
twice: `fixed` (the preset's fixes) and `unfixed` (keras_array_input
uninstalled: Keras as released). Two inputs each time:
- `shuffled`: 32 examples, `shuffle=True`, 2 epochs;
- `ordered`: 28 examples (a partial last batch of 4, which TensorFlow splits
  between the workers), `shuffle=False`, 1 epoch.
Every step writes the indices it trained to OUT/<run>-<input>-worker<i>.txt,
one line per step; every `tf.gather` of float32 rows (the features: the
labels are int32, the indices int64) writes how many rows it gathered to
OUT/<run>-<input>-gathers<i>.txt.
"""

from __future__ import annotations

import os
import sys

GLOBAL_BATCH = 8
INPUTS = {"shuffled": (32, True, 2), "ordered": (28, False, 1)}  # examples, shuffle, epochs


def main() -> int:
    out_dir = sys.argv[1]
    import tfdist

    tf = tfdist.import_tensorflow()
    import keras
    import numpy as np

    from tfdist.compat import _patch, keras_array_input

    strategy = tfdist.make_strategy("multi_worker_mirrored", join_timeout=120)
    task = strategy.cluster_resolver.task_id
    gathers = {"to": None}
    real_gather = tf.gather

    def counting_gather(params, indices, *args, **kwargs):
        if gathers["to"] and params.dtype == tf.float32:
            tf.print(tf.size(indices), output_stream=f"file://{gathers['to']}")
        return real_gather(params, indices, *args, **kwargs)

    tf.gather = counting_gather  # Keras's adapter and tfdist's fix both call tf.gather

    class Recorder(keras.Model):
        def __init__(self, path):
            super().__init__()
            self.dense = keras.layers.Dense(1)
            self.record_to = path

        def call(self, x):
            return self.dense(x)

        def train_step(self, data):
            x, _ = data
            tf.print(tf.cast(x[:, 0], tf.int32), summarize=-1,
                     output_stream=f"file://{self.record_to}")
            return {"examples": tf.cast(tf.shape(x)[0], "float32")}

    for run in ("fixed", "unfixed"):
        if run == "unfixed":
            _patch.uninstall(keras_array_input.NAMES)
        for name, (examples, shuffle, epochs) in INPUTS.items():
            x = np.arange(examples, dtype="float32")[:, None]
            y = np.zeros((examples, 1), "int32")
            gathers["to"] = os.path.join(out_dir, f"{run}-{name}-gathers{task}.txt")
            with strategy.scope():
                model = Recorder(os.path.join(out_dir, f"{run}-{name}-worker{task}.txt"))
                model.compile(optimizer="sgd", loss="mse")
            model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=epochs, shuffle=shuffle, verbose=0)
            print(f"{run} {name}: OK", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

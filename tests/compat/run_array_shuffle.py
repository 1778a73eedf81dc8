"""One task of the keras_array_shuffle test (test_array_shuffle.py), run by `tfdist launch`.

Each worker makes the multi_worker_mirrored preset (no global seed) and fits
on 32 NumPy examples (feature 0 = the example's index), global batch 8,
`shuffle=True`, for 2 epochs, twice: `fixed` (the preset's fixes) and
`unfixed` (keras_array_shuffle uninstalled: Keras as released). Every step
writes the indices it trained to OUT/<run>-worker<i>.txt, one line per step.
"""

from __future__ import annotations

import os
import sys

EXAMPLES, GLOBAL_BATCH, EPOCHS = 32, 8, 2


def main() -> int:
    out_dir = sys.argv[1]
    import tfdist

    tf = tfdist.import_tensorflow()
    import keras
    import numpy as np

    from tfdist.compat import _patch, keras_array_shuffle

    strategy = tfdist.make_strategy("multi_worker_mirrored", join_timeout=120)
    task = strategy.cluster_resolver.task_id

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

    x = np.arange(EXAMPLES, dtype="float32")[:, None]
    y = np.zeros((EXAMPLES, 1), "float32")
    for run in ("fixed", "unfixed"):
        if run == "unfixed":
            _patch.uninstall(keras_array_shuffle.NAMES)
        with strategy.scope():
            model = Recorder(os.path.join(out_dir, f"{run}-worker{task}.txt"))
            model.compile(optimizer="sgd", loss="mse")
        model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=EPOCHS, shuffle=True, verbose=0)
        print(f"{run}: OK", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

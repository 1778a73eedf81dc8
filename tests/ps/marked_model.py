"""The parameter-server test jobs' model (tests/launch/run_ps_job.py, tests/ps/run_failures.py).

A 2-layer regression (y = sum of the 8 inputs) whose train_step prints MARKER
on the worker that runs it, so a test can see from a task's log that the task
really ran a step.
"""

import sys

MARKER = "tfdist-test-step-ran"


def marked_regression(strategy, *, hidden: int):
    """(model, dataset_fn): the compiled model under `strategy` and its infinite data."""
    import keras
    import numpy as np

    import tfdist

    tf = tfdist.import_tensorflow()
    rng = np.random.default_rng(0)
    x = rng.standard_normal((512, 8)).astype("float32")
    y = x.sum(axis=1, keepdims=True)

    def dataset_fn(input_context):
        return tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(16)

    class Marked(keras.Sequential):
        def train_step(self, data):
            tf.print(MARKER, output_stream=sys.stderr)  # runs (and prints) on a worker
            return super().train_step(data)

    with strategy.scope():
        model = Marked([keras.Input((8,)), keras.layers.Dense(hidden), keras.layers.Dense(1)])
        model.compile(keras.optimizers.Adam(0.01), "mse")
    return model, dataset_fn

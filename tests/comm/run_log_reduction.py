"""One task of tests/comm/test_log_reduction.py, run by `tfdist launch --num_workers=2`.

Each worker makes the multi_worker_mirrored preset and fits one small
regression model (loss and two metrics: three values in the step's logs)
three times from the same weights on the same data:
  1. `packed`: tfdist as installed (keras_log_reduction packs the logs);
  2. `unpacked`: the same with keras_log_reduction taken out (the canary:
     one collective per log value);
  3. `spe4`: packed, steps_per_execution=4 (the logs of the last step only).
For each it records every batch's logs, the final weights and, on worker 0,
from a profiler trace of a few more steps, the collectives it ran per step
(every worker runs the same steps). Worker 1 runs those steps unprofiled:
with both workers profiling, TensorFlow 2.21's profiler crashed in
`tf.profiler.experimental.stop()` while collecting (SIGSEGV, or 'double free
or corruption') in 3 of 6 two-worker runs of this script, each time on worker 1;
with worker 0 alone profiling, 0 of 6 (the profiler's known crashes:
tensorflow/tensorboard#3149).
Worker i writes OUT/worker<i>.json.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

import numpy as np

BATCH = 16  # global
STEPS = 4   # per epoch
PROFILED = 12  # steps of the profiled fit (the first execution is not profiled)


def data():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((BATCH * STEPS, 4)).astype("float32")
    y = (x @ np.array([[1.0], [-2.0], [0.5], [3.0]], "float32")).astype("float32")
    return x, y


def fit(keras, strategy, *, steps_per_execution: int = 1, more_steps: bool = False,
        profile: bool = False):
    """(per-batch logs, final weights, collectives per step or None).

    more_steps: then fit PROFILED more steps (every worker of a job must), profiled
    if `profile`.
    """

    x, y = data()
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.set_weights([np.full((4, 1), 0.5, "float32"), np.zeros(1, "float32")])
        model.compile(keras.optimizers.SGD(0.05), "mse", metrics=["mae", "mse"],
                      steps_per_execution=steps_per_execution)
    records = []

    class Record(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):  # Keras passes logs by keyword
            records.append({k: float(v) for k, v in sorted(logs.items())})

    model.fit(x, y, batch_size=BATCH, epochs=2, verbose=0, shuffle=False, callbacks=[Record()])
    weights = [w.tolist() for w in model.get_weights()]
    per_step = None
    if more_steps:
        per_step = collectives_per_step(keras, model, x, y, profile=profile)
    return records, weights, per_step


def collectives_per_step(keras, model, x, y, *, profile: bool = True) -> float | None:
    """Collectives this worker runs per training step inside Keras's step function, from a
    profiler trace of whole steps (the second execution on, up to the last batch: no
    tracing, no epoch end); without `profile` the same steps, unprofiled, and None."""
    import tensorflow as tf

    from tfdist.compat import profiler_trace

    trace = tempfile.mkdtemp()
    window = {}

    class Profile(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            if profile and "first" not in window and batch >= model.steps_per_execution:
                window["first"] = batch
                tf.profiler.experimental.start(trace)

        def on_train_batch_end(self, batch, logs=None):
            if "first" in window and "steps" not in window and batch >= PROFILED - 1:
                tf.profiler.experimental.stop()
                window["steps"] = batch - window["first"] + 1

    xs, ys = np.tile(x, (PROFILED // STEPS, 1)), np.tile(y, (PROFILED // STEPS, 1))
    model.fit(xs, ys, batch_size=BATCH, epochs=1, verbose=0, shuffle=False,
              callbacks=[Profile()])
    if not profile:
        return None
    events = profiler_trace.timed_events(trace, contains=":Collective")
    # Keras's step function (a nested tf.function: "StatefulPartitionedCall/...") holds
    # the gradients' and the logs' collectives; a collective the train function runs
    # outside it (one per step on this TensorFlow/tfdist) is not the logs' and not counted.
    inside = [e for e in events if "StatefulPartitionedCall/" in e[0]]
    return len(inside) / window["steps"]


def main() -> int:
    out_dir = sys.argv[1]
    import tfdist

    tfdist.import_tensorflow()
    import keras

    from tfdist.compat import keras_log_reduction

    strategy = tfdist.make_strategy("multi_worker_mirrored", join_timeout=120)
    task = strategy.cluster_resolver.task_id
    result = {}
    profile = task == 0  # see the module doc
    result["packed"] = fit(keras, strategy, more_steps=True, profile=profile)
    tfdist.compat.uninstall([keras_log_reduction.NAME])
    result["unpacked"] = fit(keras, strategy, more_steps=True, profile=profile)
    keras_log_reduction.install()
    result["spe4"] = fit(keras, strategy, steps_per_execution=4, more_steps=True,
                         profile=profile)
    with open(os.path.join(out_dir, f"worker{task}.json"), "w") as f:
        json.dump({name: {"logs": r[0], "weights": r[1], "collectives_per_step": r[2]}
                   for name, r in result.items()}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Peak memory of a pipelined training step: GPipe against 1F1B, measured.

    python -m experiments.split_memory [--micro_batches=8] [--out results/split_memory.json]

Two stages on two logical CPUs (one process), an MLP whose activations dwarf its
weights and its inputs (16 features, 8 x Dense(512), micro-batches of 1024
examples, so a micro-batch keeps 2 MiB per layer for the backward pass; the step
has M of them). For each schedule
the step runs once to trace, then TensorFlow's allocator statistics
(`tf.config.experimental.get_memory_info`, shared by the logical CPUs) are reset
and the peak above the bytes already allocated is read over one step. The
allocator is TensorFlow's BFC allocator on every CPU (TF_CPU_ALLOCATOR_USE_BFC=1,
set before TensorFlow starts): its default CPU allocator keeps statistics only
where oneDNN is on (CPUs with AVX-512 VNNI/BF16, AVX-VNNI or AMX), and raises
"Allocator stats not available" elsewhere (an AMD EPYC without AVX-512).

The unit is measured the same way: the unsplit model stepped on one and on two
micro-batches; the difference is what one more micro-batch in flight costs,
and what one micro-batch's step costs beyond that is the fixed part (gradients,
temporaries). "in flight" = (peak - fixed) / per-micro-batch bytes, next to
GPipe's M and 1F1B's K.
"""

from __future__ import annotations

import json
import os

from absl import app, flags

_MICRO = flags.DEFINE_integer("micro_batches", 8, "Micro-batches per step (M).", lower_bound=2)
_OUT = flags.DEFINE_string("out", None, "Write the rows as JSON to this file.")

FEATURES, WIDTH, DEPTH, MICRO_BATCH_SIZE, STAGES = 16, 512, 8, 1024, 2


def measure(micro_batches: int) -> dict:
    # Read when TensorFlow creates its CPU allocator: before it starts.
    os.environ["TF_CPU_ALLOCATOR_USE_BFC"] = "1"
    import numpy as np

    import tfdist

    tfdist.configure_logical_devices(STAGES)
    tf = tfdist.import_tensorflow()
    import keras

    def build():
        keras.utils.set_random_seed(0)
        inputs = keras.Input((FEATURES,))
        x = inputs
        for i in range(DEPTH):
            x = keras.layers.Dense(WIDTH, activation="relu", name=f"dense_{i}")(x)
        return keras.Model(inputs, keras.layers.Dense(1, name="head")(x))

    rng = np.random.default_rng(0)
    batch = MICRO_BATCH_SIZE * micro_batches
    x = rng.standard_normal((batch, FEATURES)).astype("float32")
    y = rng.standard_normal((batch, 1)).astype("float32")

    def peak_of_step(model, xs, ys) -> int:
        model.train_on_batch(xs, ys)  # trace and build the optimizer first
        tf.config.experimental.reset_memory_stats("CPU:0")
        base = tf.config.experimental.get_memory_info("CPU:0")["current"]
        model.train_on_batch(xs, ys)
        return tf.config.experimental.get_memory_info("CPU:0")["peak"] - base

    micro = MICRO_BATCH_SIZE
    unsplit = build()
    unsplit.compile(keras.optimizers.SGD(0.01), "mse")
    one = peak_of_step(unsplit, x[:micro], y[:micro])
    two = peak_of_step(unsplit, x[:2 * micro], y[:2 * micro])
    per_micro = two - one
    fixed = one - per_micro
    rows = {"micro_batches": micro_batches, "stages": STAGES, "per_micro_batch_bytes": per_micro,
            "fixed_bytes": fixed}
    for schedule in ("gpipe", "1f1b"):
        split = tfdist.split_model(build(), devices=["/cpu:0", "/cpu:1"],
                                   micro_batches=micro_batches, schedule=schedule)
        split.compile(keras.optimizers.SGD(0.01), "mse")
        peak = peak_of_step(split, x, y)
        rows[schedule] = {"peak_bytes": peak, "in_flight": (peak - fixed) / per_micro}
    return rows


def main(argv):
    del argv
    rows = measure(_MICRO.value)
    mib = 2**20
    print(f"one micro-batch in flight: {rows['per_micro_batch_bytes'] / mib:.1f} MiB; "
          f"fixed per step: {rows['fixed_bytes'] / mib:.1f} MiB")
    for schedule, bound in (("gpipe", rows["micro_batches"]), ("1f1b", rows["stages"])):
        r = rows[schedule]
        print(f"{schedule:5s} M={rows['micro_batches']}: peak {r['peak_bytes'] / mib:7.1f} MiB "
              f"above the weights = {r['in_flight']:.2f} micro-batches in flight "
              f"(schedule bound: {bound})")
    if _OUT.value:
        os.makedirs(os.path.dirname(os.path.abspath(_OUT.value)), exist_ok=True)
        with open(_OUT.value, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    app.run(main)

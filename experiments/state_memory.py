"""The cost model's state bytes against the allocator: `python -m experiments.state_memory`.

A model of large layers (4 x Dense(1024) and a Dense(16) head, 4.2M float32
parameters) is built in this fresh process while TensorFlow's CPU allocator
counts the bytes in use: after the variables, after Adam's slots, after one
step's gradients. Each difference is printed next to
`tfdist.planning.replica_memory`'s parameter, optimizer and gradient bytes, and
the last line is the same as JSON:

    {"parameters": [allocated, predicted], "optimizer": [...], "gradients": [...],
     "allocator": "..."}

The allocator: TensorFlow keeps statistics for the CPU only in its BFC
allocator, which it uses by default only where oneDNN is on (CPUs with
AVX-512 VNNI/BF16, AVX-VNNI or AMX); elsewhere (an AMD EPYC without AVX-512,
or TF_ENABLE_ONEDNN_OPTS=0) `get_memory_info("CPU:0")` raises "Allocator
stats not available". This script sets TF_CPU_ALLOCATOR_USE_BFC=1 before
TensorFlow starts, so the same BFC allocator counts on every CPU. It rounds
each allocation up to 256 bytes and counts small ones (biases, Adam's step
counter), so it reads slightly above the cost model's exact sums.
"""

from __future__ import annotations

import json
import os
import sys

# Read when TensorFlow creates its CPU allocator: before the import.
os.environ["TF_CPU_ALLOCATOR_USE_BFC"] = "1"

WIDTH, DEPTH, OUTPUTS, BATCH = 1024, 4, 16, 2


def measure() -> dict:
    """Allocated and predicted bytes of the parameters, Adam's slots and the gradients.

    Raises:
      RuntimeError: this TensorFlow keeps no CPU allocator statistics even with
        TF_CPU_ALLOCATOR_USE_BFC=1.
    """
    import tfdist

    tf = tfdist.import_tensorflow()
    import keras

    from tfdist import planning

    def allocated() -> int:
        return tf.config.experimental.get_memory_info("CPU:0")["current"]

    tf.constant(1.0)  # start the runtime
    try:
        start = allocated()
    except ValueError as e:
        raise RuntimeError(
            f"TensorFlow {tf.__version__} keeps no CPU allocator statistics here even with "
            f"TF_CPU_ALLOCATOR_USE_BFC=1 ({e}); the allocator cannot be compared.") from None
    inputs = keras.Input((WIDTH,))
    h = inputs
    for i in range(DEPTH):
        h = keras.layers.Dense(WIDTH, name=f"dense_{i}")(h)
    model = keras.Model(inputs, keras.layers.Dense(OUTPUTS, name="head")(h))
    after_variables = allocated()
    optimizer = keras.optimizers.Adam()
    optimizer.build(model.trainable_variables)
    after_slots = allocated()
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(model(tf.ones((BATCH, WIDTH))))
    grads = tape.gradient(loss, model.trainable_variables)
    del tape, loss
    after_gradients = allocated()
    del grads
    memory = planning.replica_memory(planning.model_stats(model),
                                     per_replica_batch_size=BATCH, optimizer=optimizer)
    return {
        "parameters": [after_variables - start, memory.parameters],
        "optimizer": [after_slots - after_variables, memory.optimizer],
        "gradients": [after_gradients - after_slots, memory.gradients],
        "allocator": "TensorFlow's BFC allocator (TF_CPU_ALLOCATOR_USE_BFC=1)",
    }


def main() -> int:
    try:
        rows = measure()
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    for part in ("parameters", "optimizer", "gradients"):
        allocated, predicted = rows[part]
        print(f"{part:10s} allocator {allocated / 2**20:7.3f} MiB, cost model "
              f"{predicted / 2**20:7.3f} MiB, ratio {allocated / predicted:.4f}")
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())

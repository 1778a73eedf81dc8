"""Run by tests/test_ps_sharded.py in a fresh process: sharded vs unsharded training.

Trains the same Embedding + Dense model (same initial weights, same batches)
twice: under the parameter_server preset with 1 worker, 2 ps and every
variable split in 2 shards, and with no strategy at all (duplicate sparse
indices summed, as under every tfdist strategy). With one worker the
steps run one after another, so both runs must agree. Prints one JSON line.
"""

import json
import os
import sys

import numpy as np

import tfdist


def build(keras):
    inputs = keras.Input((4,), dtype="int32")
    h = keras.layers.Embedding(64, 8)(inputs)
    h = keras.layers.Flatten()(h)
    h = keras.layers.Dense(32, activation="relu")(h)
    outputs = keras.layers.Dense(1)(h)
    model = keras.Model(inputs, outputs)
    model.compile(keras.optimizers.Adam(0.01), "mse")
    return model


def main(steps: int) -> None:
    from tfdist._tf import import_tensorflow

    tf = import_tensorflow()  # quietly, before Keras imports it
    import keras

    strategy = tfdist.make_strategy("parameter_server", local_workers=1, local_ps=2,
                                    shard_count=2)
    rng = np.random.default_rng(0)
    x = rng.integers(0, 64, (256, 4)).astype("int32")
    y = rng.standard_normal((256, 1)).astype("float32")

    def dataset_fn(input_context=None):
        return tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(16)

    keras.utils.set_random_seed(1)
    with strategy.scope():
        sharded = build(keras)
    plain = build(keras)
    plain.set_weights(sharded.get_weights())
    # The reference: one device with duplicate sparse-gradient indices summed, as
    # tfdist's strategies (and TensorFlow's own optimizers) apply them.
    from tfdist.compat import optimizer_update

    optimizer_update.opt_in(plain.optimizer)

    from tensorflow.python.distribute.sharded_variable import ShardedVariable

    initial = sharded.get_weights()
    sharded.fit(dataset_fn, epochs=2, steps_per_epoch=steps // 2, verbose=0)
    plain.fit(dataset_fn(), epochs=2, steps_per_epoch=steps // 2, verbose=0, shuffle=False)
    diffs = [float(np.max(np.abs(a - b)))
             for a, b in zip(sharded.get_weights(), plain.get_weights())]
    moved = [float(np.max(np.abs(a - b))) for a, b in zip(sharded.get_weights(), initial)]
    placement = {}
    for v in sharded.weights + sharded.optimizer.variables:
        if isinstance(v.value, ShardedVariable):
            placement[v.path] = [s.device.split("/device")[0] for s in v.value.variables]
    # Saving reads the shards; loading into a fresh sharded model splits them.
    import tempfile

    path = os.path.join(tempfile.mkdtemp(), "sharded.weights.h5")
    sharded.save_weights(path)
    with strategy.scope():
        reloaded = build(keras)
        reloaded.optimizer.build(reloaded.trainable_variables)
    reloaded.load_weights(path)
    roundtrip = max(float(np.max(np.abs(a - b)))
                    for a, b in zip(sharded.get_weights(), reloaded.get_weights()))
    print(json.dumps({
        "save_roundtrip_diff": roundtrip,
        "max_abs_diff": max(diffs),
        "min_change": min(moved),
        "iterations": int(sharded.optimizer.iterations.numpy()),
        "placement": placement,
    }), flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 40)

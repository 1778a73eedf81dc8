"""One worker of the 2-worker gradient-compression test, run by `tfdist launch`.

    python tests/comm/run_worker.py OUT_DIR '{"gradient_compression": "powersgd", ...}' \
        '{"mixed_precision": "mixed_bfloat16", ...}'

Trains a small Conv2D + Dense model under multi_worker_mirrored with the
given preset options and StepOptions, and writes every weight and the
per-epoch losses to OUT_DIR/<task_id>.npz.
"""

import json
import sys

import numpy as np


def main(out_dir: str, preset_options: str, step_options: str) -> None:
    import tfdist
    from tfdist import step_options as step_lib
    from tfdist._tf import import_tensorflow

    tfdist.configure_threads(intra_op=1)
    tf = import_tensorflow()
    import keras

    strategy = tfdist.make_strategy("multi_worker_mirrored", **json.loads(preset_options))
    options = tfdist.StepOptions(**json.loads(step_options))
    step_lib.check(options, strategy)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((256, 8, 8, 3)).astype("float32")
    y = (x.mean(axis=(1, 2, 3)) > 0).astype("int32")
    ds = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(32)
    with strategy.scope(), step_lib.dtype_policy(options):
        keras.utils.set_random_seed(0)
        model = keras.Sequential([
            keras.Input((8, 8, 3)), keras.layers.Conv2D(16, 3, activation="relu"),
            keras.layers.Flatten(), keras.layers.Dense(32, activation="relu"),
            keras.layers.Dense(2, dtype="float32")])
        model.compile(step_lib.optimizer(keras.optimizers.Adam(1e-2), options),
                      keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      **step_lib.compile_arguments(options))
    history = model.fit(ds, epochs=3, steps_per_epoch=8, verbose=0)
    task = strategy.cluster_resolver.task_id
    arrays = {f"w{i}": v.numpy() for i, v in enumerate(model.weights)}
    np.savez(f"{out_dir}/{task}.npz", loss=np.array(history.history["loss"]), **arrays)


if __name__ == "__main__":
    main(*sys.argv[1:4])

"""Mixed precision, steps_per_execution and XLA under one preset, in a fresh process.

    python tests/core/run_step_options.py mirrored|parameter_server

Prints one JSON line {"runs": [...], ...}; raises on a failure. Run by
tests/core/test_step_options.py.
"""

import json
import sys

import numpy as np

import tfdist
from tfdist._tf import import_tensorflow

PRESET = sys.argv[1]
if PRESET == "mirrored":
    tfdist.configure_logical_devices(2)
tf = import_tensorflow()
import keras  # noqa: E402

from tfdist import step_options as step_lib  # noqa: E402
from tfdist.compat import _patch  # noqa: E402

OPTIONS = {"mirrored": {"num_devices": 2},
           "parameter_server": {"local_workers": 2, "local_ps": 1}}[PRESET]
STRATEGY = tfdist.make_strategy(PRESET, **OPTIONS)
rng = np.random.default_rng(0)
X = rng.standard_normal((256, 8)).astype("float32")
Y = (X[:, :3].argmax(axis=1)).astype("int32")


def train(options, epochs=2):
    ds = tf.data.Dataset.from_tensor_slices((X, Y)).repeat().batch(32)
    with STRATEGY.scope(), step_lib.dtype_policy(options):
        keras.utils.set_random_seed(0)
        model = keras.Sequential([
            keras.Input((8,)), keras.layers.Dense(32, activation="relu"),
            keras.layers.BatchNormalization(), keras.layers.Dense(3, dtype="float32")])
        model.compile(step_lib.optimizer(keras.optimizers.Adam(1e-2), options),
                      keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      **step_lib.compile_arguments(options))
    assert keras.config.dtype_policy().name == "float32"  # restored after building
    history = model.fit(ds, epochs=epochs, steps_per_epoch=8, verbose=0)
    return model, history.history["loss"]


def replicas_identical(model):
    for w in model.weights:
        parts = [p.numpy() for p in STRATEGY.experimental_local_results(w)]
        if not all(np.array_equal(parts[0], p) for p in parts[1:]):
            return False
    return True


def overflow_on_one_replica():
    """mixed_float16, replica 1's gradients overflow, replica 0's do not: the step must be
    skipped on both (weights finite, loss scale halved)."""
    x = np.ones((32, 4), "float32")
    x[16:] = 1e30  # the second replica's half of the batch
    y = np.zeros((32, 1), "float32")
    options = tfdist.StepOptions(mixed_precision="mixed_float16")
    with STRATEGY.scope(), step_lib.dtype_policy(options):
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1, dtype="float32")])
        model.compile(keras.optimizers.SGD(0.1), "mse")
    model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(32), epochs=1, verbose=0)
    return {"finite": bool(np.isfinite(model.layers[0].kernel.numpy()).all()),
            "scale": float(model.optimizer.dynamic_scale.numpy())}


def partial_execution():
    """53 examples in batches of 8: 7 steps an epoch, run as 4 + 3 with steps_per_execution=4.

    Adam, whose bias correction reads the step counter. Returns both runs' step counts
    (steps_per_execution 1 and 4) and the largest difference of their weights.
    """
    results = {}
    for spe in (1, 4):
        with STRATEGY.scope():
            keras.utils.set_random_seed(0)
            model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                                      keras.layers.Dense(3)])
            model.compile(keras.optimizers.Adam(1e-2),
                          keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                          steps_per_execution=spe)
        model.fit(tf.data.Dataset.from_tensor_slices((X[:53], Y[:53])).batch(8), epochs=2,
                  verbose=0)
        results[spe] = (int(model.optimizer.iterations.numpy()),
                        [w.numpy() for w in model.weights])
    return {"iterations": [results[1][0], results[4][0]],
            "max_diff": max(float(np.abs(a - b).max())
                            for a, b in zip(results[1][1], results[4][1]))}


def main():
    runs, weights = [], {}
    combos = [(p, spe, False) for p in ("none", "mixed_float16", "mixed_bfloat16")
              for spe in (1, 4)]
    if PRESET == "parameter_server":
        combos += [(p, 4, True) for p in ("none", "mixed_float16", "mixed_bfloat16")]
    for policy, spe, jit in combos:
        options = tfdist.StepOptions(mixed_precision=policy, steps_per_execution=spe,
                                     jit_compile=jit,
                                     loss_scale=256.0 if policy == "mixed_float16" else None)
        step_lib.check(options, STRATEGY)
        model, loss = train(options)
        if not np.isfinite(loss).all() or not loss[-1] < loss[0]:
            raise AssertionError(f"{policy} spe={spe} jit={jit} did not train: {loss}")
        kernel = model.layers[0].kernel
        if policy != "none" and kernel.dtype != "float32":
            raise AssertionError(f"{policy}: variables must stay float32, got {kernel.dtype}")
        if policy != "none" and model.layers[0].compute_dtype == "float32":
            raise AssertionError(f"{policy}: the layer computes in float32")
        if policy == "mixed_float16" and getattr(model.optimizer, "initial_scale", None) != 256.0:
            raise AssertionError("loss_scale did not reach the LossScaleOptimizer")
        identical = replicas_identical(model) if PRESET == "mirrored" else None
        if PRESET == "mirrored" and not identical:
            raise AssertionError(f"{policy} spe={spe}: replicas differ")
        if policy == "none":
            weights[spe] = [w.numpy() for w in model.weights]
        runs.append({"policy": policy, "spe": spe, "jit": jit, "loss": loss[-1]})
    out = {"runs": runs}
    if PRESET == "mirrored":
        # steps_per_execution changes how steps are grouped, not what they compute.
        out["spe_max_diff"] = max(float(np.abs(a - b).max())
                                  for a, b in zip(weights[1], weights[4]))
        try:
            step_lib.check(tfdist.StepOptions(jit_compile=True), STRATEGY)
        except ValueError as e:
            out["jit_error"] = str(e)
        out["partial_execution"] = partial_execution()
        # Negative control: the steps not gated on their batch (the fix before 2026-11-28).
        from tfdist.compat import keras_multi_step

        gate = keras_multi_step._batch_tensors
        keras_multi_step._batch_tensors = lambda tf, data: []
        out["partial_execution_ungated"] = partial_execution()
        keras_multi_step._batch_tensors = gate
        out["overflow_on_one_replica"] = overflow_on_one_replica()
        _patch.uninstall(["loss_scale.check_finite", "loss_scale.tf_apply"])
        out["overflow_on_one_replica_unpatched"] = overflow_on_one_replica()
        # Negative control: Keras's own multi-step loop, unpatched, fails here.
        _patch.uninstall(["keras_multi_step.make_function"])
        try:
            train(tfdist.StepOptions(steps_per_execution=4), epochs=1)
            out["unpatched"] = "trained"
        except tf.errors.InvalidArgumentError as e:
            out["unpatched"] = str(e).splitlines()[0] + " " + (
                "placeholder" if "placeholder" in str(e) else "")
    print(json.dumps(out))


if __name__ == "__main__":
    main()

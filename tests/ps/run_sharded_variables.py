"""Run by tests/ps/test_sharded_variables.py in a fresh process: sharded variables under Keras 3.

One in-process cluster (1 worker, 2 ps, every variable split in 2 shards).
With one worker the steps run one after another, so each sharded run must
agree with the same computation done with no strategy at all:

1. `model.fit` of an Embedding + Dense model vs the same model trained plain
   (duplicate sparse indices summed, as under every tfdist strategy);
2. the public parameter_server_training tutorial's custom loop
   (ClusterCoordinator, `strategy.run`, optimizer slots created lazily inside
   it, no `optimizer.build`) vs the same loop run plain;
3. `tape.gradient` w.r.t. a sharded Keras variable vs the unsharded gradient;
4. canaries: with each sharded-variable fix uninstalled, the unpatched Keras
   path still fails (so the fix is still needed).

Prints one JSON line.
"""

import json
import os
import sys
import tempfile

import numpy as np

import tfdist


def build(keras, optimizer="adam"):
    inputs = keras.Input((4,), dtype="int32")
    h = keras.layers.Embedding(64, 8)(inputs)
    h = keras.layers.Flatten()(h)
    h = keras.layers.Dense(32, activation="relu")(h)
    outputs = keras.layers.Dense(1)(h)
    model = keras.Model(inputs, outputs)
    model.compile(keras.optimizers.get(optimizer) if isinstance(optimizer, str) else optimizer,
                  "mse")
    return model


def max_diff(a, b):
    return max(float(np.max(np.abs(np.asarray(u) - np.asarray(v)))) for u, v in zip(a, b))


def fit_vs_plain(tf, keras, strategy, steps, x, y):
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
    plain.fit(dataset_fn(), epochs=2, steps_per_epoch=steps // 2, verbose=0)
    moved = [float(np.max(np.abs(a - b))) for a, b in zip(sharded.get_weights(), initial)]
    placement = {}
    for v in sharded.weights + sharded.optimizer.variables:
        if isinstance(v.value, ShardedVariable):
            placement[v.path] = [s.device.split("/device")[0] for s in v.value.variables]
    # Saving reads the shards; loading into a fresh sharded model splits them.
    path = os.path.join(tempfile.mkdtemp(), "sharded.weights.h5")
    sharded.save_weights(path)
    with strategy.scope():
        reloaded = build(keras)
        reloaded.optimizer.build(reloaded.trainable_variables)
    reloaded.load_weights(path)
    return {
        "save_roundtrip_diff": max_diff(sharded.get_weights(), reloaded.get_weights()),
        "max_abs_diff": max_diff(sharded.get_weights(), plain.get_weights()),
        "min_change": min(moved),
        "iterations": int(sharded.optimizer.iterations.numpy()),
        "placement": placement,
    }


def tutorial_loop(tf, keras, strategy, x, y, *, steps, optimizer_outside=False):
    """The tutorial's custom loop, under `strategy`, and the same loop with no strategy.

    `optimizer_outside`: the optimizer is made before the scope, as keras.io's examples do
    (keras-team/keras#17187); its first `apply_gradients`, traced on the coordinator inside
    `strategy.run`, moves it onto the parameter servers. Keys then start "outside_".
    """
    labels = (y > 0).astype("float32")

    def dataset_fn(_):
        return tf.data.Dataset.from_tensor_slices((x, labels)).repeat().batch(16)

    def make(scope, outside=False):
        keras.utils.set_random_seed(2)
        optimizer = keras.optimizers.RMSprop(learning_rate=0.01) if outside else None
        with scope:
            model = build(keras)
            optimizer = optimizer or keras.optimizers.RMSprop(learning_rate=0.01)
            accuracy = keras.metrics.BinaryAccuracy()
        return model, optimizer, accuracy

    def replica_step(model, optimizer, accuracy, batch_data, batch_labels):
        with tf.GradientTape() as tape:
            pred = tf.sigmoid(model(batch_data, training=True))
            per_example_loss = keras.losses.BinaryCrossentropy(reduction=None)(
                batch_labels, pred)
            loss = tf.nn.compute_average_loss(per_example_loss)
        gradients = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(gradients, model.trainable_variables))
        accuracy.update_state(batch_labels, pred)
        return loss

    model, optimizer, accuracy = make(strategy.scope(), optimizer_outside)
    initial = model.get_weights()
    assert not optimizer.built  # the slots come from the first apply_gradients, in strategy.run

    @tf.function
    def step_fn(iterator):
        batch_data, batch_labels = next(iterator)
        losses = strategy.run(replica_step,
                              args=(model, optimizer, accuracy, batch_data, batch_labels))
        return strategy.reduce(tf.distribute.ReduceOp.SUM, losses, axis=None)

    coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)

    @tf.function
    def per_worker_dataset_fn():
        return strategy.distribute_datasets_from_function(dataset_fn)

    iterator = iter(coordinator.create_per_worker_dataset(per_worker_dataset_fn))
    for _ in range(steps):
        coordinator.schedule(step_fn, args=(iterator,))
    coordinator.join()

    import contextlib

    ref_model, ref_optimizer, ref_accuracy = make(contextlib.nullcontext())
    ref_model.set_weights(initial)
    from tfdist.compat import optimizer_update

    optimizer_update.opt_in(ref_optimizer)  # duplicate sparse indices summed, as under tfdist
    ref_step = tf.function(lambda bx, by: replica_step(ref_model, ref_optimizer, ref_accuracy,
                                                       bx, by))
    for batch_data, batch_labels in dataset_fn(None).take(steps):
        ref_step(batch_data, batch_labels)
    from tensorflow.python.distribute.sharded_variable import ShardedVariable

    prefix = "outside_loop_" if optimizer_outside else "loop_"
    return {prefix + key: value for key, value in {
        "iterations": int(optimizer.iterations.numpy()),
        "accuracy": float(accuracy.result()),
        "ref_accuracy": float(ref_accuracy.result()),
        "max_abs_diff": max_diff(model.get_weights(), ref_model.get_weights()),
        "sharded_slots": sum(isinstance(v.value, ShardedVariable) for v in optimizer.variables),
        "on_ps": all("/job:ps/" in getattr(v.value, "device", "") or isinstance(
            v.value, ShardedVariable) for v in optimizer.variables),
    }.items()}


def tape_gradient(tf, keras, strategy):
    """tape.gradient w.r.t. a sharded Keras variable equals the unsharded gradient."""
    table = np.arange(12, dtype="float32").reshape(6, 2)
    with strategy.scope():
        sharded = keras.Variable(table)
    plain = keras.Variable(table)
    ids = tf.constant([0, 5, 5, 3])
    grads = []
    for var in (sharded, plain):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.gather(tf.convert_to_tensor(var.value), ids) ** 2)
        grads.append(tf.convert_to_tensor(tape.gradient(loss, [var])[0]).numpy())
    from tfdist.compat import ps_variables

    return {"tape_sharded": ps_variables.is_sharded(sharded),
            "tape_gradient_diff": float(np.max(np.abs(grads[0] - grads[1])))}


def canaries(tf, keras, strategy):
    """Each fix uninstalled: Keras's own path on sharded variables still fails."""
    from tfdist.compat import _patch, keras_build
    from tfdist.compat import ps_variables as pv

    coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
    x = np.ones((4, 8), "float32")
    failures = {}
    for fix, optimizer in ((pv.SLOT_FROM_REFERENCE, "rmsprop"), (pv.TAPE_GRADIENT, "sgd"),
                           (pv.DISTRIBUTED_UPDATE_STEP, "sgd"), (pv.WEIGHT_DECAY, "adamw"),
                           (pv.ARRAY, None)):
        # Keras's own path: keras_build.optimizer_variables (every preset's) creates slots
        # under tf.init_scope, which on Keras 3.10 lets the unpatched slot path through.
        _patch.uninstall([fix.name, keras_build.OPTIMIZER_VARIABLES_FIX.name])
        try:
            with strategy.scope():
                model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4)])
                opt = keras.optimizers.get(optimizer) if optimizer else None
            if opt is None:
                np.asarray(model.weights[0])
            else:
                if fix is not pv.SLOT_FROM_REFERENCE:
                    opt.build(model.trainable_variables)

                @tf.function
                def step():
                    def replica():  # traced and run in this iteration only
                        with tf.GradientTape() as tape:
                            loss = tf.reduce_sum(model(x))  # noqa: B023
                        grads = tape.gradient(loss, model.trainable_variables)  # noqa: B023
                        opt.apply_gradients(zip(grads, model.trainable_variables))  # noqa: B023

                    strategy.run(replica)
                    return tf.constant(0)

                coordinator.schedule(step)
                coordinator.join()
            failures[fix.name] = None
        except Exception as e:  # noqa: BLE001 (the canary reports any failure)
            failures[fix.name] = f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:200]}"
        finally:
            _patch.install(fix)
            _patch.install(keras_build.OPTIMIZER_VARIABLES_FIX)
    return {"canaries": failures}


def main(steps: int) -> None:
    from tfdist._tf import import_tensorflow

    tf = import_tensorflow()  # quietly, before Keras imports it
    import keras

    strategy = tfdist.make_strategy("parameter_server", local_workers=1, local_ps=2,
                                    shard_count=2)
    rng = np.random.default_rng(0)
    x = rng.integers(0, 64, (256, 4)).astype("int32")
    y = rng.standard_normal((256, 1)).astype("float32")
    result = fit_vs_plain(tf, keras, strategy, steps, x, y)
    result.update(tutorial_loop(tf, keras, strategy, x, y, steps=steps))
    result.update(tutorial_loop(tf, keras, strategy, x, y, steps=steps, optimizer_outside=True))
    result.update(tape_gradient(tf, keras, strategy))
    result.update(canaries(tf, keras, strategy))
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 40)

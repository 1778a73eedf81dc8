"""BatchNorm replica state and sparse gradients on 2 logical CPUs, in one fresh process.

    python tests/numerics/run_batch_norm_and_sparse.py mirrored  # one JSON object of measurements

Run by tests/numerics/test_batch_norm_and_sparse.py (which asserts on the numbers) and reusable
by hand. Every comparison is against an independent run in this process:
the same model, seed and global batch on one device (the default strategy),
with duplicate sparse-gradient indices summed where the optimizer is not
SGD (`tfdist.sum_duplicate_sparse_gradients`), itself checked against a
dense twin (one-hot matmul instead of a gather, so the gradient is dense
and no fix is involved).

The multi-worker half (`worker` mode) runs under `tfdist launch`: each task
trains the same models under multi_worker_mirrored, then the single-device
references, and writes its weights and a saved model to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

GLOBAL_BATCH = 16
STEPS = 3
VOCAB, EMBED = 12, 4
SPARSE_OPTIMIZERS = ("adam", "adamw", "rmsprop", "adagrad")


# --- data and models (plain Keras) --------------------------------------------------


def dense_data(features=6, n=GLOBAL_BATCH * STEPS, seed=0):
    import numpy as np

    rng = np.random.default_rng(seed)
    # Offset and scale so batch statistics differ visibly between replica halves.
    x = (3.0 * rng.standard_normal((n, features)) + 1.0).astype("float32")
    y = rng.standard_normal((n, 1)).astype("float32")
    return x, y


def image_data(shape=(32, 32, 3), classes=4, n=GLOBAL_BATCH * 2, seed=0):
    import numpy as np

    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((n, *shape)) + 0.5).astype("float32")
    y = rng.standard_normal((n, classes)).astype("float32")
    return x, y


def token_data(n=GLOBAL_BATCH * STEPS, length=6, seed=0):
    """Ids from a small vocabulary, so every batch repeats ids within and across replicas."""
    import numpy as np

    rng = np.random.default_rng(seed)
    x = rng.integers(0, VOCAB // 2, size=(n, length)).astype("int32")
    y = rng.standard_normal((n, 1)).astype("float32")
    return x, y


def bn_mlp():
    import keras

    return keras.Sequential([keras.Input((6,)), keras.layers.Dense(8),
                             keras.layers.BatchNormalization(), keras.layers.Dense(1)])


def mlp():
    import keras

    return keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh"),
                             keras.layers.Dense(1)])


def conv_bn():
    import keras

    return keras.Sequential([
        keras.Input((32, 32, 3)), keras.layers.Conv2D(8, 3, strides=2),
        keras.layers.BatchNormalization(), keras.layers.ReLU(),
        keras.layers.Conv2D(8, 3, padding="same"), keras.layers.BatchNormalization(),
        keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(4)])


def mobilenet_v3_small():
    import keras

    # dropout_rate=0: the head's dropout would draw different masks per replica.
    return keras.applications.MobileNetV3Small(
        input_shape=(32, 32, 3), weights=None, classes=4, classifier_activation=None,
        include_preprocessing=False, dropout_rate=0.0)


def resnet50():
    import keras

    return keras.applications.ResNet50(input_shape=(32, 32, 3), weights=None, classes=4,
                                       classifier_activation=None)


def embedding_model(*, dense_twin=False):
    """Embedding(ids) -> mean over positions -> Dense: the plain sparse-gradient case."""
    import keras

    inputs = keras.Input((None,), dtype="int32")
    if dense_twin:
        table = keras.layers.Dense(EMBED, use_bias=False, name="embedding")
        hidden = table(keras.ops.one_hot(inputs, VOCAB))
    else:
        hidden = keras.layers.Embedding(VOCAB, EMBED, name="embedding")(inputs)
    hidden = keras.layers.GlobalAveragePooling1D()(hidden)
    return keras.Model(inputs, keras.layers.Dense(1, name="out")(hidden))


def transformer():
    """Token + learned position embedding -> self-attention block -> pooled Dense."""
    import keras

    class PositionEmbedding(keras.layers.Layer):
        def build(self, shape):
            self.table = self.add_weight(shape=(shape[1], shape[2]), name="table",
                                         initializer="random_normal")

        def call(self, x):
            positions = keras.ops.arange(keras.ops.shape(x)[1])
            return x + keras.ops.take(self.table, positions, axis=0)  # a gather: IndexedSlices

    inputs = keras.Input((6,), dtype="int32")
    x = keras.layers.Embedding(VOCAB, 8)(inputs)
    x = PositionEmbedding()(x)
    attention = keras.layers.MultiHeadAttention(num_heads=2, key_dim=4)(x, x)
    x = keras.layers.LayerNormalization()(x + attention)
    x = keras.layers.Dense(16, activation="relu")(x)
    x = keras.layers.GlobalAveragePooling1D()(x)
    return keras.Model(inputs, keras.layers.Dense(1)(x))


def make_optimizer(name, lr):
    import keras

    return {"sgd": lambda: keras.optimizers.SGD(lr),
            "adam": lambda: keras.optimizers.Adam(lr),
            "adamw": lambda: keras.optimizers.AdamW(lr, weight_decay=0.01),
            "rmsprop": lambda: keras.optimizers.RMSprop(lr),
            "adagrad": lambda: keras.optimizers.Adagrad(lr),
            # 3 steps: one update, then one micro-step left in the accumulators.
            "adam_accumulate": lambda: keras.optimizers.Adam(lr, gradient_accumulation_steps=2),
            "sgd_clipnorm": lambda: keras.optimizers.SGD(lr, clipnorm=0.05),
            }[name]()


def train(strategy, build, data, *, optimizer="sgd", lr=0.05, summed=False, seed=1,
          epochs=1, weights=None):
    """Builds (same seed), compiles and fits `build()` under `strategy`; returns the model.

    `weights` (a list from `get_weights()`) makes the initial weights exact
    rather than trusting that every strategy draws the same initial values.
    """
    import keras

    import tfdist

    x, y = data
    with strategy.scope():
        keras.utils.set_random_seed(seed)
        model = build()
        if weights is not None:
            model.set_weights(weights)
        opt = make_optimizer(optimizer, lr)
        if summed:
            tfdist.sum_duplicate_sparse_gradients(opt)
        model.compile(opt, "mse")
    model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=epochs, verbose=0, shuffle=False)
    return model


def max_difference(a, b) -> float:
    """Largest absolute difference between two models' weights (or two weight lists)."""
    import numpy as np

    a = a.get_weights() if hasattr(a, "get_weights") else a
    b = b.get_weights() if hasattr(b, "get_weights") else b
    return max(float(np.max(np.abs(np.asarray(u, np.float64) - np.asarray(v, np.float64))))
               for u, v in zip(a, b))


def embedding_difference(a, b) -> float:
    """Difference of the embedding tables only (where the sparse fix acts)."""
    return max_difference([a.get_layer("embedding").get_weights()[0]],
                          [b.get_layer("embedding").get_weights()[0]])


# --- the mirrored measurements ---------------------------------------------------------


def mirrored() -> dict:
    import tfdist

    tfdist.configure_logical_devices(2)
    import keras
    import numpy as np
    import tensorflow as tf

    from tfdist.compat import _patch, optimizer_update

    one = tf.distribute.get_strategy()
    results: dict = {}
    tfdist_default = tfdist.make_strategy("mirrored", num_devices=2)
    tfdist_sync = tfdist.make_strategy("mirrored", num_devices=2, sync_batch_norm=True)
    results["installed"] = list(_patch.installed())
    _lap(results, "start")

    # BatchNorm, default: replica copies identical; negative control: the user's own strategy.
    dense = dense_data()
    user = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"],
                                          cross_device_ops=tf.distribute.ReductionToOneDevice())
    results["bn_user_strategy_spread"] = tfdist.replica_spread(train(user, bn_mlp, dense))
    model = train(tfdist_default, bn_mlp, dense)
    results["bn_default_spread"] = tfdist.replica_spread(model)
    x = dense[0]
    plain = bn_mlp()
    plain.set_weights(model.get_weights())
    results["bn_default_predict_vs_saved_weights"] = float(np.max(np.abs(
        model.predict(x, batch_size=GLOBAL_BATCH, verbose=0) - plain.predict(x, verbose=0))))
    results["bn_default_evaluate_vs_saved_weights"] = abs(
        model.evaluate(*dense, batch_size=GLOBAL_BATCH, verbose=0)
        - _compiled(plain).evaluate(*dense, batch_size=GLOBAL_BATCH, verbose=0))
    images = image_data()
    results["conv_default_spread"] = tfdist.replica_spread(
        train(tfdist_default, conv_bn, images, lr=0.01))
    # mixed_float16: Keras's LossScaleOptimizer assigns its loss scale inside a tf.cond
    # in replica context, where no cross-replica sync is allowed: it must still train.
    keras.config.set_dtype_policy("mixed_float16")
    mixed = train(tfdist_default, bn_mlp, dense, optimizer="adam", lr=1e-3)
    keras.config.set_dtype_policy("float32")
    results["mixed_float16_optimizer"] = type(mixed.optimizer).__name__
    results["mixed_float16_spread"] = max(tfdist.replica_spread(mixed),
                                          tfdist.replica_spread(mixed.optimizer.variables))
    _lap(results, "bn_default")

    # BatchNorm, sync_batch_norm = one device with the same global batch.
    for name, build in (("bn_mlp", bn_mlp), ("conv", conv_bn),
                        ("mobilenet", mobilenet_v3_small), ("resnet50", resnet50)):
        data = dense if name == "bn_mlp" else images
        # ResNet50 at 32x32 from random weights is chaotic in float32: on ONE device,
        # permuting the same batch moves its gradients by up to 120% (ReLU masks flip on
        # rounding noise), so no run can match another to 1e-5 there. In float64 the
        # comparison is well posed (measured: 7e-13).
        keras.config.set_dtype_policy("float64" if name == "resnet50" else "float32")
        initial = _initial_weights(build)
        reference = train(one, build, data, lr=0.01, weights=initial)
        synced = train(tfdist_sync, build, data, lr=0.01, weights=initial)
        results[f"{name}_sync_vs_one_device"] = max_difference(synced, reference)
        results[f"{name}_sync_spread"] = tfdist.replica_spread(synced)
        if name == "conv":  # negative control: per-replica statistics differ
            default = train(tfdist_default, build, data, lr=0.01, weights=initial)
            results["conv_default_vs_one_device"] = max_difference(default, reference)
        _lap(results, name)
    keras.config.set_dtype_policy("float32")

    # Sparse gradients: the independent reference (dense twin) and the single-device opt-in.
    tokens = token_data()
    summed_weights = {}
    initial = _initial_weights(embedding_model)
    for opt in SPARSE_OPTIMIZERS:
        twin = train(one, lambda: embedding_model(dense_twin=True), tokens, optimizer=opt,
                     lr=0.1, weights=initial)
        summed = train(one, embedding_model, tokens, optimizer=opt, lr=0.1, summed=True)
        plain_keras = train(one, embedding_model, tokens, optimizer=opt, lr=0.1)
        distributed = train(tfdist_default, embedding_model, tokens, optimizer=opt, lr=0.1)
        summed_weights[opt] = summed.get_weights()
        results[f"{opt}_summed_vs_dense_twin"] = max_difference(summed, twin)
        results[f"{opt}_plain_keras_vs_summed"] = max_difference(plain_keras, summed)
        results[f"{opt}_mirrored_vs_summed"] = max_difference(distributed, summed)
        results[f"{opt}_mirrored_spread"] = tfdist.replica_spread(distributed)
    _lap(results, "sparse")
    sequences = token_data(length=6, seed=3)
    reference = train(one, transformer, sequences, optimizer="adam", lr=0.01, summed=True)
    results["transformer_mirrored_vs_summed"] = max_difference(
        train(tfdist_default, transformer, sequences, optimizer="adam", lr=0.01), reference)

    # Negative controls: with the fixes uninstalled, the same runs are far off.
    _patch.uninstall([optimizer_update.FIX.name])
    results["adam_mirrored_vs_summed_unfixed"] = max_difference(
        train(tfdist_default, embedding_model, tokens, optimizer="adam", lr=0.1),
        summed_weights["adam"])
    optimizer_update.install()
    from tfdist.compat import batch_norm

    _patch.uninstall([batch_norm.REPLICA_STATE_FIX.name])
    results["bn_default_spread_unfixed"] = tfdist.replica_spread(
        train(tfdist_default, bn_mlp, dense))
    batch_norm.install()
    _lap(results, "controls")
    return results


_CLOCK = [0.0]


def _lap(results, name):
    import time

    now = time.perf_counter()
    if _CLOCK[0]:
        results.setdefault("seconds", {})[name] = round(now - _CLOCK[0], 1)
    _CLOCK[0] = now


def _initial_weights(build, seed=1):
    import keras

    keras.utils.set_random_seed(seed)
    return build().get_weights()


# --- the multi-worker measurements (one task of `tfdist launch`) --------------------------


def worker(out: str) -> dict:
    """Trains under multi_worker_mirrored, then the single-device references; writes to `out`.

    Files: bn_default_<task>.npz / bn_unfixed_<task>.npz (each worker's
    weights), accumulate_<task>.npz (each worker's state after gradient accumulation),
    bn_default.keras (the saved model; every worker saves to that one path), and
    results_<task>.json with this task's measurements (sparse sums, accumulation and
    clipping against one device, each with its negative control).
    """
    import tfdist

    strategy = tfdist.make_strategy("multi_worker_mirrored")
    task = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    import tensorflow as tf

    one = tf.distribute.get_strategy()
    results: dict = {"replicas": strategy.num_replicas_in_sync}
    dense, images, tokens = dense_data(), image_data(n=GLOBAL_BATCH), token_data()

    model = train(strategy, bn_mlp, dense)
    # What each worker holds, and the saved model (one path on every worker, as users
    # write it: tfdist keeps the chief's file; see tfdist/chief.py).
    _save_weights(model, os.path.join(out, f"bn_default_{task}.npz"))
    model.save(os.path.join(out, "bn_default.keras"))
    results["bn_default_spread"] = tfdist.replica_spread(model)

    # A process can hold one MultiWorkerMirroredStrategy: switch the same one to global
    # statistics, as make_strategy(..., sync_batch_norm=True) does (tested under mirrored).
    from tfdist.compat import batch_norm

    batch_norm.configure(strategy, sync_batch_norm=True)
    sync = strategy
    for name, build, data in (("bn_mlp", bn_mlp, dense), ("conv", conv_bn, images)):
        initial = _initial_weights(build)
        distributed = train(sync, build, data, lr=0.01, weights=initial).get_weights()
        reference = train(one, build, data, lr=0.01, weights=initial)
        results[f"{name}_sync_vs_one_device"] = max_difference(distributed, reference)

    initial = _initial_weights(embedding_model)
    for opt in SPARSE_OPTIMIZERS:
        distributed = train(strategy, embedding_model, tokens, optimizer=opt, lr=0.1,
                            weights=initial).get_weights()
        summed = train(one, embedding_model, tokens, optimizer=opt, lr=0.1, summed=True,
                       weights=initial)
        results[f"{opt}_workers_vs_summed"] = max_difference(distributed, summed)
    import numpy as np

    from tests.support import model_state as _state

    # Gradient accumulation (keras-team/keras#20582 fails under any MirroredStrategy): every
    # variable, the accumulators included, equals one device's; each worker's state is saved.
    accumulated = train(strategy, embedding_model, tokens, optimizer="adam_accumulate", lr=0.1,
                        weights=initial)
    reference = train(one, embedding_model, tokens, optimizer="adam_accumulate", lr=0.1,
                      weights=initial)
    results["accumulate_vs_one_device"] = max_difference(
        _state(accumulated), _state(reference))
    results["accumulate_vs_not_accumulating"] = max_difference(
        accumulated.get_weights(), train(one, embedding_model, tokens, optimizer="adam", lr=0.1,
                                         weights=initial).get_weights())
    np.savez(os.path.join(out, f"accumulate_{task}.npz"), *_state(accumulated))
    # Clipping on 2 workers clips the summed gradients, as one device does (optimizer_update's
    # clip fix); dense gradients (an Embedding's repeated ids clip differently on one device).
    initial = _initial_weights(mlp)
    clipped = train(strategy, mlp, dense, optimizer="sgd_clipnorm", lr=0.1, weights=initial)
    results["clip_vs_one_device"] = max_difference(
        clipped, train(one, mlp, dense, optimizer="sgd_clipnorm", lr=0.1, weights=initial))
    results["clip_vs_unclipped"] = max_difference(
        clipped, train(one, mlp, dense, optimizer="sgd", lr=0.1, weights=initial))
    from tfdist.compat import _patch, optimizer_update

    _patch.uninstall([optimizer_update.CLIP_FIX.name])  # negative control: Keras's clipping
    results["clip_unfixed_vs_one_device"] = max_difference(
        train(strategy, mlp, dense, optimizer="sgd_clipnorm", lr=0.1, weights=initial),
        train(one, mlp, dense, optimizer="sgd_clipnorm", lr=0.1, weights=initial))
    optimizer_update.install()
    # Negative control: per-worker statistics (sync off) without the fix: each worker
    # keeps its own moving statistics.
    batch_norm.configure(strategy, sync_batch_norm=False)
    _patch.uninstall([batch_norm.REPLICA_STATE_FIX.name])
    _save_weights(train(strategy, bn_mlp, dense), os.path.join(out, f"bn_unfixed_{task}.npz"))
    batch_norm.install()
    with open(os.path.join(out, f"results_{task}.json"), "w") as f:
        json.dump(results, f)
    return results


# --- parameter_server (an in-process cluster: needs a process of its own) -----------------


def parameter_server() -> dict:
    """BN under parameter_server with 1 worker vs one device on the same batches.

    Each PS worker step runs the whole global batch on one replica, so batch
    statistics are global-batch statistics already, and the moving statistics
    are single variables on a parameter server (no replica copies to drift).
    With several workers, their asynchronous updates interleave like every
    other PS variable's (last writer wins on each assignment).
    """
    import tfdist

    results: dict = {}
    try:
        tfdist.make_options("parameter_server", sync_batch_norm=True)
    except ValueError as e:
        results["sync_option_error"] = str(e)
    strategy = tfdist.make_strategy("parameter_server", local_workers=1, local_ps=1)
    import keras
    import tensorflow as tf

    x, y = dense_data()

    def fit(strategy):
        with strategy.scope():
            keras.utils.set_random_seed(1)
            model = bn_mlp()
            model.set_weights(initial)
            model.compile(keras.optimizers.SGD(0.05), "mse")
        data = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH).repeat()
        model.fit(data, epochs=1, steps_per_epoch=STEPS, verbose=0)
        return model

    initial = _initial_weights(bn_mlp)
    model = fit(strategy)
    reference = fit(tf.distribute.get_strategy())
    bn = model.layers[1]
    results["moving_mean_type"] = type(bn.moving_mean.value).__name__
    results["moving_mean_device"] = bn.moving_mean.value.device
    results["ps_vs_one_device"] = max_difference(model, reference)
    results["moving_mean_moved"] = float(abs(reference.layers[1].moving_mean.numpy()).max())
    return results


def _save_weights(model, path):
    import numpy as np

    np.savez(path, *model.get_weights())


def _compiled(model):
    import keras

    model.compile(keras.optimizers.SGD(0.0), "mse")
    return model


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["mirrored", "worker", "parameter_server"])
    parser.add_argument("--out", help="worker mode: where each task writes its files")
    args = parser.parse_args()
    if args.mode == "worker":
        results = worker(args.out)
    else:
        results = {"mirrored": mirrored, "parameter_server": parameter_server}[args.mode]()
    print("RESULTS " + json.dumps(results))


if __name__ == "__main__":
    main()

"""Gradient compression under `mirrored` x2 against a NumPy computation of the same steps.

Run in a fresh process by tests/comm/test_compression.py (2 logical CPUs). For each
method, a model with Dense kernels and biases, a Conv2D kernel and an
Embedding (sparse gradients, duplicate ids) takes two SGD steps (lr 1,
so each update is minus the reduced gradient) under tfdist's mirrored x2;
the reference takes each replica's gradient from a single-device copy of the
model and reduces it in NumPy as the method says (fp16/bf16: round, sum,
round; PowerSGD: A = g + e, P = orth(sum A Q), Q = sum A^T P, g~ = P Q^T,
e = A - g~/2). Prints one JSON line of results; raises on a mismatch.
"""

import json
import sys

import numpy as np

import tfdist
from tfdist._tf import import_tensorflow

tfdist.configure_logical_devices(2)
tf = import_tensorflow()
import keras  # noqa: E402

BATCH = 16


def build():
    ids = keras.Input((4,), dtype="int32", name="ids")
    image = keras.Input((6, 6, 2), name="image")
    e = keras.layers.Flatten()(keras.layers.Embedding(20, 8, name="embed")(ids))
    c = keras.layers.Flatten()(keras.layers.Conv2D(6, 3, name="conv")(image))
    x = keras.layers.Concatenate()([e, c])
    x = keras.layers.Dense(24, activation="tanh", name="hidden")(x)
    out = keras.layers.Dense(5, name="logits")(x)
    return keras.Model([ids, image], out)


def data(step):
    rng = np.random.default_rng(step)
    ids = rng.integers(0, 6, size=(BATCH, 4)).astype("int32")  # many duplicate ids
    image = rng.standard_normal((BATCH, 6, 6, 2)).astype("float32")
    y = rng.integers(0, 5, size=BATCH).astype("int32")
    return (ids, image), y


LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


_REFERENCE = []  # one single-device model, built once


def replica_gradients(weights, x, y):
    """Each replica's gradient as Keras computes it: loss over its half / 2 replicas."""
    if not _REFERENCE:
        _REFERENCE.append(build())
    model = _REFERENCE[0]
    for variable, value in zip(model.trainable_variables, weights):
        variable.assign(value)
    grads = []
    for r in range(2):
        part = slice(r * BATCH // 2, (r + 1) * BATCH // 2)
        with tf.GradientTape() as tape:
            loss = LOSS(y[part], model([x[0][part], x[1][part]])) / 2.0
        g = tape.gradient(loss, model.trainable_variables)
        grads.append([tf.convert_to_tensor(v).numpy() for v in g])
    return grads


def to(dtype, values):
    return tf.cast(tf.cast(values, dtype), tf.float32).numpy()


def main(method):
    options = {"gradient_compression": method}
    if method == "powersgd":
        options.update(powersgd_rank=2, powersgd_warmup_steps=1)
    strategy = tfdist.make_strategy("mirrored", num_devices=2, bucket_bytes=600, **options)
    with strategy.scope():
        keras.utils.set_random_seed(1)
        model = build()
        model.compile(keras.optimizers.SGD(1.0), LOSS)
    model.optimizer.build(model.trainable_variables)
    names = [v.path for v in model.trainable_variables]
    weights = [v.numpy() for v in model.trainable_variables]
    state = {}  # powersgd: variable index -> [error (sum over replicas), q]
    for index, v in enumerate(model.trainable_variables):
        found = [s for s in model.optimizer.variables
                 if s.name.startswith(v.path.replace("/", "_") + "_powersgd")]
        if found:
            error, q = sorted(found, key=lambda s: s.name)
            state[index] = [np.zeros(error.shape, "float32"), q.numpy()]
    if method == "powersgd":
        # Every matrix that shrinks at least 2x at rank 2 has state (the embedding's
        # stays unused: its gradients are sparse and sent whole).
        compressed = sorted(names[i] for i in state)
        assert compressed == ["conv/kernel", "embed/embeddings", "hidden/kernel",
                              "logits/kernel"], compressed
    for step in range(2):
        x, y = data(step)
        grads = replica_gradients(weights, x, y)
        errors = {}
        for i, (g0, g1) in enumerate(zip(*grads)):
            if method in ("fp16", "bf16") and "embed" not in names[i]:
                half = tf.float16 if method == "fp16" else tf.bfloat16
                g = to(half, to(half, g0) + to(half, g1))
            elif method == "powersgd" and step >= 1 and i in state and "embed" not in names[i]:
                error, q = state[i]
                shape = (int(np.prod(g0.shape[:-1])), g0.shape[-1])
                a = [g0.reshape(shape) + error / 2, g1.reshape(shape) + error / 2]
                p, _ = np.linalg.qr(a[0] @ q + a[1] @ q)
                q = a[0].T @ p + a[1].T @ p
                approx = p @ q.T
                errors[i] = (a[0] + a[1] - approx, q)
                g = approx.reshape(g0.shape)
            else:
                g = g0 + g1
            weights[i] = weights[i] - g
        for i, (error, _) in errors.items():
            state[i] = [error, state[i][1]]
        ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)
        model.fit(ds, epochs=1, verbose=0, shuffle=False)
        for i, v in enumerate(model.trainable_variables):
            got = v.numpy()
            tol = 2e-5 if method != "powersgd" else 1e-4
            if not np.allclose(got, weights[i], rtol=tol, atol=tol):
                raise AssertionError(f"{method} step {step}: {names[i]} differs from the NumPy "
                                     f"reference by {np.abs(got - weights[i]).max():.3g}")
            parts = [c.numpy() for c in strategy.experimental_local_results(v)]
            if not all(np.array_equal(parts[0], p) for p in parts[1:]):
                raise AssertionError(f"{method}: replicas differ on {names[i]}")
            weights[i] = got
        for i in state:  # the backed-up error is the sum over replicas; Q as the reference
            saved = [s for s in model.optimizer.variables
                     if s.name == names[i].replace("/", "_") + "_powersgd_error"][0]
            if step >= 1 and not np.allclose(saved.numpy(), state[i][0], atol=1e-4):
                raise AssertionError(f"error feedback of {names[i]} differs from the reference")
            q_var = [s for s in model.optimizer.variables
                     if s.name == names[i].replace("/", "_") + "_powersgd_q"][0]
            state[i][1] = q_var.numpy()
    return {"method": method, "ok": True}


def too_large_rank():
    strategy = tfdist.make_strategy("mirrored", num_devices=2, gradient_compression="powersgd",
                                    powersgd_rank=25)
    with strategy.scope():
        model = build()
        model.compile(keras.optimizers.SGD(1.0), LOSS)
    try:
        model.fit(tf.data.Dataset.from_tensor_slices(data(0)).batch(BATCH), verbose=0)
    except ValueError as e:
        return str(e)
    raise AssertionError("powersgd_rank=25, above every matrix's smaller dimension, trained")


def resume_with_backup():
    """PowerSGD state is saved by tfdist.BackupAndRestore: a resumed run is the same run.

    Returns the max weight difference of (1 epoch, then a fresh model resuming
    for 1 more) against 2 uninterrupted epochs, and the same with the restored
    error feedback zeroed (negative control: must differ).
    """
    import tempfile

    x, y = data(0)
    strategy = tfdist.make_strategy("mirrored", num_devices=2, gradient_compression="powersgd",
                                    powersgd_rank=2, powersgd_warmup_steps=0)

    def fit(backup_dir, epochs, zero_error=False, interrupted=False):
        with strategy.scope():
            keras.utils.set_random_seed(3)
            model = build()
            model.compile(keras.optimizers.Adam(1e-2), LOSS)
        # interrupted: the backup stays, as when the process is killed after epoch 1.
        backup = tfdist.BackupAndRestore(backup_dir, delete_on_finish=not interrupted)
        ds = backup.dataset(tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(BATCH))
        callbacks = [backup]
        if zero_error:
            class ZeroError(keras.callbacks.Callback):
                def on_train_begin(self, logs=None):
                    for v in model.optimizer.variables:
                        if v.name.endswith("_powersgd_error"):
                            v.assign(np.zeros(v.shape, "float32"))
            callbacks.append(ZeroError())
        model.fit(ds, epochs=epochs, steps_per_epoch=4, verbose=0, callbacks=callbacks)
        return [w.numpy() for w in model.weights]

    with tempfile.TemporaryDirectory() as a, tempfile.TemporaryDirectory() as b, \
            tempfile.TemporaryDirectory() as c:
        straight = fit(a, 2)
        fit(b, 1, interrupted=True)
        resumed = fit(b, 2)
        fit(c, 1, interrupted=True)
        zeroed = fit(c, 2, zero_error=True)
    diff = max(float(np.abs(p - q).max()) for p, q in zip(straight, resumed))
    control = max(float(np.abs(p - q).max()) for p, q in zip(straight, zeroed))
    return {"resume_diff": diff, "zeroed_error_diff": control}


def one_replica():
    """One replica (mirrored over 1 device; a 1-worker multi_worker_mirrored is the same):
    the exchange is the identity, also inside PowerSGD's warm-up tf.cond."""
    strategy = tfdist.make_strategy("mirrored", num_devices=1, gradient_compression="powersgd",
                                    powersgd_rank=2, powersgd_warmup_steps=1, bucket_bytes=600)
    with strategy.scope():
        keras.utils.set_random_seed(4)
        model = build()
        model.compile(keras.optimizers.Adam(1e-2), LOSS)
    history = model.fit(tf.data.Dataset.from_tensor_slices(data(1)).repeat().batch(BATCH),
                        epochs=2, steps_per_epoch=4, verbose=0)
    return history.history["loss"]


def custom_loop():
    """A custom training loop (the TF distributed-training tutorial's pattern) with PowerSGD.

    The optimizer is built under the scope first: Keras 3 cannot build it lazily inside
    `strategy.run` under MirroredStrategy (fails with or without tfdist).
    """
    strategy = tfdist.make_strategy("mirrored", num_devices=2, gradient_compression="powersgd",
                                    powersgd_rank=2, powersgd_warmup_steps=1)
    (ids, image), y = data(5)
    ds = strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices(((ids, image), y)).repeat(8).batch(BATCH))
    with strategy.scope():
        keras.utils.set_random_seed(2)
        model = build()
        optimizer = keras.optimizers.Adam(1e-2)
        optimizer.build(model.trainable_variables)
        per_example = keras.losses.SparseCategoricalCrossentropy(from_logits=True,
                                                                 reduction="none")

    def step(inputs):
        x, labels = inputs
        with tf.GradientTape() as tape:
            loss = tf.nn.compute_average_loss(per_example(labels, model(x, training=True)),
                                              global_batch_size=BATCH)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    @tf.function
    def train(inputs):
        return strategy.reduce("SUM", strategy.run(step, args=(inputs,)), axis=None)

    losses = [float(train(batch)) for batch in ds]
    for w in model.weights:
        parts = [p.numpy() for p in strategy.experimental_local_results(w)]
        if not all(np.array_equal(parts[0], p) for p in parts[1:]):
            raise AssertionError(f"custom loop: replicas differ on {w.path}")
    return {"first": losses[0], "last": losses[-1]}


if __name__ == "__main__":
    results = [main(m) for m in sys.argv[1:]]
    print(json.dumps({"results": results, "rank_error": too_large_rank(),
                      "custom_loop": custom_loop(), "one_replica": one_replica(),
                      **resume_with_backup()}))

"""One process of test_untouched.py: maybe make a tfdist preset, then train plain Keras.

    python tests/compat/run_untouched.py --preset NAME[,NAME...] --out FILE.npz
    python tests/compat/run_untouched.py --preset none --out FILE.npz   # never imports tfdist

After making the presets, in the order given (or nothing), the process trains, with no tfdist
involved, the way users' own code does:
- a plain model (Embedding with repeated ids, i.e. sparse gradients with
  duplicate indices; BatchNormalization; Dense; Adam; a metric) with `fit`,
  `evaluate` and `predict`;
- the same model with a custom GradientTape loop;
- the same model with Keras's `BackupAndRestore`, interrupted and resumed;
- the same model saved and loaded every public way (`model.save` to .keras
  and .h5 and `keras.models.load_model`, which compiles what it loads;
  `save_weights`/`load_weights`; `model.export` and `tf.saved_model.load`;
  ModelCheckpoint, CSVLogger and BackupAndRestore inside `fit`), the loaded
  models evaluated and predicting, and `compile(steps_per_execution=2)`;
- the patterns tfdist's fixes reach under its own strategies, with no strategy:
  `jit_compile=True` (fit, predict, the value Keras reports, save and
  `load_model`), a model with `train_step` and no `call` (its Adam built in the
  traced step), `add_loss` of a Loss object, a string input;
- the same model under the mixed_float16 policy (a LossScaleOptimizer);
- the same model under the user's own `tf.distribute.MirroredStrategy` on
  two logical CPUs, made after tfdist's strategy, and there the `add_loss`
  model and the mixed_float16 one too, and an optimizer made outside its scope
  (Keras's "Mixing different tf.distribute.Strategy objects" stays);
- the `fit` model and the user's MirroredStrategy model exported with
  `model.export` and `tf.saved_model.save`, and served.
Every weight, optimizer variable, loss and metric value goes to FILE.npz;
the test compares them bit for bit with a process that never imported tfdist.
Initial weights come from a seeded numpy generator, so no random state that
making a strategy might consume can change them.
"""

from __future__ import annotations

import argparse
import os
import sys

VOCAB, FEATURES, N, BATCH = 12, 6, 96, 16


def _data():
    import numpy as np

    rng = np.random.default_rng(0)
    ids = rng.integers(0, 4, size=(N, 5)).astype("int32")  # few ids: many duplicates
    x = rng.standard_normal((N, FEATURES)).astype("float32")
    y = (x.sum(1, keepdims=True) + ids.mean(1, keepdims=True)).astype("float32")
    return ids, x, y


def _model():
    import keras
    import numpy as np

    ids = keras.Input((5,), dtype="int32")
    feats = keras.Input((FEATURES,))
    embedded = keras.layers.Flatten()(keras.layers.Embedding(VOCAB, 3)(ids))
    h = keras.layers.Concatenate()([embedded, feats])
    h = keras.layers.Dense(8, activation="relu")(h)
    h = keras.layers.BatchNormalization()(h)
    model = keras.Model([ids, feats], keras.layers.Dense(1)(h))
    rng = np.random.default_rng(42)
    model.set_weights([(0.3 * rng.standard_normal(w.shape)).astype(w.dtype) if w.ndim > 1
                       else w for w in model.get_weights()])
    return model


def _state(prefix, model, optimizer, out):
    for i, w in enumerate(model.get_weights()):
        out[f"{prefix}/weight{i}"] = w
    for i, v in enumerate(optimizer.variables):
        out[f"{prefix}/optimizer{i}"] = v.numpy()


def _serve(prefix, model, inputs, out):
    """What a SavedModel of the model serves: `model.export` and `tf.saved_model.save`."""
    import tempfile

    import tensorflow as tf

    directory = tempfile.mkdtemp()
    model.export(os.path.join(directory, "export"), verbose=False)
    exported = tf.saved_model.load(os.path.join(directory, "export"))
    out[f"{prefix}/export"] = exported.serve(inputs).numpy()
    tf.saved_model.save(model, os.path.join(directory, "saved_model"))
    saved = tf.saved_model.load(os.path.join(directory, "saved_model"))
    serve = saved.signatures["serving_default"]  # takes its inputs by name
    by_dtype = {tensor.dtype.name: tensor for tensor in map(tf.constant, inputs)}
    [served] = serve(**{name: by_dtype[spec.dtype.name] for name, spec in
                        serve.structured_input_signature[1].items()}).values()
    out[f"{prefix}/saved_model"] = served.numpy()
def _loaded(prefix, model, ids, x, y, out):
    """What a loaded model is: compiled or not, its evaluate (or the error), its predict."""
    import numpy as np

    out[f"{prefix}/compiled"] = np.asarray(bool(model.compiled))
    try:
        out[f"{prefix}/evaluate"] = np.asarray(
            model.evaluate([ids, x], y, batch_size=BATCH, verbose=0))
    except Exception as e:  # an uncompiled model: "No loss to compute"
        out[f"{prefix}/evaluate"] = np.asarray(f"{type(e).__name__}: {e}"[:200])
    out[f"{prefix}/predict"] = model.predict([ids, x], batch_size=BATCH, verbose=0)
    for i, w in enumerate(model.get_weights()):
        out[f"{prefix}/weight{i}"] = w


def files(out: dict, workdir: str) -> None:
    """Saving and loading, every public Keras way, with no strategy."""
    import keras
    import numpy as np
    import tensorflow as tf

    ids, x, y = _data()
    model = _model()
    # Loss and metric objects: Keras 3.15 cannot deserialize the string "mse" from .h5.
    model.compile(keras.optimizers.Adam(0.05), keras.losses.MeanSquaredError(),
                  metrics=[keras.metrics.MeanAbsoluteError()], steps_per_execution=2)
    callbacks = [
        keras.callbacks.ModelCheckpoint(os.path.join(workdir, "ckpt-{epoch}-{loss:.4f}.keras"),
                                        save_freq=3),
        keras.callbacks.CSVLogger(os.path.join(workdir, "log.csv")),
        keras.callbacks.BackupAndRestore(os.path.join(workdir, "backup")),
    ]
    history = model.fit([ids, x], y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0,
                        callbacks=callbacks)
    for key, values in history.history.items():
        out[f"files/history/{key}"] = np.asarray(values)
    checkpoints = sorted(f for f in os.listdir(workdir) if f.startswith("ckpt-"))
    out["files/checkpoints"] = np.asarray(checkpoints)
    with open(os.path.join(workdir, "log.csv")) as f:
        out["files/csv"] = np.asarray(f.read())

    path = os.path.join(workdir, "model.keras")
    model.save(path)
    _loaded("files/keras", keras.models.load_model(path), ids, x, y, out)
    _loaded("files/checkpoint", keras.models.load_model(os.path.join(workdir, checkpoints[-1])),
            ids, x, y, out)
    h5 = os.path.join(workdir, "model.h5")
    model.save(h5)
    _loaded("files/h5", keras.models.load_model(h5), ids, x, y, out)
    weights = os.path.join(workdir, "model.weights.h5")
    model.save_weights(weights)
    fresh = _model()
    fresh.load_weights(weights)
    out["files/load_weights/predict"] = fresh.predict([ids, x], batch_size=BATCH, verbose=0)
    exported = os.path.join(workdir, "exported")
    model.export(exported, verbose=False)
    reloaded = tf.saved_model.load(exported)  # kept: its function refers to its variables
    out["files/export/serve"] = np.asarray(reloaded.serve([tf.constant(ids), tf.constant(x)]))


def train(out: dict, *, user_mirrored: bool = True) -> None:
    """Plain Keras and TensorFlow, as a user writes them."""
    import keras
    import numpy as np
    import tensorflow as tf

    ids, x, y = _data()

    # 1. compile/fit/evaluate/predict, no strategy.
    model = _model()
    optimizer = keras.optimizers.Adam(0.05)
    model.compile(optimizer, "mse", metrics=["mae"])
    history = model.fit([ids, x], y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    for key, values in history.history.items():
        out[f"fit/history/{key}"] = np.asarray(values)
    out["fit/evaluate"] = np.asarray(model.evaluate([ids, x], y, batch_size=BATCH, verbose=0))
    out["fit/predict"] = model.predict([ids, x], batch_size=BATCH, verbose=0)
    _state("fit", model, optimizer, out)
    _serve("fit", model, [ids[:BATCH], x[:BATCH]], out)

    # 2. a custom training loop with GradientTape and a metric.
    model = _model()
    optimizer = keras.optimizers.Adam(0.05)
    loss_fn = keras.losses.MeanSquaredError()
    metric = keras.metrics.Mean()

    @tf.function
    def step(batch_ids, batch_x, batch_y):
        with tf.GradientTape() as tape:
            loss = loss_fn(batch_y, model([batch_ids, batch_x], training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        metric.update_state(loss)
        return loss

    losses = [step(ids[i:i + BATCH], x[i:i + BATCH], y[i:i + BATCH]).numpy()
              for i in range(0, N, BATCH)]
    out["loop/losses"] = np.asarray(losses)
    out["loop/metric"] = np.asarray(metric.result())
    _state("loop", model, optimizer, out)

    # 3. Keras's own BackupAndRestore, saving mid-epoch, interrupted and resumed (stock Keras
    # restarts the interrupted epoch; tfdist's fixes for it apply to tfdist's strategies only).
    import tempfile

    folder = tempfile.mkdtemp(prefix="untouched-backup-")

    class Interrupt(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if int(self.model.optimizer.iterations.numpy()) == 5:
                raise RuntimeError("interrupted")

    model = _model()
    model.compile(keras.optimizers.SGD(0.05, momentum=0.5), "mse")
    try:
        model.fit([ids, x], y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0,
                  callbacks=[keras.callbacks.BackupAndRestore(folder, save_freq=2),
                             Interrupt()])
    except RuntimeError:
        pass
    with open(os.path.join(folder, "training_metadata.json")) as f:
        out["backup/metadata"] = np.asarray(f.read())
    model = _model()
    optimizer = keras.optimizers.SGD(0.05, momentum=0.5)
    model.compile(optimizer, "mse")
    model.fit([ids, x], y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0,
              callbacks=[keras.callbacks.BackupAndRestore(folder, save_freq=2)])
    _state("backup", model, optimizer, out)

    mixed_float16(out, "mixed")
    patterns(out)
    if not user_mirrored:
        return
    # 4. the user's own MirroredStrategy, made after tfdist's.
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    out["user_mirrored/key_base"] = np.asarray(strategy.extended._collective_key_base)
    out["user_mirrored/class_key_base"] = np.asarray(
        tf.distribute.MirroredStrategy._collective_key_base)
    with strategy.scope():
        model = _model()
        optimizer = keras.optimizers.Adam(0.05)
        model.compile(optimizer, "mse", metrics=["mae"])
    history = model.fit([ids, x], y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    for key, values in history.history.items():
        out[f"user_mirrored/history/{key}"] = np.asarray(values)
    _state("user_mirrored", model, optimizer, out)
    _serve("user_mirrored", model, [ids[:BATCH], x[:BATCH]], out)
    with strategy.scope():
        model = _add_loss_model()
    history = model.fit(_add_loss_data(), batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    out["user_mirrored/add_loss/history"] = np.asarray(history.history["loss"])
    _state("user_mirrored/add_loss", model, model.optimizer, out)
    mixed_float16(out, "user_mirrored/mixed", strategy)
    # An optimizer made before the user's own strategy's scope (keras-team/keras#17187): Keras's
    # error stays; keras_build.adopt_optimizer moves such optimizers only onto tfdist's strategies.
    optimizer = keras.optimizers.Adam(0.05)
    with strategy.scope():
        model = _model()
        model.compile(optimizer, "mse")
    try:
        model.fit([ids, x], y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
        out["user_mirrored/optimizer_outside_scope"] = np.asarray("trained")
    except RuntimeError as e:  # the message names objects by address: keep what it says
        out["user_mirrored/optimizer_outside_scope"] = np.asarray(
            "Mixing different tf.distribute.Strategy objects" in str(e))


def mixed_float16(out: dict, prefix: str, strategy=None) -> None:
    """The model under the mixed_float16 policy (Keras wraps the optimizer in a
    LossScaleOptimizer; tfdist patches its apply and finite check), with `fit` and
    `evaluate`, under `strategy` if given."""
    import contextlib

    import keras
    import numpy as np

    ids, x, y = _data()
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        with strategy.scope() if strategy is not None else contextlib.nullcontext():
            model = _model()
            model.compile(keras.optimizers.SGD(0.05, momentum=0.5), "mse")
        history = model.fit([ids, x], y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
        out[f"{prefix}/history"] = np.asarray(history.history["loss"])
        out[f"{prefix}/evaluate"] = np.asarray(
            model.evaluate([ids, x], y, batch_size=BATCH, verbose=0))
        out[f"{prefix}/scale"] = np.asarray(model.optimizer.dynamic_scale.numpy())
        _state(prefix, model, model.optimizer, out)
    finally:
        keras.mixed_precision.set_global_policy("float32")


def _add_loss_model():
    import keras
    import numpy as np

    class LogisticEndpoint(keras.layers.Layer):
        def __init__(self, name=None):
            super().__init__(name=name)
            self.loss_fn = keras.losses.BinaryCrossentropy(from_logits=True)

        def call(self, targets, logits):
            self.add_loss(self.loss_fn(targets, logits))
            return keras.ops.softmax(logits)

    inputs, targets = keras.Input((3,), name="inputs"), keras.Input((10,), name="targets")
    logits = keras.layers.Dense(10)(inputs)
    model = keras.Model([inputs, targets], LogisticEndpoint()(targets, logits))
    rng = np.random.default_rng(3)
    model.set_weights([rng.standard_normal(w.shape).astype(w.dtype) for w in model.get_weights()])
    model.compile(keras.optimizers.SGD(0.5))
    return model


def _add_loss_data():
    import numpy as np

    rng = np.random.default_rng(4)
    return {"inputs": rng.random((N, 3)).astype("float32"),
            "targets": rng.random((N, 10)).astype("float32")}


def patterns(out: dict) -> None:
    """What tfdist's fixes for users' programs reach, run here with no strategy."""
    import keras
    import numpy as np
    import tensorflow as tf

    ids, x, y = _data()
    rng = np.random.default_rng(5)

    # XLA asked for by the user: compiled, reported, saved and loaded as Keras does.
    model = _model()
    model.compile(keras.optimizers.SGD(0.05), "mse", jit_compile=True)
    out["xla/jit_compile"] = np.asarray(model.jit_compile)
    history = model.fit([ids, x], y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    out["xla/history"] = np.asarray(history.history["loss"])
    out["xla/predict"] = model.predict([ids, x], batch_size=BATCH, verbose=0)
    path = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"untouched-{os.getpid()}.keras")
    model.save(path)
    loaded = keras.saving.load_model(path)
    os.remove(path)
    out["xla/loaded_jit_compile"] = np.asarray(loaded.jit_compile)
    out["xla/loaded_predict"] = loaded.predict([ids, x], batch_size=BATCH, verbose=0)

    # A model with train_step and no call: built, with its Adam, while the step is traced.
    class Autoencoder(keras.Model):
        def __init__(self):
            super().__init__()
            self.encoder = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(2)])
            self.decoder = keras.Sequential([keras.Input((2,)), keras.layers.Dense(FEATURES)])
            self.tracker = keras.metrics.Mean(name="loss")

        @property
        def metrics(self):
            return [self.tracker]

        def train_step(self, data):
            with tf.GradientTape() as tape:
                loss = keras.ops.mean(keras.ops.square(self.decoder(self.encoder(data)) - data))
            grads = tape.gradient(loss, self.trainable_weights)
            self.optimizer.apply_gradients(zip(grads, self.trainable_weights))
            self.tracker.update_state(loss)
            return {"loss": self.tracker.result()}

    model = Autoencoder()
    model.set_weights([rng.standard_normal(w.shape).astype(w.dtype) for w in model.get_weights()])
    model.compile(keras.optimizers.Adam(0.05))
    history = model.fit(x, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    out["train_step/history"] = np.asarray(history.history["loss"])
    _state("train_step", model, model.optimizer, out)

    # add_loss of a Loss object.
    model = _add_loss_model()
    history = model.fit(_add_loss_data(), batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    out["add_loss/history"] = np.asarray(history.history["loss"])
    _state("add_loss", model, model.optimizer, out)

    # A string input.
    texts = np.array([" ".join(rng.choice(["a", "b", "c", "d"], size=3)) for _ in range(N)])
    vectorize = keras.layers.TextVectorization(max_tokens=6, output_sequence_length=3)
    vectorize.adapt(texts)
    inputs = keras.Input((1,), dtype="string")
    pooled = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(6, 2)(vectorize(inputs)))
    model = keras.Model(inputs, keras.layers.Dense(1)(pooled))
    model.set_weights([rng.standard_normal(w.shape).astype(w.dtype) for w in model.get_weights()])
    model.compile(keras.optimizers.SGD(0.1), "mse")
    data = tf.data.Dataset.from_tensor_slices((texts[:, None], y)).batch(BATCH)
    history = model.fit(data, epochs=1, verbose=0)
    out["string/history"] = np.asarray(history.history["loss"])
    out["string/evaluate"] = np.asarray(model.evaluate(data, verbose=0))
    _state("string", model, model.optimizer, out)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--no_user_mirrored", action="store_true",
                        help="skip the user's own MirroredStrategy (see the test for why)")
    parser.add_argument("--shadow_compile", action="store_true",
                        help="negative control: a pass-through compile on TensorFlowTrainer "
                             "(where tfdist's parameter-server fix used to sit), which makes "
                             "load_model return uncompiled models")
    parser.add_argument("--opt_in", action="store_true",
                        help="negative control: opt the plain optimizers in to tfdist's "
                             "sparse-gradient fix, which must change the result")
    args = parser.parse_args()
    os.environ.pop("TF_CONFIG", None)
    if args.preset == "none":
        import tensorflow as tf

        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    else:
        import tfdist

        tfdist.configure_logical_devices(2)
        for preset in args.preset.split(","):
            options = {"parameter_server": {"local_workers": 1, "local_ps": 2, "shard_count": 2},
                       "mirrored": {"num_devices": 2}}.get(preset, {})
            strategy = tfdist.make_strategy(preset, **options)
            print("made", preset, type(strategy).__name__, "fixes:",
                  ",".join(tfdist.compat.installed()), flush=True)
        if args.opt_in:
            import keras

            from tfdist.compat import optimizer_update

            original_adam = keras.optimizers.Adam
            keras.optimizers.Adam = lambda *a, **k: optimizer_update.opt_in(
                original_adam(*a, **k))
    if args.shadow_compile:
        import functools

        from keras.src.backend.tensorflow.trainer import TensorFlowTrainer
        from keras.src.trainers.trainer import Trainer

        TensorFlowTrainer.compile = functools.wraps(Trainer.compile)(
            lambda self, *a, **k: Trainer.compile(self, *a, **k))
    out: dict = {}
    train(out, user_mirrored=not args.no_user_mirrored)
    import tempfile

    with tempfile.TemporaryDirectory() as workdir:
        files(out, workdir)
    import numpy as np

    out["tfdist_imported"] = np.asarray("tfdist" in sys.modules)
    np.savez(args.out, **out)
    print("saved", len(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Users' program patterns under the synchronous presets, each against one device, in one process.

    python tests/compat/run_sync_programs.py mirrored    # 2 logical CPUs; prints RESULTS {json}

Run by tests/compat/test_sync_programs.py (which asserts on the numbers) and
reusable by hand. Each pattern is a shrunk, offline version of what keras.io
and KerasHub programs write; each is trained under `mirrored` (2 replicas) and
its ZeRO-1/ZeRO-2 variants, and under ONE device with the same initial weights,
seed and global batch (the independent reference). Negative controls run the
same pattern under a stock `tf.distribute.MirroredStrategy` (Keras as
released) and record its error or its difference from one device.

Keys of the printed object: `<pattern>.<preset>.<what>`:
  vs_one_device  largest |weight difference| against one device after training
  <log>_vs_one_device, evaluate_vs_one_device: largest |difference| / max(1, |one device's|)
  spread         largest difference between the replicas' copies of any variable
  error          `<ErrorType>: <first line>` where the run raised
plus pattern-specific values (evaluate's loss, logged losses).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

GLOBAL_BATCH = 8
STEPS = 3
N = GLOBAL_BATCH * STEPS


# --- patterns: each `build()` returns an uncompiled model, `data()` a tf.data.Dataset ----------


def _texts():
    import numpy as np

    words = np.array(["good", "bad", "film", "plot", "great", "awful", "actor", "dull"])
    rng = np.random.default_rng(0)
    texts = [" ".join(rng.choice(words, size=rng.integers(2, 6))) for _ in range(N)]
    labels = np.array([[float(("good" in t) or ("great" in t))] for t in texts], "float32")
    return np.array(texts), labels


class StringInput:
    """keras.io's end-to-end text classifier: TextVectorization inside the model, raw strings in."""

    name = "string"
    presets = ("mirrored", "zero1", "stock")
    worker_presets = ("mwms", "zero2")

    def build(self):
        import keras

        texts, _ = _texts()
        vectorize = keras.layers.TextVectorization(max_tokens=12, output_mode="int",
                                                   output_sequence_length=5)
        vectorize.adapt(texts)
        inputs = keras.Input((1,), dtype="string")
        x = keras.layers.Embedding(12, 4)(vectorize(inputs))
        x = keras.layers.GlobalAveragePooling1D()(x)
        return keras.Model(inputs, keras.layers.Dense(1, activation="sigmoid")(x))

    def compile(self, model):
        import keras

        model.compile(keras.optimizers.SGD(0.5), "binary_crossentropy", metrics=["accuracy"])

    def data(self):
        import tensorflow as tf

        texts, labels = _texts()
        return tf.data.Dataset.from_tensor_slices((texts[:, None], labels)).batch(GLOBAL_BATCH)


class BoolMask:
    """KerasHub's preprocessor output: a dict of int32 token ids and a bool padding mask."""

    name = "bool"
    presets = ("mirrored", "zero2", "stock")
    worker_presets = ("mwms",)

    def build(self):
        import keras
        from keras import ops

        ids = keras.Input((6,), dtype="int32", name="token_ids")
        mask = keras.Input((6,), dtype="bool", name="padding_mask")
        x = keras.layers.Embedding(10, 4)(ids)
        weights = ops.expand_dims(ops.cast(mask, "float32"), -1)
        pooled = ops.sum(x * weights, axis=1) / ops.maximum(ops.sum(weights, axis=1), 1.0)
        return keras.Model({"token_ids": ids, "padding_mask": mask},
                           keras.layers.Dense(1)(pooled))

    def compile(self, model):
        import keras

        model.compile(keras.optimizers.SGD(0.5), "mse")

    def data(self):
        import numpy as np
        import tensorflow as tf

        rng = np.random.default_rng(1)
        ids = rng.integers(1, 10, size=(N, 6)).astype("int32")
        lengths = rng.integers(2, 7, size=N)
        mask = np.arange(6)[None, :] < lengths[:, None]
        ids = np.where(mask, ids, 0).astype("int32")
        y = rng.standard_normal((N, 1)).astype("float32")
        return tf.data.Dataset.from_tensor_slices(
            ({"token_ids": ids, "padding_mask": mask}, y)).batch(GLOBAL_BATCH)


class VAE:
    """keras.io's VAE: a `keras.Model` holding an encoder and a decoder, `train_step`, no `call`.

    As keras.io writes it (hand-written means of `keras.losses.binary_crossentropy`, Adam),
    except that the sampling noise comes with the data instead of from a random op inside
    the step: a random draw per replica cannot equal one device's draw for the whole batch.
    """

    name = "vae"
    presets = ("mirrored", "zero2", "stock")
    worker_presets = ("mwms",)
    evaluates = False
    latent = 2

    def build(self):
        import keras
        from keras import layers, ops

        images = keras.Input((4, 4, 1))
        noise = keras.Input((self.latent,))
        h = layers.Dense(8, activation="relu")(layers.Flatten()(images))
        z_mean, z_log_var = layers.Dense(self.latent)(h), layers.Dense(self.latent)(h)
        z = z_mean + ops.exp(0.5 * z_log_var) * noise
        encoder = keras.Model([images, noise], [z_mean, z_log_var, z], name="encoder")
        latent = keras.Input((self.latent,))
        decoded = layers.Reshape((4, 4, 1))(layers.Dense(16, activation="sigmoid")(latent))
        decoder = keras.Model(latent, decoded, name="decoder")
        return _vae_class()(encoder, decoder)

    def compile(self, model):
        import keras

        model.compile(optimizer=keras.optimizers.Adam(0.01))

    def data(self):
        import numpy as np
        import tensorflow as tf

        rng = np.random.default_rng(2)
        images = rng.uniform(size=(N, 4, 4, 1)).astype("float32")
        noise = rng.standard_normal((N, self.latent)).astype("float32")
        return tf.data.Dataset.from_tensor_slices((images, noise)).batch(GLOBAL_BATCH)


def _vae_class():
    import keras
    import tensorflow as tf
    from keras import ops

    class VAEModel(keras.Model):
        def __init__(self, encoder, decoder, **kwargs):
            super().__init__(**kwargs)
            self.encoder = encoder
            self.decoder = decoder
            self.total_loss_tracker = keras.metrics.Mean(name="total_loss")
            self.reconstruction_loss_tracker = keras.metrics.Mean(name="reconstruction_loss")
            self.kl_loss_tracker = keras.metrics.Mean(name="kl_loss")

        @property
        def metrics(self):
            return [self.total_loss_tracker, self.reconstruction_loss_tracker,
                    self.kl_loss_tracker]

        def train_step(self, data):
            images, noise = data
            with tf.GradientTape() as tape:
                z_mean, z_log_var, z = self.encoder([images, noise])
                reconstruction = self.decoder(z)
                reconstruction_loss = ops.mean(ops.sum(
                    keras.losses.binary_crossentropy(images, reconstruction), axis=(1, 2)))
                kl_loss = -0.5 * (1 + z_log_var - ops.square(z_mean) - ops.exp(z_log_var))
                kl_loss = ops.mean(ops.sum(kl_loss, axis=1))
                total_loss = reconstruction_loss + kl_loss
            grads = tape.gradient(total_loss, self.trainable_weights)
            self.optimizer.apply_gradients(zip(grads, self.trainable_weights))
            self.total_loss_tracker.update_state(total_loss)
            self.reconstruction_loss_tracker.update_state(reconstruction_loss)
            self.kl_loss_tracker.update_state(kl_loss)
            return {"loss": self.total_loss_tracker.result(),
                    "reconstruction_loss": self.reconstruction_loss_tracker.result(),
                    "kl_loss": self.kl_loss_tracker.result()}

    return VAEModel


class GAN:
    """keras.io's GAN ("Customizing what happens in fit()"): own `compile`, two optimizers.

    As keras.io writes it (a `BinaryCrossentropy` loss object, Adam for each network),
    except that the latent vectors and the label noise come with the data.
    """

    name = "gan"
    presets = ("mirrored", "zero1", "stock")
    worker_presets = ("mwms", "zero1")
    evaluates = False
    latent = 3

    def build(self):
        import keras
        from keras import layers

        discriminator = keras.Sequential(
            [keras.Input((4, 4, 1)), layers.Conv2D(4, 3, strides=2, padding="same"),
             layers.LeakyReLU(negative_slope=0.2), layers.GlobalMaxPooling2D(),
             layers.Dense(1)], name="discriminator")
        generator = keras.Sequential(
            [keras.Input((self.latent,)), layers.Dense(2 * 2 * 4),
             layers.LeakyReLU(negative_slope=0.2), layers.Reshape((2, 2, 4)),
             layers.Conv2DTranspose(4, 4, strides=2, padding="same"),
             layers.LeakyReLU(negative_slope=0.2),
             layers.Conv2D(1, 3, padding="same", activation="sigmoid")], name="generator")
        return _gan_class()(discriminator=discriminator, generator=generator)

    def compile(self, model):
        import keras

        model.compile(d_optimizer=keras.optimizers.Adam(0.003),
                      g_optimizer=keras.optimizers.Adam(0.003),
                      loss_fn=keras.losses.BinaryCrossentropy(from_logits=True))

    def optimizers(self, model):
        return [model.d_optimizer, model.g_optimizer]

    def data(self):
        import numpy as np
        import tensorflow as tf

        rng = np.random.default_rng(3)
        return tf.data.Dataset.from_tensor_slices({
            "images": rng.uniform(size=(N, 4, 4, 1)).astype("float32"),
            "z1": rng.standard_normal((N, self.latent)).astype("float32"),
            "z2": rng.standard_normal((N, self.latent)).astype("float32"),
            "label_noise": rng.uniform(size=(N, 2, 1)).astype("float32"),
        }).batch(GLOBAL_BATCH)


def _gan_class():
    import keras
    import tensorflow as tf

    class GANModel(keras.Model):
        def __init__(self, discriminator, generator):
            super().__init__()
            self.discriminator = discriminator
            self.generator = generator
            self.d_loss_tracker = keras.metrics.Mean(name="d_loss")
            self.g_loss_tracker = keras.metrics.Mean(name="g_loss")

        @property
        def metrics(self):
            return [self.d_loss_tracker, self.g_loss_tracker]

        def compile(self, d_optimizer, g_optimizer, loss_fn):
            super().compile()
            self.d_optimizer = d_optimizer
            self.g_optimizer = g_optimizer
            self.loss_fn = loss_fn

        def train_step(self, data):
            real_images = data["images"]
            batch_size = tf.shape(real_images)[0]
            generated_images = self.generator(data["z1"])
            combined_images = tf.concat([generated_images, real_images], axis=0)
            labels = tf.concat([tf.ones((batch_size, 1)), tf.zeros((batch_size, 1))], axis=0)
            noise = tf.transpose(data["label_noise"], (1, 0, 2))
            labels += 0.05 * tf.reshape(noise, (-1, 1))
            with tf.GradientTape() as tape:
                predictions = self.discriminator(combined_images)
                d_loss = self.loss_fn(labels, predictions)
            grads = tape.gradient(d_loss, self.discriminator.trainable_weights)
            self.d_optimizer.apply(grads, self.discriminator.trainable_weights)
            misleading_labels = tf.zeros((batch_size, 1))
            with tf.GradientTape() as tape:
                predictions = self.discriminator(self.generator(data["z2"]))
                g_loss = self.loss_fn(misleading_labels, predictions)
            grads = tape.gradient(g_loss, self.generator.trainable_weights)
            self.g_optimizer.apply(grads, self.generator.trainable_weights)
            self.d_loss_tracker.update_state(d_loss)
            self.g_loss_tracker.update_state(g_loss)
            return {"d_loss": self.d_loss_tracker.result(),
                    "g_loss": self.g_loss_tracker.result()}

    return GANModel


class TruePositives:
    """keras.io's `CategoricalTruePositives`: a Metric whose `result()` returns its variable."""

    name = "metric"
    presets = ("mirrored",)  # a stock MirroredStrategy trains it too
    worker_presets = ("mwms",)

    def build(self):
        import keras

        return keras.Sequential([keras.Input((4,)), keras.layers.Dense(6, activation="tanh"),
                                 keras.layers.Dense(3, activation="softmax")])

    def compile(self, model):
        import keras

        model.compile(keras.optimizers.SGD(0.5), keras.losses.SparseCategoricalCrossentropy(),
                      metrics=[_true_positives_class()()])

    def data(self):
        import numpy as np
        import tensorflow as tf

        rng = np.random.default_rng(4)
        x = rng.standard_normal((N, 4)).astype("float32")
        # Labels of shape (n, 1): the metric compares them with (n, 1) predictions.
        y = np.argmax(x[:, :3], axis=1).astype("int32")[:, None]
        return tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH)


def _true_positives_class():
    import keras
    from keras import ops

    class CategoricalTruePositives(keras.metrics.Metric):
        def __init__(self, name="categorical_true_positives", **kwargs):
            super().__init__(name=name, **kwargs)
            self.true_positives = self.add_variable(shape=(), name="ctp",
                                                    initializer="zeros")

        def update_state(self, y_true, y_pred, sample_weight=None):
            y_pred = ops.reshape(ops.argmax(y_pred, axis=1), (-1, 1))
            values = ops.cast(y_true, "int32") == ops.cast(y_pred, "int32")
            values = ops.cast(values, "float32")
            if sample_weight is not None:
                values = ops.multiply(values, ops.cast(sample_weight, "float32"))
            self.true_positives.assign_add(ops.sum(values))

        def result(self):
            return self.true_positives

        def reset_state(self):
            self.true_positives.assign(0)

    return CategoricalTruePositives


class AddLoss:
    """keras.io's `LogisticEndpoint`: a layer that `add_loss`es a `BinaryCrossentropy` value.

    Compiled without a loss, as keras.io does; SGD rather than keras.io's Adam, so that a
    gradient of the wrong size shows in the weights too (Adam's steps barely depend on it).
    """

    name = "add_loss"
    presets = ("mirrored", "zero2", "stock")
    worker_presets = ("mwms",)

    def build(self):
        import keras

        inputs = keras.Input((3,), name="inputs")
        targets = keras.Input((10,), name="targets")
        logits = keras.layers.Dense(10)(inputs)
        predictions = _logistic_endpoint_class()(name="predictions")(targets, logits)
        return keras.Model(inputs=[inputs, targets], outputs=predictions)

    def compile(self, model):
        import keras

        model.compile(optimizer=keras.optimizers.SGD(0.5))

    def data(self):
        import numpy as np
        import tensorflow as tf

        rng = np.random.default_rng(5)
        return tf.data.Dataset.from_tensor_slices({
            "inputs": rng.random((N, 3)).astype("float32"),
            "targets": rng.random((N, 10)).astype("float32")}).batch(GLOBAL_BATCH)


def _logistic_endpoint_class():
    import keras
    from keras import ops

    class LogisticEndpoint(keras.layers.Layer):
        def __init__(self, name=None):
            super().__init__(name=name)
            self.loss_fn = keras.losses.BinaryCrossentropy(from_logits=True)

        def call(self, targets, logits, sample_weights=None):
            self.add_loss(self.loss_fn(targets, logits, sample_weights))
            return ops.softmax(logits)

    return LogisticEndpoint


class Jit:
    """A model compiled with `jit_compile` left to Keras ("auto") or set to True by the user."""

    def __init__(self, jit_compile):
        self.jit_compile = jit_compile
        self.name = "xla_auto" if jit_compile == "auto" else "xla_true"
        # "auto" resolves to no XLA under any strategy: a stock strategy trains it too.
        self.presets = ("mirrored",) if jit_compile == "auto" else ("mirrored", "stock")
        self.worker_presets = () if jit_compile == "auto" else ("mwms",)

    def build(self):
        import keras

        return keras.Sequential([keras.Input((5,)), keras.layers.Dense(8, activation="relu"),
                                 keras.layers.Dense(1)])

    def compile(self, model):
        import keras

        kwargs = {} if self.jit_compile == "auto" else {"jit_compile": self.jit_compile}
        model.compile(keras.optimizers.SGD(0.1), "mse", **kwargs)

    def data(self):
        import numpy as np
        import tensorflow as tf

        rng = np.random.default_rng(6)
        x = rng.standard_normal((N, 5)).astype("float32")
        return tf.data.Dataset.from_tensor_slices((x, x[:, :1] * x[:, 1:2])).batch(GLOBAL_BATCH)


class PartialBatch:
    """A dataset whose size is not a multiple of the batch: the last batch, 5 examples, is
    split 3 + 2 between the replicas (and the workers). One device takes the mean over the 5;
    tfdist weights each replica's gradient by its examples (tfdist.sync.sum_over_replicas).
    keras.io's guides hit it wherever a dataset (or `validation_split`'s remainder) is not a
    multiple of the batch size. Also under bucketed all-reduce (the `buckets` preset:
    `bucket_bytes=64`), which carries the count in its first bucket."""

    name = "partial_batch"
    presets = ("mirrored", "zero1", "zero2", "buckets", "stock")
    worker_presets = ("mwms", "zero2")

    def build(self):
        import keras

        return keras.Sequential([keras.Input((5,)), keras.layers.Dense(8, activation="relu"),
                                 keras.layers.Dense(1)])

    def compile(self, model):
        import keras

        model.compile(keras.optimizers.SGD(0.1), "mse", metrics=["mae"])

    def data(self):
        import numpy as np
        import tensorflow as tf

        rng = np.random.default_rng(7)
        x = rng.standard_normal((2 * GLOBAL_BATCH + 5, 5)).astype("float32")
        return tf.data.Dataset.from_tensor_slices((x, 2 * x[:, :1] + x[:, 1:2])).batch(
            GLOBAL_BATCH)


class OptimizerOutsideScope:
    """The optimizer made before the strategy's scope, the model made and compiled in it.

    keras.io's examples make it first (a module-level `optimizer = keras.optimizers.Adam()`,
    a `get_optimizer_and_loss()` helper); the distributed-training guide's advice puts only
    the model and `compile` in the scope. Keras 3's optimizer keeps the strategy it was
    created under: `fit` then fails with "Mixing different tf.distribute.Strategy objects"
    (keras-team/keras#17187). AdamW with a float learning rate (a variable, like the step
    counter, made at creation), weight decay and global_clipnorm=0.5, below every batch's
    gradient norm here (4.4 to 15.8 at the initial weights), so the clipping acts."""

    name = "optimizer_outside_scope"
    presets = ("mirrored", "zero1", "zero2", "stock")
    worker_presets = ("mwms", "zero2")

    def before_scope(self):
        import keras

        self.optimizer = keras.optimizers.AdamW(0.05, weight_decay=0.01,
                                                global_clipnorm=0.5)

    def build(self):
        import keras

        return keras.Sequential([keras.Input((5,)), keras.layers.Dense(8, activation="relu"),
                                 keras.layers.Dense(1)])

    def compile(self, model):
        model.compile(self.optimizer, "mse", metrics=["mae"])

    def data(self):
        import numpy as np
        import tensorflow as tf

        rng = np.random.default_rng(11)
        x = rng.standard_normal((N, 5)).astype("float32")
        return tf.data.Dataset.from_tensor_slices((x, 3 * x[:, :1] - x[:, 2:3])).batch(
            GLOBAL_BATCH)


PATTERNS = {p.name: p for p in (StringInput(), BoolMask(), VAE(), GAN(), TruePositives(),
                                AddLoss(), Jit("auto"), Jit(True), PartialBatch(),
                                OptimizerOutsideScope())}


# --- running one pattern under one strategy ----------------------------------------------


def _error(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).strip()[:3000]}"


def _initial_weights(pattern):
    import keras

    keras.utils.set_random_seed(1)
    return pattern.build().get_weights()


def run(pattern, strategy, initial) -> dict:
    """Builds (same initial weights), compiles, fits (and evaluates) `pattern` under `strategy`."""
    import keras

    import tfdist

    out: dict = {}
    try:
        if hasattr(pattern, "before_scope"):
            pattern.before_scope()
        with strategy.scope():
            keras.utils.set_random_seed(1)
            model = pattern.build()
            model.set_weights(initial)
            pattern.compile(model)
        history = model.fit(pattern.data(), epochs=1, verbose=0)
        out["logs"] = {k: [float(v) for v in values] for k, values in history.history.items()}
        if getattr(pattern, "evaluates", True):
            out["evaluate"] = float(model.evaluate(pattern.data(), verbose=0,
                                                   return_dict=True)["loss"])
            out["predict"] = model.predict(pattern.data(), verbose=0)
        out["weights"] = model.get_weights()
        out["jit_compile"] = bool(model.jit_compile)
        optimizers = getattr(pattern, "optimizers", lambda m: [m.optimizer])(model)
        out["spread"] = tfdist.replica_spread(
            list(model.weights) + [v for o in optimizers for v in o.variables])
        out["iterations"] = [int(o.iterations.numpy()) for o in optimizers]
    except Exception as e:  # noqa: BLE001 - negative controls record what stock Keras raises
        out["error"] = _error(e)
    return out


def _difference(a, b) -> float:
    import numpy as np

    return max(float(np.max(np.abs(np.asarray(u, "float64") - np.asarray(v, "float64"))))
               for u, v in zip(a, b))


def _relative(a, b) -> float:
    """Largest |a - b| / max(1, |b|): logged values (losses of 10 and more) in float32."""
    return max(abs(float(u) - float(v)) / max(1.0, abs(float(v))) for u, v in zip(a, b))


def compare(results: dict, name: str, preset: str, run_out: dict, reference: dict) -> None:
    key = f"{name}.{preset}"
    if "error" in run_out:
        results[f"{key}.error"] = run_out["error"]
        return
    results[f"{key}.vs_one_device"] = _difference(run_out["weights"], reference["weights"])
    for log, values in run_out["logs"].items():
        results[f"{key}.logs.{log}"] = values
        results[f"{name}.one_device.logs.{log}"] = reference["logs"][log]
        results[f"{key}.{log}_vs_one_device"] = _relative(values, reference["logs"][log])
    if "evaluate" in run_out:
        results[f"{key}.evaluate_vs_one_device"] = _relative([run_out["evaluate"]],
                                                             [reference["evaluate"]])
        results[f"{key}.predict_vs_one_device"] = _difference([run_out["predict"]],
                                                              [reference["predict"]])
    results[f"{key}.spread"] = run_out["spread"]
    results[f"{key}.iterations"] = run_out["iterations"]
    results[f"{name}.one_device.iterations"] = reference["iterations"]
    results[f"{key}.jit_compile"] = run_out["jit_compile"]


# --- modes -------------------------------------------------------------------------------


def mirrored() -> dict:
    import tfdist

    tfdist.configure_logical_devices(2)
    import tensorflow as tf

    strategies = {
        "mirrored": tfdist.make_strategy("mirrored", num_devices=2),
        "zero1": tfdist.make_strategy("mirrored", num_devices=2, shard="optimizer",
                                      shard_min_bytes=0),
        "zero2": tfdist.make_strategy("mirrored", num_devices=2, shard="gradients",
                                      shard_min_bytes=0),
        "buckets": tfdist.make_strategy("mirrored", num_devices=2, bucket_bytes=64),
        # Negative control: Keras as released, under TensorFlow's own strategy.
        "stock": tf.distribute.MirroredStrategy(
            ["/cpu:0", "/cpu:1"], cross_device_ops=tf.distribute.ReductionToOneDevice()),
    }
    one = tf.distribute.get_strategy()
    results: dict = {}
    references, initials = {}, {}
    warnings = _XlaWarnings()
    _lap(results, "start")
    for name, pattern in PATTERNS.items():
        initials[name] = initial = _initial_weights(pattern)
        references[name] = reference = run(pattern, one, initial)
        if "error" in reference:
            results[f"{name}.one_device.error"] = reference["error"]
            continue
        results[f"{name}.one_device.jit_compile"] = reference["jit_compile"]
        for preset in pattern.presets:
            strategy = strategies[preset]
            before = warnings.count
            compare(results, name, preset, run(pattern, strategy, initial), reference)
            results[f"{name}.{preset}.xla_warnings"] = warnings.count - before
    _lap(results, "patterns")
    results.update(_sparse_duplicates(strategies["mirrored"], one))

    # Negative controls of the fixes themselves: tfdist's own strategy with one taken out.
    from tfdist.compat import _patch, keras_build, keras_losses, keras_xla

    controls = {
        "unfixed_build": ((keras_build.SYMBOLIC_BUILD,), ("string", "vae")),
        "unfixed_optimizer": ((keras_build.OPTIMIZER_VARIABLES,), ("vae",)),
        "unfixed_adopt": ((keras_build.ADOPT_OPTIMIZER,), ("optimizer_outside_scope",)),
        "unfixed_losses": (tuple(f.name for f in keras_losses.FIXES),
                           ("vae", "gan", "add_loss")),
        "unfixed_xla": ((keras_xla.NAME,), ("xla_true",)),
    }
    for tag, (fixes, names) in controls.items():
        _patch.uninstall(fixes)
        for name in (n for n in names if n in references):
            compare(results, name, tag,
                    run(PATTERNS[name], strategies["mirrored"], initials[name]),
                    references[name])
        keras_build.install()
        keras_losses.install()
        keras_xla.install()
    # The partial batch with each replica's mean weighted equally (as before the weighting).
    from tfdist import sync as sync_lib

    sync_lib._KerasSum.weights_examples = False
    try:
        compare(results, "partial_batch", "unweighted",
                run(PATTERNS["partial_batch"], strategies["mirrored"], initials["partial_batch"]),
                references["partial_batch"])
    finally:
        sync_lib._KerasSum.weights_examples = True
    _lap(results, "controls")
    return results


def _sparse_duplicates(strategy, one) -> dict:
    """docs/numerics.md's example: an embedding row looked up 3 times in a batch, Adam.

    tfdist sums duplicate sparse-gradient indices (Adam's math as on JAX), so `mirrored`
    equals one device opted in to the sum, not a plain single-device TensorFlow run; with
    `keep_duplicate_sparse_slices` it equals the plain run instead.
    """
    import keras
    import numpy as np

    import tfdist

    def run(s, *, summed=False, kept=False):
        with s.scope():
            model = keras.Sequential([
                keras.Input((3,), dtype="int32"),
                keras.layers.Embedding(4, 1, embeddings_initializer="ones"),
                keras.layers.GlobalAveragePooling1D()])
            optimizer = keras.optimizers.Adam(0.1)
            if summed:
                tfdist.sum_duplicate_sparse_gradients(optimizer)
            if kept:
                tfdist.keep_duplicate_sparse_slices(optimizer)
            model.compile(optimizer, "mse")
        model.fit(np.array([[1, 1, 2], [1, 2, 3]]), np.zeros((2, 1)), batch_size=2, epochs=3,
                  verbose=0)
        return model.get_weights()

    plain, summed = run(one), run(one, summed=True)
    mirrored, kept = run(strategy), run(strategy, kept=True)
    return {"sparse.plain_vs_summed": _difference(plain, summed),
            "sparse.mirrored_vs_summed": _difference(mirrored, summed),
            "sparse.mirrored_vs_plain": _difference(mirrored, plain),
            "sparse.kept_vs_plain": _difference(kept, plain)}


class _XlaWarnings:
    """Counts tfdist's "XLA off" warnings (one per model is the promise)."""

    def __init__(self):
        import logging

        counter = self

        class Handler(logging.Handler):
            def emit(self, record):
                if "jit_compile=True" in record.getMessage():
                    counter.count += 1

        self.count = 0
        logging.getLogger("tfdist").addHandler(Handler())


_CLOCK = [0.0]


def _lap(results, name):
    import time

    now = time.perf_counter()
    if _CLOCK[0]:
        results.setdefault("seconds", {})[name] = round(now - _CLOCK[0], 1)
    _CLOCK[0] = now


def worker(out: str) -> dict:
    """One task of a `tfdist launch` of 2 workers: every pattern under multi_worker_mirrored.

    Writes results_<task>.json (this task's measurements) and <pattern>.<preset>_<task>.npz
    (its final weights, for the test to check that both workers hold the same bits).
    """
    import numpy as np

    import tfdist

    first = tfdist.make_strategy("multi_worker_mirrored")  # starts this task's server
    import tensorflow as tf

    task = first.cluster_resolver.task_id
    # Further strategies of the same process (keras.io's guides make one per run_training()).
    strategies = {
        "mwms": first,
        "zero1": tfdist.make_strategy("multi_worker_mirrored", shard="optimizer",
                                      shard_min_bytes=0),
        "zero2": tfdist.make_strategy("multi_worker_mirrored", shard="gradients",
                                      shard_min_bytes=0),
    }
    one = tf.distribute.get_strategy()
    results: dict = {"replicas": {k: s.num_replicas_in_sync for k, s in strategies.items()}}
    warnings = _XlaWarnings()
    _lap(results, "start")
    for name, pattern in PATTERNS.items():
        if not pattern.worker_presets:
            continue
        initial = _initial_weights(pattern)
        reference = run(pattern, one, initial)
        if "error" in reference:
            results[f"{name}.one_device.error"] = reference["error"]
            continue
        for preset in pattern.worker_presets:
            before = warnings.count
            distributed = run(pattern, strategies[preset], initial)
            compare(results, name, preset, distributed, reference)
            results[f"{name}.{preset}.xla_warnings"] = warnings.count - before
            if "weights" in distributed:
                np.savez(os.path.join(out, f"{name}.{preset}_{task}.npz"),
                         *distributed["weights"])
    _lap(results, "patterns")
    results.update(_metric_reduction_canary(strategies["mwms"]))
    results.update(_variable_dtypes(strategies["mwms"], task))
    results.update(_run_training_twice(out, task, one))
    _lap(results, "run_training_twice")
    with open(os.path.join(out, f"results_{task}.json"), "w") as f:
        json.dump(results, f)
    return results


def _variable_dtypes(strategy, task: int) -> dict:
    """Variables of dtypes TensorFlow's broadcast ops lack, made with this task's values.

    Every worker must end with worker 0's values (the initial-value broadcast); without
    tfdist's initial_values fix (the canary) making one fails on every worker alike.
    """
    import tensorflow as tf

    import tfdist
    from tfdist.compat import initial_values

    results = {}
    values = [task + 1, 2 * task + 3]
    for dtype in ("bfloat16", "int8", "uint8", "float32"):
        with strategy.scope():
            variable = tf.Variable(tf.constant(values, dtype))
        results[f"dtype.{dtype}"] = [float(x) for x in
                                     tf.cast(variable.values[0], tf.float32).numpy()]
        results[f"dtype.{dtype}.dtype"] = variable.dtype.name
    tfdist.compat.uninstall([initial_values.NAME])
    try:
        with strategy.scope():
            tf.Variable(tf.constant(values, tf.bfloat16))
        results["dtype.unfixed.error"] = None
    except Exception as e:  # noqa: BLE001 (the canary records what stock TensorFlow does)
        results["dtype.unfixed.error"] = str(e)[:300]
    finally:
        initial_values.install()
    return results


def _metric_reduction_canary(strategy) -> dict:
    """What stock code does with a metric whose `result()` is its variable, on several workers.

    Keras's own multi-worker reduction fails ("Invalid reduction dimension 0"), and
    TensorFlow's `strategy.reduce(..., axis=None)`, which tfdist's fix uses for scalar
    tensors, refuses the variable ("Cannot convert `input_tensor` to a `PerReplica` object").
    """
    import tensorflow as tf

    from tfdist.compat import _patch, keras_multi_worker

    keras_reduce = _patch.stored_original(keras_multi_worker.REDUCE_PER_REPLICA)
    with strategy.scope():
        metric = _true_positives_class()()
    attempts = {
        "keras_reduce": lambda values: keras_reduce(values, strategy, "auto"),
        "strategy_reduce": lambda values: strategy.reduce("MEAN", values["ctp"], axis=None),
    }
    out = {}
    for name, reduce in attempts.items():
        @tf.function
        def step(reduce=reduce):
            return reduce(strategy.run(lambda: {"ctp": metric.result()}))

        try:
            step()
            out[f"metric.{name}.error"] = None
        except Exception as e:  # noqa: BLE001 - the canary records what stock code raises
            out[f"metric.{name}.error"] = _error(e)
    return out


def _run_training_twice(out: str, task: int, one) -> dict:
    """keras.io's distributed-training guide: `run_training()` twice, each making a strategy.

    The second call restores the first one's checkpoint and trains one more epoch; the
    result must equal two epochs on one device.
    """
    import keras
    import numpy as np
    import tensorflow as tf

    import tfdist

    checkpoint_dir = os.path.join(out, "ckpt")
    os.makedirs(checkpoint_dir, exist_ok=True)
    rng = np.random.default_rng(7)
    x = rng.standard_normal((N, 4)).astype("float32")
    y = np.argmax(x[:, :3], axis=1).astype("int32")
    train_dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH)

    def get_compiled_model():
        keras.utils.set_random_seed(1)
        inputs = keras.Input(shape=(4,))
        hidden = keras.layers.Dense(8, activation="relu")(inputs)
        model = keras.Model(inputs, keras.layers.Dense(3)(hidden))
        model.set_weights(initial)
        model.compile(optimizer=keras.optimizers.Adam(0.01),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=[keras.metrics.SparseCategoricalAccuracy()])
        return model

    def make_or_restore_model():
        checkpoints = [os.path.join(checkpoint_dir, name) for name in os.listdir(checkpoint_dir)]
        if checkpoints:
            return keras.models.load_model(max(checkpoints, key=os.path.getctime))
        return get_compiled_model()

    def run_training(epochs=1):
        strategy = tfdist.make_strategy("multi_worker_mirrored")
        with strategy.scope():
            model = make_or_restore_model()
            callbacks = [keras.callbacks.ModelCheckpoint(
                filepath=os.path.join(checkpoint_dir, "ckpt-{epoch}.keras"), save_freq="epoch")]
            model.fit(train_dataset, epochs=epochs, callbacks=callbacks, verbose=0)
        # All tasks share this machine's directory: the chief's checkpoint must be there
        # before another task lists it (on separate machines each task reads its own copy).
        strategy.reduce("SUM", strategy.run(lambda: tf.constant(1.0)), axis=None)
        return strategy, model

    initial = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8),
                                keras.layers.Dense(3)]).get_weights()
    first, _ = run_training(epochs=1)
    second, model = run_training(epochs=1)
    with one.scope():
        reference = get_compiled_model()
    reference.fit(train_dataset, epochs=2, verbose=0)
    np.savez(os.path.join(out, f"run_training_twice.mwms_{task}.npz"), *model.get_weights())
    return {"run_training_twice.distinct_strategies": first is not second,
            "run_training_twice.vs_one_device": _difference(model.get_weights(),
                                                            reference.get_weights()),
            "run_training_twice.spread": tfdist.replica_spread(model)}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["mirrored", "worker"])
    parser.add_argument("--out", help="worker mode: where each task writes its files")
    args = parser.parse_args()
    results = worker(args.out) if args.mode == "worker" else mirrored()
    print("RESULTS " + json.dumps(results, default=str))


if __name__ == "__main__":
    main()

"""Keras 3 model.fit under the parameter_server preset, on one in-process cluster.

Run by tests/ps/test_fit.py in a fresh pytest process: connecting to a cluster
renames this process's devices (/job:chief/...), which would break later
MirroredStrategy tests in a shared process, and the cases install (and, for
their negative controls, briefly uninstall) tfdist's compat fixes. The
cluster (2 workers, 2 ps as tf.distribute.Servers) is started once for the
module; TensorFlow servers cannot be stopped, so every case reuses it.
"""

import contextlib
import re
import warnings

import numpy as np
import pytest

import tfdist
from tfdist import ps

pytestmark = pytest.mark.timeout(240)

GLOBAL_BATCH = 16
NUM_WORKERS = 2


@pytest.fixture(scope="module")
def strategy():
    from tests.ps import shared_cluster  # one strategy for every case module of the process

    return shared_cluster.strategy()


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((8, 1)).astype("float32")
    x = rng.standard_normal((512, 8)).astype("float32")
    return x, x @ w


def _dataset_fn(data, repeat=True):
    import tensorflow as tf

    x, y = data

    def dataset_fn(input_context):
        batch = input_context.get_per_replica_batch_size(GLOBAL_BATCH)
        ds = tf.data.Dataset.from_tensor_slices((x, y))
        ds = ds.repeat() if repeat else ds
        return ds.batch(batch).shard(input_context.num_input_pipelines,
                                     input_context.input_pipeline_id)

    return dataset_fn


def _model(strategy, metrics=("mae",), lr=0.01, **compile_kwargs):
    import keras

    with strategy.scope():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16),
                                  keras.layers.Dense(1)])
        model.compile(keras.optimizers.Adam(lr), "mse", metrics=list(metrics), **compile_kwargs)
    return model


@contextlib.contextmanager
def _without(*fixes):
    """The negative control: runs the block with these tfdist fixes uninstalled."""
    from tfdist.compat import _patch

    _patch.uninstall([f.name for f in fixes])
    try:
        yield
    finally:
        for fix in fixes:
            _patch.install(fix)


def test_fit_with_dataset_fn_and_callbacks(strategy, data, tmp_path):
    import keras
    import tensorflow as tf

    pytest.importorskip("tensorboard")
    model = _model(strategy)
    seen = []

    class Record(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            seen.append(("batch", batch, dict(logs)))

        def on_epoch_end(self, epoch, logs=None):
            seen.append(("epoch", epoch, dict(logs)))

    ckpt = tmp_path / "ckpt" / "e{epoch}.weights.h5"
    x, y = data
    val = tf.data.Dataset.from_tensor_slices((x, y)).batch(64)  # finite: evaluated exactly
    history = model.fit(
        _dataset_fn(data), epochs=3, steps_per_epoch=40, verbose=0, validation_data=val,
        callbacks=[Record(), keras.callbacks.ModelCheckpoint(str(ckpt), save_weights_only=True),
                   keras.callbacks.TensorBoard(str(tmp_path / "tb"))])
    assert set(history.history) == {"loss", "mae", "val_loss", "val_mae"}
    losses = history.history["loss"]
    assert len(losses) == 3 and losses[-1] < losses[0] * 0.1
    assert int(model.optimizer.iterations.numpy()) == 120
    batches = [s for s in seen if s[0] == "batch"]
    assert [b[1] for b in batches] == list(range(40)) * 3
    assert all(set(b[2]) <= {"loss", "mae"} for b in batches)
    assert [s[1] for s in seen if s[0] == "epoch"] == [0, 1, 2]
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [
        "e1.weights.h5", "e2.weights.h5", "e3.weights.h5"]
    assert {"train", "validation"} <= {p.name for p in (tmp_path / "tb").iterdir()}
    # The last val_loss is the exact loss over the validation set.
    pred = model.predict(x, verbose=0)
    np.testing.assert_allclose(history.history["val_loss"][-1], np.mean((pred - y) ** 2),
                               rtol=1e-5)
    # The checkpoint holds the trained weights (read from the ps).
    restored = _model(strategy)
    with strategy.scope():
        restored.optimizer.build(restored.trainable_variables)
    restored.load_weights(str(tmp_path / "ckpt" / "e3.weights.h5"))
    for a, b in zip(model.get_weights(), restored.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_counters_are_exact_under_asynchronous_workers(strategy, data):
    """200 scheduled steps on 2 workers: iterations and metrics count all of them."""
    model = _model(strategy, metrics=("mae",))
    steps = 200
    history = model.fit(_dataset_fn(data), epochs=1, steps_per_epoch=steps, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == steps
    loss_tracker = model.metrics[0]  # Mean: total and count on the ps
    per_step = GLOBAL_BATCH // strategy.num_replicas_in_sync
    assert int(loss_tracker.count.numpy()) == steps * per_step
    assert np.isfinite(history.history["loss"][0])


def _interleaved_increments(strategy, rounds):
    """Two workers increment one Keras counter, each reading it before either writes.

    The read inside Keras's `assign_add` is made to wait at a barrier (two
    queues on ps:0) until the other worker has read too, so both reads see the
    same value: a read-modify-write loses one increment every round, an atomic
    increment keeps both. Deterministic: no timing involved.
    """
    import keras
    import tensorflow as tf

    with strategy.scope():
        counter = keras.Variable(0.0, dtype="float32", trainable=False)
    with tf.device("/job:ps/replica:0/task:0"):
        queues = [tf.queue.FIFOQueue(16, [tf.float32], shapes=[[]]) for _ in range(2)]
    real = counter._value

    class ReadsAtBarrier:
        """Stands in for the counter's tf.Variable while the step is traced."""

        def __init__(self, party):
            self._party = party

        def __getattr__(self, name):
            return getattr(real, name)

    def read_at_barrier(proxy, dtype=None, name=None, as_ref=False):
        value = real.read_value()
        with tf.control_dependencies([queues[proxy._party].enqueue(value)]):
            other = queues[1 - proxy._party].dequeue()
        return value + 0.0 * other  # the value read, available once both parties read

    tf.register_tensor_conversion_function(ReadsAtBarrier, read_at_barrier)
    coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)

    def make_increment():
        @tf.function
        def increment():
            strategy.run(lambda: counter.assign_add(1.0))
            return tf.constant(0)

        return increment

    functions = [make_increment() for _ in range(2)]
    for round_ in range(rounds):
        for party, function in enumerate(functions):
            if round_ == 0:  # schedule() traces the step here: read through the barrier
                counter._value = ReadsAtBarrier(party)
            try:
                coordinator.schedule(function)
            finally:
                counter._value = real
        coordinator.join()
    return float(counter.numpy())


def test_increments_are_exact_when_workers_interleave_and_lost_without_the_fix(strategy):
    from tfdist.compat import ps_variables

    assert _interleaved_increments(strategy, rounds=5) == 10.0
    # Negative control (and canary for keras-team/keras#18668): Keras's own
    # assign_add loses exactly one increment per round.
    with _without(ps_variables.ASSIGN_ADD):
        assert _interleaved_increments(strategy, rounds=5) == 5.0


def test_fit_with_a_dataset_and_evaluate(strategy, data, capsys):
    import tensorflow as tf

    x, y = data
    model = _model(strategy)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(GLOBAL_BATCH)
    history = model.fit(dataset, epochs=2, steps_per_epoch=60, verbose=2)
    assert int(model.optimizer.iterations.numpy()) == 120
    # The progress bar prints the epoch's exact logs, as History records them.
    out = capsys.readouterr().out
    assert "Epoch 2/2" in out and "60/60" in out, out
    assert re.search(r"60/60 - .* - loss: \d", out), out
    assert len(history.history["loss"]) == 2
    # Without steps, a finite dataset is evaluated once, exactly, on the coordinator.
    finite = tf.data.Dataset.from_tensor_slices((x, y)).batch(64)
    exact = model.evaluate(finite, verbose=0, return_dict=True)
    pred = model.predict(x, verbose=0)
    np.testing.assert_allclose(exact["loss"], np.mean((pred - y) ** 2), rtol=1e-5)
    np.testing.assert_allclose(exact["mae"], np.mean(np.abs(pred - y)), rtol=1e-5)
    # With steps, the test steps are spread over the workers.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ps.RepeatedEvaluationDataWarning)
        spread = model.evaluate(_dataset_fn(data), steps=8, verbose=0, return_dict=True)
    assert set(spread) == {"loss", "mae"}
    np.testing.assert_allclose(spread["loss"], exact["loss"], rtol=0.5)


def test_exactly_once_evaluation_from_compile(strategy, data):
    """The tutorial's compile(pss_evaluation_shards=...): evaluate sees every example once."""
    import tensorflow as tf

    x, y = data
    x, y = x[:300], y[:300]  # 19 batches of 16: not a multiple of the shards
    model = _model(strategy, pss_evaluation_shards="auto")
    model.fit(_dataset_fn(data), epochs=1, steps_per_epoch=30, verbose=0)
    pred = model.predict(x, verbose=0)
    exact = {"loss": float(np.mean((pred - y) ** 2)), "mae": float(np.mean(np.abs(pred - y)))}

    def finite_fn(input_context):
        return tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH)

    def repeated_fn(input_context):
        return finite_fn(input_context).repeat()

    for given in (finite_fn, finite_fn(None), tfdist.PerWorkerDataset(finite_fn)):
        logs = model.evaluate(given, verbose=0, return_dict=True)
        for name in exact:
            np.testing.assert_allclose(logs[name], exact[name], rtol=1e-5, err_msg=str(given))
    # Keras's list form, and 7 shards of 19 batches (some shards hold 2, some 3).
    with strategy.scope():
        model.compile(model.optimizer, "mse", metrics=["mae"], pss_evaluation_shards=7)
    loss, mae = model.evaluate(finite_fn, verbose=0)
    np.testing.assert_allclose([loss, mae], [exact["loss"], exact["mae"]], rtol=1e-5)
    # Inexact by design without shards: steps=13 over a repeated dataset re-reads
    # each worker's first batches (and says so).
    with strategy.scope():
        model.compile(model.optimizer, "mse", metrics=["mae"])
    with pytest.warns(ps.RepeatedEvaluationDataWarning, match="first ones again"):
        spread = model.evaluate(repeated_fn, steps=13, verbose=0, return_dict=True)
    assert abs(spread["loss"] - exact["loss"]) > 1e-4 * exact["loss"]
    # Validation inside fit is exact too.
    with strategy.scope():
        model.compile(model.optimizer, "mse", metrics=["mae"], pss_evaluation_shards=4)
    history = model.fit(_dataset_fn(data), epochs=1, steps_per_epoch=1, verbose=0,
                        validation_data=finite_fn)
    pred = model.predict(x, verbose=0)
    np.testing.assert_allclose(history.history["val_loss"][0], np.mean((pred - y) ** 2),
                               rtol=1e-5)
    # Clear errors for what exactly-once evaluation cannot do.
    with pytest.raises(ValueError, match=r"dataset must be finite|must be finite"):
        model.evaluate(repeated_fn, verbose=0)
    with pytest.raises(ValueError, match=r"takes no steps\. Received: steps=3"):
        model.evaluate(finite_fn, steps=3, verbose=0)
    with pytest.raises(ValueError, match=r"Received: pss_evaluation_shards=-1"):
        with strategy.scope():
            model.compile("adam", "mse", pss_evaluation_shards=-1)


def test_upstream_keras_still_lacks_parameter_server_fit_and_exact_evaluation(strategy, data):
    """Canaries: fail once Keras 3 supports PS fit / pss_evaluation_shards itself (keras#18624)."""
    import keras

    from tfdist.compat import _patch

    model = _model(strategy)
    with pytest.raises(ValueError):
        _patch.stored_original("ps_fit.fit")(model, _dataset_fn(data), epochs=1, steps_per_epoch=2,
                                      verbose=0)
    with pytest.raises(TypeError, match="pss_evaluation_shards"):
        _patch.stored_original("ps_fit.compile")(model, "adam", "mse", pss_evaluation_shards=2)
    # Models outside tfdist's strategies keep Keras's behaviour (the TypeError).
    plain = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])
    with pytest.raises(TypeError, match="pss_evaluation_shards"):
        plain.compile("adam", "mse", pss_evaluation_shards=2)


def test_recompile_runs_the_new_optimizer_and_loss(strategy, data):
    """A recompiled model's fit traces its new step (the old graph kept Adam and mse)."""
    import keras

    model = _model(strategy, lr=0.05)
    model.fit(_dataset_fn(data), epochs=1, steps_per_epoch=5, verbose=0)
    with strategy.scope():
        model.compile(keras.optimizers.SGD(learning_rate=0.0), "mae")
    before = model.get_weights()
    # Targets shifted by 10 keep every batch's mae (~10) far from its mse (~100), whichever
    # batches the workers happened to take: the loss tells which of the two ran.
    x, y = data
    shifted = (x, y + 10.0)
    history = model.fit(_dataset_fn(shifted), epochs=1, steps_per_epoch=5, verbose=0)
    for a, b in zip(before, model.get_weights()):
        np.testing.assert_array_equal(a, b)  # lr 0: nothing moves
    assert int(model.optimizer.iterations.numpy()) == 5  # the new optimizer counted them
    error = model.predict(x, verbose=0) - shifted[1]
    batches = error[: len(error) // GLOBAL_BATCH * GLOBAL_BATCH].reshape(-1, GLOBAL_BATCH // 2)
    batch_mae, batch_mse = np.abs(batches).mean(axis=1), (batches ** 2).mean(axis=1)
    assert batch_mae.max() < batch_mse.min()  # the two losses cannot be confused on any batch
    loss = history.history["loss"][0]
    assert batch_mae.min() - 1e-4 <= loss <= batch_mae.max() + 1e-4, (loss, batch_mae, batch_mse)


def test_bad_input_is_a_clear_error(strategy, data):
    import keras
    import tensorflow as tf

    x, y = data
    model = _model(strategy)
    with pytest.raises(ValueError, match=r"steps_per_epoch is required .*cannot know where"):
        model.fit(_dataset_fn(data), epochs=1, verbose=0)
    with pytest.raises(ValueError, match=r"Received: x of type list"):
        model.fit([1, 2], steps_per_epoch=2, verbose=0)
    with pytest.raises(ValueError, match=r"does not take validation_batch_size\. Received: "
                                         r"validation_batch_size=32"):
        model.fit(_dataset_fn(data), steps_per_epoch=2, validation_batch_size=32, verbose=0,
                  validation_data=_dataset_fn(data), validation_steps=1)
    with pytest.raises(ValueError, match=r"validation_freq must be .*Received: validation_freq=0"):
        model.fit(_dataset_fn(data), steps_per_epoch=2, validation_freq=0, verbose=0)
    with pytest.raises(ValueError, match=r"infinite dataset .*Received: steps=None"):
        model.evaluate(tf.data.Dataset.from_tensor_slices((x, y)).batch(8).repeat(), verbose=0)
    with pytest.raises(ValueError, match=r"steps is required when x is a dataset function"):
        model.evaluate(_dataset_fn(data), verbose=0)
    with pytest.raises(ValueError, match=r"validation_steps is required"):
        model.fit(_dataset_fn(data), steps_per_epoch=1, verbose=0,
                  validation_data=_dataset_fn(data))
    with pytest.raises(ValueError, match=r"PerWorkerDataset takes a function"):
        tfdist.PerWorkerDataset(tf.data.Dataset.range(3))
    with pytest.raises(ValueError, match=r"must return a tf.data.Dataset. Received: list"):
        tfdist.PerWorkerDataset(lambda ctx: [1, 2])
    # Gradient accumulation: asynchronous workers would share one set of accumulators.
    with strategy.scope():
        model.compile(keras.optimizers.SGD(0.1, gradient_accumulation_steps=2), "mse")
    with pytest.raises(ValueError, match=r"gradient_accumulation_steps=2 is not supported under "
                                         r"tfdist's parameter_server preset.*Fix: drop"):
        model.fit(_dataset_fn(data), steps_per_epoch=1, verbose=0)
    # compile outside the scope (keras-team/keras#17187): the new optimizer moves onto the ps.
    optimizer = keras.optimizers.SGD(0.1)
    model.compile(optimizer, "mse")
    model.fit(_dataset_fn(data), steps_per_epoch=1, verbose=0)
    assert int(optimizer.iterations.numpy()) == 1
    assert all("/job:ps/" in v.value.device for v in optimizer.variables), [
        v.value.device for v in optimizer.variables]
    # One built already (outside every scope) cannot move: the clear error stays.
    built = keras.optimizers.SGD(0.1)
    built.build([keras.Variable(np.zeros((2,), "float32"))])
    model.compile(built, "mse")
    with pytest.raises(ValueError, match=r"inside `with strategy.scope\(\):`"):
        model.fit(_dataset_fn(data), steps_per_epoch=1, verbose=0)


class _PreprocessingModel:
    """Builds a model whose fit/evaluate preprocess first, as KerasHub task models do."""

    @staticmethod
    def make(strategy):
        import keras
        import tensorflow as tf

        class Preprocessing(keras.Sequential):
            def _prepare(self, x):
                if not isinstance(x, tf.data.Dataset):
                    raise ValueError(f"Expected a tf.data.Dataset. Received: {type(x)}")
                return x.map(lambda a, b: (a * 2.0, b)).prefetch(2)

            def fit(self, x=None, **kwargs):
                return super().fit(self._prepare(x), **kwargs)

            def evaluate(self, x=None, **kwargs):
                return super().evaluate(self._prepare(x), **kwargs)

        with strategy.scope():
            model = Preprocessing([keras.Input((8,)), keras.layers.Dense(1)])
            model.compile(keras.optimizers.SGD(0.05), "mse", pss_evaluation_shards=3)
        return model


def test_models_that_override_fit_take_a_per_worker_dataset(strategy, data):
    """A function does not survive such a fit; PerWorkerDataset does."""
    import tensorflow as tf

    x, y = data
    model = _PreprocessingModel.make(strategy)
    with pytest.raises(ValueError, match="Expected a tf.data.Dataset"):
        model.fit(_dataset_fn(data), steps_per_epoch=2, verbose=0)
    per_worker = tfdist.PerWorkerDataset(_dataset_fn(data))
    history = model.fit(per_worker, epochs=2, steps_per_epoch=40, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 80
    assert history.history["loss"][-1] < history.history["loss"][0]
    # The workers ran the model's own preprocessing (x * 2): the exact loss says so.
    finite = tfdist.PerWorkerDataset(
        lambda ctx: tf.data.Dataset.from_tensor_slices((x, y)).batch(32))
    logs = model.evaluate(finite, verbose=0, return_dict=True)
    pred = model.predict(x * 2.0, verbose=0)
    np.testing.assert_allclose(logs["loss"], np.mean((pred - y) ** 2), rtol=1e-5)


def test_kerashub_task_model_trains_from_a_per_worker_dataset(strategy):
    keras_hub = pytest.importorskip("keras_hub", reason="KerasHub is an optional test dependency")
    import keras
    import tensorflow as tf

    rng = np.random.default_rng(1)
    features = {"token_ids": rng.integers(1, 64, (64, 8)).astype("int32"),
                "segment_ids": np.zeros((64, 8), "int32"),
                "padding_mask": np.ones((64, 8), "int32")}
    labels = rng.integers(0, 2, (64,)).astype("int32")

    def dataset_fn(input_context):
        ds = tf.data.Dataset.from_tensor_slices((features, labels)).repeat().batch(8)
        return ds.shard(input_context.num_input_pipelines, input_context.input_pipeline_id)

    with strategy.scope():
        backbone = keras_hub.models.BertBackbone(
            vocabulary_size=64, num_layers=1, num_heads=2, hidden_dim=8, intermediate_dim=16,
            max_sequence_length=8)
        model = keras_hub.models.BertTextClassifier(backbone, num_classes=2, preprocessor=None)
        model.compile(optimizer=keras.optimizers.Adam(1e-3),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    history = model.fit(tfdist.PerWorkerDataset(dataset_fn), epochs=1, steps_per_epoch=10,
                        verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 10
    assert np.isfinite(history.history["loss"][0])


def test_in_process_servers_listen_on_every_interface(strategy):
    """Documents the exposure (docs/parameter_server.md, 'Security'); fails if TensorFlow
    starts binding the cluster spec's address, so the docs can say so."""
    from tfdist.ps import servers

    ports = {int(a.rsplit(":", 1)[1]) for c in servers._LOCAL_CLUSTERS.values()
             for role in ("worker", "ps") for a in getattr(c.cluster, role)}
    listening = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = open(table).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            local, state = line.split()[1], line.split()[3]
            address, port = local.rsplit(":", 1)
            if state == "0A" and int(port, 16) in ports:  # LISTEN
                listening.add((int(port, 16), set(address) == {"0"}))
    assert {p for p, _ in listening} == ports, listening
    assert all(wildcard for _, wildcard in listening), listening


def test_a_rerun_of_an_applied_step_applies_nothing(strategy, data):
    """What TensorFlow does after a worker dies between applying a step and reporting
    back: it runs the same closure (same step id) again, which tfdist's failure
    handler flags as a re-run. The flagged re-run must not apply; unflagged, the
    same step id applies again (the control: the flag and ledger are what skip it)."""
    import tensorflow as tf

    from tfdist.compat import ps_recovery
    from tfdist.ps import CoordinatorTrainer

    model = _model(strategy)
    model.fit(_dataset_fn(data), epochs=1, steps_per_epoch=2, verbose=0)
    trainer = CoordinatorTrainer.for_model(model)
    assert trainer.skip_completed_reruns
    function = trainer.step_function("train")
    iterator = trainer._iterator("train", _dataset_fn(data))
    step_id = tf.constant(trainer._next_step_id, tf.int64)
    trainer._next_step_id += 1

    def run(flag):
        trainer.coordinator.schedule(function, args=(iterator, step_id, flag))
        trainer.coordinator.join()
        return int(model.optimizer.iterations.numpy()), model.get_weights()

    before, weights = int(model.optimizer.iterations.numpy()), model.get_weights()
    after, applied = run(ps_recovery.first_run_flag())
    assert after == before + 1 and any(np.any(a != b) for a, b in zip(weights, applied))
    rerun, rerun_weights = run(tf.constant(True))
    assert rerun == after
    for a, b in zip(applied, rerun_weights):
        np.testing.assert_array_equal(a, b)
    again, _ = run(ps_recovery.first_run_flag())
    assert again == after + 1


def _vae(strategy):
    """keras.io's VAE, shrunk: a train_step of its own, sub-models, no call(); Adam."""
    import keras
    import tensorflow as tf

    class Sampling(keras.layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.seed_generator = keras.random.SeedGenerator(1337)

        def call(self, inputs):
            z_mean, z_log_var = inputs
            epsilon = keras.random.normal(tf.shape(z_mean), seed=self.seed_generator)
            return z_mean + tf.exp(0.5 * z_log_var) * epsilon

    class VAE(keras.Model):
        def __init__(self, encoder, decoder, **kwargs):
            super().__init__(**kwargs)
            self.encoder, self.decoder = encoder, decoder
            self.total_loss_tracker = keras.metrics.Mean(name="total_loss")

        @property
        def metrics(self):
            return [self.total_loss_tracker]

        def train_step(self, data):
            with tf.GradientTape() as tape:
                z_mean, z_log_var, z = self.encoder(data)
                reconstruction = self.decoder(z)
                reconstruction_loss = tf.reduce_mean(tf.reduce_sum(
                    tf.square(data - reconstruction), axis=1))
                kl = -0.5 * (1 + z_log_var - tf.square(z_mean) - tf.exp(z_log_var))
                total_loss = reconstruction_loss + tf.reduce_mean(tf.reduce_sum(kl, axis=1))
            grads = tape.gradient(total_loss, self.trainable_weights)
            self.optimizer.apply_gradients(zip(grads, self.trainable_weights))
            self.total_loss_tracker.update_state(total_loss)
            return {"loss": self.total_loss_tracker.result()}

    keras.utils.set_random_seed(3)
    with strategy.scope():
        inputs = keras.Input((8,))
        hidden = keras.layers.Dense(8, activation="relu")(inputs)
        z_mean, z_log_var = keras.layers.Dense(2)(hidden), keras.layers.Dense(2)(hidden)
        encoder = keras.Model(inputs, [z_mean, z_log_var, Sampling()([z_mean, z_log_var])])
        latent = keras.Input((2,))
        decoder = keras.Model(latent, keras.layers.Dense(8)(keras.layers.Dense(8)(latent)))
        vae = VAE(encoder, decoder)
        vae.compile(optimizer=keras.optimizers.Adam(0.01))
    return vae


def test_model_with_a_train_step_and_no_call_trains_as_on_one_device(strategy, data,
                                                                      monkeypatch):
    import tensorflow as tf

    from tfdist.compat import keras_build

    x = data[0][:GLOBAL_BATCH]
    # One batch every step; one step per epoch, so each step finishes (on
    # whichever worker) before the next starts: one device's sequence of updates.
    fixed = lambda input_context: tf.data.Dataset.from_tensors(x).repeat()  # noqa: E731
    steps = 3
    reference = _vae(tf.distribute.get_strategy())
    expected = reference.fit(tf.data.Dataset.from_tensors(x).repeat(), epochs=steps,
                             steps_per_epoch=1, verbose=0).history["loss"]

    vae = _vae(strategy)
    history = vae.fit(fixed, epochs=steps, steps_per_epoch=1, verbose=0)
    assert int(vae.optimizer.iterations.numpy()) == steps
    np.testing.assert_allclose(history.history["loss"], expected, rtol=0, atol=1e-6)
    for ps_weight, one in zip(vae.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(ps_weight, one, rtol=0, atol=1e-6)
    # Adam's slots, made while the first step was traced, live on the ps.
    devices = [v.value.device for v in vae.optimizer.variables]
    assert len(devices) > 2 and all("/job:ps" in d for d in devices), devices

    # Negative control: the symbolic build run on such a model, as before.
    monkeypatch.setattr(keras_build, "has_own_call", lambda model: True)
    with pytest.raises(Exception, match="Unable to automatically build the model"):
        _vae(strategy).fit(fixed, epochs=1, steps_per_epoch=1, verbose=0)

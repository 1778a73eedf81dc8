"""Keras 3 model.fit under the parameter_server preset, on one in-process cluster.

Run by tests/test_ps.py in a fresh pytest process: connecting to a cluster
renames this process's devices (/job:chief/...), which would break later
MirroredStrategy tests in a shared process. The cluster (2 workers, 2 ps as
tf.distribute.Servers on 127.0.0.1) is started once for the module;
TensorFlow servers cannot be stopped, so every case reuses it.
"""

import os
import re

import numpy as np
import pytest

import tfdist

pytestmark = pytest.mark.timeout(240)

GLOBAL_BATCH = 16
NUM_WORKERS = 2


@pytest.fixture(scope="module")
def strategy():
    return tfdist.make_strategy("parameter_server", local_workers=NUM_WORKERS, local_ps=2)


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((8, 1)).astype("float32")
    x = rng.standard_normal((512, 8)).astype("float32")
    return x, x @ w


def _dataset_fn(data):
    import tensorflow as tf

    x, y = data

    def dataset_fn(input_context):
        batch = input_context.get_per_replica_batch_size(GLOBAL_BATCH)
        return (tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(batch)
                .shard(input_context.num_input_pipelines, input_context.input_pipeline_id))

    return dataset_fn


def _model(strategy, metrics=("mae",), lr=0.01):
    import keras

    with strategy.scope():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16),
                                  keras.layers.Dense(1)])
        model.compile(keras.optimizers.Adam(lr), "mse", metrics=list(metrics))
    return model


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
    val = tf.data.Dataset.from_tensor_slices((x, y)).batch(64).repeat()
    history = model.fit(
        _dataset_fn(data), epochs=3, steps_per_epoch=40, verbose=0,
        validation_data=val, validation_steps=4,
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
    assert {"train", "validation"} <= set(os.listdir(tmp_path / "tb"))
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
    # Each step is one replica on one worker: GLOBAL_BATCH // 1 examples.
    per_step = GLOBAL_BATCH // strategy.num_replicas_in_sync
    assert int(loss_tracker.count.numpy()) == steps * per_step
    assert np.isfinite(history.history["loss"][0])


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
    np.testing.assert_allclose(exact["loss"], np.mean((pred - y) ** 2), rtol=1e-4)
    np.testing.assert_allclose(exact["mae"], np.mean(np.abs(pred - y)), rtol=1e-4)
    # With steps, the test steps are spread over the workers.
    spread = model.evaluate(_dataset_fn(data), steps=8, verbose=0, return_dict=True)
    assert set(spread) == {"loss", "mae"}
    np.testing.assert_allclose(spread["loss"], exact["loss"], rtol=0.5)


def test_bad_input_is_a_clear_error(strategy, data):
    import tensorflow as tf

    x, y = data
    model = _model(strategy)
    with pytest.raises(ValueError, match=r"steps_per_epoch is required .*cannot know where"):
        model.fit(_dataset_fn(data), epochs=1, verbose=0)
    with pytest.raises(ValueError, match=r"x must be a function .*Received: x of type ndarray"):
        model.fit(x, y, steps_per_epoch=2, verbose=0)
    with pytest.raises(ValueError, match=r"Received: x of type list"):
        model.fit([1, 2], steps_per_epoch=2, verbose=0)
    with pytest.raises(ValueError, match=r"infinite dataset .*Received: steps=None"):
        model.evaluate(tf.data.Dataset.from_tensor_slices((x, y)).batch(8).repeat(), verbose=0)
    with pytest.raises(ValueError, match=r"steps is required when x is a dataset function"):
        model.evaluate(_dataset_fn(data), verbose=0)
    with pytest.raises(ValueError, match=r"validation_steps is required"):
        model.fit(_dataset_fn(data), steps_per_epoch=1, verbose=0,
                  validation_data=_dataset_fn(data))


def test_upstream_keras_still_rejects_parameter_server_fit(strategy, data):
    """Fails once Keras 3 supports PS fit itself (keras-team/keras#18624)."""
    from tfdist.compat import ps_fit

    model = _model(strategy)
    with pytest.raises(ValueError):
        ps_fit.original("fit")(model, _dataset_fn(data), epochs=1, steps_per_epoch=2,
                               verbose=0)


def test_upstream_assign_add_is_still_read_modify_write():
    """Fails once Keras makes assign_add a native increment (retire the fix)."""
    from tfdist.compat import ps_variables

    assert ps_variables.upstream_assign_add_is_read_modify_write()

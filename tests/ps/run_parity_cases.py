"""Users' programs under the parameter_server preset, asynchronous (in-process cluster, 2 workers).

Run by tests/ps/test_fit.py in the same pytest process as tests/ps/run_fit_cases.py
(one cluster for both: tests/ps/shared_cluster.py). Each program of
tests/ps/parity_programs.py must take exactly the steps it takes on one device
with a finite loss that falls (two workers update asynchronously, so the
values themselves differ from one device; tests/ps/test_parity.py checks
equality with one worker). Then the negative control of the lookup-table
fixes and the errors that remain.
"""

import math

import numpy as np
import pytest

from tests.ps import parity_programs, shared_cluster

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def strategy():
    return shared_cluster.strategy()


def _trains(name, strategy, tmp_path):
    program, steps = parity_programs.PROGRAMS[name]
    result = program(strategy, str(tmp_path))
    losses = result["losses"]
    assert losses and all(math.isfinite(v) for v in losses), (name, losses)
    if steps is not None:
        assert result["steps"] == steps, (name, result["steps"], steps)
    return result


@pytest.mark.parametrize("name", ["class_weights", "py_dataset", "captured_dataset",
                                  "string_lookup_function", "string_lookup_dataset",
                                  "optimizer_outside_scope"])
def test_program_trains_with_exact_steps(name, strategy, tmp_path):
    result = _trains(name, strategy, tmp_path)
    first_fit = result["losses"][:3 if name != "captured_dataset" else 2]
    assert first_fit[-1] < first_fit[0], (name, result["losses"])


def test_validation_with_early_stopping_reduce_lr_and_tensorboard(strategy, tmp_path):
    result = _trains("validation_callbacks", strategy, tmp_path)
    epochs = result["epochs"]
    assert 1 <= epochs < 12, result  # EarlyStopping ended it
    assert result["steps"] == epochs * 6
    assert len(result["learning_rates"]) == epochs
    assert result["learning_rates"][-1] < result["learning_rates"][0]  # ReduceLROnPlateau
    assert {"train", "validation"} <= set(result["tensorboard"])


def test_evaluate_predict_and_validation_inside_the_scope(strategy, tmp_path):
    result = _trains("inside_scope", strategy, tmp_path)
    x, y = parity_programs._classification(64, seed=3)
    # Exact, on the coordinator: the evaluate values are those of the final weights.
    probabilities = result["predictions"]
    expected = -np.mean(np.log(probabilities[np.arange(len(y)), y]))
    np.testing.assert_allclose(result["losses"][-2], expected, rtol=1e-5)
    np.testing.assert_allclose(result["losses"][-1],
                               np.mean(probabilities.argmax(1) == y), rtol=1e-6)


def test_jit_compiled_model_trains_on_workers_and_evaluates_here(strategy, tmp_path):
    result = _trains("jit_compiled", strategy, tmp_path)
    assert result["predictions"].shape == (16, 2)
    assert result["losses"][1] < result["losses"][0]


def test_checkpoint_path_formats_the_batch_loss(strategy, tmp_path):
    result = _trains("checkpoint_with_loss", strategy, tmp_path)
    # save_freq=4 over 12 steps: 3 saves, each named with a batch loss (names may repeat).
    assert 1 <= len(result["checkpoints"]) <= 3
    for name in result["checkpoints"]:
        assert math.isfinite(float(name[len("model-loss="):-len(".keras")])), name
    assert all(math.isfinite(v) for v in result["loaded_losses"])


def test_saved_model_loads_compiled_and_evaluates_the_same(strategy, tmp_path):
    result = _trains("saved_and_loaded", strategy, tmp_path)
    assert result["loaded_compiled"]
    trained, loaded = result["losses"][:2], result["losses"][2:]
    np.testing.assert_allclose(loaded, trained, rtol=1e-6)


@pytest.mark.parametrize("name", ["gpt2_causal_lm_dataset", "gpt2_causal_lm_per_worker"])
def test_kerashub_causal_lm_with_its_bpe_preprocessor(name, strategy, tmp_path):
    pytest.importorskip("keras_hub", reason="KerasHub is an optional test dependency")
    result = _trains(name, strategy, tmp_path)
    assert result["losses"][-1] < result["losses"][0]


def test_arrays_evaluate_exactly_once_over_the_workers(strategy):
    """evaluate(x, y) with pss_evaluation_shards: Keras's batches, sharded over the workers."""
    import keras

    x, y = parity_programs._classification(100, seed=6)  # 4 batches of 32, the last of 4
    weights = np.linspace(0.5, 1.5, len(y)).astype("float32")
    model = parity_programs._classifier(strategy)
    with strategy.scope():
        model.compile(keras.optimizers.Adam(0.05), "sparse_categorical_crossentropy",
                      weighted_metrics=["accuracy"], pss_evaluation_shards=3)
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    on_workers = model.evaluate(x, y, sample_weight=weights, verbose=0, return_dict=True)
    probabilities = model.predict(x, verbose=0)
    per_example = -np.log(probabilities[np.arange(len(y)), y])
    np.testing.assert_allclose(on_workers["loss"],
                               np.sum(per_example * weights) / len(y), rtol=1e-5)
    np.testing.assert_allclose(on_workers["accuracy"], np.sum(
        (probabilities.argmax(1) == y) * weights) / np.sum(weights), rtol=1e-5)


def test_lookup_in_a_cond_fails_without_the_table_fixes(strategy):
    """Negative control and canary: TensorFlow's own path leaves the per-worker table's
    handle unfed inside tf.cond (both routes)."""
    import tensorflow as tf

    from tfdist.compat import _patch, ps_tables
    from tfdist.ps import trainer as trainer_lib

    with strategy.scope():
        table = tf.lookup.StaticHashTable(
            tf.lookup.KeyValueTensorInitializer(["a", "b"], [1, 2]), default_value=-1)

    def dataset_fn(input_context):
        words = tf.data.Dataset.from_tensor_slices(["a", "b", "c"]).repeat()
        return words.map(lambda w: tf.cond(tf.strings.length(w) > 0,
                                           lambda: table.lookup(w),
                                           lambda: tf.constant(-5)))

    coordinator = trainer_lib.coordinator_for(strategy)

    @tf.function
    def step(iterator):
        return next(iterator)

    def first_values(x):
        from tfdist.ps import data as data_lib

        iterator = iter(coordinator.create_per_worker_dataset(
            data_lib.for_workers(x, strategy)))
        values = [coordinator.schedule(step, args=(iterator,)) for _ in range(6)]
        coordinator.join()
        return {int(v.fetch()) for v in values}

    # Each worker reads a, b, c, a, ...: 6 steps over 2 workers reach c (-1) on one at least.
    assert first_values(dataset_fn) == {1, 2, -1}
    assert first_values(dataset_fn(None)) == {1, 2, -1}
    _patch.uninstall(ps_tables.names())
    try:
        for x in (dataset_fn, dataset_fn(None)):
            with pytest.raises(Exception, match="must feed a value for placeholder"):
                first_values(x)
    finally:
        ps_tables.install()


def test_forms_that_cannot_work_are_refused_clearly(strategy):
    import tensorflow as tf

    x, y = parity_programs._classification()
    model = parity_programs._classifier(strategy)
    with pytest.raises(ValueError, match=r"steps_per_epoch is required .*dataset function"):
        model.fit(lambda ctx: tf.data.Dataset.from_tensor_slices((x, y)).batch(8), verbose=0)
    with pytest.raises(ValueError, match=r"repeats forever.*steps_per_epoch=N"):
        model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(8).repeat(), verbose=0)
    with pytest.raises(ValueError, match=r"number of batches in x is unknown"):
        model.fit(tf.data.Dataset.from_tensor_slices((x, y)).filter(lambda a, b: b > 0)
                  .batch(8), verbose=0)
    with pytest.raises(ValueError, match=r"does not take batch_size when x is a dataset"):
        model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(8), batch_size=8, verbose=0)
    with pytest.raises(ValueError, match=r"Received: x of type list"):
        model.fit([1, 2], steps_per_epoch=2, verbose=0)

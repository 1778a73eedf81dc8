"""Presets train Keras 3 models and match the single-device run."""

import numpy as np
import pytest

import tfdist

TOLERANCE = 1e-5  # fp32; measured differences are ~2e-7


def _train(strategy, *, global_batch_size=32, epochs=2, seed=7):
    import keras

    rng = np.random.default_rng(0)
    x = rng.standard_normal((256, 8)).astype("float32")
    y = (x @ rng.standard_normal((8, 1))).astype("float32")
    with strategy.scope():
        keras.utils.set_random_seed(seed)
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                                  keras.layers.Dense(1)])
        model.compile(keras.optimizers.SGD(0.05), "mse")
    history = model.fit(x, y, batch_size=global_batch_size, epochs=epochs, shuffle=False,
                        verbose=0)
    return [w.numpy() for w in model.weights], history.history["loss"]


def _max_diff(a, b):
    return max(float(np.abs(x - y).max()) for x, y in zip(a, b))


@pytest.fixture(scope="module")
def single_device_run():
    return _train(tfdist.make_strategy("default"))


@pytest.mark.parametrize("num_devices", [2, 4])
def test_mirrored_matches_single_device(single_device_run, num_devices):
    strategy = tfdist.make_strategy("mirrored", num_devices=num_devices)
    assert strategy.num_replicas_in_sync == num_devices
    weights, losses = _train(strategy)
    assert _max_diff(weights, single_device_run[0]) < TOLERANCE
    np.testing.assert_allclose(losses, single_device_run[1], rtol=1e-5)


@pytest.mark.parametrize("cross_device_ops", ["ring", "reduction_to_one_device",
                                              "hierarchical_copy"])
def test_every_cpu_reduction_matches_single_device(single_device_run, cross_device_ops):
    strategy = tfdist.make_strategy("mirrored", num_devices=2, cross_device_ops=cross_device_ops)
    weights, _ = _train(strategy)
    assert _max_diff(weights, single_device_run[0]) < TOLERANCE


def test_strategies_can_be_made_again_with_other_device_counts(single_device_run):
    # Without tfdist.compat.collective_keys the second strategy
    # poisons the process ("joining a group with size4, but that group has size 2").
    for num_devices in (2, 4, 2):
        weights, _ = _train(tfdist.make_strategy("mirrored", num_devices=num_devices))
        assert _max_diff(weights, single_device_run[0]) < TOLERANCE


def test_explicit_devices_and_one_device():
    strategy = tfdist.make_strategy("mirrored", devices=["/cpu:1", "/cpu:3"])
    assert [d.split("/")[-1] for d in strategy.extended.worker_devices] == ["device:CPU:1",
                                                                          "device:CPU:3"]
    one = tfdist.make_strategy("one_device", device="/cpu:2")
    _train(one, epochs=1)
    assert "CPU:2" in one.extended.worker_devices[0]


def test_mirrored_defaults_to_all_logical_cpus(logical_cpus):
    assert tfdist.make_strategy("mirrored").num_replicas_in_sync == logical_cpus


def test_options_object_is_accepted():
    strategy = tfdist.make_strategy(tfdist.MirroredOptions(num_devices=2))
    assert strategy.num_replicas_in_sync == 2
    with pytest.raises(ValueError, match="not both"):
        tfdist.make_strategy(tfdist.MirroredOptions(), num_devices=2)


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(num_devices=8), "num_devices=8 but this process has only 4 logical CPU device(s)"),
    (dict(devices=["/cpu:0", "/cpu:9"]), "Device '/cpu:9' does not exist in this process"),
    (dict(devices=["/gpu:0"]), "Device '/gpu:0' does not exist"),
    (dict(cross_device_ops="nccl"), "cross_device_ops='nccl' needs every device to be a GPU"),
])
def test_mirrored_rejects_what_this_machine_cannot_do(kwargs, fragment):
    with pytest.raises(ValueError) as e:
        tfdist.make_strategy("mirrored", **kwargs)
    assert fragment in str(e.value)


def test_describe_shows_replicas_devices_and_per_replica_batch():
    text = tfdist.describe(tfdist.make_strategy("mirrored", num_devices=4), 512)
    assert "4 replica(s)" in text and "CPU:3" in text and "512 = 4 x 128 per replica" in text
    with pytest.raises(ValueError, match="global_batch_size=30"):
        tfdist.describe(tfdist.make_strategy("mirrored", num_devices=4), 30)


def test_summaries_name_strategies_as_tf_distribute_exports_them():
    import tensorflow as tf

    from tfdist.strategies import strategy_name

    assert tfdist.describe(tfdist.make_strategy("mirrored", num_devices=2)).startswith(
        "MirroredStrategy: 2 replica(s) on ")
    assert strategy_name(tfdist.make_strategy("one_device")) == "OneDeviceStrategy"
    assert strategy_name(tfdist.make_strategy("default")) == "default strategy"
    # Their classes' own names are what summaries used to print (the 2-worker summary itself
    # is checked in tests/launch/test_output.py); instances made without their cluster.
    mwms = tf.distribute.MultiWorkerMirroredStrategy
    ps = tf.distribute.ParameterServerStrategy
    assert (mwms.__name__, ps.__name__) == ("CollectiveAllReduceStrategy",
                                            "ParameterServerStrategyV2")
    assert strategy_name(object.__new__(mwms)) == "MultiWorkerMirroredStrategy"
    assert strategy_name(object.__new__(
        tf.distribute.experimental.MultiWorkerMirroredStrategy)) == "MultiWorkerMirroredStrategy"
    assert strategy_name(object.__new__(ps)) == "ParameterServerStrategy"

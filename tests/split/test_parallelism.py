"""split_model and sequence_parallel run a tfdist.Parallelism: the planner's, or a strategy's.

On the 4 logical CPUs of tests/conftest.py. Numbers are compared with the
unsplit model (same seed, same batches, same order) in fp32 within the split
tests' tolerance.
"""

import numpy as np
import pytest

import keras

import tfdist
from tfdist import planning
from tfdist.planning import planner
from tfdist.split.sequence_parallel import SequenceParallelModel

from tests.split.test_sequence_parallel import LOSS, _data, causal_lm
from tests.support import assert_fit_matches

TOL = 1e-5  # tests/split/test_split_model.py's
RNG = np.random.default_rng(0)
X = RNG.standard_normal((32, 32)).astype("float32")
Y = RNG.standard_normal((32, 1)).astype("float32")
CPUS = ["/device:CPU:0", "/device:CPU:1", "/device:CPU:2", "/device:CPU:3"]


def mlp(seed=1):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((32,))] + [
        keras.layers.Dense(32, activation="tanh", name=f"d{i}") for i in range(6)] + [
        keras.layers.Dense(1, name="out")])


def _recommendation(monkeypatch):
    """tfdist.plan on 4 devices too small for one replica's state: 2 pipelines of 2 stages."""
    monkeypatch.setattr(planner, "VARIANTS", ())  # an installation without sharding
    per_layer = (32 * 32 + 32) * 4 * 4  # weights, grads, 2 Adam slots
    machine = planning.Machine(device=planning.Device(kind="CPU", memory=int(per_layer * 4.5)),
                               num_devices=4, link=planning.Link(bandwidth=1e9))
    return tfdist.plan(mlp(), global_batch_size=16, machine=machine)


def test_the_plans_parallelism_runs_as_it_is_and_equals_one_device(monkeypatch):
    rec = _recommendation(monkeypatch)
    assert rec.recommended == "split"
    assert rec.parallelism == tfdist.Parallelism(replicas=2, stages=2, micro_batches=4)
    assert "parallelism=recommendation.parallelism" in rec.reasons[-1]
    split = tfdist.split_model(mlp(), parallelism=rec.parallelism)
    assert split.replica_devices == [CPUS[:2], CPUS[2:]]
    assert split.strategy.num_replicas_in_sync == 2 and split.micro_batches == 4
    assert split.parallelism == rec.parallelism.replace(devices=tuple(CPUS))
    ref = mlp()
    ref.compile(keras.optimizers.Adam(0.01), "mse")
    with split.strategy.scope():  # Adam's slots are mirrored variables: made in the scope
        split.compile(keras.optimizers.Adam(0.01), "mse")
    assert_fit_matches(split, ref, X, Y, tol=TOL, batch_size=16)
    for variable in split.trainable_variables:  # every replica's copy identical
        copies = [np.asarray(v) for v in split.strategy.experimental_local_results(variable.value)]
        assert len(copies) == 2 and all(np.array_equal(copies[0], c) for c in copies), variable


def test_the_old_keywords_describe_the_same_parallelism():
    dims = tfdist.Parallelism(replicas=2, stages=2, micro_batches=2, schedule="gpipe")
    by_keywords = tfdist.split_model(mlp(), devices=["/cpu:0", "/cpu:1", "/cpu:2", "/cpu:3"],
                                     replicas=2, micro_batches=2, schedule="gpipe")
    by_dims = tfdist.split_model(mlp(), parallelism=dims)
    assert by_keywords.parallelism == by_dims.parallelism == dims.replace(devices=tuple(CPUS))
    assert by_keywords.replica_devices == by_dims.replica_devices == [CPUS[:2], CPUS[2:]]
    assert by_keywords.plan.stages == by_dims.plan.stages


def test_a_strategy_made_from_a_parallelism_runs_the_split():
    dims = tfdist.Parallelism(replicas=2, stages=2, micro_batches=2)
    strategy = tfdist.make_strategy(dims)
    assert strategy.extended.worker_devices == (
        "/job:localhost/replica:0/task:0/device:CPU:0",
        "/job:localhost/replica:0/task:0/device:CPU:2")
    split = tfdist.split_model(mlp(), strategy=strategy)
    assert split.strategy is strategy and split.replica_devices == [CPUS[:2], CPUS[2:]]
    ref = mlp()
    for m in (split, ref):
        m.compile(keras.optimizers.SGD(0.05), "mse")
    assert_fit_matches(split, ref, X, Y, tol=TOL, batch_size=16, epochs=1)


def test_sequence_parallelism_through_split_model_equals_unsplit():
    x, y = _data("causal_lm")
    sp = tfdist.split_model(causal_lm(), parallelism=tfdist.Parallelism(replicas=2, sequence=2))
    assert isinstance(sp, SequenceParallelModel)
    assert sp.replica_devices == [CPUS[:2], CPUS[2:]] and sp.strategy.num_replicas_in_sync == 2
    ref = causal_lm()
    for m in (sp, ref):
        m.compile(keras.optimizers.SGD(0.1), LOSS)
    assert_fit_matches(sp, ref, x, y, tol=TOL, epochs=1)


@pytest.mark.parametrize("kwargs, message", [
    (dict(parallelism=tfdist.Parallelism(stages=2), devices=["/cpu:0", "/cpu:1"]),
     "devices are part of the Parallelism"),
    (dict(parallelism=tfdist.Parallelism(stages=2), micro_batches=2),
     "micro_batches are part of the Parallelism"),
    (dict(parallelism={"stages": 2}), "parallelism must be a tfdist.Parallelism"),
    (dict(parallelism=tfdist.Parallelism(replicas=2, shard="optimizer")),
     "split_model does not run shard='optimizer'"),
    (dict(parallelism=tfdist.Parallelism(stages=2, tensor=2)), "name them, e.g. tensor_parallel="),
    (dict(parallelism=tfdist.Parallelism(stages=8)), "configure_logical_devices(8)"),
    (dict(parallelism=tfdist.Parallelism(sequence=2), balance_by="flops"),
     "balance_by shape a pipeline"),
])
def test_a_parallelism_split_model_cannot_run_is_a_clear_error(kwargs, message):
    with pytest.raises(ValueError) as info:
        tfdist.split_model(mlp(), **kwargs)
    assert message in str(info.value), str(info.value)


def test_a_strategy_without_a_parallelism_is_refused():
    import tensorflow as tf

    with pytest.raises(ValueError, match="carries the Parallelism to run"):
        tfdist.split_model(mlp(), strategy=tf.distribute.get_strategy())
    with pytest.raises(ValueError, match="not both"):
        tfdist.split_model(mlp(), strategy=tf.distribute.get_strategy(),
                           parallelism=tfdist.Parallelism(stages=2))

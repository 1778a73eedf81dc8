"""tfdist.compat.keras_multi_worker and keras_build: still needed, shape-checked, pass-through.

The canary runs a real 2-worker `fit` (tfdist's launcher, 127.0.0.1) with the
fixes uninstalled and sees both upstream failures (keras-team/keras#20585).
When it fails because stock Keras trains, upstream fixed the bug: drop the
fix. tests/multi_worker/test_end_to_end.py shows the fixes make 2-worker `fit` match a
single replica.
"""

import io
import os
import sys

import numpy as np
import pytest

import tfdist
from tests.support import REPO, alive
from tfdist.compat import _patch, keras_build, keras_multi_worker


def _trainer():
    from keras.src.backend.tensorflow import trainer

    return trainer


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_canary_stock_keras_still_fails_two_worker_fit_and_the_fixes_repair_it(tmp_path):
    from tfdist import launch as launch_lib

    out, err = io.StringIO(), io.StringIO()
    result = launch_lib.launch(
        [sys.executable,
         os.path.join(REPO, "tests", "compat", "run_keras_multi_worker_canary.py"),
         str(tmp_path)],
        num_workers=2, timeout=240, grace_period=3.0, stdout=out, stderr=err,
        env=dict(os.environ, PYTHONPATH=REPO))
    text = out.getvalue()
    assert all(not alive(t.pid) for t in result.tasks)
    assert result.returncode == 0, text[-3000:] + err.getvalue()[-3000:]
    for worker in (0, 1):
        lines = {line.split("] ", 1)[1].split(": ", 1)[0]: line.split(": ", 1)[1]
                 for line in text.splitlines() if line.startswith(f"[worker:{worker}] ")
                 and ": " in line}
        assert "Attempt to convert a value (PerReplica" in lines["stock"], (
            "stock Keras no longer fails 2-worker fit in _maybe_symbolic_build: "
            f"keras-team/keras#20585 may be fixed; re-check {keras_build.SYMBOLIC_BUILD}."
            f"\n{text}")
        assert "Invalid reduction dimension 0" in lines["symbolic_build_only"], (
            "stock Keras no longer reduces scalar logs with axis=0 in multi-worker fit: "
            f"re-check {keras_multi_worker.REDUCE_PER_REPLICA}.\n{text}")
        assert lines["fixed"] == "OK", text
    w0, w1 = np.load(tmp_path / "worker0.npy"), np.load(tmp_path / "worker1.npy")
    np.testing.assert_array_equal(w0, w1)
    assert np.abs(w0 - np.array([.5, .5, .5, .5, 0], "float32")).max() > 1e-2  # it trained


def test_fixes_install_together_pass_through_and_uninstall():
    import keras
    import tensorflow as tf

    # Earlier tests in this process made strategies, which install keras_build's fix for
    # every preset: start from stock Keras so install() reports both fixes as new.
    tfdist.compat.uninstall()
    trainer = _trainer()
    stock = (trainer.TensorFlowTrainer._maybe_symbolic_build, trainer.reduce_per_replica)
    # Every make_strategy installs keras_build's fix: start without it, whatever ran before.
    tfdist.compat.uninstall([keras_build.SYMBOLIC_BUILD])
    with tfdist.compat.uninstall_after():
        assert set(keras_multi_worker.install()) == {keras_build.SYMBOLIC_BUILD,
                                                     keras_multi_worker.REDUCE_PER_REPLICA}
        assert keras_multi_worker.install() == ()  # idempotent
        assert trainer.reduce_per_replica is not stock[1]

        # On one machine (reduce_per_replica passes through there) mirrored equals plain fit.
        x = np.random.default_rng(0).standard_normal((64, 4)).astype("float32")
        y = x.sum(1, keepdims=True)

        def fit(strategy):
            with strategy.scope():
                model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
                model.set_weights([np.ones((4, 1), "float32"), np.zeros(1, "float32")])
                model.compile(keras.optimizers.SGD(0.1), "mse")
            model.fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=False)
            return model.get_weights()[0]

        mirrored = fit(tfdist.make_strategy("mirrored", devices=("/cpu:0", "/cpu:1")))
        plain = fit(tf.distribute.get_strategy())
        np.testing.assert_allclose(mirrored, plain, atol=1e-6)
    assert (trainer.TensorFlowTrainer._maybe_symbolic_build, trainer.reduce_per_replica) == stock


def test_a_changed_signature_is_refused_naming_both_shapes():
    def other(self, iterator=None):  # as if Keras dropped `data_batch`
        return None

    with pytest.raises(_patch.CompatError, match=r"takes \(iterator\); the tfdist fix was "
                                                 r"written for \(iterator, data_batch\)"):
        keras_build.SYMBOLIC_BUILD_FIX.check(other)
    with pytest.raises(_patch.CompatError, match=r"written for \(values, strategy, reduction\)"):
        keras_multi_worker.REDUCE_PER_REPLICA_FIX.check(lambda values, strategy: values)


def test_an_epoch_iterator_without_its_distributed_dataset_is_refused(monkeypatch):
    class OtherEpochIterator:  # keeps its dataset under another name
        def __init__(self, distribute_strategy=None, *args, **kwargs):
            self._dataset = None

    trainer = _trainer()
    monkeypatch.setattr(trainer, "TFEpochIterator", OtherEpochIterator)
    with pytest.raises(_patch.CompatError, match="no longer keeps its dataset in "
                                                 "self._distributed_dataset"):
        keras_build.SYMBOLIC_BUILD_FIX.check(
            trainer.TensorFlowTrainer._maybe_symbolic_build)


def test_the_build_reads_per_replica_specs_and_refuses_another_dataset():
    import tensorflow as tf

    class Iterator:
        _distributed_dataset = tf.data.Dataset.range(3)  # not distributed

    with pytest.raises(_patch.CompatError, match="holds _?RangeDataset in _distributed_dataset, "
                                                 "not a tf.distribute.DistributedDataset"):
        keras_build.replica_batch_spec(Iterator())
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])  # a PerReplicaSpec
    dataset = tf.data.Dataset.from_tensors(({"ids": tf.zeros([4, 3], tf.int32)},
                                            tf.constant(["a"] * 4))).batch(2)
    Iterator._distributed_dataset = strategy.experimental_distribute_dataset(dataset)
    spec = keras_build.replica_batch_spec(Iterator())
    assert spec[0]["ids"].shape.as_list() == [None, 4, 3]  # one replica's: None, not 2
    assert spec[0]["ids"].dtype == tf.int32 and spec[1].dtype == tf.string

"""The Keras 3 multi-worker fixes still target code that has the bug.

If one of these fails after a Keras upgrade, upstream changed the patched code
(keras-team/keras#20585): re-check tfdist/compat/keras_multi_worker.py, and
drop the fix if upstream fixed the bug. tests/test_multi_worker.py shows the
fixes make 2-worker `model.fit` match a single replica.
"""

import inspect

import numpy as np

import tfdist
from tfdist.compat import keras_multi_worker


def _trainer():
    from keras.src.backend.tensorflow import trainer

    return trainer


def test_patched_functions_still_exist_with_the_expected_signatures():
    trainer = _trainer()
    build = getattr(trainer.TensorFlowTrainer._maybe_symbolic_build, "__tfdist_original__",
                    trainer.TensorFlowTrainer._maybe_symbolic_build)
    assert list(inspect.signature(build).parameters) == ["self", "iterator", "data_batch"]
    reduce = getattr(trainer.reduce_per_replica, "__tfdist_original__",
                     trainer.reduce_per_replica)
    assert list(inspect.signature(reduce).parameters) == ["values", "strategy", "reduction"]
    assert callable(trainer._collective_all_reduce_multi_worker)
    assert callable(trainer.TensorFlowTrainer._symbolic_build)


def test_upstream_still_has_both_bugs():
    # _maybe_symbolic_build still reduces the (nested) first batch across
    # workers, and reduce_per_replica still reduces scalars with axis=0.
    assert keras_multi_worker.symbolic_build_fix_needed(), (
        "Keras no longer reduces the first batch in _maybe_symbolic_build: "
        "keras-team/keras#20585 may be fixed; re-check the symbolic_build fix.")
    assert keras_multi_worker.reduce_per_replica_fix_needed(), (
        "Keras no longer reduces scalar logs with axis=0: re-check the reduce_per_replica fix.")


def test_apply_is_idempotent_and_leaves_single_worker_fit_unchanged():
    first = keras_multi_worker.apply()
    trainer = _trainer()
    patched = (trainer.TensorFlowTrainer._maybe_symbolic_build, trainer.reduce_per_replica)
    assert keras_multi_worker.apply() == first == {"symbolic_build": True,
                                                   "reduce_per_replica": True}
    assert (trainer.TensorFlowTrainer._maybe_symbolic_build,
            trainer.reduce_per_replica) == patched
    assert trainer.reduce_per_replica.__tfdist_original__ is not trainer.reduce_per_replica

    # Single-machine strategies take Keras's own path: same result as plain fit.
    import keras

    x = np.random.default_rng(0).standard_normal((64, 4)).astype("float32")
    y = x.sum(1, keepdims=True)

    def fit(strategy):
        with strategy.scope():
            model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
            model.set_weights([np.ones((4, 1), "float32"), np.zeros(1, "float32")])
            model.compile(keras.optimizers.SGD(0.1), "mse")
        model.fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=False)
        return model.get_weights()[0]

    import tensorflow as tf

    mirrored = fit(tfdist.make_strategy("mirrored", devices=("/cpu:0", "/cpu:1")))
    plain = fit(tf.distribute.get_strategy())
    np.testing.assert_allclose(mirrored, plain, atol=1e-6)

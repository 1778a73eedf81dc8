"""An optimizer made before `strategy.scope()` trains as on one device (adopt_optimizer).

Keras 3's optimizer keeps the strategy it was created under (keras-team/keras#17187): made
outside the scope of the strategy it then trains under, it fails when it builds its slots
("Mixing different tf.distribute.Strategy objects"). These tests cover the custom-training
tutorial's loop, where the optimizer is built inside `strategy.run`, on every replica; `fit`
is covered by the `optimizer_outside_scope` pattern (tests/compat/test_sync_programs.py) and
by the corpus's kerashub_gpt2_lora. Reference: the same model, seed, initial weights and
global batch on one device. Negative control: the same tfdist strategy with the fix taken out
fails as stock Keras does.
"""

import re

import numpy as np
import pytest

import tfdist
from tests.support import max_abs_difference, one_device, tutorial_custom_loop

TOLERANCE = 1e-6  # float32, 4 steps: summation order only
GLOBAL_BATCH, STEPS = 8, 4


def _data():
    rng = np.random.default_rng(5)
    x = rng.normal(size=(GLOBAL_BATCH * STEPS, 4)).astype("float32")
    return x, 2 * x[:, :2] - x[:, 2:]


def _train(strategy, make_optimizer, *, outside=True):
    import keras

    # Before the scope, as keras.io's examples do; the reference makes it inside (its
    # OneDeviceStrategy is a strategy too, and stock Keras).
    optimizer = make_optimizer() if outside else None
    with strategy.scope():
        optimizer = optimizer or make_optimizer()
        keras.utils.set_random_seed(1)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(6, activation="relu"),
                                  keras.layers.Dense(2)])
    x, y = _data()
    tutorial_custom_loop(strategy, model, optimizer, x, y, GLOBAL_BATCH)
    return model.get_weights(), optimizer


OPTIMIZERS = {
    "adam": lambda: __import__("keras").optimizers.Adam(0.05),
    "sgd_momentum_schedule": lambda: __import__("keras").optimizers.SGD(
        __import__("keras").optimizers.schedules.ExponentialDecay(0.1, 2, 0.5), momentum=0.9),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_custom_loop_with_an_optimizer_made_outside_the_scope(name):
    reference, _ = _train(one_device(), OPTIMIZERS[name], outside=False)
    strategy = tfdist.make_strategy("mirrored", num_devices=2)
    weights, optimizer = _train(strategy, OPTIMIZERS[name])
    assert max_abs_difference(weights, reference) < TOLERANCE
    # One step per batch (a counter left outside the strategy would count each replica's).
    assert int(optimizer.iterations.numpy()) == STEPS
    assert optimizer.variables[0] is optimizer._iterations  # the same Keras variable, adopted
    assert tfdist.replica_spread(optimizer.variables) == 0.0


def test_without_the_fix_the_custom_loop_fails_as_stock_keras():
    from tfdist.compat import _patch, keras_build

    strategy = tfdist.make_strategy("mirrored", num_devices=2)
    assert keras_build.ADOPT_OPTIMIZER in _patch.installed()
    _patch.uninstall([keras_build.ADOPT_OPTIMIZER])
    try:
        with pytest.raises(RuntimeError, match="Mixing different tf.distribute.Strategy objects"):
            _train(strategy, OPTIMIZERS["adam"])
    finally:
        keras_build.install()
    assert keras_build.ADOPT_OPTIMIZER in _patch.installed()



def _made_under(strategy, make_optimizer):
    def make():
        with strategy.scope():
            return make_optimizer()

    return make


def test_an_optimizer_from_an_earlier_tfdist_strategy_moves_onto_the_new_one():
    # A notebook whose strategy cell ran again: the optimizer was made under the first
    # strategy, the model and the training under the second.
    reference, _ = _train(one_device(), OPTIMIZERS["adam"], outside=False)
    earlier = tfdist.make_strategy("mirrored", num_devices=2)
    strategy = tfdist.make_strategy("mirrored", num_devices=2)
    weights, optimizer = _train(strategy, _made_under(earlier, OPTIMIZERS["adam"]))
    assert max_abs_difference(weights, reference) < TOLERANCE
    assert int(optimizer.iterations.numpy()) == STEPS
    assert optimizer._distribution_strategy is strategy
    assert tfdist.replica_spread(optimizer.variables) == 0.0


def test_an_optimizer_from_a_users_strategy_is_a_clear_error_and_the_user_keeps_keras():
    import tensorflow as tf

    user = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    strategy = tfdist.make_strategy("mirrored", num_devices=2)
    # Not tfdist's to move: what was received, why, and how to fix it.
    with pytest.raises(RuntimeError, match=r"This Adam optimizer was created under "
                       r"MirroredStrategy at 0x[0-9a-f]+, which tfdist did not make, and is "
                       r"being built under tfdist's MirroredStrategy.*Create the optimizer "
                       r"inside `with strategy.scope\(\):` of the strategy you train with"):
        _train(strategy, _made_under(user, OPTIMIZERS["adam"]))
    # Built under the user's own strategy, an optimizer made under tfdist's is stock Keras.
    with pytest.raises(RuntimeError, match="Mixing different tf.distribute.Strategy objects"):
        _train(user, _made_under(strategy, OPTIMIZERS["adam"]))


def test_without_the_fix_an_earlier_strategys_optimizer_fails_as_stock_keras():
    from tfdist.compat import _patch, keras_build

    earlier = tfdist.make_strategy("mirrored", num_devices=2)
    strategy = tfdist.make_strategy("mirrored", num_devices=2)
    _patch.uninstall([keras_build.ADOPT_OPTIMIZER])
    try:
        with pytest.raises(RuntimeError, match="Mixing different tf.distribute.Strategy objects"):
            _train(strategy, _made_under(earlier, OPTIMIZERS["adam"]))
    finally:
        keras_build.install()


_BEFORE_THE_CLUSTER = """
import numpy as np, keras, tfdist
optimizer = keras.optimizers.Adam(0.01)  # before the strategy: on /job:localhost
strategy = tfdist.make_strategy("parameter_server", local_workers=1, local_ps=1)
with strategy.scope():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    model.compile(optimizer, "mse")
try:
    model.fit(np.ones((16, 4), "float32"), np.ones((16, 2), "float32"), batch_size=8, verbose=0)
except RuntimeError as e:
    print("ERROR", e)
"""


@pytest.mark.timeout(180)
def test_an_optimizer_made_before_the_parameter_server_cluster_is_a_clear_error():
    # The in-process cluster renames this process's devices: the optimizer's variables, made
    # before it, cannot be read any more, so they cannot be moved (in a process of its own).
    import os
    import subprocess
    import sys

    from tests.support import REPO

    proc = subprocess.run([sys.executable, "-c", _BEFORE_THE_CLUSTER], capture_output=True,
                          text=True, timeout=150, cwd=REPO,
                          env=dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert re.search(r"ERROR This Adam optimizer's variable 'adam/iteration' lives on "
                     r"/job:localhost/\S+, which this process cannot reach any more \(.*\): the "
                     r"optimizer was created before tfdist's ParameterServerStrategy\w* "
                     r"connected the process to its cluster. Create the optimizer after "
                     r"`tfdist.make_strategy\(...\)`", proc.stdout), proc.stdout[-3000:]

"""tfdist.compat.collective_keys: each tfdist MirroredStrategy gets its own collective keys.

When the canary fails after a TensorFlow upgrade, upstream changed: re-check
tfdist/compat/collective_keys.py (and drop it if upstream fixed the bug).
"""

import numpy as np

import tfdist
from tests.support import run_python

_COLLIDE = """
import tfdist
tfdist.configure_logical_devices(4)
import numpy as np, tensorflow as tf, keras
x = np.ones((32, 4), "float32")
for n in (2, 4):
    s = tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(n)])
    with s.scope():
        m = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)]); m.compile("sgd", "mse")
    try:
        m.fit(x, x[:, :1], batch_size=8, epochs=1, verbose=0)
        print("OK", n)
    except Exception as e:
        print(f"FAILED {n} {type(e).__name__}: {e}")
"""


def test_canary_stock_strategies_with_different_device_counts_still_collide():
    # Upstream behaviour the fix exists for: a second MirroredStrategy with
    # another device count collides on group key 1. Whether the collision
    # shows depends on which replica reaches the collective first, so one of
    # three fresh processes has to show it (measured: 5 of 6 fresh processes on TF 2.18.1,
    # which one earlier run had taken for "does not collide").
    outputs = []
    for _ in range(3):
        result = run_python("-c", _COLLIDE, timeout=120)
        assert "OK 2" in result.stdout, result.stdout + result.stderr
        outputs.append(result.stdout)
        if "FAILED 4" in result.stdout and "joining a group with size4" in (
                result.stdout + result.stderr):
            return
    raise AssertionError("MirroredStrategy no longer collides on collective keys (3 of 3 runs): "
                         "tfdist.compat.collective_keys may be unneeded now.\n"
                         + "\n---\n".join(outputs))


def test_tfdist_strategies_get_their_own_keys_and_users_strategies_keep_tensorflows():
    import keras
    import tensorflow as tf

    x = np.ones((48, 4), "float32")
    bases = []
    for n, cross_device_ops in ((2, "auto"), (4, "auto"), (3, "ring"), (2, "auto")):
        strategy = tfdist.make_strategy("mirrored", num_devices=n,
                                        cross_device_ops=cross_device_ops)
        bases.append(strategy.extended._collective_key_base)
        with strategy.scope():
            model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
            model.compile("sgd", "mse")
        model.fit(x, x[:, :1], batch_size=12, epochs=1, verbose=0)  # no collision
    assert len(set(bases)) == len(bases) and 0 not in bases
    assert tf.distribute.MirroredStrategy._collective_key_base == 0
    assert tf.distribute.MirroredStrategy(["/cpu:0"]).extended._collective_key_base == 0

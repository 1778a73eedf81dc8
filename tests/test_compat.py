"""Each compat fix is still needed, and still finds what it patches.

When one of these fails after a TensorFlow/Keras upgrade, upstream changed:
re-check the fix in tfdist/compat/ (and drop it if upstream fixed the bug).
"""

from tests.helpers import run_python

import tfdist.compat


def test_tested_versions_are_the_installed_ones():
    assert tfdist.compat.check_versions(warn=False), tfdist.compat.versions()


def test_collective_key_collision_still_happens_without_the_fix():
    # Upstream behaviour the fix exists for: a second MirroredStrategy with
    # another device count collides on group key 1.
    result = run_python("-c", """
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
""", timeout=120)
    assert "OK 2" in result.stdout, result.stdout + result.stderr
    collided = "FAILED 4" in result.stdout and "joining a group with size4" in (
        result.stdout + result.stderr)
    assert collided, ("MirroredStrategy no longer collides on collective keys: "
                      "tfdist.compat.collective_keys may be unneeded now.\n" + result.stdout)


def test_fresh_collective_key_base_moves_the_base():
    from tensorflow.python.distribute import mirrored_strategy

    first = tfdist.compat.fresh_collective_key_base()
    second = tfdist.compat.fresh_collective_key_base()
    assert second > first
    assert mirrored_strategy.MirroredStrategy._collective_key_base == second

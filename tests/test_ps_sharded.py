"""Sharded variables (variable partitioner) train under Keras 3 and match unsharded.

Runs tests/_ps_sharded_run.py in a fresh process: its cluster (1 worker, 2
ps) has another shape than test_ps.py's, and a process can only talk to one.
"""

import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.timeout(180)
def test_sharded_training_matches_unsharded():
    proc = subprocess.run(
        [sys.executable, os.path.join(HERE, "_ps_sharded_run.py"), "40"],
        capture_output=True, text=True, timeout=150,
        env={**os.environ, "PYTHONPATH": os.path.dirname(HERE)})
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    result = json.loads(lines[-1])
    assert result["iterations"] == 40
    assert result["min_change"] > 1e-4  # every weight trained
    assert result["max_abs_diff"] <= 1e-5
    assert result["save_roundtrip_diff"] == 0.0  # save_weights/load_weights of shards
    placement = result["placement"]
    # Embedding and Dense kernels are split over both ps tasks, and so are the
    # Adam slots created for them.
    for name in ("embedding/embeddings", "dense/kernel", "adam/embedding_embeddings_momentum",
                 "adam/dense_kernel_velocity"):
        assert sorted(placement[name]) == ["/job:ps/replica:0/task:0",
                                           "/job:ps/replica:0/task:1"], (name, placement)


def test_gradient_of_sharded_keras_variable_is_stitched():
    """tape.gradient w.r.t. a sharded Keras variable equals the unsharded gradient."""
    from tfdist._tf import import_tensorflow

    tf = import_tensorflow()
    from tensorflow.python.distribute.sharded_variable import ShardedVariable

    import keras
    from tfdist.compat import ps_variables

    ps_variables.install()
    table = tf.reshape(tf.range(12, dtype=tf.float32), (6, 2))
    shards = [tf.Variable(table[:4]), tf.Variable(table[4:])]
    sharded = keras.Variable(initializer=tf.zeros((6, 2)))
    sharded._value = ShardedVariable(shards)
    plain = keras.Variable(table)
    ids = tf.constant([0, 5, 5, 3])
    grads = []
    for var in (sharded, plain):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.gather(tf.convert_to_tensor(var.value), ids) ** 2)
        grads.append(tf.convert_to_tensor(tape.gradient(loss, [var])[0]))
    tf.debugging.assert_equal(grads[0], grads[1])
    assert ps_variables.is_sharded(sharded) and not ps_variables.is_sharded(plain)


def test_upstream_tape_still_fails_on_sharded_keras_variables():
    """Fails once Keras/TF differentiate sharded Keras variables themselves."""
    from tfdist._tf import import_tensorflow

    tf = import_tensorflow()
    from tensorflow.python.distribute.sharded_variable import ShardedVariable
    from tensorflow.python.eager import backprop

    import keras
    from tfdist.compat import ps_variables

    ps_variables.install()
    upstream = backprop.GradientTape.gradient.__wrapped__
    var = keras.Variable(initializer=tf.zeros((4, 2)))
    var._value = ShardedVariable([tf.Variable(tf.ones((2, 2))), tf.Variable(tf.ones((2, 2)))])
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(tf.convert_to_tensor(var.value))
    with pytest.raises(AttributeError, match="handle"):
        upstream(tape, loss, [var])

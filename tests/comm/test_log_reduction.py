"""tfdist.compat.keras_log_reduction: one collective for a multi-worker step's logs.

One 2-worker launch (tests/comm/run_log_reduction.py) fits a regression
model whose step logs three values (loss, mae, mse): with the fix, without it
(the canary: Keras's reduction, through tfdist's keras_multi_worker fix,
still launches one collective per value) and with steps_per_execution=4. The
logs and weights are checked against one device with the same global batch.
"""

import io
import json
import os
import sys

import numpy as np
import pytest

import tfdist
from tests.comm import run_log_reduction as run
from tests.support import REPO, alive
from tfdist.compat import _patch, keras_log_reduction, keras_multi_worker


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    from tfdist import launch as launch_lib

    out_dir = tmp_path_factory.mktemp("log_reduction")
    out, err = io.StringIO(), io.StringIO()
    result = launch_lib.launch(
        [sys.executable, os.path.join(REPO, "tests", "comm", "run_log_reduction.py"),
         str(out_dir)], num_workers=2, timeout=300, grace_period=3.0, output="all", stdout=out,
        stderr=err,
        env=dict(os.environ, PYTHONPATH=REPO))
    assert all(not alive(t.pid) for t in result.tasks)
    assert result.returncode == 0, out.getvalue()[-3000:] + err.getvalue()[-3000:]
    return [json.loads((out_dir / f"worker{i}.json").read_text()) for i in (0, 1)]


@pytest.fixture(scope="module")
def one_device():
    import keras

    strategy = tfdist.make_strategy("mirrored", devices=("/cpu:0",))
    logs, weights, _ = run.fit(keras, strategy)
    return logs, weights


def _max_difference(a, b) -> float:
    return max(float(np.abs(np.asarray(x) - np.asarray(y)).max()) for x, y in zip(a, b))


def _about(per_step: float, expected: float) -> bool:
    """`expected` collectives per step over the profiled window (8 or 11 steps), or one fewer
    in all: the profiler can stop before the last step's last collective is recorded (fit
    returns before a step's ops finish). Packed (2) and per-value (4) stay apart."""
    return expected - 1 / 8 - 1e-9 <= per_step <= expected + 1e-9


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_one_collective_for_the_logs_and_the_same_logs_as_one_device(workers, one_device):
    ref_logs, ref_weights = one_device
    # Worker 0 profiles its steps (the workers run the same ones; run_log_reduction says
    # why worker 1 does not).
    counts = {name: [w[name]["collectives_per_step"] for w in workers]
              for name in ("packed", "unpacked")}
    # The gradients' all-reduce and one for loss, mae and mse together ...
    assert _about(counts["packed"][0], 2) and counts["packed"][1] is None, counts
    # ... where the per-value path (the canary) still runs one per value.
    assert _about(counts["unpacked"][0], 4) and counts["unpacked"][1] is None, (
        "without keras_log_reduction a step no longer runs one collective per log value: "
        f"re-check whether the fix is still needed. {counts}")
    for worker in workers:
        packed, unpacked = worker["packed"], worker["unpacked"]
        assert len(packed["logs"]) == len(ref_logs) == 2 * run.STEPS
        for got, want in zip(packed["logs"], ref_logs):
            assert got.keys() == want.keys() == {"loss", "mae", "mse"}
            for key in want:
                assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), (key, got, want)
        # Packing changes which collective carries a value, not the value.
        for got, want in zip(packed["logs"], unpacked["logs"]):
            for key in want:
                assert got[key] == pytest.approx(want[key], rel=1e-6, abs=1e-7)
        assert _max_difference(packed["weights"], ref_weights) < 1e-5
        assert _max_difference(packed["weights"], unpacked["weights"]) == 0.0
    assert workers[0]["packed"]["weights"] == workers[1]["packed"]["weights"]
    assert workers[0]["packed"]["logs"] == workers[1]["packed"]["logs"]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_steps_per_execution_reduces_only_the_last_steps_logs(workers, one_device):
    ref_logs, ref_weights = one_device
    # Per execution of 4 steps: 4 gradient all-reduces and one of the logs (worker 0 profiles).
    assert _about(workers[0]["spe4"]["collectives_per_step"], 5 / 4), workers[0]
    assert workers[1]["spe4"]["collectives_per_step"] is None
    for worker in workers:
        spe = worker["spe4"]
        # Callbacks see the logs at the end of each execution: steps 4 and 8 of each epoch.
        assert len(spe["logs"]) == 2
        for got, want in zip(spe["logs"], [ref_logs[run.STEPS - 1], ref_logs[-1]]):
            for key in want:
                assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6)
        assert _max_difference(spe["weights"], ref_weights) < 1e-5
    assert workers[0]["spe4"]["weights"] == workers[1]["spe4"]["weights"]


def test_fix_is_shape_checked_passes_through_and_uninstalls():
    import keras
    import tensorflow as tf
    from keras.src.backend.tensorflow import trainer

    stock = trainer.reduce_per_replica
    with tfdist.compat.uninstall_after():
        assert keras_log_reduction.install()
        assert not keras_log_reduction.install()  # idempotent
        assert trainer.reduce_per_replica is not stock
        # A user's own strategy and single-machine tfdist strategies: Keras's own result.
        strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
        values = {"a": tf.constant(1.0), "b": tf.constant(3.0)}
        for s in (strategy, tfdist.make_strategy("mirrored", num_devices=2)):
            got = trainer.reduce_per_replica(values, s, "auto")
            assert {k: float(v) for k, v in got.items()} == {"a": 1.0, "b": 3.0}
    assert trainer.reduce_per_replica is stock
    # A Keras whose function takes other arguments is refused, nothing changed.
    with pytest.raises(_patch.CompatError, match="reduce_per_replica"):
        keras_log_reduction.FIX.check(lambda values, strategy: values)
    del keras


def test_wraps_keras_multi_worker_fix_and_survives_its_removal():
    from keras.src.backend.tensorflow import trainer

    stock = trainer.reduce_per_replica
    with tfdist.compat.uninstall_after():
        keras_multi_worker.install()
        keras_log_reduction.install()
        assert trainer.reduce_per_replica.__tfdist_fix__ == keras_log_reduction.NAME
        # Taking the inner fix out rebuilds the outer one on stock Keras.
        tfdist.compat.uninstall([keras_multi_worker.REDUCE_PER_REPLICA])
        assert trainer.reduce_per_replica.__tfdist_fix__ == keras_log_reduction.NAME
        assert trainer.reduce_per_replica.__wrapped__ is stock
    assert trainer.reduce_per_replica is stock

"""Sharded variables (variable partitioner) under Keras 3: fit, the tutorial's custom loop.

Runs tests/ps/run_sharded_variables.py in a fresh process: its cluster (1 worker, 2
ps) has another shape than test_fit.py's, a process can only talk to one, and
it installs (and, for its canaries, uninstalls) tfdist's compat fixes.
"""

import json
import os

import pytest

from tests.support import run_python

HERE = os.path.dirname(os.path.abspath(__file__))
SHARDS = ["/job:ps/replica:0/task:0", "/job:ps/replica:0/task:1"]


@pytest.fixture(scope="module")
def result():
    proc = run_python(os.path.join(HERE, "run_sharded_variables.py"), "40", timeout=480)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    return json.loads(lines[-1])


@pytest.mark.timeout(540)
def test_sharded_fit_matches_unsharded(result):
    assert result["iterations"] == 40
    assert result["min_change"] > 1e-4  # every weight trained
    # Reference: the same model, initial weights and batches with no strategy
    # (duplicate sparse indices summed). One worker: steps run in order.
    assert result["max_abs_diff"] <= 1e-5
    assert result["save_roundtrip_diff"] == 0.0  # save_weights/load_weights of shards
    placement = result["placement"]
    # Embedding and Dense kernels are split over both ps tasks, and so are the
    # Adam slots created for them.
    for name in ("embedding/embeddings", "dense/kernel", "adam/embedding_embeddings_momentum",
                 "adam/dense_kernel_velocity"):
        assert sorted(placement[name]) == SHARDS, (name, placement)


@pytest.mark.timeout(540)
def test_tutorial_custom_loop_with_lazy_slots(result):
    """Slots created inside strategy.run, no optimizer.build()."""
    assert result["loop_iterations"] == 40
    assert result["loop_sharded_slots"] >= 2  # the RMSprop slots of the sharded kernels
    # Reference: the same loop, weights and batches with no strategy.
    assert result["loop_max_abs_diff"] <= 1e-5
    assert abs(result["loop_accuracy"] - result["loop_ref_accuracy"]) <= 1e-6
    assert result["loop_on_ps"]


@pytest.mark.timeout(540)
def test_tutorial_custom_loop_with_an_optimizer_made_outside_the_scope(result):
    """keras-team/keras#17187: made before the scope, moved onto the ps by its first build."""
    assert result["outside_loop_iterations"] == 40
    assert result["outside_loop_sharded_slots"] >= 2
    assert result["outside_loop_on_ps"]  # its step counter and learning rate too
    assert result["outside_loop_max_abs_diff"] <= 1e-5
    assert abs(result["outside_loop_accuracy"] - result["outside_loop_ref_accuracy"]) <= 1e-6


@pytest.mark.timeout(540)
def test_gradient_of_sharded_keras_variable_is_stitched(result):
    assert result["tape_sharded"]
    assert result["tape_gradient_diff"] == 0.0


@pytest.mark.timeout(540)
def test_upstream_still_fails_on_sharded_keras_variables(result):
    """Canaries: each fails once Keras/TF handle sharded Keras variables themselves."""
    expected = {
        "ps_variables.slot_from_reference": "doesn't support being used as a reference",
        "ps_variables.tape_gradient": "has no attribute 'handle'",
        "ps_variables.distributed_update_step": "doesn't support being used as a reference",
        "ps_variables.weight_decay": "doesn't support being used as a reference",
        "ps_variables.array": "has no attribute '__array__'",
    }
    for name, text in expected.items():
        assert result["canaries"][name] and text in result["canaries"][name], (
            name, result["canaries"][name])

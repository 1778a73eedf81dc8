"""Per-step knobs (tfdist.step_options): mixed precision, loss scale, steps_per_execution, XLA.

Each combination trains under mirrored x2 and parameter_server (in-process
cluster) in a fresh process (tests/core/run_step_options.py); multi_worker_mirrored
with 2 workers is in tests/comm/test_compression.py (mixed precision with compression).
"""

import json

import pytest

from tests.support import run_python


@pytest.mark.parametrize("preset", ["mirrored", "parameter_server"])
def test_knobs_train_or_are_refused(preset):
    result = run_python("tests/core/run_step_options.py", preset, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    expected = 6 if preset == "mirrored" else 9
    assert len(report["runs"]) == expected
    if preset == "mirrored":
        assert report["spe_max_diff"] <= 1e-6
        # An epoch of 7 steps run as 4 + 3: as many optimizer steps as batches, and the same
        # weights as one step per execution. Ungated, the step whose get_next ended the epoch
        # still counted one optimizer step (Adam's bias correction then drifts).
        assert report["partial_execution"]["iterations"] == [14, 14], report
        assert report["partial_execution"]["max_diff"] <= 1e-6, report
        assert report["partial_execution_ungated"]["iterations"] == [14, 16], report
        assert report["partial_execution_ungated"]["max_diff"] > 1e-5, report
        assert "jit_compile=True with several synchronous replicas on CPUs fails" in (
            report["jit_error"])
        assert "Drop jit_compile" in report["jit_error"]
        # Dynamic loss scaling skips a step when any replica overflows (tfdist.compat.
        # loss_scale: the summed gradients decide); Keras alone applies it from replica
        # 0's answer (canary: both loss_scale fixes taken out).
        assert report["overflow_on_one_replica"] == {"finite": True, "scale": 16384.0}
        assert report["overflow_on_one_replica_unpatched"]["finite"] is False
        # keras-team/keras#19246 still fails without tfdist's fix (behavioural canary).
        assert "placeholder" in report["unpatched"], report["unpatched"]

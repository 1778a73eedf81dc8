"""experiments/bucket_timeline.py: reading a step's collectives against its backward pass
from profiler events (made-up events, no TensorFlow), and its bad input."""

import pytest

from experiments import bucket_timeline as timeline

SGD = "StatefulPartitionedCall/sgd/CollectiveReduceV2{}:CollectiveReduceV2"
LOGS = "StatefulPartitionedCall/CollectiveReduceV2:CollectiveReduceV2"


def _grad(layer: str) -> str:
    return f"StatefulPartitionedCall/gradient_tape/seq/{layer}/Conv2DBackpropFilter:_Mkl"


def _step(t: float, early: bool) -> list:
    """One step at t seconds: backward ops 0-10 ms, 2 optimizer collectives (one at 4 ms
    when `early`, else both after the backward pass), then the logs' collective."""
    first = t + (0.004 if early else 0.011)
    return [(_grad("conv2d_2"), t, 0.005), (SGD.format(""), first, 0.001),
            (_grad("conv2d_1"), t + 0.005, 0.005), (SGD.format("_1"), t + 0.012, 0.001),
            (LOGS, t + 0.014, 0.001)]


def test_step_summaries_count_the_collectives_started_during_the_backward_pass():
    events = sorted(_step(0.0, True) + _step(0.1, False), key=lambda e: e[1])
    steps = timeline.step_summaries(events, 2)
    assert [s["started_during_backward"] for s in steps] == [1, 0]
    assert steps[0]["backward_ms"] == pytest.approx(10.0)
    assert steps[0]["collective_starts_ms"] == pytest.approx([4.0, 12.0])
    assert steps[1]["collective_starts_ms"] == pytest.approx([11.0, 12.0])
    # The logs' collective is not one of the optimizer's; 4 do not make 3 equal steps.
    with pytest.raises(ValueError, match="4 optimizer collectives do not divide into 3 steps"):
        timeline.step_summaries(events, 3)


def test_bad_arguments_name_what_was_received():
    assert timeline.check_arguments(16384, ["1", "2"], 3) == [1, 2]
    with pytest.raises(ValueError, match=r"--bucket_bytes must be >= 1. Received: 0"):
        timeline.check_arguments(0, ["1"], 3)
    with pytest.raises(ValueError, match=r"--steps must be >= 1. Received: 0"):
        timeline.check_arguments(1, ["1"], 0)
    with pytest.raises(ValueError, match=r"--inter_op must be positive integers.*'1,x'"):
        timeline.check_arguments(1, ["1", "x"], 3)

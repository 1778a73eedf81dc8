"""experiments/bench_loss_scale.py: its table from made-up results (no TensorFlow) and its
bad input, named with what was received."""

import pytest

from experiments import bench_loss_scale as bench


def _run(step_ms: float, collectives: int) -> dict:
    return {"step_ms": step_ms, "collectives_per_step": collectives}


def test_rows_give_each_way_its_median_step_and_the_ratio():
    results = {2: {"sums_first": [_run(2.0, 2), _run(3.0, 2), _run(2.5, 2)],
                   "keras_order": [_run(7.5, 3), _run(8.0, 3), _run(4.0, 3)]}}
    rows = {r["name"]: r for r in bench.rows(results, "tiny")}
    assert rows["loss_scale/tiny/2w/sums_first/step"]["value"] == 2.5
    assert rows["loss_scale/tiny/2w/keras_order/step"]["value"] == 7.5
    assert rows["loss_scale/tiny/2w/speedup"]["value"] == pytest.approx(3.0)
    assert "2 collectives per step; rounds: 2.00, 3.00, 2.50" in \
        rows["loss_scale/tiny/2w/sums_first/step"]["note"]


def test_bad_arguments_name_what_was_received():
    assert bench.check_arguments(["2", "4"], 3, 50) == [2, 4]
    with pytest.raises(ValueError, match=r"--workers must be integers >= 2 .*Received: '1,2'"):
        bench.check_arguments(["1", "2"], 3, 50)
    with pytest.raises(ValueError, match=r"--workers .*Received: 'two'"):
        bench.check_arguments(["two"], 3, 50)
    with pytest.raises(ValueError, match=r"--rounds must be >= 1. Received: 0"):
        bench.check_arguments(["2"], 0, 50)
    with pytest.raises(ValueError, match=r"--steps must be >= 5. Received: 4"):
        bench.check_arguments(["2"], 1, 4)

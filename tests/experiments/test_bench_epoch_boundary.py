"""experiments/bench_epoch_boundary.py: its argument checks, its rows, and a small lab run.

Network namespaces need root, `ip`, `tc` and `nsenter`; without them the lab run is skipped
with the reason.
"""

import pytest

from experiments import bench_epoch_boundary as bench
from tests.support import live_namespaces, namespaces_refused, running_roles


def test_bad_arguments_name_what_was_received():
    assert bench.check_arguments(1.0, 2, 1, ["fit"]) == ["fit"]
    for args, message in (((0.0, 5, 1, ["fit"]), r"--rate must be positive.*Received: 0.0"),
                          ((1.0, 1, 1, ["fit"]), r"--epochs must be at least 2 .*Received: 1"),
                          ((1.0, 5, 0, ["fit"]), r"--rounds must be at least 1. Received: 0"),
                          ((1.0, 5, 1, ["fit", "loop"]),
                           r"--patterns must name one or more of fit, fit_per_epoch. "
                           r"Received: fit,loop")):
        with pytest.raises(ValueError, match=message):
            bench.check_arguments(*args)


def _run(waits, calls=()):
    return {"boundary_wait_seconds": list(waits), "fit_call_seconds": list(calls),
            "loop_seconds": 80.0, "median_step_seconds": 1.3, "exit_wait_seconds": 0.004,
            "load_average": 0.5}


def test_a_per_epoch_fit_that_returns_late_counts_as_a_wait():
    # The first call traces; a later call 27 s over the others' median is a 27 s wait.
    waits = bench._waits(_run([0.1, -0.2], calls=[17.9, 15.5, 42.5, 15.5]))
    assert waits[:2] == [0.1, -0.2] and max(waits) == pytest.approx(27.0)
    table = {r["name"]: r for r in bench.rows(
        {"fit_per_epoch unfixed": [_run([0.1, 5.8], calls=[17.9, 15.5, 42.5, 15.5])],
         "fit_per_epoch fixed": [_run([0.1, -0.2], calls=[17.0, 15.2, 14.8, 15.6])]}, 1.0, 4)}
    prefix = "epoch boundary/1 Gbit/s-eq/fit_per_epoch"
    assert table[f"{prefix}/unfixed: largest wait"]["value"] == pytest.approx(27.0)
    assert table[f"{prefix}/unfixed: waits over 1 s"]["value"] == 2
    assert table[f"{prefix}/fixed: waits over 1 s"]["value"] == 0
    assert "62.5 Mbit/s each way" in table[f"{prefix}/fixed: largest wait"]["note"]


@pytest.mark.timeout(900)
def test_both_variants_run_on_simulated_nodes_and_leave_nothing_behind():
    refused = namespaces_refused()
    if refused:
        pytest.skip(refused)
    before = live_namespaces()
    # 10 Gbit/s-eq: a step is ~0.13 s, so 2 epochs of 12 steps per run.
    results = bench.measure(10.0, 2, 1, ["fit_per_epoch"], log=lambda *a, **k: None)
    assert sorted(results) == ["fit_per_epoch fixed", "fit_per_epoch unfixed"]
    for (run,) in results.values():
        assert len(run["boundary_wait_seconds"]) == 1 and len(run["fit_call_seconds"]) == 2
        assert 0 < run["median_step_seconds"] < 30 and run["exit_wait_seconds"] < 5
    assert live_namespaces() <= before
    assert not running_roles("experiments.bench_epoch_boundary", "worker")

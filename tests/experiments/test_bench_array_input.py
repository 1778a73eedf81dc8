"""experiments/bench_array_input.py: its argument checks, and a tiny run of its measurement."""

import math

import pytest

from experiments import bench_array_input as bench


def test_bad_arguments_name_what_was_received():
    assert bench.check_arguments(["1", "4"], 2) == [1, 4]
    with pytest.raises(ValueError, match=r"--workers must be integers >= 1, e.g. 1,2,4. "
                                         r"Received: '2,x'"):
        bench.check_arguments(["2", "x"], 1)
    with pytest.raises(ValueError, match=r"Received: '0'"):
        bench.check_arguments(["0"], 1)
    with pytest.raises(ValueError, match=r"--rounds must be at least 1. Received: 0"):
        bench.check_arguments(["1"], 0)


def test_both_pipelines_give_worker_0_the_same_rows_and_the_rows_are_finite():
    result = bench.measure([1, 2], 1, log=lambda *a, **k: None)
    assert result["same_rows"] == {1: True, 2: True}
    rows = {r["name"]: r for r in bench.rows(result, 1)}
    assert sorted(rows) == sorted(f"array_input_{n}workers_{w}" for n in (1, 2)
                                  for w in ("keras", "tfdist", "speedup"))
    assert all(math.isfinite(r["value"]) and r["value"] > 0 for r in rows.values())
    assert "pinned to one core" in rows["array_input_2workers_tfdist"]["note"]

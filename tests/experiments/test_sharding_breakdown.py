"""experiments/sharding_breakdown.py: its argument checks, and a small run of every variant."""

import math
import re

import subprocess

import pytest

from experiments import sharding_breakdown as breakdown


def test_bad_arguments_name_what_was_received():
    breakdown.check_arguments(1, 1, 64)
    for args, message in (((0, 1, 64), "--rounds must be at least 1. Received: 0"),
                          ((1, -2, 64), "--steps must be at least 1. Received: -2"),
                          ((1, 1, 63), "--width must be even .* Received: 63")):
        with pytest.raises(ValueError, match=message):
            breakdown.check_arguments(*args)


@pytest.mark.timeout(600)
def test_every_variant_and_collective_is_timed_and_no_worker_is_left():
    result = breakdown.measure(rounds=1, steps=2, width=64)
    times = result["times"]
    assert sorted(times) == sorted(breakdown.VARIANTS)
    assert all(list(v) == ["step"] for k, v in times.items() if k != "none")
    assert sorted(times["none"]) == sorted(["step", "8_gathers_2MB", "2_gathers_8MB",
                                            "4_reduce_scatters_4MB", "all_reduce_16.9MB"])
    assert all(len(values) == 2 and all(t > 0 and math.isfinite(t) for t in values)
               for names in times.values() for values in names.values())
    # The allocator was on (TF_CPU_ALLOCATOR_USE_BFC) and saw the step.
    assert all(p["peak"] >= p["resident"] > 0 for p in result["peaks"].values())
    lines = breakdown.report(result)
    assert re.search(r"^none +step +[\d.]+ ms  1\.000 x none$", lines[0])
    assert sum("x none" in line for line in lines) == len(breakdown.VARIANTS)
    left = subprocess.run(["pgrep", "-f", "experiments.sharding_breakdown --worker"],
                          capture_output=True, text=True).stdout.split()
    assert not left, left

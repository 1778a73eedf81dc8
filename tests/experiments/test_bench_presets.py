"""bench_presets.measure_allreduce: a pair of workers that does not finish is killed and said,
not a traceback (and leaves no process behind)."""

import subprocess
import sys

import pytest

from experiments import bench_presets


def _workers() -> list[str]:
    found = subprocess.run(["pgrep", "-f", "experiments.allreduce_worker"],
                           capture_output=True, text=True).stdout.split()
    return found


@pytest.mark.timeout(120)
def test_a_pair_that_does_not_finish_in_time_is_killed_and_said():
    before = _workers()
    # 1 s: the workers are still importing TensorFlow (the old code let the
    # subprocess.TimeoutExpired out, and the report's process ended in a traceback)
    with pytest.raises(RuntimeError, match=r"did not finish \(worker 0 in 1 s.*both workers "
                                           r"were killed.*rerun when it is quieter"):
        bench_presets.measure_allreduce([1024], 1, timeout=1.0)
    assert _workers() == before


@pytest.mark.timeout(120)
def test_the_program_says_why_and_exits_1(tmp_path):
    # The program's own entry: the RuntimeError becomes one line on stderr, rc 1.
    code = ("import sys; from experiments import bench_presets\n"
            "def measure(quick): raise RuntimeError('the workers failed')\n"
            "bench_presets.measure = measure\n"
            "from absl import app, flags\n"
            "flags.DEFINE_bool('quick', True, '')\n"
            "app.run(bench_presets.main, argv=['x'])\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=100)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == "bench_presets: the workers failed"
    assert "Traceback" not in result.stderr

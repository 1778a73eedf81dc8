"""keras_array_shuffle: 2 workers' `fit` on shuffled NumPy input trains every example once per
epoch, in a new order each epoch; without the fix (Keras as released) the workers' shares
overlap (the negative control and canary)."""

import io
import os
import sys
from collections import Counter

import pytest

from tests.support import REPO, alive

EXAMPLES, STEPS_PER_EPOCH, EPOCHS = 32, 4, 2


def _steps(path) -> list[list[int]]:
    with open(path) as f:
        return [[int(n) for n in line.strip().strip("[]").split()] for line in f if line.strip()]


@pytest.mark.timeout(300)
def test_two_workers_train_every_example_once_per_epoch(tmp_path):
    from tfdist import launch as launch_lib

    out, err = io.StringIO(), io.StringIO()
    result = launch_lib.launch(
        [sys.executable, os.path.join(REPO, "tests", "compat", "run_array_shuffle.py"),
         str(tmp_path)],
        num_workers=2, timeout=240, grace_period=3.0, stdout=out, stderr=err,
        env=dict(os.environ, PYTHONPATH=REPO))
    assert all(not alive(t.pid) for t in result.tasks)
    assert result.returncode == 0, out.getvalue()[-3000:] + err.getvalue()[-3000:]
    epochs = {}
    for run in ("fixed", "unfixed"):
        workers = [_steps(tmp_path / f"{run}-worker{w}.txt") for w in (0, 1)]
        assert all(len(steps) == STEPS_PER_EPOCH * EPOCHS for steps in workers), workers
        epochs[run] = [Counter(i for steps in workers
                               for step in steps[e * STEPS_PER_EPOCH:(e + 1) * STEPS_PER_EPOCH]
                               for i in step) for e in range(EPOCHS)]
        if run == "fixed":
            order = [sum(workers[0][e * STEPS_PER_EPOCH:(e + 1) * STEPS_PER_EPOCH], [])
                     for e in range(EPOCHS)]
            assert order[0] != order[1], "the same order in both epochs"
    for counts in epochs["fixed"]:
        assert counts == Counter(range(EXAMPLES)), counts
    assert any(max(counts.values()) > 1 for counts in epochs["unfixed"]), (
        "without keras_array_shuffle the workers' shuffled shares no longer overlap: Keras may "
        "now seed the array adapter's order under tf.distribute; re-check "
        "tfdist.compat.keras_array_shuffle.", epochs["unfixed"])

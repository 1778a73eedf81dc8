"""keras_array_input: 2 workers' `fit` on NumPy input.

With the fix: shuffled, every example is trained once per epoch, in a new order each epoch; in
order (a partial last batch, no shuffling), every step trains exactly the examples it trains in
Keras as released; and each worker gathers half of each global batch's rows. Without it (Keras
as released: the negative control and canary): the workers' shuffled shares overlap, and every
worker gathers all of each global batch's rows.
"""

import io
import os
import sys
from collections import Counter

import pytest

from tests.compat.run_array_input import GLOBAL_BATCH, INPUTS
from tests.support import REPO, alive


def _lines(path) -> list[list[int]]:
    with open(path) as f:
        return [[int(n) for n in line.strip().strip("[]").split()] for line in f if line.strip()]


@pytest.mark.timeout(300)
def test_two_workers_share_one_order_and_gather_only_their_rows(tmp_path):
    from tfdist import launch as launch_lib

    out, err = io.StringIO(), io.StringIO()
    result = launch_lib.launch(
        [sys.executable, os.path.join(REPO, "tests", "compat", "run_array_input.py"),
         str(tmp_path)],
        num_workers=2, timeout=240, grace_period=3.0, stdout=out, stderr=err,
        env=dict(os.environ, PYTHONPATH=REPO))
    assert all(not alive(t.pid) for t in result.tasks)
    assert result.returncode == 0, out.getvalue()[-3000:] + err.getvalue()[-3000:]

    def steps(run, name):
        return [_lines(tmp_path / f"{run}-{name}-worker{w}.txt") for w in (0, 1)]

    def gathered(run, name):
        return {w: {n for line in _lines(tmp_path / f"{run}-{name}-gathers{w}.txt")
                    for n in line} for w in (0, 1)}

    # Shuffled: with the fix, each epoch trains every example once, in a new order.
    examples, _, epochs = INPUTS["shuffled"]
    per_epoch = examples // GLOBAL_BATCH
    counts = {}
    for run in ("fixed", "unfixed"):
        workers = steps(run, "shuffled")
        assert all(len(s) == per_epoch * epochs for s in workers), workers
        counts[run] = [Counter(i for s in workers for step in s[e * per_epoch:(e + 1) * per_epoch]
                               for i in step) for e in range(epochs)]
    order = [sum(steps("fixed", "shuffled")[0][e * per_epoch:(e + 1) * per_epoch], [])
             for e in range(epochs)]
    assert order[0] != order[1], "the same order in both epochs"
    for epoch in counts["fixed"]:
        assert epoch == Counter(range(examples)), epoch
    assert any(max(epoch.values()) > 1 for epoch in counts["unfixed"]), (
        "without keras_array_input the workers' shuffled shares no longer overlap: Keras may "
        "now seed the array adapter's order under tf.distribute; re-check "
        "tfdist.compat.keras_array_input.", counts["unfixed"])

    # In order, with a partial last batch: the fix trains what Keras's own split trains.
    assert steps("fixed", "ordered") == steps("unfixed", "ordered")
    assert sorted(i for s in steps("fixed", "ordered") for step in s for i in step) == list(
        range(INPUTS["ordered"][0]))

    # Rows gathered per batch: with the fix, each worker's half of the global batch (of the
    # partial last batch of 4, 2 each); without it, the whole global batch on every worker.
    for name in INPUTS:
        fixed, unfixed = gathered("fixed", name), gathered("unfixed", name)
        share = {GLOBAL_BATCH // 2} if name == "shuffled" else {GLOBAL_BATCH // 2, 2}
        assert fixed[0] == fixed[1] == share, fixed
        assert GLOBAL_BATCH in unfixed[0] and GLOBAL_BATCH in unfixed[1], (
            "without keras_array_input each worker no longer gathers whole global batches: "
            "Keras may now shard the array adapter's input before it gathers; re-check "
            "tfdist.compat.keras_array_input.", unfixed)

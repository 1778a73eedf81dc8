"""tfdist.notebook_launcher: a function from a cell, run on a local cluster."""

import pytest

import tfdist


def _report_task(scale):
    import json
    import os

    task = json.loads(os.environ["TF_CONFIG"])["task"]
    print("task says hello")
    return {"index": task["index"], "value": scale * (task["index"] + 1)}


def _fail_on_worker_1():
    import json
    import os
    import sys

    if json.loads(os.environ["TF_CONFIG"])["task"]["index"] == 1:
        sys.exit(3)


@pytest.mark.timeout(120)
def test_runs_the_function_on_every_task_and_returns_their_results(capfd):
    results = tfdist.notebook_launcher(_report_task, args=(10,), num_workers=2, timeout=100)
    assert results == {"worker:0": {"index": 0, "value": 10},
                       "worker:1": {"index": 1, "value": 20}}
    out = capfd.readouterr().out
    assert "[worker:0] task says hello" in out and "[worker:1] task says hello" in out


@pytest.mark.timeout(120)
def test_a_failing_task_raises_with_its_name():
    with pytest.raises(tfdist.NotebookLaunchError, match="worker:1 exited with code 3"):
        tfdist.notebook_launcher(_fail_on_worker_1, num_workers=2, timeout=100)


def test_functions_that_cannot_be_sent_are_rejected():
    with pytest.raises(ValueError, match="cannot send a lambda"):
        tfdist.notebook_launcher(lambda: 1)
    factor = 2

    def closure():
        return factor

    with pytest.raises(ValueError, match=r"uses variables of an enclosing function \(factor\)"):
        tfdist.notebook_launcher(closure)
    with pytest.raises(ValueError, match="plain function defined with `def`"):
        tfdist.notebook_launcher(print)
    with pytest.raises(ValueError, match="must be picklable"):
        tfdist.notebook_launcher(_report_task, args=(lambda: 1,))
    with pytest.raises(ValueError, match="num_workers must be an integer >= 1"):
        tfdist.notebook_launcher(_report_task, args=(1,), num_workers=0)

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


def _import_planted():
    try:
        import tfdist_planted_module  # noqa: F401
    except ModuleNotFoundError:
        return "not imported"
    return "imported"


@pytest.mark.timeout(120)
def test_folders_other_users_can_write_to_stay_off_the_tasks_path(tmp_path, monkeypatch):
    """A module planted in a world-writable working folder (like /tmp) must not run in tasks."""
    from tfdist.launch import notebook

    folder = tmp_path / "notebook_dir"
    folder.mkdir()
    (folder / "tfdist_planted_module.py").write_text("PLANTED = True\n")
    monkeypatch.chdir(folder)
    # Negative control: the notebook's own private folder goes first on the tasks' path.
    folder.chmod(0o755)
    assert notebook.task_sys_path()[0] == str(folder)
    folder.chmod(0o777)
    with pytest.warns(UserWarning, match=rf"leaves {folder} off the tasks' sys.path: every "
                                         rf"user can write to it"):
        results = tfdist.notebook_launcher(_import_planted, num_workers=1, timeout=100)
    assert results == {"worker:0": "not imported"}

"""How the launcher reads preempted tasks (exit 75) and shrinks a group: policy, no processes."""

from __future__ import annotations

import signal

import pytest

from tfdist.launch import policy, supervisor
from tfdist.preemption import PREEMPTED_EXIT_CODE, preempted_step


def test_the_marker_line_gives_the_step():
    lines = ["[worker:0] epoch 1", "tfdist: preempted at step 13 (SIGTERM to worker:1): backup "
             "of step 13 saved in /b; exiting with status 75", "more"]
    assert preempted_step(lines) == 13
    assert preempted_step(["nothing here"]) is None


def test_peers_that_save_together_end_the_attempt_as_a_preemption_not_a_failure():
    rules = policy.JobPolicy(["worker:0", "worker:1"])
    assert rules.on_exit("worker:1", PREEMPTED_EXIT_CODE, preempted_step=13) is None
    end = rules.on_exit("worker:0", PREEMPTED_EXIT_CODE, preempted_step=13)
    assert end.returncode == PREEMPTED_EXIT_CODE and end.restartable
    assert end.message.startswith("preempted at step 13, backup saved: worker:0, worker:1")
    assert "Run the same command again to resume from step 13" in end.message


def test_a_peer_that_fails_after_a_preemption_is_a_failure():
    rules = policy.JobPolicy(["worker:0", "worker:1"])
    rules.on_exit("worker:1", PREEMPTED_EXIT_CODE, preempted_step=13)
    end = rules.on_exit("worker:0", 1, " It lost a peer.", lost_peer=True)
    assert end.returncode == 1 and end.failed_task == "worker:0"


def test_a_preempted_parameter_server_chief_ends_the_job_restartably():
    rules = policy.JobPolicy(["chief:0", "worker:0", "ps:0"])
    end = rules.on_exit("chief:0", PREEMPTED_EXIT_CODE, preempted_step=20)
    assert (end.returncode, end.restartable) == (PREEMPTED_EXIT_CODE, True)
    assert "preempted at step 20" in end.message


def test_a_signal_to_the_launcher_never_restarts():
    saved = policy.signal_end(signal.SIGTERM, [("worker:0", PREEMPTED_EXIT_CODE, 562),
                                               ("worker:1", PREEMPTED_EXIT_CODE, 562)])
    assert saved.returncode == PREEMPTED_EXIT_CODE and not saved.restartable
    assert saved.message.startswith("got SIGTERM: preempted at step 562, backup saved")
    killed = policy.signal_end(signal.SIGTERM, [("worker:0", -15, None), ("worker:1", -9, None)])
    assert (killed.returncode, killed.message) == (143, "got SIGTERM: stopped every task")
    assert not killed.restartable


def _failed(task: str) -> policy.End:
    return policy.End(1, f"{task} exited with code 1", task, restartable=True)


def test_elastic_leaves_out_a_worker_that_failed_twice_in_a_row_never_below_the_minimum():
    elastic = supervisor.Elastic(3, 2)
    assert elastic.after(_failed("worker:2")) is None
    assert elastic.after(_failed("worker:1")) is None  # another worker: the streak restarts
    said = elastic.after(_failed("worker:1"))
    assert elastic.workers == 2
    assert said.startswith("worker:1 failed 2 attempts in a row: restarting with 2 worker(s) "
                           "instead of 3 (--min_workers=2)")
    assert "keeps its global batch" in said
    elastic.after(_failed("worker:1"))
    assert elastic.after(_failed("worker:1")) is None and elastic.workers == 2  # the minimum
    # A preemption is not a failure: it breaks the streak.
    elastic = supervisor.Elastic(2, 1)
    elastic.after(_failed("worker:1"))
    elastic.after(policy.End(PREEMPTED_EXIT_CODE, "preempted", None, restartable=True))
    assert elastic.after(_failed("worker:1")) is None and elastic.workers == 2
    assert supervisor.Elastic(2, None).after(_failed("worker:1")) is None


@pytest.mark.parametrize("kwargs, message", [
    ({"min_workers": 0, "num_workers": 2}, "min_workers must be an integer >= 1. Received: "
                                           "min_workers=0"),
    ({"min_workers": 3, "num_workers": 2}, "min_workers must be <= num_workers. Received: "
                                           "min_workers=3, num_workers=2"),
    ({"min_workers": 1, "num_workers": 2, "num_ps": 1},
     "a parameter-server job already goes on without a worker"),
])
def test_bad_min_workers_is_a_clear_error(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        supervisor.check_min_workers(kwargs.pop("min_workers"), kwargs.pop("num_workers"),
                                     **kwargs)

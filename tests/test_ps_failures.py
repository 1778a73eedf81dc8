"""Failures under the parameter_server preset, with real processes on 127.0.0.1.

1. SIGKILL a worker mid-training: the coordinator keeps training on the
   other worker, the step count stays exact, and a restarted worker rejoins.
2. SIGKILL the ps: the coordinator fails with a clear error, and
   `tfdist launch --max_restarts=1` restarts the job, which resumes from its
   last checkpoint and finishes with the exact step count.
"""

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time

import pytest

import tfdist

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "_ps_failure_run.py")
STEPS_PER_EPOCH = 50


def _env(tf_config=None):
    env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
    env["PYTHONPATH"] = os.path.dirname(HERE)
    env.pop("PYTEST_CURRENT_TEST", None)
    if tf_config is not None:
        env["TF_CONFIG"] = tf_config
    return env


def _reader(stream, lines: queue.Queue, keep: list):
    for line in iter(stream.readline, ""):
        keep.append(line)
        lines.put(line)
    lines.put(None)


def _next_event(lines: queue.Queue, deadline: float, keep: list) -> dict:
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError("timed out waiting for the chief; output:\n" + "".join(keep[-40:]))
        try:
            line = lines.get(timeout=left)
        except queue.Empty:
            continue
        if line is None:
            raise AssertionError("the chief exited early; output:\n" + "".join(keep[-60:]))
        text = line.removeprefix("[chief:0] ")  # when run under the launcher
        if text.startswith("{"):
            return json.loads(text)


def _stop(procs):
    for p in procs:
        if p.poll() is None:
            p.kill()
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


@pytest.mark.timeout(240)
def test_killed_worker_training_continues_and_restarted_worker_rejoins(tmp_path):
    cluster = tfdist.local_cluster(num_workers=2, num_ps=1, chief=True)
    config = lambda t, i: tfdist.tf_config_for(cluster, t, i)  # noqa: E731
    procs = []

    def server(task_type, index, log):
        with open(log, "w") as out:
            proc = subprocess.Popen([sys.executable, SCRIPT, "serve", str(tmp_path)],
                                    env=_env(config(task_type, index)),
                                    stdout=out, stderr=subprocess.STDOUT)
        procs.append(proc)
        return proc

    try:
        server("ps", 0, tmp_path / "ps0.log")
        server("worker", 0, tmp_path / "worker0.log")
        worker1 = server("worker", 1, tmp_path / "worker1_first.log")
        chief = subprocess.Popen([sys.executable, SCRIPT, "worker_kill", str(tmp_path)],
                                 env=_env(config("chief", 0)), stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True)
        procs.append(chief)
        lines, keep = queue.Queue(), []
        threading.Thread(target=_reader, args=(chief.stdout, lines, keep), daemon=True).start()
        deadline = time.monotonic() + 200
        first = _next_event(lines, deadline, keep)
        if first["event"] == "strategy_ready":
            first = _next_event(lines, deadline, keep)
        assert first["event"] == "epoch" and first["iterations"] == STEPS_PER_EPOCH

        worker1.send_signal(signal.SIGKILL)  # the chief is training more epochs now
        worker1.wait(timeout=10)
        time.sleep(3)  # let some steps run without it
        server("worker", 1, tmp_path / "worker1.log")
        (tmp_path / "restarted").write_text("1")

        done = _next_event(lines, deadline, keep)
        assert done["event"] == "done", done
        # No step was lost: the killed worker's in-flight step was re-run on the
        # survivor. Steps run at least once, so if worker:1 died after applying
        # its update, that one step counts twice (seen 0 times in 4 runs).
        assert done["scheduled"] <= done["iterations"] <= done["scheduled"] + 1, done
        assert "tfdist-test-step-ran" in (tmp_path / "worker1.log").read_text(), (
            "the restarted worker:1 never ran a step")

        # Losing the ps is fatal for this process: a clear error, in bounded time.
        procs[0].send_signal(signal.SIGKILL)
        procs[0].wait(timeout=10)
        (tmp_path / "ps_killed").write_text("1")
        ps_error = _next_event(lines, deadline, keep)
        assert ps_error["event"] == "ps_error", ps_error
        assert ps_error["error"] and "Lost a parameter server" in ps_error["error"], ps_error
        assert "--max_restarts" in ps_error["error"]
        chief.wait(timeout=30)
        assert chief.returncode == 0, "".join(keep[-40:])
        (tmp_path / "chief.log").write_text("".join(keep))
    finally:
        _stop(procs)


@pytest.mark.timeout(240)
def test_lost_ps_is_a_clear_error_and_launcher_restart_resumes(tmp_path):
    cmd = [sys.executable, "-m", "tfdist.launch", "--num_workers=1", "--num_ps=1", "--chief",
           "--max_restarts=1", "--timeout=200", "--grace_period=2", "--",
           sys.executable, SCRIPT, "resume", str(tmp_path)]
    proc = subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lines, keep = queue.Queue(), []
    threading.Thread(target=_reader, args=(proc.stdout, lines, keep), daemon=True).start()
    try:
        deadline = time.monotonic() + 220
        ps_pid = None
        while ps_pid is None:
            event = _next_event(lines, deadline, keep)
            if event["event"] == "epoch" and event["epoch"] >= 1 and ps_pid is None:
                ps_pid = next(int(line.split("pid=")[1].split()[0]) for line in keep
                              if line.startswith("[ps:0]") and "pid=" in line)
        os.kill(ps_pid, signal.SIGKILL)
        done = None
        while done is None:
            event = _next_event(lines, deadline, keep)
            if event["event"] == "done":
                done = event
        proc.wait(timeout=60)
        text = "".join(keep)
        (tmp_path / "launch.log").write_text(text)
        assert proc.returncode == 0, text[-3000:]
        # The launcher sees the dead ps first, stops the group, restarts it.
        assert "ps:0 was killed by SIGKILL" in text, text[-3000:]
        assert "attempt 2" in text, text[-3000:]
        assert done["resumed_from"] >= 2, done  # resumed after the last saved epoch
        assert done["iterations"] == done["scheduled"] == 6 * STEPS_PER_EPOCH, done
    finally:
        _stop([proc])

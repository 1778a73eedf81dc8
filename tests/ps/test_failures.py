"""Failures under the parameter_server preset, with real processes on 127.0.0.1.

1. One chief, 2 workers, 1 ps (tests/ps/run_failures.py, mode "faults"):
   worker:1 killed during an exactly-once evaluation (still exact); worker:1
   killed and restarted twice (it rejoins each time), then killed again and
   worker:0 killed while worker:1's replacement is starting (the
   coordinator used to stall for an hour; now it trains on worker:1, and
   worker:0 rejoins when restarted); every step accounted for exactly
   (iterations == scheduled + re-run steps reported as written twice); both workers
   lost -> a clear error within connect_timeout, and training continues once
   one is back; the ps lost -> a clear error.
2. The ps killed under `tfdist launch --max_restarts=1`: the launcher restarts
   the job, which resumes from its last checkpoint with the exact step count.
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
from tests.support import REPO
from tfdist.ps.servers import reachable

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "run_failures.py")
MARKER = "tfdist-test-step-ran"
STEPS_PER_EPOCH = 50


def _env(tf_config=None):
    env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
    env["PYTHONPATH"] = REPO
    env.pop("PYTEST_CURRENT_TEST", None)
    if tf_config is not None:
        env["TF_CONFIG"] = tf_config
    return env


def _reader(stream, lines: queue.Queue, keep: list):
    for line in iter(stream.readline, ""):
        keep.append(line)
        lines.put(line)
    lines.put(None)


class _Chief:
    """The chief's JSON events, read as they come."""

    def __init__(self, proc, deadline):
        self.proc, self.deadline = proc, deadline
        self.lines, self.keep = queue.Queue(), []
        threading.Thread(target=_reader, args=(proc.stdout, self.lines, self.keep),
                         daemon=True).start()

    def next(self) -> dict:
        while True:
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise AssertionError("timed out waiting for the chief; output:\n" + self.tail())
            try:
                line = self.lines.get(timeout=left)
            except queue.Empty:
                continue
            if line is None:
                raise AssertionError("the chief exited early; output:\n" + self.tail(60))
            text = line.removeprefix("[chief:0] ")  # when run under the launcher
            if text.startswith("{"):
                return json.loads(text)

    def tail(self, lines: int = 40) -> str:
        """The chief's last lines, TensorFlow's repeated connection errors left out."""
        kept = [line for line in self.keep if not line.startswith(("E0000", "W0000", "I0000",
                                                                  "Additional GRPC", ":UNKNOWN",
                                                                  "This could happen"))]
        return "".join(kept[-lines:])

    def until(self, name: str) -> dict:
        while True:
            event = self.next()
            if event["event"] == name:
                return event


def _stop(procs):
    for p in procs:
        if p.poll() is None:
            p.kill()
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


def _wait(predicate, what, deadline):
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting until {what}")
        time.sleep(0.1)


@pytest.mark.timeout(660)
def test_worker_failures_overlapping_all_lost_and_ps_lost(tmp_path):
    cluster = tfdist.local_cluster(num_workers=2, num_ps=1, chief=True)
    config = lambda t, i: tfdist.tf_config_for(cluster, t, i)  # noqa: E731
    procs, live, chief = [], {}, None
    deadline = time.monotonic() + 600  # generous: 5 TensorFlow processes start on 2 cores

    def server(task_type, index, tag=""):
        log = tmp_path / f"{task_type}{index}{tag}.log"
        with open(log, "w") as out:
            proc = subprocess.Popen([sys.executable, SCRIPT, "serve", str(tmp_path)],
                                    env=_env(config(task_type, index)),
                                    stdout=out, stderr=subprocess.STDOUT)
        procs.append(proc)
        live[(task_type, index)] = (proc, log)
        return proc

    def kill(task_type, index):
        proc, _ = live.pop((task_type, index))
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)

    def ran_steps(task_type, index):
        proc, log = live[(task_type, index)]

        def ran():
            if proc.poll() is not None:
                raise AssertionError(f"{task_type}:{index} exited ({proc.returncode}) before "
                                     f"it ran a step; its log:\n{log.read_text()[-1500:]}")
            if chief is not None and chief.proc.poll() is not None:
                raise AssertionError(f"the chief exited ({chief.proc.returncode}) before "
                                     f"{task_type}:{index} ran a step:\n" + chief.tail())
            return MARKER in log.read_text()

        try:
            _wait(ran, f"{task_type}:{index} ran a step ({log})", deadline)
        except AssertionError as e:
            if "timed out" not in str(e):
                raise
            raise AssertionError(f"{e}\n--- its log:\n{log.read_text()[-1500:]}"
                                 f"\n--- the chief:\n{chief.tail()}") from None

    def touch(name):
        (tmp_path / name).write_text("1")

    try:
        server("ps", 0)
        server("worker", 0)
        server("worker", 1)
        for role in ("ps", "worker"):
            for address in getattr(cluster, role):
                _wait(lambda a=address: reachable(a), f"{address} listens", deadline)
        chief_proc = subprocess.Popen([sys.executable, SCRIPT, "faults", str(tmp_path)],
                                      env=_env(config("chief", 0)), stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True)
        procs.append(chief_proc)
        chief = _Chief(chief_proc, deadline)
        assert chief.until("epoch")["iterations"] == STEPS_PER_EPOCH

        # Exactly-once evaluation survives losing a worker mid-way.
        chief.until("eval_start")
        time.sleep(0.3)
        kill("worker", 1)
        done = chief.until("eval_done")
        assert done["reruns"] >= 1, done  # worker:1's shard was re-run elsewhere
        assert abs(done["loss"] - done["exact"]) <= 1e-5 * done["exact"], done

        # worker:1 restarted twice, rejoining each time; then killed again and
        # worker:0 killed while worker:1's replacement starts.
        for attempt in range(2):
            server("worker", 1, f"_restart{attempt}")
            ran_steps("worker", 1)
            kill("worker", 1)
        server("worker", 1, "_restart2")
        # worker:0 dies while worker:1's replacement comes up (it listens; the
        # coordinator has not taken it back yet, or is doing so right now).
        _wait(lambda: reachable(cluster.worker[1]), "worker:1's replacement listens", deadline)
        kill("worker", 0)
        ran_steps("worker", 1)  # the coordinator took worker:1 back without worker:0
        progress = [chief.until("epoch") for _ in range(2)]
        assert progress[-1]["iterations"] > progress[0]["iterations"], progress
        server("worker", 0, "_restart")
        ran_steps("worker", 0)
        touch("phase_c")
        accounted = chief.until("accounted")
        # Steps run at least once (TensorFlow re-runs a lost worker's step); a
        # step whose worker died after writing its update lands twice, and tfdist
        # reports it: no tolerance here.
        assert accounted["iterations"] == (accounted["scheduled"]
                                           + accounted["rerun_after_write"]), accounted
        assert accounted["rerun_after_write"] <= accounted["reruns"], accounted

        # Every worker lost: a clear error within connect_timeout (20 s) + polling.
        kill("worker", 0)
        kill("worker", 1)
        touch("all_lost")
        lost = chief.until("all_lost_error")
        assert lost["error"] and "Every worker has been unreachable for 20 s" in lost["error"]
        assert "worker:0 at" in lost["error"] and "worker:1 at" in lost["error"], lost
        assert lost["seconds"] < 90, lost
        server("worker", 1, "_restart3")
        # Until a worker is back, every fit fails at once (nothing could run it).
        _wait(lambda: reachable(cluster.worker[1]), "worker:1 listens again", deadline)
        touch("worker_back")
        resumed = chief.until("resumed")
        assert resumed["applied"] == STEPS_PER_EPOCH + resumed["rerun_after_write"], resumed

        # Losing the ps is fatal for this process: a clear error, in bounded time.
        kill("ps", 0)
        touch("ps_killed")
        ps_error = chief.until("ps_error")
        assert ps_error["error"] and "Lost a parameter server" in ps_error["error"], ps_error
        assert "--max_restarts" in ps_error["error"]
        chief_proc.wait(timeout=30)
        assert chief_proc.returncode == 0, "".join(chief.keep[-40:])
    finally:
        _stop(procs)
        if chief is not None:
            (tmp_path / "chief.log").write_text("".join(chief.keep))


@pytest.mark.timeout(240)
def test_lost_ps_is_a_clear_error_and_launcher_restart_resumes(tmp_path):
    cmd = [sys.executable, "-m", "tfdist.launch", "--num_workers=1", "--num_ps=1", "--chief",
           "--max_restarts=1", "--timeout=200", "--grace_period=2", "--",
           sys.executable, SCRIPT, "resume", str(tmp_path)]
    proc = subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    chief = _Chief(proc, time.monotonic() + 220)
    try:
        ps_pid = None
        while ps_pid is None:
            event = chief.next()
            if event["event"] == "epoch" and event["epoch"] >= 1:
                ps_pid = next(int(line.split("pid=")[1].split()[0]) for line in chief.keep
                              if line.startswith("[ps:0]") and "pid=" in line)
        os.kill(ps_pid, signal.SIGKILL)
        done = chief.until("done")
        proc.wait(timeout=60)
        text = "".join(chief.keep)
        (tmp_path / "launch.log").write_text(text)
        assert proc.returncode == 0, text[-3000:]
        # The launcher sees the dead ps first, stops the group, restarts it.
        assert "ps:0 was killed by SIGKILL" in text, text[-3000:]
        assert "attempt 2" in text, text[-3000:]
        assert done["resumed_from"] >= 2, done  # resumed after the last saved epoch
        assert done["iterations"] == done["scheduled"] == 6 * STEPS_PER_EPOCH, done
    finally:
        _stop([proc])

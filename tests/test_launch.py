"""The launcher on tiny scripts (no TensorFlow): prefixes, exit codes, stopping, restarts."""

import io
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from tfdist import cluster as cluster_lib
from tfdist import launch as launch_lib
from tests.helpers import REPO, alive

PY = sys.executable


def _script(tmp_path, body: str) -> str:
    path = tmp_path / "child.py"
    path.write_text("import json, os, sys, time, signal\n"
                    "TASK = json.loads(os.environ['TF_CONFIG'])['task']\n"
                    "NAME = f\"{TASK['type']}:{TASK['index']}\"\n" + textwrap.dedent(body))
    return str(path)



def _run(cmd, **kwargs):
    out, err = io.StringIO(), io.StringIO()
    result = launch_lib.launch(cmd, stdout=out, stderr=err, **kwargs)
    for task in result.tasks:
        assert not alive(task.pid), f"{task} left running"
    return result, out.getvalue(), err.getvalue()


@pytest.mark.timeout(60)
def test_prefixes_output_and_sets_tf_config(tmp_path):
    script = _script(tmp_path, """
        print("hello from", NAME, json.loads(os.environ["TF_CONFIG"])["cluster"]["worker"][1])
        print("to stderr", file=sys.stderr)
    """)
    result, out, err = _run([PY, script], num_workers=2)
    assert result.returncode == 0 and result.attempts == 1, err
    port1 = result.cluster.worker[1]
    assert f"[worker:0] hello from worker:0 {port1}" in out
    assert f"[worker:1] hello from worker:1 {port1}" in out
    assert "[worker:1] to stderr" in err
    assert all(a.startswith("127.0.0.1:") for a in result.cluster.worker)
    assert "TF_CONFIG" not in os.environ


@pytest.mark.timeout(60)
def test_first_failure_decides_and_stops_the_others(tmp_path):
    script = _script(tmp_path, """
        if NAME == "worker:1":
            sys.exit(3)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # like TensorFlow: needs SIGKILL
        time.sleep(60)
    """)
    start = time.monotonic()
    result, out, err = _run([PY, script], num_workers=3, grace_period=1.0)
    assert result.returncode == 3
    assert result.failed_task == "worker:1"
    assert "worker:1 exited with code 3; stopped the other tasks" in err
    assert time.monotonic() - start < 20
    stopped = {t.task: t.stopped for t in result.tasks}
    assert stopped == {"worker:0": True, "worker:1": False, "worker:2": True}


@pytest.mark.timeout(60)
def test_killed_task_exit_code_is_128_plus_signal(tmp_path):
    script = _script(tmp_path, """
        if NAME == "worker:0":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)
    """)
    result, _, err = _run([PY, script], num_workers=2, grace_period=1.0)
    assert result.returncode == 128 + signal.SIGKILL
    assert "worker:0 was killed by SIGKILL" in err


@pytest.mark.timeout(60)
def test_parameter_server_job_result_is_the_chiefs(tmp_path):
    script = _script(tmp_path, """
        if NAME == "chief:0":
            time.sleep(0.5)
            sys.exit(0)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        time.sleep(60)   # ps and worker servers never exit on their own
    """)
    start = time.monotonic()
    result, _, err = _run([PY, script], num_workers=2, num_ps=1, chief=True, grace_period=1.0)
    assert result.returncode == 0, err
    assert "chief:0 exited 0" in err
    assert time.monotonic() - start < 20
    assert {t.task for t in result.tasks} == {"chief:0", "worker:0", "worker:1", "ps:0"}


@pytest.mark.timeout(60)
def test_restart_uses_fresh_ports_and_can_succeed(tmp_path):
    script = _script(tmp_path, """
        if os.environ["TFDIST_LAUNCH_ATTEMPT"] == "1" and NAME == "worker:1":
            sys.exit(7)
    """)
    result, _, err = _run([PY, script], num_workers=2, max_restarts=2)
    assert result.returncode == 0 and result.attempts == 2, err
    assert "restarting the group with fresh ports (restart 1 of 2)" in err


@pytest.mark.timeout(60)
def test_gives_up_after_max_restarts(tmp_path):
    script = _script(tmp_path, "sys.exit(5 if NAME == 'worker:0' else 0)\n")
    result, _, err = _run([PY, script], num_workers=1, max_restarts=1)
    assert (result.returncode, result.attempts) == (5, 2)
    assert "giving up after 2 attempts" in err


@pytest.mark.timeout(60)
def test_timeout_stops_everything(tmp_path):
    script = _script(tmp_path, "time.sleep(60)\n")
    result, _, err = _run([PY, script], num_workers=2, timeout=1.0, grace_period=1.0)
    assert result.returncode == launch_lib.TIMEOUT_EXIT_CODE
    assert "timed out" in err


def test_bad_input_is_rejected_before_starting(tmp_path):
    with pytest.raises(ValueError, match=r"num_workers must be an integer >= 1. Received: "
                                         r"num_workers=0"):
        launch_lib.launch([PY, "x.py"], num_workers=0)
    with pytest.raises(ValueError, match=r"The script 'missing\.py' does not exist"):
        launch_lib.launch([PY, "-u", "missing.py"], num_workers=2)
    with pytest.raises(ValueError, match=r"not on PATH"):
        launch_lib.launch(["no-such-program-xyz"], num_workers=1)
    with pytest.raises(ValueError, match=r"needs a chief"):
        launch_lib.launch([PY, "-c", "pass"], num_workers=1, num_ps=1)
    with pytest.raises(ValueError, match=r"non-empty list"):
        launch_lib.launch("python x.py", num_workers=1)


def test_taken_port_is_a_clear_error(tmp_path):
    port = cluster_lib.free_ports(1)[0]
    cluster = cluster_lib.Cluster(worker=(f"127.0.0.1:{port}",))
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))
        sock.listen()
        with pytest.raises(ValueError, match=rf"Port {port} of worker:0 .* already in use"):
            launch_lib.launch([PY, "-c", "pass"], num_workers=1, cluster=cluster)


def _launcher_process(tmp_path, body):
    script = _script(tmp_path, body)
    env = dict(os.environ, PYTHONPATH=REPO)
    return subprocess.Popen(
        [PY, "-m", "tfdist.launch", "--num_workers=2", "--grace_period=1", "--", PY, script],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _child_pids(proc, n):
    pids = []
    while len(pids) < n:
        line = proc.stdout.readline()
        assert line, proc.stderr.read()
        if "pid=" in line:
            pids.append(int(line.rsplit("pid=", 1)[1]))
    return pids


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL])
def test_signalled_launcher_leaves_no_children(tmp_path, sig):
    proc = _launcher_process(tmp_path, """
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print(f"{NAME} pid={os.getpid()}", flush=True)
        time.sleep(60)
    """)
    try:
        pids = _child_pids(proc, 2)
        proc.send_signal(sig)
        rc = proc.wait(timeout=20)
        if sig != signal.SIGKILL:
            assert rc == 128 + sig
        deadline = time.monotonic() + 10
        while any(alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(alive(p) for p in pids), "orphaned children"
    finally:
        proc.kill()
        proc.wait()


def test_cli_without_a_command_fails_with_usage():
    result = subprocess.run([PY, "-m", "tfdist.cli", "launch", "--num_workers=2"], cwd=REPO,
                            env=dict(os.environ, PYTHONPATH=REPO), capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 2
    assert "no command to run" in result.stderr

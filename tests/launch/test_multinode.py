"""`tfdist launch --nnodes`: the rendezvous, the job's end on every node, bad flags (no TensorFlow).

Nodes here are launcher processes on 127.0.0.1 with their own ports; the
real separate network stacks (one network namespace per node) are in
tests/launch/test_namespaces.py.
"""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from tfdist import cluster as cluster_lib
from tests.support import REPO, alive

PY = sys.executable


def _script(tmp_path, body: str) -> str:
    path = tmp_path / "task.py"
    path.write_text("import json, os, signal, sys, time\n"
                    "CONFIG = json.loads(os.environ['TF_CONFIG'])\n"
                    "NAME = f\"{CONFIG['task']['type']}:{CONFIG['task']['index']}\"\n"
                    "ATTEMPT = int(os.environ['TFDIST_LAUNCH_ATTEMPT'])\n"
                    + textwrap.dedent(body))
    return str(path)


def _node(rank, coordinator, script, *flags, nnodes=2):
    return subprocess.Popen(
        [PY, "-m", "tfdist.launch", f"--nnodes={nnodes}", f"--node_rank={rank}",
         f"--coordinator={coordinator}", "--grace_period=1", *flags, "--", PY, script],
        cwd=REPO, env=dict(os.environ, PYTHONPATH=REPO), stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True)


def _finish(procs, timeout=60):
    outputs = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=timeout)
            outputs.append((proc.returncode, out, err))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return outputs


def _coordinator():
    return f"127.0.0.1:{cluster_lib.free_ports(1)[0]}"


@pytest.mark.timeout(120)
def test_nodes_form_one_cluster_and_succeed_together(tmp_path):
    script = _script(tmp_path, """
        print("config", json.dumps(CONFIG), flush=True)
    """)
    coordinator = _coordinator()
    procs = [_node(1, coordinator, script, "--num_workers=2"),
             _node(0, coordinator, script, "--num_workers=1", "--chief")]
    (rc1, out1, err1), (rc0, out0, err0) = _finish(procs)
    assert (rc0, rc1) == (0, 0), err0 + err1
    configs = [json.loads(line.split("config ", 1)[1])
               for line in (out0 + out1).splitlines() if " config " in line]
    assert sorted(c["task"]["type"] + str(c["task"]["index"]) for c in configs) == [
        "chief0", "worker0", "worker1", "worker2"]
    cluster = configs[0]["cluster"]
    assert all(c["cluster"] == cluster for c in configs)
    # The chief and node 0's worker first, then node 1's workers, in node order.
    assert "[chief:0]" in out0 and "[worker:0]" in out0
    assert "[worker:1]" in out1 and "[worker:2]" in out1
    assert f"coordinator listening on {coordinator} for 2 node(s)" in err0
    assert "all 4 tasks exited 0" in err0 and "all 4 tasks exited 0" in err1
    assert "listening on all interfaces: keep them behind a firewall" in err1


@pytest.mark.timeout(120)
def test_a_failure_on_one_node_restarts_every_node(tmp_path):
    script = _script(tmp_path, """
        if NAME == "worker:1" and ATTEMPT == 1:
            sys.exit(3)
        time.sleep(0.5)
        print("attempt", ATTEMPT, flush=True)
    """)
    coordinator = _coordinator()
    procs = [_node(r, coordinator, script, "--max_restarts=1") for r in (0, 1)]
    (rc0, out0, err0), (rc1, out1, err1) = _finish(procs)
    assert (rc0, rc1) == (0, 0), err0 + err1
    for err in (err0, err1):
        assert "worker:1 (node 1) exited with code 3; stopped the other tasks." in err
        assert "restarting this node's tasks on fresh ports" in err
    assert "[worker:0] attempt 2" in out0 and "[worker:1] attempt 2" in out1
    # Without restarts both nodes end with the failing task's status and name.
    procs = [_node(r, coordinator, script) for r in (0, 1)]
    (rc0, _, err0), (rc1, _, err1) = _finish(procs)
    assert (rc0, rc1) == (3, 3)
    assert "worker:1 (node 1) exited with code 3" in err0


@pytest.mark.timeout(120)
def test_a_node_that_stops_first_and_rejoins_at_once_gets_the_next_cluster(tmp_path):
    # Node 1's task fails, so node 1 stops at once and rejoins while node 0's task takes 3 s
    # to stop: the coordinator, still waiting for node 0 to stop, must keep node 1's join for
    # the next attempt (it dropped it: both nodes then waited for a cluster until
    # --join_timeout, "the coordinator went away or sent no cluster", 1 run in ~10 on a
    # loaded machine, every run here).
    script = _script(tmp_path, """
        if NAME == "worker:0" and ATTEMPT == 1:
            signal.signal(signal.SIGTERM, lambda *a: (time.sleep(3), sys.exit(0)))
            time.sleep(60)
        if NAME == "worker:1" and ATTEMPT == 1:
            time.sleep(1)
            sys.exit(3)
        print("attempt", ATTEMPT, flush=True)
    """)
    coordinator = _coordinator()
    procs = [_node(r, coordinator, script, "--max_restarts=1", "--grace_period=20",
                   "--join_timeout=30") for r in (0, 1)]
    (rc0, out0, err0), (rc1, out1, err1) = _finish(procs, timeout=90)
    assert (rc0, rc1) == (0, 0), err0 + err1
    assert "[worker:0] attempt 2" in out0 and "[worker:1] attempt 2" in out1


@pytest.mark.timeout(120)
def test_min_workers_goes_on_without_a_node_that_is_gone_for_good(tmp_path):
    # The coordinator is quiet while it waits --node_timeout (8 s) for node 1 to rejoin: the
    # node's connection must not time out meanwhile (it read with a 5 s timeout: "the
    # coordinator went away"), and node 0, whose last message is its join, is not "silent"
    # once the attempt starts. The nodes say the coordinator's note.
    script = _script(tmp_path, """
        print("attempt", ATTEMPT, "workers", len(CONFIG["cluster"]["worker"]), flush=True)
        time.sleep(60 if ATTEMPT == 1 else 3)
    """)
    coordinator = _coordinator()
    procs = [_node(r, coordinator, script, "--max_restarts=2", "--min_workers=1",
                   "--node_timeout=8", "--join_timeout=40") for r in (0, 1)]
    try:
        assert "[worker:0] attempt 1 workers 2" in procs[0].stdout.readline()
    finally:
        procs[1].kill()  # node 1 is gone: its launcher, and with it its task
    (rc0, out0, err0), = _finish(procs[:1], timeout=90)
    _finish(procs[1:], timeout=10)
    assert rc0 == 0, err0
    assert "[worker:0] attempt 2 workers 1" in out0
    assert ("node(s) 1 did not rejoin within 8 s (--node_timeout) after attempt 1: continuing "
            "with 1 worker(s) on node(s) 0 (--min_workers=1)") in err0
    assert "sent nothing" not in err0


@pytest.mark.timeout(120)
def test_a_killed_node_launcher_ends_the_job_on_every_node(tmp_path):
    script = _script(tmp_path, """
        os.write(1, f"{NAME} pid={os.getpid()}{chr(10)}".encode())
        time.sleep(60)
    """)
    coordinator = _coordinator()
    node0 = _node(0, coordinator, script, "--node_timeout=10")
    node1 = _node(1, coordinator, script, "--node_timeout=10")
    pids = []
    try:
        for node in (node0, node1):
            line = node.stdout.readline()
            assert "pid=" in line, node.stderr.read()
            pids.append(int(line.rsplit("pid=", 1)[1]))
        node1.kill()  # SIGKILL: the job keeper still ends node 1's task
        (rc0, out0, err0), = _finish([node0])
        assert rc0 == 1, err0
        assert "node 1's launcher went away (it exited or was killed)" in err0
        deadline = time.monotonic() + 10
        while any(alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(alive(p) for p in pids)
    finally:
        _finish([node0, node1])
        for pid in pids:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.timeout(120)
def test_a_missing_node_is_named_after_join_timeout(tmp_path):
    script = _script(tmp_path, "pass\n")
    coordinator = _coordinator()
    (rc0, _, err0), = _finish([_node(0, coordinator, script, "--join_timeout=2", nnodes=3)])
    assert rc0 == 1
    assert "node(s) 1, 2 did not join within 2 s (--join_timeout)" in err0
    (rc1, _, err1), = _finish([_node(1, coordinator, script, "--join_timeout=2")])
    assert rc1 == 1
    assert f"could not reach the coordinator at {coordinator}" in err1
    assert "start node 0 (it runs the coordinator)" in err1


@pytest.mark.timeout(120)
def test_nodes_that_disagree_are_refused(tmp_path):
    script = _script(tmp_path, "time.sleep(1)\n")
    coordinator = _coordinator()
    procs = [_node(0, coordinator, script, "--join_timeout=20"),
             _node(1, coordinator, script, nnodes=3)]
    time.sleep(1)
    (rc1, _, err1), = _finish(procs[1:])
    assert rc1 == 2 and "node 1 was started with --nnodes=3, the coordinator with --nnodes=2" \
        in err1, err1
    procs.append(_node(1, coordinator, script, "--chief"))  # chief elsewhere than node 0: ignored
    (rc0, _, err0), (rc1, _, err1) = _finish([procs[0], procs[2]])
    assert (rc0, rc1) == (0, 0), err0 + err1


@pytest.mark.parametrize("flags,message", [
    (["--nnodes=2"], "--nnodes=2 needs --coordinator=HOST:PORT"),
    (["--nnodes=2", "--node_rank=2", "--coordinator=127.0.0.1:29400"],
     "node_rank must be in 0..nnodes-1 = 0..1. Received: node_rank=2"),
    (["--nnodes=0", "--coordinator=127.0.0.1:29400"], "nnodes must be an integer >= 1"),
    (["--nnodes=2", "--coordinator=127.0.0.1:0"], "coordinator has an invalid port '0'"),
    (["--nnodes=2", "--coordinator=nonsense"], "coordinator"),
    # 192.0.2.1 is a documentation address: binding it fails before any packet is sent.
    (["--nnodes=2", "--coordinator=192.0.2.1:29400"],
     "Node 0 runs the coordinator, so the coordinator address must be one of node 0's own"),
    (["--nnodes=2", "--coordinator=127.0.0.1:29400", "--network=private"],
     "--network=private keeps tasks on one machine"),
    (["--nnodes=2", "--coordinator=127.0.0.1:29400", "--evaluator"], "--evaluator runs on one"),
    (["--node_rank=1"], "--node_rank only apply with --nnodes > 1"),
    (["--nnodes=2", "--coordinator=127.0.0.1:29400", "--node_timeout=1"],
     "node_timeout must be >= 6 s"),
])
def test_bad_multi_node_flags(flags, message):
    result = subprocess.run([PY, "-m", "tfdist.launch", *flags, "--", PY, "-c", "pass"],
                            cwd=REPO, env=dict(os.environ, PYTHONPATH=REPO), capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr and "Traceback" not in result.stderr, result.stderr

"""`tfdist launch --nnodes=2` on two real network stacks, and a network partition between them.

The test builds its own small network: three network namespaces held by
processes it starts (a switch with a bridge, and one namespace per node),
joined by veth pairs, with the documentation addresses 192.0.2.1 and
192.0.2.2. No packet leaves these namespaces. When the holder processes end
(the test's teardown, or the kernel's parent-death signal if pytest itself
dies) the namespaces vanish with their interfaces.

1. Each node runs the same `tfdist launch` command (its own --node_rank): a
   2-worker MultiWorkerMirrored `fit`. In the middle of epoch 2 both workers
   pause; the test cuts node 1's link to the switch (packets silently
   dropped, as in a real partition) and lets them go on: the next all-reduce
   cannot complete, and both nodes end with a clear error, within the
   collective timeout plus the launchers' node timeout, not a hang.
2. The test heals the link and runs the same two commands again: training
   resumes from the chief's backup and both nodes end with identical weights,
   equal to an uninterrupted single-replica run.
"""

import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from tests.multi_worker import run_training as script
from tests.support import REPO

PY = sys.executable
SCRIPT = os.path.join(REPO, "tests", "launch", "run_fault_training.py")
ADDRESSES = ("192.0.2.1", "192.0.2.2")  # TEST-NET-1: never routed anywhere
COORDINATOR = f"{ADDRESSES[0]}:29400"

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not sys.platform.startswith("linux")
    or not (shutil.which("ip") and shutil.which("nsenter")),
    reason="needs root on Linux with `ip` and `nsenter` to build network namespaces")

_HOLDER = ("import ctypes, sys\n"
           "libc = ctypes.CDLL(None, use_errno=True)\n"
           "libc.prctl(1, 9)  # PR_SET_PDEATHSIG: SIGKILL when the test dies\n"
           "if libc.unshare(0x40000000) != 0:  # CLONE_NEWNET\n"
           "    sys.exit(f'unshare: errno {ctypes.get_errno()}')\n"
           "print('ready', flush=True)\n"
           "sys.stdin.read()\n")


class Lab:
    """Two hosts and a switch, each a network namespace held by a process."""

    def __init__(self):
        self.holders = []
        self.switch, self.node0, self.node1 = (self._holder() for _ in range(3))
        self.run(self.switch, "ip", "link", "add", "br0", "type", "bridge")
        self.run(self.switch, "ip", "link", "set", "br0", "up")
        for i, (node, address) in enumerate(zip((self.node0, self.node1), ADDRESSES)):
            port = f"port{i}"
            subprocess.run(["ip", "link", "add", port, "netns", str(self.switch.pid), "type",
                            "veth", "peer", "name", "eth0", "netns", str(node.pid)], check=True)
            self.run(self.switch, "ip", "link", "set", port, "master", "br0")
            self.run(self.switch, "ip", "link", "set", port, "up")
            self.run(node, "ip", "addr", "add", f"{address}/24", "dev", "eth0")
            self.run(node, "ip", "link", "set", "eth0", "up")
            self.run(node, "ip", "link", "set", "lo", "up")

    def _holder(self) -> subprocess.Popen:
        proc = subprocess.Popen([PY, "-c", _HOLDER], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True)
        self.holders.append(proc)
        assert proc.stdout.readline() == "ready\n"
        return proc

    @staticmethod
    def enter(holder) -> list[str]:
        return ["nsenter", f"--net=/proc/{holder.pid}/ns/net"]

    def run(self, holder, *cmd) -> None:
        subprocess.run(self.enter(holder) + list(cmd), check=True, timeout=30)

    def partition(self, cut: bool) -> None:
        """Node 1's switch port down (cut) or up: node 1 is unreachable, silently."""
        self.run(self.switch, "ip", "link", "set", "port1", "down" if cut else "up")

    def close(self) -> None:
        for proc in self.holders:
            proc.kill()
            proc.wait()


@pytest.fixture
def lab():
    lab = Lab()
    try:
        yield lab
    finally:
        lab.close()


@pytest.fixture(scope="module")
def reference():
    import tfdist

    return script.train(tfdist.make_strategy("mirrored", devices=("/cpu:0",)), "tfdata")


def _start_nodes(lab, tmp_path, *script_args):
    procs = []
    for rank, holder in enumerate((lab.node0, lab.node1)):
        cmd = lab.enter(holder) + [
            PY, "-m", "tfdist.launch", "--nnodes=2", f"--node_rank={rank}",
            f"--coordinator={COORDINATOR}", "--num_workers=1", "--node_timeout=10",
            "--grace_period=2", "--timeout=200", "--join_timeout=60", "--",
            "python", SCRIPT, "--out", str(tmp_path), "--backup", str(tmp_path / "backup"),
            "--collective_timeout=10", *script_args]
        procs.append(subprocess.Popen(cmd, cwd=REPO, env=dict(os.environ, PYTHONPATH=REPO),
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    return procs


def _wait(procs, timeout=240):
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=timeout)[0])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return [(proc.returncode, out) for proc, out in zip(procs, outputs)]


@pytest.mark.timeout(600)
def test_two_nodes_partition_is_a_clear_error_then_resume_is_exact(lab, tmp_path, reference):
    import time

    pause = tmp_path / "go-on"
    pause_at = script.STEPS + script.STEPS // 2  # mid-epoch 2
    procs = _start_nodes(lab, tmp_path, f"--pause_at={pause_at}", f"--pause_file={pause}")
    try:
        deadline = time.monotonic() + 300
        reached = [tmp_path / f"go-on.{task}.reached" for task in ("worker0", "worker1")]
        while not all(r.exists() for r in reached):
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), \
                [p.poll() for p in procs]
            time.sleep(0.2)
        lab.partition(cut=True)
        pause.write_text("1")
        (rc0, out0), (rc1, out1) = _wait(procs)
    finally:
        _wait(procs, timeout=5)
    assert rc0 != 0 and rc1 != 0, out0[-3000:] + out1[-3000:]
    # Node 0 (the coordinator) names the failed task and why, or the node it lost.
    assert ("worker:0 (node 0)" in out0 and "It lost a peer" in out0) or \
        "node 1 sent nothing for 10 s" in out0, out0[-3000:]
    # Node 1 cannot hear the coordinator any more: it says so and stops its task.
    assert ("no word from the coordinator for 10 s (--node_timeout)" in out1
            or "lost the connection to the coordinator" in out1), (
        out1[-3000:] + "\n----- node 0\n" + out0[-3000:])
    assert "node 0 died or the network to it failed" in out1
    assert not (tmp_path / "worker0.npy").exists()

    lab.partition(cut=False)
    (rc0, out0), (rc1, out1) = _wait(_start_nodes(lab, tmp_path))
    assert (rc0, rc1) == (0, 0), out0[-3000:] + out1[-3000:]
    assert "[worker:0] resuming at epoch 1" in out0 and "[worker:1] resuming at epoch 1" in out1
    assert "[worker:0] joined: 2 replicas" in out0
    w0, w1 = np.load(tmp_path / "worker0.npy"), np.load(tmp_path / "worker1.npy")
    np.testing.assert_array_equal(w0, w1)
    np.testing.assert_allclose(w0, reference, rtol=0, atol=1e-6)


@pytest.mark.timeout(600)
def test_a_node_gone_for_good_leaves_one_worker_that_resumes_exactly(lab, tmp_path):
    """`--min_workers=1`: node 1 dies for good in the middle of training (its launcher
    SIGKILLed, its task with it); after --node_timeout node 0 restarts alone, with the
    same global batch, from the last backup (ZeRO-1 state saved by 2 workers, restored on
    one), and ends equal to one replica."""
    import time

    from tests.checkpoint import test_preemption as preemption

    want = preemption.reference(5)
    program = os.path.join(REPO, "tests", "checkpoint", "run_preemption.py")
    procs = []
    for rank, holder in enumerate((lab.node0, lab.node1)):
        cmd = lab.enter(holder) + [
            PY, "-m", "tfdist.launch", "--nnodes=2", f"--node_rank={rank}",
            f"--coordinator={COORDINATOR}", "--num_workers=1", "--node_timeout=10",
            "--grace_period=5", "--timeout=400", "--join_timeout=60", "--max_restarts=2",
            "--min_workers=1", "--", "python", program, "--out", str(tmp_path), "--backup_dir",
            str(tmp_path / "backup"), "--shard", "optimizer", "--save_freq", "5", "--epochs",
            "5", "--step_delay", "0.05", "--progress", str(tmp_path / "progress")]
        procs.append(subprocess.Popen(cmd, cwd=REPO, env=dict(os.environ, PYTHONPATH=REPO),
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    try:
        deadline = time.monotonic() + 300
        while preemption.progress(tmp_path) < 17:  # mid-epoch 3, after the backup of step 15
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs)
            time.sleep(0.05)
        procs[1].kill()  # node 1 is gone: its launcher, and with it its task
        (rc0, out0), = _wait(procs[:1], timeout=400)
    finally:
        _wait(procs, timeout=5)
    assert rc0 == 0, out0[-4000:]
    assert "node(s) 1 did not rejoin within 10 s (--node_timeout) after attempt 1: continuing " \
           "with 1 worker(s) on node(s) 0 (--min_workers=1)" in out0, out0[-4000:]
    assert "resuming at step 15 on 1 replica(s); the backup was made on 2" in out0
    w = np.load(tmp_path / "worker0.npy")
    np.testing.assert_allclose(w, want, rtol=0, atol=1e-6)

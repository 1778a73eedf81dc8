"""Where a launched job's TensorFlow servers listen, and what its tasks print at start-up.

Each task is written the way the TensorFlow tutorials write it (`import
tensorflow as tf` first, then a `tf.distribute.Server` from TF_CONFIG) and
serves until the test has looked at its sockets. TensorFlow binds every
server to the wildcard address (0.0.0.0), whatever the cluster spec says:
- `--network=private`: the servers live in a network namespace whose only
  interface is loopback; nothing listens on the job's ports on this machine;
- `--network=host` (the negative control, and what every local job did
  before): this machine's wildcard address, reachable from any host.
The same two runs check quiet start: TensorFlow's C++ start-up lines are
dropped by default and shown with `--verbosity=1`.
"""

import os
import subprocess
import sys

import pytest

from tests.support import REPO, alive
from tfdist.launch import output

PY = sys.executable
LISTEN = "0A"

_SERVER = """
import os, sys, time
import tensorflow as tf   # first, as in the tutorials: TensorFlow prints its start-up lines

resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
server = tf.distribute.Server(resolver.cluster_spec(), job_name=resolver.task_type,
                              task_index=resolver.task_id, protocol="grpc", start=True)
os.write(1, f"serving pid={os.getpid()}\\n".encode())
# The chief (or a lone worker) ends the job; ps and worker servers serve until stopped.
ends_job = resolver.task_type == "chief" or "chief" not in resolver.cluster_spec().jobs
while not (ends_job and os.path.exists(sys.argv[1])):
    time.sleep(0.1)
"""


def _listening(pid: int | str) -> dict[int, set[str]]:
    """port -> local addresses (hex, as in /proc/net/tcp) in `pid`'s network namespace."""
    found: dict[int, set[str]] = {}
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{table}") as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                address, port = fields[1].split(":")
                if fields[3] == LISTEN:
                    found.setdefault(int(port, 16), set()).add(address)
    return found


def _interfaces(pid: int | str) -> list[str]:
    with open(f"/proc/{pid}/net/dev") as f:
        return [line.split(":")[0].strip() for line in f.readlines()[2:]]


def _wildcard(address: str) -> bool:
    return set(address) == {"0"}


def _run_job(tmp_path, network: str, *flags):
    script = tmp_path / "server.py"
    script.write_text(_SERVER)
    stop = tmp_path / f"stop-{network}"
    proc = subprocess.Popen(
        [PY, "-m", "tfdist.launch", "--num_workers=1", f"--network={network}", "--timeout=200",
         "--grace_period=2", *flags, "--",
         "python", str(script), str(stop)],
        cwd=REPO, env=dict(os.environ, PYTHONPATH=REPO), stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True)
    return proc, stop


def _pids(proc, n: int) -> list[int]:
    pids = []
    while len(pids) < n:
        line = proc.stdout.readline()
        assert line, proc.stderr.read()
        if "serving pid=" in line:
            pids.append(int(line.rsplit("pid=", 1)[1]))
    return pids


def _finish(proc, stop):
    stop.write_text("1")
    try:
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
        proc.wait()
    return out, err


def _job_ports(err: str) -> list[int]:
    line = next(line for line in err.splitlines() if "attempt 1: starting" in line)
    return [int(p) for p in line.rsplit("ports ", 1)[1].split(", ")]


@pytest.mark.timeout(300)
def test_private_network_servers_unreachable_and_host_network_exposed(tmp_path):
    host_ns = os.stat("/proc/self/ns/net").st_ino

    # --- private: the default where the OS allows it; chief, worker and ps servers ------------
    proc, stop = _run_job(tmp_path, "private", "--num_ps=1", "--chief")
    pids = []
    try:
        pids = _pids(proc, 3)  # chief, worker, ps
        for pid in pids:
            assert os.stat(f"/proc/{pid}/ns/net").st_ino != host_ns
            assert _interfaces(pid) == ["lo"]  # loopback only: nothing outside can connect
        inside = _listening(pids[0])
        here = _listening("self")
    finally:
        out, err = _finish(proc, stop)
    assert proc.returncode == 0, err[-3000:]
    ports = _job_ports(err)
    assert len(ports) == 3
    for port in ports:
        assert port in inside, (port, inside)  # every server is up, in the namespace,
        assert any(_wildcard(a) for a in inside[port])  # on TensorFlow's wildcard,
        assert port not in here  # and nothing listens on this machine
    assert "in a private network namespace (loopback only" in err
    private_err = err
    assert not any(alive(p) for p in pids)

    # --- host: the negative control (one server is enough) -----------------------------------
    proc, stop = _run_job(tmp_path, "host", "--verbosity=1")
    try:
        pids = _pids(proc, 1)
        assert all(os.stat(f"/proc/{pid}/ns/net").st_ino == host_ns for pid in pids)
        here = _listening("self")
    finally:
        out, err = _finish(proc, stop)
    assert proc.returncode == 0, err[-3000:]
    for port in _job_ports(err):
        assert port in here and any(_wildcard(a) for a in here[port]), (port, here.get(port))
    # Quiet start although TensorFlow was imported first: the start-up lines TensorFlow
    # printed here, kept by --verbosity=1 (which lines depends on the CPU and GPU: the oneDNN
    # notice and cpu_feature_guard only where the CPU has the instructions; CUDA probing
    # without a GPU), were dropped from the private run.
    startup = {_message(line) for line in err.splitlines()
               if output.STARTUP_LINES.match(line.removeprefix("[worker:0] "))}
    assert startup, f"--verbosity=1 showed no TensorFlow start-up line: {err[-3000:]}"
    shown = {_message(line) for line in private_err.splitlines()}
    assert not startup & shown, startup & shown


def _message(line: str) -> str:
    """A log line without its task prefix, timestamp and thread id."""
    return line.split("] ", 2)[-1] if line.startswith("[") else line

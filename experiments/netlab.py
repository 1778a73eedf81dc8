"""A simulated cluster on one machine: N "nodes" as network namespaces with shaped links.

    with NetLab(nodes=2, rate_bits=1e9) as lab:
        lab.popen(0, ["python", ...])            # a process on node 0 (192.0.2.1)
        lab.set_rate(10e9)                       # reshape every link
        lab.probe()                              # {"rtt_seconds", "bytes_per_second"}

Each node and a switch are network namespaces, each held by a small process
(`unshare(CLONE_NEWNET)`; the namespace vanishes when its holder ends, and
holders die with this process: PR_SET_PDEATHSIG). Node i has `eth0` with
192.0.2.(i+1)/24 (TEST-NET-1, never routed), joined to a bridge in the switch
by a veth pair. Both directions of every link are shaped with an HTB class
at `rate_bits` (the node's eth0 egress: its upload; the switch port's egress:
its download), so a link carries at most that rate each way, as a
full-duplex NIC does. Nothing is configured outside these namespaces. The
kernel here has no netem: the delay is what veth, the bridge and the HTB
queue give (`probe()` measures it).

Needs root, `ip`, `tc` and `nsenter`; `NetLab.available()` says why not.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

ADDRESS = "192.0.2.{}"  # TEST-NET-1 (RFC 5737)

_HOLDER = ("import ctypes, sys\n"
           "libc = ctypes.CDLL(None, use_errno=True)\n"
           "libc.prctl(1, 9)  # PR_SET_PDEATHSIG: SIGKILL when the parent dies\n"
           "if libc.unshare(0x40000000) != 0:  # CLONE_NEWNET\n"
           "    sys.exit(f'unshare: errno {ctypes.get_errno()}')\n"
           "print('ready', flush=True)\n"
           "sys.stdin.read()\n")

# One TCP connection: a 1-byte ping-pong (round trip) and a bulk send (throughput).
_PROBE_SERVER = """
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(1)
print("listening", flush=True)
c, _ = s.accept(); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
for _ in range(int(sys.argv[3])):
    c.sendall(c.recv(1))
buf = bytearray(1 << 20)
while c.recv_into(buf):
    pass
c.sendall(b"k")
"""
_PROBE_CLIENT = """
import socket, sys, time, statistics
c = socket.create_connection((sys.argv[1], int(sys.argv[2])))
c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
rtts = []
for _ in range(int(sys.argv[3])):
    t = time.perf_counter(); c.sendall(b"x"); c.recv(1); rtts.append(time.perf_counter() - t)
total, chunk = int(sys.argv[4]), b"\\0" * (1 << 20)
t = time.perf_counter()
for _ in range(total // len(chunk)):
    c.sendall(chunk)
c.shutdown(socket.SHUT_WR); c.recv(1)
print(statistics.median(rtts), total / (time.perf_counter() - t))
"""


def wait_for_workers(procs: list[subprocess.Popen], *, timeout: float, label: str) -> list[str]:
    """Each process's output once all ended (one deadline for all); leftovers killed and reaped.

    Every process's pipe is drained while they run, each by a thread of its own: a worker
    that fills its pipe (64 KiB: a few hundred log lines) would otherwise block on a write,
    and, being linked, block its peers too.

    Raises:
      RuntimeError: "<label>: the workers did not finish in <timeout> s", or
        "<label>: worker k exited with <code>" and its last 20 lines.
    """
    import threading
    import time

    outputs = [""] * len(procs)

    def drain(k: int, p: subprocess.Popen) -> None:
        if p.stdout is not None:
            outputs[k] = p.stdout.read() or ""

    readers = [threading.Thread(target=drain, args=(k, p), daemon=True,
                                name=f"{label} worker {k} output")
               for k, p in enumerate(procs)]
    for reader in readers:
        reader.start()
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired as e:
        raise RuntimeError(f"{label}: the workers did not finish in {timeout} s") from e
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        for reader in readers:
            reader.join(timeout=10)  # EOF once the process has ended
        for p in procs:
            if p.stdout is not None:
                p.stdout.close()
    for k, (p, text) in enumerate(zip(procs, outputs)):
        if p.returncode != 0:
            tail = "\n".join(text.strip().splitlines()[-20:])
            raise RuntimeError(f"{label}: worker {k} exited with {p.returncode}:\n{tail}")
    return outputs


def run_workers(lab, args: list[str], *, nodes: int, port: int, timeout: float,
                label: str) -> dict:
    """`python <args> --worker_out=FILE` on each of the first `nodes` nodes, as the workers
    of one TF_CONFIG cluster (port `port`), in fresh processes that end here; worker 0's
    JSON result from FILE.

    Raises:
      RuntimeError: as `wait_for_workers`, or "<label>: worker 0 wrote no result".
    """
    import json
    import tempfile

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cluster = {"worker": [f"{lab.address(k)}:{port}" for k in range(nodes)]}
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""),
               TF_CPP_MIN_LOG_LEVEL="2")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        procs = []
        try:
            for k in range(nodes):
                procs.append(lab.popen(
                    k, [sys.executable, *args, f"--worker_out={out}"], cwd=root, text=True,
                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                    env=dict(env, TF_CONFIG=json.dumps(
                        {"cluster": cluster, "task": {"type": "worker", "index": k}}))))
        except BaseException:
            for p in procs:
                p.kill()
                p.wait()
            raise
        outputs = wait_for_workers(procs, timeout=timeout, label=label)
        if not os.path.exists(out):
            raise RuntimeError(f"{label}: worker 0 wrote no result:\n" + outputs[0][-2000:])
        with open(out) as f:
            return json.load(f)


def _kbit(rate_bits: float) -> str:
    return f"{max(8, int(rate_bits / 1000))}kbit"


class NetLab:
    """N nodes and a switch (network namespaces), every link shaped to `rate_bits`."""

    def __init__(self, nodes: int, rate_bits: float | None = None):
        if nodes < 1:
            raise ValueError(f"nodes must be >= 1. Received: nodes={nodes}")
        problem = self.available()
        if problem:
            raise RuntimeError(problem)
        self.nodes = nodes
        self.rate_bits = None
        self._holders: list[subprocess.Popen] = []
        try:
            self.switch = self._holder()
            self.node = [self._holder() for _ in range(nodes)]
            self._run(self.switch, "ip", "link", "add", "br0", "type", "bridge")
            self._run(self.switch, "ip", "link", "set", "br0", "up")
            for i, holder in enumerate(self.node):
                subprocess.run(["ip", "link", "add", f"port{i}", "netns", str(self.switch.pid),
                                "type", "veth", "peer", "name", "eth0", "netns",
                                str(holder.pid)], check=True, timeout=30)
                self._run(self.switch, "ip", "link", "set", f"port{i}", "master", "br0")
                self._run(self.switch, "ip", "link", "set", f"port{i}", "up")
                self._run(holder, "ip", "addr", "add", f"{self.address(i)}/24", "dev", "eth0")
                self._run(holder, "ip", "link", "set", "eth0", "up")
                self._run(holder, "ip", "link", "set", "lo", "up")
            if rate_bits:
                self.set_rate(rate_bits)
        except BaseException:
            self.close()
            raise

    @staticmethod
    def available() -> str | None:
        """None when namespaces can be built here, else why not."""
        if not sys.platform.startswith("linux"):
            return "network namespaces need Linux"
        if os.geteuid() != 0:
            return "network namespaces and tc need root"
        missing = [t for t in ("ip", "tc", "nsenter") if not shutil.which(t)]
        if missing:
            return f"missing tools: {', '.join(missing)}"
        return None

    @staticmethod
    def address(i: int) -> str:
        return ADDRESS.format(i + 1)

    def namespaces(self) -> set[str]:
        """The identities ("net:[inode]") of the namespaces this lab holds now."""
        return {os.readlink(f"/proc/{p.pid}/ns/net") for p in self._holders if p.poll() is None}

    def _holder(self) -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, "-c", _HOLDER], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True)
        self._holders.append(proc)
        if proc.stdout.readline() != "ready\n":
            raise RuntimeError("could not create a network namespace (unshare failed)")
        return proc

    @staticmethod
    def _enter(holder) -> list[str]:
        return ["nsenter", f"--net=/proc/{holder.pid}/ns/net"]

    def _run(self, holder, *cmd: str) -> None:
        subprocess.run(self._enter(holder) + list(cmd), check=True, timeout=30,
                       capture_output=True)

    def enter(self, i: int) -> list[str]:
        """The command prefix that runs a program on node i."""
        return self._enter(self.node[i])

    def popen(self, i: int, cmd: list[str], **kwargs) -> subprocess.Popen:
        """Starts `cmd` on node i."""
        return subprocess.Popen(self.enter(i) + list(cmd), **kwargs)

    def set_rate(self, rate_bits: float) -> None:
        """Shapes both directions of every link to `rate_bits` (HTB, one class per device)."""
        rate = _kbit(rate_bits)
        for holder, device in ([(h, "eth0") for h in self.node]
                               + [(self.switch, f"port{i}") for i in range(self.nodes)]):
            if self.rate_bits is None:
                self._run(holder, "tc", "qdisc", "add", "dev", device, "root", "handle", "1:",
                          "htb", "default", "10")
            self._run(holder, "tc", "class", "add" if self.rate_bits is None else "change",
                      "dev", device, "parent", "1:", "classid", "1:10", "htb", "rate", rate,
                      "ceil", rate)
        self.rate_bits = rate_bits

    def probe(self, *, a: int = 0, b: int = 1, pings: int = 200,
              total_bytes: int = 32 << 20, port: int = 45999) -> dict:
        """Round trip of 1 byte and one TCP stream's throughput from node a to node b."""
        server = self.popen(b, [sys.executable, "-c", _PROBE_SERVER, self.address(b),
                                str(port), str(pings)], stdout=subprocess.PIPE, text=True)
        try:
            if server.stdout.readline() != "listening\n":
                raise RuntimeError("probe server did not start")
            out = subprocess.run(self.enter(a) + [
                sys.executable, "-c", _PROBE_CLIENT, self.address(b), str(port), str(pings),
                str(total_bytes)], capture_output=True, text=True, timeout=300, check=True)
            rtt, rate = (float(v) for v in out.stdout.split())
        finally:
            server.kill()
            server.wait()
        return {"rtt_seconds": rtt, "bytes_per_second": rate}

    def close(self) -> None:
        for proc in self._holders:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        self._holders = []

    def __enter__(self) -> "NetLab":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

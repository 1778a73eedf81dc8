"""A real SLURM on this one machine, for tfdist's tests and for trying the SLURM recipes.

    python scripts/slurm_local.py install    # apt-get the Debian packages if missing (root)
    python scripts/slurm_local.py up [--nodes=3] [--dir=DIR] # start; prints `export SLURM_CONF=...`
    python scripts/slurm_local.py down --dir=DIR              # stop every daemon it started

Everything lives in one folder (default: a new temporary one): slurm.conf, a
munge key and socket, state, spool, logs and the daemons' PID files. The
daemons are this folder's own munged, one slurmctld and one slurmd per fake
node (`slurmd -N tfnodeK`), each node on 127.0.0.1 with its own port, all on
free ports, so nothing clashes with another SLURM or another test run and
nothing listens beyond loopback's reach except what SLURM's daemons bind
(they bind every interface; the ports are free, random, and gone at `down`).

Measured on Debian 12 (SLURM 22.05, as root): the daemons do not start by
themselves after installation; `scontrol reconfigure` after a change of the
node count kills slurmctld (so a different node count means a new folder);
slurmd needs `SlurmdParameters=config_overrides` to accept nodes larger than
the machine.

`LocalSlurm` is the same thing as a context manager, for a pytest fixture:

    with LocalSlurm(nodes=3) as slurm:
        subprocess.run(["srun", "-n", "2", "hostname"], env=slurm.env())

The test suite never installs anything: tests skip when `slurmctld`/`slurmd`
are not installed. CI runs `python scripts/slurm_local.py install` first.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")
BINARIES = ("munged", "slurmctld", "slurmd", "srun", "sbatch", "scontrol", "sinfo")
# CPUs each fake node claims: srun -n 2 fits on one node, -N 2 spreads.
NODE_CPUS = 2


def missing_binaries() -> list[str]:
    """The SLURM/munge programs that are not on PATH (or in /usr/sbin)."""
    path = os.environ.get("PATH", "") + os.pathsep + "/usr/sbin" + os.pathsep + "/sbin"
    return [b for b in BINARIES if shutil.which(b, path=path) is None]


def _which(name: str) -> str:
    path = os.environ.get("PATH", "") + os.pathsep + "/usr/sbin" + os.pathsep + "/sbin"
    found = shutil.which(name, path=path)
    if found is None:
        raise RuntimeError(f"{name} is not installed: run `python scripts/slurm_local.py "
                           f"install` (as root) first.")
    return found


def install() -> None:
    """apt-get installs SLURM and munge when a program is missing. Needs root and Debian."""
    if not missing_binaries():
        print("slurm_local: SLURM and munge are installed.")
        return
    if os.geteuid() != 0:
        raise SystemExit("slurm_local install: run as root (apt-get install).")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    start = time.monotonic()
    subprocess.run(["apt-get", "update", "-qq"], check=True, env=env)
    subprocess.run(["apt-get", "install", "-y", "-qq", "--no-install-recommends", *PACKAGES],
                   check=True, env=env)
    print(f"slurm_local: installed {' '.join(PACKAGES)} in {time.monotonic() - start:.0f} s.")


def _free_ports(count: int) -> list[int]:
    socks, ports = [], []
    try:
        for _ in range(count):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
            ports.append(s.getsockname()[1])
    finally:
        for s in socks:
            s.close()
    return ports


class LocalSlurm:
    """munged + slurmctld + one slurmd per fake node, in one folder, stopped by PID.

    Args:
      nodes: fake nodes tfnode1..tfnodeN, all NodeAddr=127.0.0.1.
      directory: where everything lives (default: a new temporary folder,
        removed by `down()`).
      timeout: seconds to wait for the nodes to be idle.
    """

    def __init__(self, *, nodes: int = 3, directory: str | None = None,
                 timeout: float = 60.0):
        if nodes < 1:
            raise ValueError(f"nodes must be >= 1. Received: nodes={nodes}")
        self.nodes = nodes
        self.own_directory = directory is None
        self.directory = directory or tempfile.mkdtemp(prefix="tfdist-slurm-")
        self.timeout = timeout
        self.conf = os.path.join(self.directory, "slurm.conf")
        self.node_names = [f"tfnode{i + 1}" for i in range(nodes)]

    # -- files -----------------------------------------------------------------

    def _path(self, *parts: str) -> str:
        return os.path.join(self.directory, *parts)

    def _write_files(self) -> None:
        os.makedirs(self._path("state"), exist_ok=True)
        os.makedirs(self._path("munge"), mode=0o700, exist_ok=True)
        os.chmod(self.directory, 0o755)
        key = self._path("munge", "munge.key")
        with open(key, "wb") as f:
            f.write(os.urandom(1024))
        os.chmod(key, 0o400)
        ctld_port, *node_ports = _free_ports(1 + self.nodes)
        host = socket.gethostname().split(".")[0]
        lines = [
            "ClusterName=tfdist",
            f"SlurmctldHost={host}(127.0.0.1)",
            f"SlurmctldPort={ctld_port}",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self._path('munge', 'munge.socket')}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "SlurmdParameters=config_overrides",
            "SchedulerType=sched/backfill",
            "MpiDefault=none",
            "ReturnToService=2",
            "JobRequeue=1",
            "KillWait=5",
            "InactiveLimit=0",
            "MinJobAge=30",
            "AccountingStorageType=accounting_storage/none",
            "JobAcctGatherType=jobacct_gather/none",
            "JobCompType=jobcomp/none",
            f"StateSaveLocation={self._path('state')}",
            f"SlurmdSpoolDir={self._path('spool-%n')}",
            f"SlurmctldPidFile={self._path('slurmctld.pid')}",
            f"SlurmdPidFile={self._path('slurmd-%n.pid')}",
            f"SlurmctldLogFile={self._path('slurmctld.log')}",
            f"SlurmdLogFile={self._path('slurmd-%n.log')}",
        ]
        for name, port in zip(self.node_names, node_ports):
            lines.append(f"NodeName={name} NodeAddr=127.0.0.1 Port={port} CPUs={NODE_CPUS} "
                         f"RealMemory=1000 State=UNKNOWN")
        lines.append("PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP")
        with open(self.conf, "w") as f:
            f.write("\n".join(lines) + "\n")

    # -- daemons ---------------------------------------------------------------

    def env(self) -> dict[str, str]:
        """The environment for srun/sbatch/scontrol against this SLURM."""
        env = dict(os.environ, SLURM_CONF=self.conf)
        env["PATH"] = env.get("PATH", "") + os.pathsep + "/usr/sbin"
        for key in [k for k in env if k.startswith("SLURM_") and k != "SLURM_CONF"]:
            del env[key]
        return env

    def _start(self, args: list[str], pid_file: str) -> int:
        proc = subprocess.run(args, env=self.env(), capture_output=True, text=True, timeout=60)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(args)} failed ({proc.returncode}): "
                               f"{proc.stderr.strip()}{self._logs()}")
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                with open(pid_file) as f:
                    return int(f.read().strip())
            except (FileNotFoundError, ValueError):
                time.sleep(0.1)
        raise RuntimeError(f"{args[0]} wrote no PID file {pid_file}.{self._logs()}")

    def _logs(self) -> str:
        out = []
        for name in sorted(os.listdir(self.directory)):
            if name.endswith(".log"):
                with open(self._path(name), errors="replace") as f:
                    tail = f.read()[-1500:]
                out.append(f"\n--- {name}\n{tail}")
        return "".join(out)

    def up(self) -> "LocalSlurm":
        """Writes the folder, starts the daemons, waits until every node is idle."""
        self._write_files()
        munge = self._path("munge")
        self._start([_which("munged"), f"--socket={munge}/munge.socket",
                     f"--key-file={munge}/munge.key", f"--pid-file={munge}/munged.pid",
                     f"--log-file={munge}/munged.log", f"--seed-file={munge}/munged.seed",
                     "--force"], f"{munge}/munged.pid")
        self._start([_which("slurmctld"), "-f", self.conf], self._path("slurmctld.pid"))
        for name in self.node_names:
            self._start([_which("slurmd"), "-f", self.conf, "-N", name],
                         self._path(f"slurmd-{name}.pid"))
        self.wait_idle()
        return self

    def states(self) -> dict[str, str]:
        proc = subprocess.run([_which("sinfo"), "-h", "-N", "-o", "%N %t"], env=self.env(),
                              capture_output=True, text=True, timeout=30)
        return dict(line.split() for line in proc.stdout.splitlines() if line.strip())

    def wait_idle(self) -> None:
        deadline = time.monotonic() + self.timeout
        states: dict[str, str] = {}
        while time.monotonic() < deadline:
            states = self.states()
            if len(states) == self.nodes and all(s == "idle" for s in states.values()):
                return
            time.sleep(0.5)
        raise RuntimeError(f"SLURM nodes not idle within {self.timeout:g} s: {states}."
                           f"{self._logs()}")

    def pids(self) -> list[int]:
        """The PIDs of the daemons this folder's PID files name (running or not)."""
        files = [self._path("munge", "munged.pid"), self._path("slurmctld.pid")]
        files += [self._path(f"slurmd-{n}.pid") for n in self.node_names]
        pids = []
        for path in files:
            try:
                with open(path) as f:
                    pids.append(int(f.read().strip()))
            except (FileNotFoundError, ValueError):
                pass
        return pids

    def _stepds(self) -> list[int]:
        """slurmstepd processes serving this folder's nodes (they outlive a killed slurmd)."""
        found = []
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmd = f.read().split(b"\0")
                with open(f"/proc/{pid}/environ", "rb") as f:
                    environ = f.read()
            except OSError:
                continue
            if cmd and cmd[0].endswith(b"slurmstepd") and (
                    self.conf.encode() in environ or self.directory.encode() in b" ".join(cmd)):
                found.append(int(pid))
        return found

    def down(self) -> None:
        """Cancels every job, stops every daemon by PID, waits for them, removes the folder."""
        if os.path.exists(self.conf) and shutil.which("scancel", path="/usr/bin:/bin"):
            subprocess.run(["scancel", "--full", "--quiet", "--user=root"], env=self.env(),
                           capture_output=True, timeout=30)
            deadline = time.monotonic() + 20
            while self._stepds() and time.monotonic() < deadline:
                time.sleep(0.2)
        pids = self.pids() + self._stepds()
        for pid in reversed(pids):  # nodes first, munged last
            _signal(pid, signal.SIGTERM)
        deadline = time.monotonic() + 15
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        for pid in pids:
            _signal(pid, signal.SIGKILL)
        while any(_alive(p) for p in pids) and time.monotonic() < deadline + 5:
            time.sleep(0.1)
        left = [p for p in pids if _alive(p)]
        if left:
            raise RuntimeError(f"SLURM daemons still running after SIGKILL: {left}")
        if self.own_directory:
            shutil.rmtree(self.directory, ignore_errors=True)

    def __enter__(self) -> "LocalSlurm":
        try:
            return self.up()
        except BaseException:
            self.down()
            raise

    def __exit__(self, *exc) -> None:
        self.down()


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=("install", "up", "down", "status"))
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--dir", default=None, help="the folder (up: default a new temp one)")
    args = parser.parse_args(argv)
    if args.command == "install":
        install()
        return 0
    if args.command == "up":
        slurm = LocalSlurm(nodes=args.nodes, directory=args.dir)
        slurm.own_directory = False  # kept until `down`
        try:
            slurm.up()
        except BaseException:
            slurm.down()
            raise
        print(f"export SLURM_CONF={slurm.conf}  # stop with: python {sys.argv[0]} down "
              f"--dir={slurm.directory}")
        return 0
    if args.dir is None:
        parser.error(f"{args.command} needs --dir=DIR (the folder `up` printed)")
    with open(os.path.join(args.dir, "slurm.conf")) as f:
        nodes = sum(1 for line in f if line.startswith("NodeName="))
    slurm = LocalSlurm(nodes=nodes, directory=args.dir)
    if args.command == "status":
        print(slurm.states())
        return 0
    slurm.own_directory = True
    slurm.down()
    return 0


if __name__ == "__main__":
    sys.exit(main())

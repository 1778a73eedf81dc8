"""What keeps a launched job to itself: its network, its processes.

TensorFlow's gRPC server binds the wildcard address (`0.0.0.0:PORT`) whatever
the cluster spec says, and it runs any op it is sent without authentication.
So a local job's tasks run in a **private network namespace** that holds only
a loopback interface: their servers listen there, and nothing outside the job
(not even another process on this machine) can reach them. As root the
namespace is made directly; otherwise inside an unprivileged user namespace
that maps the user's own uid and gid onto themselves (files keep their
owner). Where neither is allowed (not Linux, user namespaces disabled, a
container without the capability) `network="auto"` falls back to the host's
network and says which ports are exposed; `network="private"` fails instead.

The **job keeper** (`_keeper.py`) is a small process that outlives the
launcher: when the launcher dies, even by SIGKILL, it kills every task's
process group and every process left in the job's namespace, so children and
grandchildren of the tasks never become orphans.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import threading
from typing import Literal

Network = Literal["auto", "private", "host"]
NETWORKS: tuple[str, ...] = ("auto", "private", "host")

_HERE = os.path.dirname(os.path.abspath(__file__))
KEEPER_SCRIPT = os.path.join(_HERE, "_keeper.py")
ENTER_SCRIPT = os.path.join(_HERE, "_enter.py")


class IsolationError(RuntimeError):
    """network='private' was asked for and this machine cannot provide it."""


def check_network(network) -> str:
    if network not in NETWORKS:
        raise ValueError(
            f"network must be one of {', '.join(NETWORKS)}. Received: network={network!r}. "
            f"'private' runs the tasks in a loopback-only network namespace, 'host' on this "
            f"machine's network, 'auto' private where the OS allows it.")
    return network


@dataclasses.dataclass(frozen=True)
class Namespaces:
    """File descriptors of the namespaces the tasks join (-1: stay in ours)."""

    user: int = -1
    net: int = -1

    @property
    def fds(self) -> tuple[int, ...]:
        return tuple(fd for fd in (self.user, self.net) if fd >= 0)


class JobKeeper:
    """Starts the keeper process; registers task process groups with it.

    Args:
      network: "private", "host" or "auto" (see the module docstring).

    Attributes:
      private: True when the tasks get the private network namespace.
      unavailable: why the private namespace could not be made (auto mode), or None.
      namespaces: what each task joins (passed to `task_argv`).
    """

    def __init__(self, *, network: Network):
        check_network(network)
        self._lock = threading.Lock()
        self.unavailable: str | None = None
        self.namespaces = Namespaces()
        args = ["--private-network"] if network != "host" else []
        self._proc = subprocess.Popen(
            [sys.executable, "-I", "-S", KEEPER_SCRIPT, *args], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=None, text=True, start_new_session=True)
        answer = self._proc.stdout.readline().strip()
        if answer == "ready private":
            self.namespaces = self._open_namespaces()
        elif answer.startswith("unavailable"):
            self.unavailable = answer.partition(" ")[2] or "unknown reason"
            if network == "private":
                self.close()
                raise IsolationError(
                    f"network='private' needs a private network namespace, and this machine "
                    f"does not allow one: {self.unavailable}. Run as root, enable unprivileged "
                    f"user namespaces (sysctl kernel.unprivileged_userns_clone=1 or "
                    f"user.max_user_namespaces > 0), or accept exposed ports with "
                    f"network='host' on a trusted network.")
        elif answer != "ready host":
            self.close()
            raise IsolationError(f"the job keeper did not start (it said {answer!r}).")

    @property
    def private(self) -> bool:
        return self.namespaces.net >= 0

    @property
    def pid(self) -> int:
        return self._proc.pid

    def _open_namespaces(self) -> Namespaces:
        base = f"/proc/{self._proc.pid}/ns"
        user = -1
        if os.stat(f"{base}/user").st_ino != os.stat("/proc/self/ns/user").st_ino:
            user = os.open(f"{base}/user", os.O_RDONLY | os.O_CLOEXEC)
        net = os.open(f"{base}/net", os.O_RDONLY | os.O_CLOEXEC)
        return Namespaces(user=user, net=net)

    def alive(self) -> bool:
        return self._proc.poll() is None

    def _send(self, line: str) -> None:
        with self._lock:
            if self._proc.poll() is None:
                try:
                    self._proc.stdin.write(line + "\n")
                    self._proc.stdin.flush()
                except (BrokenPipeError, ValueError):
                    pass

    def track(self, pgid: int) -> None:
        """The keeper kills this process group if the launcher dies."""
        self._send(f"+{pgid}")

    def forget(self, pgid: int) -> None:
        """The group is gone (reaped): its number may be reused, stop tracking it."""
        self._send(f"-{pgid}")

    def sweep(self) -> None:
        """Kills every process left in the private namespace (tasks' stray children)."""
        if not self.private or not self.alive():
            return
        self._send("sweep")
        self._proc.stdout.readline()  # "swept"

    def task_argv(self, program: list[str]) -> list[str]:
        """The command line that starts `program` as a task of this job."""
        return [sys.executable, "-I", "-S", ENTER_SCRIPT, str(os.getpid()),
                str(self.namespaces.user), str(self.namespaces.net), *program]

    def close(self) -> None:
        """Ends the keeper (it kills whatever is still registered) and closes our fds."""
        if self._proc.stdin and not self._proc.stdin.closed:
            try:
                self._proc.stdin.close()
            except BrokenPipeError:
                pass
        try:
            self._proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        if self._proc.stdout:
            self._proc.stdout.close()
        for fd in self.namespaces.fds:
            try:
                os.close(fd)
            except OSError:
                pass
        self.namespaces = Namespaces()

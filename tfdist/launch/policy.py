"""How a launched job ends: task exits in, decisions out (no processes here).

The same policy serves the local supervisor and the multi-node coordinator,
which sees the exits of every node's tasks.

- **Preemption**: a task that exits 75 (`tfdist.preemption.PREEMPTED_EXIT_CODE`)
  saved a backup after a SIGTERM and asks to be run again. Its peers are
  saving at the same step and exit 75 too: the launcher waits for them
  (`grace_period` at most) and ends the attempt with 75 and "preempted at
  step S", not as a failure; `max_restarts` restarts it. When the launcher
  itself got the signal (`signal_end`), it never restarts.
- **No parameter servers** (MultiWorkerMirrored): the job succeeds when every
  task exits 0. The first non-zero exit fails it and the others are stopped.
  A task that exits 0 while its peers still train breaks their next
  collective (they die with UnavailableError): then the message names the task
  that left first, not the survivor that crashed because of it.
- **With parameter servers**: the chief is the coordinator, and ps and worker
  tasks run servers that never exit on their own, so **the job's result is the
  chief's**. A worker that dies is restarted alone, on the same address
  (`max_worker_restarts` times each, default 3): the chief's ClusterCoordinator
  re-sends its steps elsewhere and uses it again when it is back. With no
  restarts left the job continues on the other workers; it fails when no
  worker is left. A ps or the chief that exits fails the job (the variables
  or the training loop are gone).
"""

from __future__ import annotations

import dataclasses
import signal
from typing import Iterable, Sequence

from tfdist import cluster as cluster_lib
from tfdist.preemption import PREEMPTED_EXIT_CODE

TIMEOUT_EXIT_CODE = 124  # like coreutils `timeout`
DEFAULT_WORKER_RESTARTS = 3


@dataclasses.dataclass(frozen=True)
class TaskExit:
    """How one task of the last attempt ended."""

    task: str  # "worker:1"
    pid: int
    returncode: int | None  # None: still running when stopped; <0: killed by that signal
    stopped: bool  # True if the launcher stopped it
    restarts: int = 0  # times this task alone was restarted (parameter-server jobs)


@dataclasses.dataclass(frozen=True)
class LaunchResult:
    """The outcome of `launch()`.

    Attributes:
      returncode: 0 on success; else the first failing task's exit code
        (128+N for a task killed by signal N), 124 on timeout or a silent
        task, 75 when the tasks saved a backup after a SIGTERM (preempted:
        run again to resume), 128+N when the launcher got signal N and the
        tasks saved nothing.
      attempts: how many times the group was started (1 + restarts used).
      failed_task: the task that failed the last attempt, if any.
      message: one line saying what happened.
      tasks: how each task of the last attempt ended.
      cluster: the last attempt's cluster (None: a multi-node job that ended
        before its nodes formed one).
    """

    returncode: int
    attempts: int
    failed_task: str | None
    message: str
    tasks: tuple[TaskExit, ...]
    cluster: cluster_lib.Cluster | None

    @property
    def ok(self) -> bool:
        return self.returncode == 0


def exit_code(returncode: int) -> int:
    """A child's returncode as a shell exit status (128+N for signal N)."""
    return 128 - returncode if returncode < 0 else returncode


def describe_exit(returncode: int, preempted_step: int | None = None) -> str:
    if returncode == PREEMPTED_EXIT_CODE:
        at = f" at step {preempted_step}" if preempted_step is not None else ""
        return (f"was preempted{at} (it got SIGTERM, saved a backup and exited "
                f"{PREEMPTED_EXIT_CODE})")
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"was killed by {name}"
    return f"exited with code {returncode}"


_PEER_LOST = ("UnavailableError", "Socket closed", "Connection reset by peer", "failed to connect",
              "Failed to connect", "DeadlineExceeded", "Collective ops is aborted", "unreachable")


def lost_peer(tail: Sequence[str]) -> bool:
    """True when a task's last lines show it lost a peer (UnavailableError and the like)."""
    text = "\n".join(tail)
    return any(s in text for s in _PEER_LOST)


def hint(returncode: int, tail: Sequence[str]) -> str:
    """A sentence explaining a failure from the task's last output lines."""
    from tfdist.multi_worker import JOIN_TIMEOUT_MARKER

    text = "\n".join(tail)
    if "Address already in use" in text or "Could not start gRPC server" in text:
        return (" Its port was taken by another process between the launcher's check and "
                "the server's start: run again (or use --max_restarts) to get fresh ports.")
    if JOIN_TIMEOUT_MARKER in text:
        return " A peer never joined the cluster (join timeout; see the message above)."
    if "No module named 'tensorflow'" in text or "No module named 'tfdist'" in text:
        return (" The task's Python lacks a package the script needs: run the launcher from "
                "the environment that has it, or give that Python's full path.")
    if lost_peer(tail):
        return (" It lost a peer: another task died or hung, or the network between tasks "
                "failed, and a collective timed out or broke.")
    if returncode == -signal.SIGKILL:
        return " (killed from outside, or by the kernel's out-of-memory killer)."
    return ""


@dataclasses.dataclass(frozen=True)
class RestartTask:
    """Start this task again, alone, with the same TF_CONFIG."""

    task: str
    message: str


@dataclasses.dataclass(frozen=True)
class Note:
    """Keep going; say this."""

    message: str


@dataclasses.dataclass(frozen=True)
class End:
    """Stop every task; the attempt ends with this result."""

    returncode: int
    message: str
    failed_task: str | None = None
    restartable: bool = False


Decision = RestartTask | Note | End | None


def _role(task: str) -> str:
    return task.split(":", 1)[0]


class JobPolicy:
    """Turns task exits into decisions for one attempt.

    Args:
      tasks: every task of the cluster ("chief:0", "worker:1", ...).
      max_worker_restarts: per worker, in jobs with parameter servers.
    """

    def __init__(self, tasks: Iterable[str], *, max_worker_restarts: int = DEFAULT_WORKER_RESTARTS):
        self.tasks = list(tasks)
        self.has_ps = any(_role(t) == "ps" for t in self.tasks)
        self.max_worker_restarts = max_worker_restarts
        self.running = set(self.tasks)
        self.restarts = {t: 0 for t in self.tasks}
        self._left_early: str | None = None
        self.preempted: dict[str, int | None] = {}  # task -> the step its backup holds

    def _preempted_end(self, note: str = "") -> End:
        steps = sorted({s for s in self.preempted.values() if s is not None})
        at = f" at step {steps[0]}" if len(steps) == 1 else (
            f" at steps {', '.join(map(str, steps))}" if steps else "")
        return End(PREEMPTED_EXIT_CODE,
                   f"preempted{at}, backup saved: {', '.join(sorted(self.preempted))} got "
                   f"SIGTERM or followed a peer that did, saved and exited "
                   f"{PREEMPTED_EXIT_CODE}{note}. Run the same command again to resume "
                   f"from step {steps[0] if len(steps) == 1 else 'S'}.",
                   None, restartable=True)

    def on_preemption_timeout(self, seconds: float) -> End:
        """Some tasks exited 75 but others still run `seconds` later (they get stopped)."""
        still = ", ".join(sorted(self.running))
        return self._preempted_end(f"; {still} still ran {seconds:g} s later (--grace_period) "
                                   f"and was stopped")

    def watched(self, task: str) -> bool:
        """Tasks that must keep making progress (servers may be silent forever)."""
        return not self.has_ps or _role(task) in ("chief", "evaluator")

    def on_exit(self, task: str, returncode: int, tail_hint: str = "",
                lost_peer: bool = False, preempted_step: int | None = None) -> Decision:
        """Decides what a task's exit means.

        Args:
          task: its name.
          returncode: Popen's returncode (<0: killed by that signal).
          tail_hint: `hint()` of its last lines.
          lost_peer: its last lines show a lost peer (UnavailableError & co).
          preempted_step: the step of its `tfdist: preempted at step S` line.
        """
        self.running.discard(task)
        role = _role(task)
        what = f"{task} {describe_exit(returncode, preempted_step)}"
        if returncode == PREEMPTED_EXIT_CODE:
            self.preempted[task] = preempted_step
        if not self.has_ps:
            if returncode == PREEMPTED_EXIT_CODE:
                # Its peers save at the same step and exit 75 too: wait for them.
                return self._preempted_end() if not self.running else None
            if returncode == 0:
                if not self.running:
                    if self.preempted:
                        return self._preempted_end()
                    return End(0, f"all {len(self.tasks)} tasks exited 0")
                if self._left_early is None and role in ("chief", "worker"):
                    self._left_early = task
                return None
            message = f"{what}; stopped the other tasks.{tail_hint}"
            failed = task
            if self._left_early is not None and lost_peer:
                message = (
                    f"{self._left_early} left the job first: it exited 0 while its peers were "
                    f"still training, and then {what} because its peer was gone. In a "
                    f"multi_worker_mirrored job every task must run every step (same epochs, "
                    f"steps and data size on every task). Stopped the other tasks.")
                failed = self._left_early
            return End(exit_code(returncode), message, failed, restartable=True)
        if role == "chief":
            if returncode == 0:
                return End(0, f"{task} exited 0: the job succeeded (ps/worker servers stopped)")
            if returncode == PREEMPTED_EXIT_CODE:
                return self._preempted_end("; stopped the ps and worker servers")
            return End(exit_code(returncode), f"{what}; stopped the other tasks.{tail_hint}",
                       task, restartable=True)
        if role == "ps":
            return End(exit_code(returncode) or 1,
                       f"{what}; a parameter server holds part of the variables, so the job "
                       f"cannot go on without it: stopped the other tasks.{tail_hint}",
                       task, restartable=True)
        if role == "evaluator":
            if returncode == 0:
                return None
            return End(exit_code(returncode), f"{what}; stopped the other tasks.{tail_hint}",
                       task, restartable=True)
        # A worker of a parameter-server job.
        workers_left = sum(1 for t in self.running if _role(t) == "worker")
        if returncode != 0 and self.restarts[task] < self.max_worker_restarts:
            self.restarts[task] += 1
            self.running.add(task)
            return RestartTask(task, (
                f"{what}; restarting it alone on the same address (restart "
                f"{self.restarts[task]} of {self.max_worker_restarts}); the other tasks keep "
                f"running.{tail_hint}"))
        if workers_left:
            reason = ("exited 0" if returncode == 0 else
                      f"{describe_exit(returncode)} and used its {self.max_worker_restarts} "
                      f"restarts")
            return Note(f"{task} {reason}; the job continues on {workers_left} worker(s).")
        return End(exit_code(returncode) or 1,
                   f"{what} and no worker is left to run the training steps: stopped the "
                   f"other tasks.{tail_hint}", task, restartable=True)

    def on_silent(self, task: str, seconds: float) -> End:
        return End(TIMEOUT_EXIT_CODE,
                   f"{task} wrote nothing for {seconds:g} s (--progress_timeout): it looks hung; "
                   f"stopped every task.", task, restartable=True)


def signal_end(signum: int, exits: Sequence[tuple[str, int | None, int | None]]) -> End:
    """How an attempt ends when the launcher itself got signal `signum` and stopped the tasks.

    Args:
      signum: the signal (SIGTERM, SIGINT, SIGHUP).
      exits: (task, returncode, preempted step) of every task, after the stop.

    Tasks that exited 75 saved a backup: the result is 75 ("preempted at step
    S, backup saved"), else 128+signum. Never restartable: the signal was for
    the launcher (the cluster is taking the machine away).
    """
    name = signal.Signals(signum).name
    saved = {task: step for task, code, step in exits if code == PREEMPTED_EXIT_CODE}
    if not saved:
        return End(128 + signum, f"got {name}: stopped every task")
    steps = sorted({s for s in saved.values() if s is not None})
    at = f" at step {steps[0]}" if len(steps) == 1 else ""
    return End(PREEMPTED_EXIT_CODE,
               f"got {name}: preempted{at}, backup saved ({', '.join(sorted(saved))} saved and "
               f"exited {PREEMPTED_EXIT_CODE}); not restarting, since the signal was for this "
               f"launcher. Run the same command again to resume.")

"""Start one local process per task with its own TF_CONFIG, and supervise them.

    tfdist launch --num_workers=2 -- python train.py --strategy=multi_worker_mirrored
    python -m tfdist.launch --num_workers=2 --max_restarts=1 -- python train.py ...

    result = tfdist.launch.launch(["python", "train.py"], num_workers=2)
    result.returncode

What it does, like torchrun / horovodrun for TensorFlow:
- picks free ports on 127.0.0.1 (tfdist.cluster.local_cluster) and gives each
  child its TF_CONFIG in the child's environment (never in ours);
- prefixes every output line with the task: `[worker:1] ...` (stdout to our
  stdout, stderr to our stderr);
- supervises: the first child that fails decides the exit code, and the
  others are stopped at once (SIGTERM to the child's process group, SIGKILL
  after `grace_period` s; TensorFlow catches SIGTERM, so SIGKILL matters);
- `max_restarts`: after a failure, restarts the whole group on fresh ports
  (a training script with tfdist.checkpoint.BackupAndRestore resumes);
- SIGINT/SIGTERM to the launcher stops every child; on Linux each child also
  gets PR_SET_PDEATHSIG=SIGKILL, so even a SIGKILLed launcher leaves no orphans.

The job's result (stated policy):
- no ps tasks (MultiWorkerMirrored): success when every task exits 0; the
  first non-zero exit fails the job.
- with ps tasks (ParameterServerStrategy): the chief is the coordinator and
  ps/worker tasks run servers that never exit on their own, so **the job's
  result is the chief's**: when the chief exits 0 the other tasks are
  stopped and the job succeeds; any task failing before that fails the job.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from typing import IO, Mapping, Sequence

from tfdist import cluster as cluster_lib

TIMEOUT_EXIT_CODE = 124  # like coreutils `timeout`
_POLL_SECONDS = 0.05
_PREFIX = "[tfdist launch]"


@dataclasses.dataclass(frozen=True)
class TaskExit:
    """How one task of the last attempt ended."""

    task: str  # "worker:1"
    pid: int
    returncode: int | None  # None: still running when stopped; <0: killed by that signal
    stopped: bool  # True if the launcher stopped it


@dataclasses.dataclass(frozen=True)
class LaunchResult:
    """The outcome of `launch()`.

    Attributes:
      returncode: 0 on success; else the first failing task's exit code
        (128+N for a task killed by signal N), 124 on timeout, 128+N when
        the launcher got signal N.
      attempts: how many times the group was started (1 + restarts used).
      failed_task: the task that failed the last attempt, if any.
      message: one line saying what happened.
      tasks: how each task of the last attempt ended.
      cluster: the last attempt's cluster.
    """

    returncode: int
    attempts: int
    failed_task: str | None
    message: str
    tasks: tuple[TaskExit, ...]
    cluster: cluster_lib.Cluster

    @property
    def ok(self) -> bool:
        return self.returncode == 0


def _exit_code(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


def _describe_exit(returncode: int) -> str:
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"was killed by {name}"
    return f"exited with code {returncode}"


def _hint(returncode: int, tail: Sequence[str]) -> str:
    from tfdist.multi_worker import JOIN_TIMEOUT_MARKER

    text = "\n".join(tail)
    if "Address already in use" in text or "Could not start gRPC server" in text:
        return (" Its port was taken by another process between the launcher's check and "
                "the server's start: run again (or use --max_restarts) to get fresh ports.")
    if JOIN_TIMEOUT_MARKER in text:
        return " A peer never joined the cluster (join timeout; see the message above)."
    if returncode == -signal.SIGKILL:
        return " (killed from outside, or by the kernel's out-of-memory killer)."
    return ""


def check_command(cmd: Sequence[str]) -> list[str]:
    """Validates the command before anything starts.

    Checks that the program exists and, for `python [opts] script.py ...`, that
    the script exists.

    Raises:
      ValueError: empty command, unknown program, or missing script.
    """
    if isinstance(cmd, (str, bytes)) or not cmd or not all(isinstance(a, str) for a in cmd):
        raise ValueError(
            "The command must be a non-empty list of strings, e.g. ['python', 'train.py']. "
            f"Received: cmd={cmd!r}. On the command line put it after '--': "
            "tfdist launch --num_workers=2 -- python train.py")
    cmd = list(cmd)
    program = cmd[0]
    if os.sep in program:
        if not os.path.exists(program):
            raise ValueError(f"The program {program!r} does not exist. Received: cmd={cmd!r}")
    elif shutil.which(program) is None:
        raise ValueError(
            f"The program {program!r} is not on PATH. Received: cmd={cmd!r}. Give its full "
            f"path or fix PATH.")
    if os.path.basename(program).startswith("python"):
        args = iter(cmd[1:])
        for arg in args:
            if arg in ("-m", "-c"):
                break  # a module or inline code: nothing to check here
            if arg in ("-W", "-X", "-Q"):
                next(args, None)
                continue
            if arg.startswith("-"):
                continue
            if not os.path.isfile(arg):
                raise ValueError(
                    f"The script {arg!r} does not exist (looked in {os.getcwd()}). Received: "
                    f"cmd={cmd!r}. Check the path; it is relative to the current directory.")
            break
    elif program.endswith(".py") and not os.path.isfile(program):
        raise ValueError(f"The script {program!r} does not exist. Received: cmd={cmd!r}")
    return cmd


def _pdeathsig():
    """In the child, before exec: die with SIGKILL when the launcher dies (Linux)."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class _Task:
    def __init__(self, name: str, proc: subprocess.Popen):
        self.name = name
        self.proc = proc
        self.stopped = False
        self.tail: list[str] = []
        self.readers: list[threading.Thread] = []


class _Group:
    """One attempt: the running tasks, their output relays and the stop logic."""

    def __init__(self, cmd, cluster, *, env, out: IO[str], err: IO[str], lock, attempt: int):
        self.tasks: list[_Task] = []
        self._out, self._err, self._lock = out, err, lock
        base = dict(os.environ if env is None else env)
        for name in ("TF_CONFIG",):
            base.pop(name, None)
        base["PYTHONUNBUFFERED"] = "1"
        try:
            for task_type, task_id in cluster.tasks():
                name = f"{task_type}:{task_id}"
                child_env = dict(base,
                                 TF_CONFIG=cluster_lib.tf_config_for(cluster, task_type, task_id),
                                 TFDIST_LAUNCH_ATTEMPT=str(attempt))
                proc = subprocess.Popen(
                    cmd, env=child_env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE, start_new_session=True,
                    preexec_fn=_pdeathsig if sys.platform.startswith("linux") else None)
                task = _Task(name, proc)
                self.tasks.append(task)
                for pipe, sink in ((proc.stdout, out), (proc.stderr, err)):
                    t = threading.Thread(target=self._relay, args=(task, pipe, sink),
                                         daemon=True, name=f"relay-{name}")
                    t.start()
                    task.readers.append(t)
        except BaseException:
            self.stop(grace_period=0)
            raise

    def _relay(self, task: _Task, pipe, sink) -> None:
        prefix = f"[{task.name}] "
        for raw in iter(pipe.readline, b""):
            line = raw.decode("utf-8", "replace").rstrip("\n")
            task.tail = (task.tail + [line])[-20:]
            with self._lock:
                sink.write(prefix + line + "\n")
                sink.flush()
        pipe.close()

    def stop(self, *, grace_period: float, skip: _Task | None = None) -> None:
        """SIGTERM every live task's process group, then SIGKILL after the grace period."""
        live = [t for t in self.tasks if t.proc.poll() is None and t is not skip]
        for t in live:
            t.stopped = True
            _killpg(t.proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_period
        for t in live:
            try:
                t.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for t in self.tasks:
            # Also reaps grandchildren left in a finished task's group.
            _killpg(t.proc.pid, signal.SIGKILL)
        for t in self.tasks:
            t.proc.wait()
        for t in self.tasks:
            for reader in t.readers:
                reader.join(timeout=5)

    def exits(self) -> tuple[TaskExit, ...]:
        return tuple(TaskExit(t.name, t.proc.pid, t.proc.returncode, t.stopped) for t in self.tasks)


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


class _Signals:
    """Turns SIGINT/SIGTERM into a flag while launch() runs (main thread only)."""

    def __init__(self):
        self.received: int | None = None
        self._saved: dict[int, object] = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._saved[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        del frame
        self.received = signum

    def __exit__(self, *exc):
        for sig, handler in self._saved.items():
            signal.signal(sig, handler)


def _check_count(name: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}. Received: {name}={value!r}")


def launch(cmd: Sequence[str], *, num_workers: int, num_ps: int = 0, chief: bool = False,
           evaluator: bool = False, max_restarts: int = 0, timeout: float | None = None,
           grace_period: float = 5.0, env: Mapping[str, str] | None = None,
           cluster: cluster_lib.Cluster | None = None,
           stdout: IO[str] | None = None, stderr: IO[str] | None = None) -> LaunchResult:
    """Runs `cmd` once per task of a local cluster and supervises the group.

    Args:
      cmd: the command every task runs, e.g. ["python", "train.py", "--epochs=3"].
      num_workers: number of 'worker' tasks (>= 1).
      num_ps: number of parameter servers.
      chief: add a 'chief' task (the coordinator for ParameterServerStrategy).
      evaluator: add an 'evaluator' task.
      max_restarts: restart the whole group on fresh ports up to this many
        times after a failure.
      timeout: seconds for the whole job (all attempts); then every task is
        stopped and the result is 124. None: no limit.
      grace_period: seconds between SIGTERM and SIGKILL when stopping tasks.
      env: the children's base environment (default: os.environ); TF_CONFIG
        is set per task.
      cluster: run on this cluster instead of fresh local ports (its ports must
        be free; restarts reuse it).
      stdout, stderr: where the prefixed output goes (default: sys.stdout/err).

    Returns:
      A LaunchResult; `returncode` is what `tfdist launch` exits with.

    Raises:
      ValueError: bad counts, a missing program or script, a taken port.

    Example:
      >>> r = launch(["python", "train.py"], num_workers=2)  # doctest: +SKIP
      >>> r.returncode, r.attempts
      (0, 1)
    """
    _check_count("num_workers", num_workers, 1)
    _check_count("num_ps", num_ps, 0)
    _check_count("max_restarts", max_restarts, 0)
    if timeout is not None and (isinstance(timeout, bool) or not timeout > 0):
        raise ValueError(f"timeout must be > 0 seconds or None. Received: timeout={timeout!r}")
    if num_ps and not chief:
        raise ValueError(
            f"A parameter-server job needs a chief (the coordinator). Received: num_ps={num_ps}, "
            f"chief=False. Add --chief.")
    cmd = check_command(cmd)
    out = stdout or sys.stdout
    err = stderr or sys.stderr
    lock = threading.Lock()
    deadline = None if timeout is None else time.monotonic() + timeout

    def say(text: str) -> None:
        with lock:
            err.write(f"{_PREFIX} {text}\n")
            err.flush()

    with _Signals() as signals:
        attempt = 0
        while True:
            attempt += 1
            if cluster is None:
                this_cluster = cluster_lib.local_cluster(
                    num_workers=num_workers, num_ps=num_ps, chief=chief, evaluator=evaluator)
            else:
                cluster_lib.check_local_ports(cluster)  # TFConfigError (a ValueError)
                this_cluster = cluster
            say(f"attempt {attempt}: starting {len(this_cluster.tasks())} tasks "
                f"({this_cluster.sizes()}) on 127.0.0.1 ports "
                f"{', '.join(a.rsplit(':', 1)[1] for t, i in this_cluster.tasks() for a in [this_cluster.address(t, i)])}")
            group = _Group(cmd, this_cluster, env=env, out=out, err=err, lock=lock,
                           attempt=attempt)
            outcome = _supervise(group, this_cluster, signals=signals, deadline=deadline,
                                 grace_period=grace_period)
            returncode, failed, message, restartable = outcome
            say(message)
            result = LaunchResult(returncode=returncode, attempts=attempt, failed_task=failed,
                                  message=message, tasks=group.exits(), cluster=this_cluster)
            if returncode == 0 or not restartable or attempt > max_restarts:
                if returncode and restartable and max_restarts:
                    say(f"giving up after {attempt} attempts (--max_restarts={max_restarts})")
                return result
            say(f"restarting the group with fresh ports (restart {attempt} of {max_restarts})")


def _supervise(group: _Group, cluster: cluster_lib.Cluster, *, signals: _Signals,
               deadline: float | None, grace_period: float):
    """Waits for the attempt to end; returns (code, failed_task, message, restartable)."""
    chief_decides = bool(cluster.ps)
    chief_task = next((t for t in group.tasks if t.name.startswith("chief:")), None)
    while True:
        if signals.received is not None:
            name = signal.Signals(signals.received).name
            group.stop(grace_period=grace_period)
            return 128 + signals.received, None, f"got {name}: stopped every task", False
        if deadline is not None and time.monotonic() > deadline:
            group.stop(grace_period=grace_period)
            return (TIMEOUT_EXIT_CODE, None,
                    "timed out (--timeout): stopped every task", False)
        for task in group.tasks:
            code = task.proc.poll()
            if code is not None and code != 0:
                group.stop(grace_period=grace_period)
                for reader in task.readers:
                    reader.join(timeout=2)
                message = (f"{task.name} {_describe_exit(code)}; stopped the other tasks."
                           f"{_hint(code, task.tail)}")
                return _exit_code(code), task.name, message, True
        if chief_decides and chief_task is not None:
            if chief_task.proc.poll() == 0:
                group.stop(grace_period=grace_period, skip=chief_task)
                return (0, None, "chief:0 exited 0: the job succeeded (ps/worker servers "
                        "stopped)", False)
        elif all(t.proc.poll() == 0 for t in group.tasks):
            group.stop(grace_period=0)
            return 0, None, f"all {len(group.tasks)} tasks exited 0", False
        time.sleep(_POLL_SECONDS)


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m tfdist.launch ...`: same flags as `tfdist launch`."""
    from absl import app, flags

    from tfdist.commands import launch as launch_command

    argv = list(sys.argv if argv is None else argv)
    for flag in flags.FLAGS.get_flags_for_module(launch_command.__name__):
        flags.FLAGS.register_key_flag_for_module(sys.argv[0], flag)  # so --help lists them
    app.run(launch_command.main, argv=["python -m tfdist.launch"] + argv[1:])
    return 0


if __name__ == "__main__":
    main()

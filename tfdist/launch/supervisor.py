"""The local supervisor: start one process per task, relay its output, end the job cleanly.

    result = tfdist.launch.launch(["python", "train.py"], num_workers=2)
    result.returncode

What it does, like torchrun / horovodrun for TensorFlow:
- gives each task its TF_CONFIG in the task's environment (never in ours), on
  free ports, plus `TFDIST_LAUNCH_ATTEMPT` (1, 2, ... per group restart) and
  `TFDIST_SCRATCH_DIR` (a scratch directory removed when the job ends);
- runs the tasks in a private loopback-only network namespace where the OS
  allows it (`tfdist.launch.isolation`): TensorFlow's servers listen on every
  interface and run any op they are sent;
- prefixes every output line with the task (`[worker:1] ...`) and renders
  it (`tfdist.launch.output`): one progress display (the chief's, else worker
  0's: a live bar on a terminal, plain lines elsewhere), TensorFlow's
  start-up and INFO log lines hidden, line length capped;
- ends the job by `tfdist.launch.policy`: the first failure stops the others
  (SIGTERM to each task's process group, SIGKILL after `grace_period`; in a
  parameter-server job the chief first, so it can save while the servers
  still hold the variables); a parameter-server worker is restarted alone;
- preemption: SIGTERM makes tasks that run `fit` with a backup callback save
  and exit 75 (`tfdist.preemption`); the launcher reports "preempted at step
  S, backup saved" and exits 75, and restarts only for a SIGTERM it did not
  receive itself;
- `max_restarts`: after a failure, restarts the whole group on fresh ports;
  `min_workers`: a worker that failed `DROP_AFTER_FAILURES` attempts in a row
  is left out of the next one (never below `min_workers`);
- no orphans: SIGINT/SIGTERM/SIGHUP to the launcher stop every task, and the
  job keeper kills what is left if the launcher itself is SIGKILLed.
"""

from __future__ import annotations

import errno
import math
import os
import resource
import signal
import subprocess
import sys
import threading
import time
from typing import IO, Mapping, Sequence

from tfdist import chief as chief_lib
from tfdist import cluster as cluster_lib
from tfdist import preemption
from tfdist.launch import isolation, jobdir, policy, program
from tfdist.launch import output as output_lib
from tfdist.launch.policy import TIMEOUT_EXIT_CODE, LaunchResult, TaskExit

_POLL_SECONDS = 0.05
PREFIX = "[tfdist launch]"
ATTEMPT_ENV = "TFDIST_LAUNCH_ATTEMPT"
GRACE_ENV = preemption.GRACE_ENV  # seconds between SIGTERM and SIGKILL, for the tasks
# A worker that failed this many attempts in a row is left out (with min_workers).
DROP_AFTER_FAILURES = 2
# File descriptors the launcher holds per task (two pipes) and for itself.
_FDS_PER_TASK = 3
_FDS_RESERVED = 64


class LaunchError(RuntimeError):
    """The job could not be started (the message says why and what to do)."""


class Task:
    """One running task process."""

    def __init__(self, task_type: str, task_id: int):
        self.task_type, self.task_id = task_type, task_id
        self.name = f"{task_type}:{task_id}"
        self.proc: subprocess.Popen | None = None
        self.output = output_lib.TaskOutput(self.name)
        self.stopped = False
        self.restarts = 0
        self.reported = False  # its exit was handed to the policy


class Group:
    """One attempt: the tasks running on this machine, their output, the stop logic.

    Args:
      argv: the checked command (program.Program.argv).
      cluster: the attempt's cluster; TF_CONFIG is built from it.
      tasks: the (task_type, task_id) pairs to run here (default: all).
      env: the tasks' base environment.
      keeper: the job keeper (namespaces, process-group tracking).
      relay: the output relay.
      attempt: the attempt number (TFDIST_LAUNCH_ATTEMPT).
    """

    def __init__(self, argv: Sequence[str], cluster: cluster_lib.Cluster, *,
                 tasks: Sequence[tuple[str, int]] | None = None, env: Mapping[str, str],
                 keeper: isolation.JobKeeper, relay: output_lib.Relay, attempt: int):
        self._argv = list(argv)
        self._cluster = cluster
        self._env = dict(env)
        self._keeper = keeper
        self._relay = relay
        self._attempt = attempt
        self.tasks = [Task(t, i) for t, i in (tasks if tasks is not None else cluster.tasks())]
        try:
            for task in self.tasks:
                self.start(task)
        except BaseException:
            self.stop(grace_period=0)
            raise

    def start(self, task: Task) -> None:
        """Starts (or restarts) one task with its TF_CONFIG."""
        env = dict(self._env, TF_CONFIG=cluster_lib.tf_config_for(
            self._cluster, task.task_type, task.task_id))
        env[ATTEMPT_ENV] = str(self._attempt)
        if task.proc is not None:
            self._keeper.forget(task.proc.pid)
        task.output = output_lib.TaskOutput(task.name)
        task.stopped = False
        task.reported = False
        try:
            task.proc = subprocess.Popen(
                self._keeper.task_argv(self._argv), env=env, stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                pass_fds=self._keeper.namespaces.fds)
        except OSError as e:
            raise LaunchError(
                f"could not start {task.name}: {e.strerror or e}. "
                f"{_os_error_fix(e)}") from None
        self._keeper.track(task.proc.pid)
        self._relay.add(task.output, task.proc.stdout, task.proc.stderr)

    def exited(self) -> list[Task]:
        """Tasks that ended since the last call (each reported once)."""
        done = []
        for task in self.tasks:
            if not task.reported and task.proc.poll() is not None:
                task.reported = True
                done.append(task)
        return done

    def tail(self, task: Task) -> list[str]:
        """The task's last lines, once its output is complete (bounded wait)."""
        self._relay.wait_closed(task.output, timeout=2)
        return list(task.output.tail)

    def silent(self, seconds: float, watched) -> Task | None:
        """A running watched task with no output for `seconds`, if any."""
        now = time.monotonic()
        for task in self.tasks:
            if (task.proc.poll() is None and watched(task.name)
                    and now - task.output.last_output > seconds):
                return task
        return None

    def stop(self, *, grace_period: float) -> None:
        """SIGTERM every live task's process group, then SIGKILL after the grace period.

        With parameter servers the chief goes first: it saves a backup on SIGTERM
        (reading the variables from the ps), so the servers get SIGTERM once it
        has exited, within the same grace period.
        """
        deadline = time.monotonic() + grace_period
        live = [t for t in self.tasks if t.proc is not None and t.proc.poll() is None]
        has_ps = any(t.task_type == "ps" for t in self.tasks)
        waves = ([[t for t in live if t.task_type == "chief"],
                  [t for t in live if t.task_type != "chief"]] if has_ps else [live])
        for wave in waves:
            for t in wave:
                t.stopped = True
                _killpg(t.proc.pid, signal.SIGTERM)
            for t in wave:
                try:
                    t.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
        started = [t for t in self.tasks if t.proc is not None]
        for t in started:
            # Also ends what a finished task left in its process group.
            _killpg(t.proc.pid, signal.SIGKILL)
        for t in started:
            t.proc.wait()
        self._keeper.sweep()  # strays that left their process group
        for t in started:
            self._keeper.forget(t.proc.pid)
            self._relay.wait_closed(t.output, timeout=5)

    def preempted_steps(self) -> list[tuple[str, int | None, int | None]]:
        """(task, returncode, step of its `preempted at step S` line) for every task."""
        found = []
        for t in self.tasks:
            if t.proc is None:
                continue
            code = t.proc.returncode
            step = (preemption.preempted_step(self.tail(t))
                    if code == preemption.PREEMPTED_EXIT_CODE else None)
            found.append((t.name, code, step))
        return found

    def exits(self) -> tuple[TaskExit, ...]:
        return tuple(TaskExit(t.name, t.proc.pid, t.proc.returncode, t.stopped, t.restarts)
                     for t in self.tasks if t.proc is not None)


def _os_error_fix(e: OSError) -> str:
    if e.errno in (errno.EMFILE, errno.ENFILE):
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        return (f"The launcher ran out of file descriptors (ulimit -n is {soft}): raise it "
                f"(ulimit -n 65536) or launch fewer tasks.")
    if e.errno in (errno.EAGAIN, errno.ENOMEM):
        return ("The system refused a new process (process limit or memory): launch fewer "
                "tasks, or raise ulimit -u.")
    return "Check the command and the system's limits."


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


class Signals:
    """Turns SIGINT/SIGTERM/SIGHUP into a flag while launch() runs (main thread only)."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def __init__(self):
        self.received: int | None = None
        self._saved: dict[int, object] = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._saved[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        del frame
        self.received = signum

    def __exit__(self, *exc):
        for sig, handler in self._saved.items():
            signal.signal(sig, handler)


class Elastic:
    """How many workers the next attempt runs (min_workers: leave out one that keeps failing).

    Args:
      workers: the workers the job starts with.
      min_workers: the fewest it may shrink to (None: never shrink).
    """

    def __init__(self, workers: int, min_workers: int | None):
        self.workers = workers
        self.min_workers = min_workers
        self._streak: tuple[str | None, int] = (None, 0)

    def after(self, end: policy.End) -> str | None:
        """Records an attempt's end; returns what to say if the next attempt shrinks."""
        failed = end.failed_task
        if end.returncode == preemption.PREEMPTED_EXIT_CODE or not failed or not (
                failed.startswith("worker:")):
            self._streak = (None, 0)
            return None
        task, count = self._streak
        self._streak = (failed, count + 1 if task == failed else 1)
        if (self.min_workers is None or self._streak[1] < DROP_AFTER_FAILURES
                or self.workers <= self.min_workers):
            return None
        before, self.workers = self.workers, self.workers - 1
        self._streak = (None, 0)
        return (f"{failed} failed {DROP_AFTER_FAILURES} attempts in a row: restarting with "
                f"{self.workers} worker(s) instead of {before} (--min_workers="
                f"{self.min_workers}). The script keeps its global batch: each worker now "
                f"takes 1/{self.workers} of it instead of 1/{before} (a global batch that no "
                f"longer divides is an error in the script), and training resumes from its "
                f"last backup.")


def check_min_workers(min_workers, num_workers: int, *, num_ps: int = 0,
                      cluster: cluster_lib.Cluster | None = None) -> None:
    """Raises ValueError unless `min_workers` is None or 1 <= min_workers <= num_workers."""
    if min_workers is None:
        return
    check_count("min_workers", min_workers, 1)
    if min_workers > num_workers:
        raise ValueError(f"min_workers must be <= num_workers. Received: min_workers="
                         f"{min_workers}, num_workers={num_workers}. The job starts with "
                         f"num_workers and may shrink to min_workers.")
    if num_ps or (cluster is not None and cluster.ps):
        raise ValueError(
            f"min_workers shrinks a synchronous (multi_worker_mirrored) job; a parameter-server "
            f"job already goes on without a worker that keeps failing. Received: min_workers="
            f"{min_workers} with num_ps={num_ps or len(cluster.ps)}. Drop --min_workers.")
    if cluster is not None:
        raise ValueError("min_workers needs a cluster the launcher makes (fresh local ports); "
                         "it cannot shrink a given cluster. Drop cluster= or min_workers.")


def check_count(name: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}. Received: {name}={value!r}")


def check_seconds(name: str, value, *, allow_zero: bool = False, allow_none: bool = True) -> None:
    ok_type = isinstance(value, (int, float)) and not isinstance(value, bool)
    if value is None and allow_none:
        return
    if not ok_type or not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        expected = ">= 0" if allow_zero else "> 0"
        none = " or None (no limit)" if allow_none else ""
        raise ValueError(f"{name} must be a finite number of seconds {expected}{none}. "
                         f"Received: {name}={value!r}")


def check_file_limit(num_tasks: int) -> None:
    """Refuses a job this process cannot hold the pipes for (instead of EMFILE midway)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return
    needed = _FDS_PER_TASK * num_tasks + _FDS_RESERVED
    if needed > soft:
        most = max(0, (soft - _FDS_RESERVED) // _FDS_PER_TASK)
        raise ValueError(
            f"{num_tasks} tasks need about {needed} open files in the launcher (pipes for "
            f"their output), but this process may open only {soft} (ulimit -n). Received: "
            f"{num_tasks} tasks; expected at most {most} here. Raise the limit "
            f"(ulimit -n {needed}) or launch fewer tasks.")


def task_env(env: Mapping[str, str] | None, *, job_dir: str, tf_logs: bool,
             show: output_lib.Show = "main", grace_period: float | None = None) -> dict:
    """The tasks' shared environment: ours (or `env`) without TF_CONFIG, plus the job's.

    Without `tf_logs`, TensorFlow's C++ INFO and WARNING logs are switched off
    in the tasks (TF_CPP_MIN_LOG_LEVEL=2, unless `env` sets it), as
    `tfdist.import_tensorflow` does; `show` is passed on as TFDIST_OUTPUT
    (read by `tfdist.fit_verbose`), `grace_period` as TFDIST_GRACE_PERIOD (read
    by `tfdist.preemption`).
    """
    base = dict(os.environ if env is None else env)
    base.pop("TF_CONFIG", None)
    base["PYTHONUNBUFFERED"] = "1"
    base[jobdir.ENV_VAR] = job_dir
    base[chief_lib.OUTPUT_ENV] = show
    if grace_period is not None:
        base[GRACE_ENV] = f"{grace_period:g}"
    if tf_logs:
        base["TFDIST_VERBOSE"] = "1"
    elif "TF_CPP_MIN_LOG_LEVEL" not in base:
        base["TF_CPP_MIN_LOG_LEVEL"] = "2"
        base["TFDIST_QUIET_SET_LOG_LEVEL"] = "1"  # tfdist's choice, not the user's (tfdist._tf)
    return base


def _ports_text(cluster: cluster_lib.Cluster, private: bool) -> str:
    ports = [cluster.address(t, i).rsplit(":", 1)[1] for t, i in cluster.tasks()]
    if private:
        return (f"in a private network namespace (loopback only, unreachable from outside "
                f"the job) on ports {', '.join(ports)}")
    return f"on this machine's network, ports {', '.join(ports)}"


def _check_private_cluster(cluster: cluster_lib.Cluster) -> None:
    for task_type, task_id in cluster.tasks():
        address = cluster.address(task_type, task_id)
        host, _ = cluster_lib.split_address(address)
        if host not in ("127.0.0.1", "localhost") and not host.startswith("127."):
            raise ValueError(
                f"In the private network namespace only loopback exists, but {task_type}:"
                f"{task_id} has address {address!r}. Use 127.0.0.1 addresses (local_cluster()), "
                f"or network='host'.")


def launch(cmd: Sequence[str], *, num_workers: int, num_ps: int = 0, chief: bool = False,
           evaluator: bool = False, max_restarts: int = 0, min_workers: int | None = None,
           max_worker_restarts: int | None = None, timeout: float | None = None,
           progress_timeout: float | None = None, grace_period: float = 5.0,
           network: isolation.Network = "auto", output: output_lib.Show = "main",
           tf_logs: bool = False,
           env: Mapping[str, str] | None = None, cluster: cluster_lib.Cluster | None = None,
           stdout: IO[str] | None = None, stderr: IO[str] | None = None) -> LaunchResult:
    """Runs `cmd` once per task of a local cluster and supervises the group.

    Args:
      cmd: the command every task runs, e.g. ["python", "train.py", "--epochs=3"].
        A bare `python`/`python3` is this launcher's own interpreter.
      num_workers: number of 'worker' tasks (>= 1).
      num_ps: number of parameter servers (needs `chief`).
      chief: add a 'chief' task (the coordinator for ParameterServerStrategy).
      evaluator: add an 'evaluator' task.
      max_restarts: restart the whole group on fresh ports up to this many
        times after a failure (a preemption the launcher did not receive
        itself counts as one).
      min_workers: elastic restarts: a worker that failed
        `DROP_AFTER_FAILURES` attempts in a row is left out of the next
        attempt, which runs with one worker fewer (never below this). The
        training script keeps its global batch (each worker's share grows)
        and resumes from its backup. None: always `num_workers`.
      max_worker_restarts: with parameter servers, restart a failed worker
        alone up to this many times (default 3); not for jobs without ps.
      timeout: seconds for the whole job (all attempts); then every task is
        stopped and the result is 124. None: no limit.
      progress_timeout: seconds a task may write nothing (stdout or stderr)
        before it counts as hung: the group is stopped (result 124, restarted
        under `max_restarts`) with a message naming it. Parameter-server jobs
        watch the chief only (servers are silent). None: no limit.
      grace_period: seconds between SIGTERM and SIGKILL when stopping tasks.
      network: "private" (tasks in a loopback-only network namespace: their
        servers are unreachable from outside the job), "host" (this machine's
        network: TensorFlow servers listen on every interface), or "auto"
        (private where the OS allows it, else host with a warning).
      output: "main": one progress display (the chief's, else worker 0's; a
        live bar when `stdout` is a terminal, plain lines without escape codes
        otherwise), other tasks' progress hidden, TensorFlow's start-up and
        INFO log lines hidden; warnings, errors and every other line shown.
        "all": every line of every task, TensorFlow's logs included.
      tf_logs: keep TensorFlow's logs (start-up lines, C++ and INFO log lines)
        with output="main" (what `tfdist launch --verbosity=1` sets).
      env: the tasks' base environment (default: os.environ); TF_CONFIG is
        set per task.
      cluster: run on this cluster instead of fresh local ports (its ports must
        be free; restarts reuse it).
      stdout, stderr: where the prefixed output goes (default: sys.stdout/err).

    Returns:
      A LaunchResult; `returncode` is what `tfdist launch` exits with.

    Raises:
      ValueError: bad counts or times, a command that cannot run, a taken port.
      tfdist.launch.isolation.IsolationError: network="private" on a machine
        that cannot provide it.
      LaunchError: the system refused to start a task (limits).

    Example:
      >>> r = launch(["python", "train.py"], num_workers=2)  # doctest: +SKIP
      >>> r.returncode, r.attempts
      (0, 1)
    """
    check_count("num_workers", num_workers, 1)
    check_count("num_ps", num_ps, 0)
    check_count("max_restarts", max_restarts, 0)
    check_min_workers(min_workers, num_workers, num_ps=num_ps, cluster=cluster)
    if max_worker_restarts is not None:
        check_count("max_worker_restarts", max_worker_restarts, 0)
        if not num_ps and not (cluster is not None and cluster.ps):
            raise ValueError(
                f"max_worker_restarts restarts one worker of a parameter-server job alone; "
                f"this job has no ps. Received: max_worker_restarts={max_worker_restarts}, "
                f"num_ps={num_ps}. Use max_restarts to restart the whole group.")
    check_seconds("timeout", timeout)
    check_seconds("progress_timeout", progress_timeout)
    check_seconds("grace_period", grace_period, allow_zero=True, allow_none=False)
    isolation.check_network(network)
    if num_ps and not chief:
        raise ValueError(
            f"A parameter-server job needs a chief (the coordinator). Received: num_ps={num_ps}, "
            f"chief=False. Add --chief.")
    num_tasks = (len(cluster.tasks()) if cluster is not None
                 else num_workers + num_ps + int(bool(chief)) + int(bool(evaluator)))
    check_file_limit(num_tasks)
    output_lib.check_show(output)
    prog = program.resolve(cmd, env=env)
    console = output_lib.Console(out=stdout or sys.stdout, err=stderr or sys.stderr)
    deadline = None if timeout is None else time.monotonic() + timeout

    def say(text: str) -> None:
        console.line("err", f"{PREFIX} {text}")

    keeper = isolation.JobKeeper(network=network)
    job_dir = relay = None
    try:
        if keeper.private and cluster is not None:
            _check_private_cluster(cluster)
        if keeper.unavailable:
            say(f"warning: no private network namespace here ({keeper.unavailable}): the "
                f"tasks' TensorFlow servers listen on all interfaces of this machine and "
                f"accept any connection. Use it on a trusted network only, or firewall the "
                f"ports below.")
        if prog.note:
            say(f"running {prog.note}")
        job_dir = jobdir.JobDir()
        has_chief = chief or (cluster is not None and bool(cluster.chief))
        display = output_lib.Display(main_task=output_lib.main_task(chief=has_chief),
                                     show=output, tf_logs=tf_logs)
        relay = output_lib.Relay(console=console, display=display)
        base_env = task_env(env, job_dir=job_dir.path, tf_logs=display.keeps_tf_logs,
                            show=output, grace_period=grace_period)
        elastic = Elastic(num_workers, min_workers)
        with Signals() as signals:
            attempt = 0
            while True:
                attempt += 1
                if cluster is None:
                    this_cluster = cluster_lib.local_cluster(
                        num_workers=elastic.workers, num_ps=num_ps, chief=chief,
                        evaluator=evaluator)
                else:
                    if not keeper.private:
                        cluster_lib.check_local_ports(cluster)  # TFConfigError (a ValueError)
                    this_cluster = cluster
                say(f"attempt {attempt}: starting {len(this_cluster.tasks())} tasks "
                    f"({this_cluster.sizes()}) {_ports_text(this_cluster, keeper.private)}")
                group = Group(prog.argv, this_cluster, env=base_env, keeper=keeper,
                              relay=relay, attempt=attempt)
                rules = policy.JobPolicy(
                    [t.name for t in group.tasks],
                    max_worker_restarts=(policy.DEFAULT_WORKER_RESTARTS
                                         if max_worker_restarts is None else max_worker_restarts))
                end = _supervise(group, rules, keeper=keeper, signals=signals,
                                 deadline=deadline, progress_timeout=progress_timeout,
                                 grace_period=grace_period, say=say)
                say(end.message)
                result = LaunchResult(returncode=end.returncode, attempts=attempt,
                                      failed_task=end.failed_task, message=end.message,
                                      tasks=group.exits(), cluster=this_cluster)
                if end.returncode == 0 or not end.restartable or attempt > max_restarts:
                    if end.returncode and end.restartable and max_restarts:
                        say(f"giving up after {attempt} attempts (--max_restarts={max_restarts})")
                    return result
                shrink = elastic.after(end)
                if shrink:
                    say(shrink)
                say(f"restarting the group with fresh ports (restart {attempt} of "
                    f"{max_restarts})")
    finally:
        keeper.close()
        if relay is not None:
            relay.close()
        if job_dir is not None:
            job_dir.close()


def _supervise(group: Group, rules: policy.JobPolicy, *, keeper: isolation.JobKeeper,
               signals: Signals, deadline: float | None, progress_timeout: float | None,
               grace_period: float, say) -> policy.End:
    """Runs one attempt to its end; the group is stopped when this returns."""
    preempted_since = None
    while True:
        if signals.received is not None:
            # The tasks get SIGTERM: those in a fit with a backup save and exit 75.
            group.stop(grace_period=grace_period)
            return policy.signal_end(signals.received, group.preempted_steps())
        if deadline is not None and time.monotonic() > deadline:
            group.stop(grace_period=grace_period)
            return policy.End(TIMEOUT_EXIT_CODE, "timed out (--timeout): stopped every task")
        if not keeper.alive():
            group.stop(grace_period=grace_period)
            return policy.End(1, "the job keeper process died, so a SIGKILLed launcher could "
                                 "leave orphans: stopped every task")
        for task in group.exited():
            code = task.proc.returncode
            tail = group.tail(task) if code else []
            decision = rules.on_exit(task.name, code, policy.hint(code, tail),
                                     lost_peer=policy.lost_peer(tail),
                                     preempted_step=preemption.preempted_step(tail))
            if code == preemption.PREEMPTED_EXIT_CODE and preempted_since is None:
                preempted_since = time.monotonic()
            if isinstance(decision, policy.End):
                group.stop(grace_period=grace_period)
                return decision
            if isinstance(decision, policy.RestartTask):
                say(decision.message)
                task.restarts += 1
                group.start(task)
            elif isinstance(decision, policy.Note):
                say(decision.message)
        if (preempted_since is not None and not rules.has_ps
                and time.monotonic() - preempted_since > grace_period):
            # Peers of a task that saved and exited 75 save at the same step; one that is
            # still running after the grace period is stopped.
            group.stop(grace_period=grace_period)
            return rules.on_preemption_timeout(grace_period)
        if progress_timeout is not None:
            silent = group.silent(progress_timeout, rules.watched)
            if silent is not None:
                group.stop(grace_period=grace_period)
                return rules.on_silent(silent.name, progress_timeout)
        time.sleep(_POLL_SECONDS)

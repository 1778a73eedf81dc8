"""SIGTERM as a save point: the tasks agree on a step, save a backup there, and exit 75.

Clusters take machines away with SIGTERM, a grace period, then SIGKILL
(Kubernetes evictions, SLURM preemption and time limits, spot VMs: 30 s by
default). TensorFlow's processes do not stop on SIGTERM (MultiWorkerMirrored
installs a C++ handler that only records it), so without help a job keeps
training through the grace period, is SIGKILLed, and loses everything since
its last backup.

While a `fit` with a backup callback runs (`tfdist.BackupAndRestore`, or
Keras's own `keras.callbacks.BackupAndRestore` under a tfdist strategy),
SIGTERM is a save point instead:

1. the handler records it (nothing else happens inside the handler);
2. at the next step boundary the tasks agree on the step to save at. One
   process (mirrored, one worker, the parameter-server coordinator): the
   step that just finished. Several workers (multi_worker_mirrored): the
   first worker that saw a SIGTERM announces "the step after mine" through
   TensorFlow's coordination service and waits until every worker has
   acknowledged it; no worker can finish that step before the announcing
   worker joins its all-reduce, so every worker reaches it and none has
   passed it (TensorFlow's PreemptionCheckpointHandler agrees the same way).
   Any number of tasks may get the SIGTERM, at any moment;
3. every task takes part in one coordinated save at that step (the chief
   writes), waits until the backup is complete, prints
   `tfdist: preempted at step S (SIGTERM to worker:1): ...` and exits with
   status 75 (`PREEMPTED_EXIT_CODE`, sysexits' EX_TEMPFAIL: run again).
   `os._exit` is used, so nothing after the save can hold the process past
   the grace period.

A SIGTERM during the last steps of a `fit` is caught when the fit ends (one
all-reduce per fit): the final state is saved and the tasks exit 75, so the
relaunch finds the finished run instead of starting over. Outside such a
`fit`, SIGTERM ends the process as it would without tfdist (status 143),
also under multi_worker_mirrored, instead of being swallowed.

`tfdist launch` reads the line above: it reports "preempted at step S,
backup saved" instead of a failure, exits 75, and does not restart a job
whose SIGTERM it received itself.
"""

from __future__ import annotations

import itertools
import os
import re
import signal
import sys
import threading
import time
import warnings
from typing import Callable, Iterable

PREEMPTED_EXIT_CODE = 75  # sysexits.h EX_TEMPFAIL: a temporary failure; run again
MARKER = "tfdist: preempted at step "
_MARKER_RE = re.compile(re.escape(MARKER) + r"(\d+)")
_KEY_PREFIX = "tfdist/preemption"
_END = "end"
ACK_TIMEOUT = 20.0  # seconds the announcing worker waits for every worker's acknowledgement
GRACE_ENV = "TFDIST_GRACE_PERIOD"  # set by tfdist launch for its tasks
DEFAULT_GRACE_PERIOD = 30.0  # Kubernetes', SLURM's KillWait and spot VMs' usual grace period


def preempted_step(lines: Iterable[str]) -> int | None:
    """The step of the last `tfdist: preempted at step S` line in `lines`, if any."""
    step = None
    for line in lines:
        match = _MARKER_RE.search(line)
        if match:
            step = int(match.group(1))
    return step


# --- the signal ------------------------------------------------------------------------


class _Recorder:
    """Records SIGTERM while at least one save point is active (installed from the main thread).

    A fit that raises never reaches on_train_end, so its save point stays
    listed; the next fit's save points drop the ones that already saw a step
    (every save point of one fit begins before its first step).
    """

    def __init__(self):
        self.lock = threading.Lock()
        self.received: float | None = None  # time.monotonic() of the first SIGTERM
        self.acted = False  # a save point took the SIGTERM up
        self._active: list = []
        self._previous = None

    def _handle(self, signum, frame):
        del signum, frame
        if self.received is None:
            self.received = time.monotonic()
            self.acted = False
            # A save point left behind by a fit that raised never acts on it: end the
            # process then, as SIGTERM would have, before the grace period is over.
            threading.Thread(target=self._unless_acted, args=(_grace_period() - 2,),
                             name="tfdist-sigterm-watchdog", daemon=True).start()

    def _unless_acted(self, seconds: float) -> None:
        time.sleep(max(1.0, seconds))
        if not self.acted:
            print("tfdist: SIGTERM was not taken up by a running fit (no step ended since); "
                  "exiting as SIGTERM would.", file=sys.stderr, flush=True)
            _flush()
            os._exit(128 + signal.SIGTERM)

    def install(self, owner) -> bool:
        """Starts recording SIGTERM for `owner`. False off the main thread."""
        if threading.current_thread() is not threading.main_thread():
            return False
        with self.lock:
            self._active = [a for a in self._active if a is not owner and not a.steps_seen]
            if not self._active:
                self.received = None
                if self._previous is None:
                    self._previous = signal.getsignal(signal.SIGTERM)
                    signal.signal(signal.SIGTERM, self._handle)
            self._active.append(owner)
        return True

    def reset_foreign_handler(self) -> None:
        """SIG_DFL for SIGTERM unless Python code (a save point, the user) handles it."""
        with self.lock:
            if self._previous is None and signal.getsignal(signal.SIGTERM) in (
                    signal.SIG_DFL, None):
                signal.signal(signal.SIGTERM, signal.SIG_DFL)

    def uninstall(self, owner) -> None:
        """Ends `owner`'s recording; the last one puts back the handler found before.

        A handler installed outside Python (TensorFlow's, which only records
        the signal) is not put back but SIG_DFL: SIGTERM then ends the process.
        """
        with self.lock:
            self._active = [a for a in self._active if a is not owner]
            if self._active or self._previous is None:
                return
            previous = (self._previous if callable(self._previous)
                        or self._previous is signal.SIG_IGN else signal.SIG_DFL)
            signal.signal(signal.SIGTERM, previous)
            self._previous = None
        if self.received is not None and previous is signal.SIG_DFL:
            # A SIGTERM arrived after the last step boundary looked: act on it now.
            _flush()
            signal.raise_signal(signal.SIGTERM)


def _grace_period() -> float:
    """The seconds between SIGTERM and SIGKILL: TFDIST_GRACE_PERIOD (tfdist launch sets it), 30."""
    try:
        return float(os.environ.get(GRACE_ENV, DEFAULT_GRACE_PERIOD))
    except ValueError:
        return DEFAULT_GRACE_PERIOD


_recorder = _Recorder()


def default_sigterm() -> None:
    """SIGTERM ends this process (SIG_DFL) unless Python code installed a handler for it.

    Called from the main thread after TensorFlow's coordination agent started,
    which installs a C++ handler that only records SIGTERM; a Python handler
    (the user's, or a save point's) is left alone.
    """
    if threading.current_thread() is not threading.main_thread():
        return
    _recorder.reset_foreign_handler()
_counter = itertools.count()


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass


def _task() -> str:
    from tfdist import chief

    name = chief.task_name()
    return "this process" if name == "local" else name


def _synchronous_tasks() -> list[str]:
    """The chief and worker tasks of TF_CONFIG (the coordination service's agents)."""
    from tfdist import cluster as cluster_lib

    config = cluster_lib.tf_config_from_env()
    if config is None:
        return []
    return [f"{role}:{i}" for role in ("chief", "worker")
            for i in range(len(getattr(config.cluster, role)))]


_any_functions: dict[int, Callable] = {}


def any_task(strategy, flag: bool) -> bool:
    """True if `flag` is true on any worker of `strategy` (an all-reduce: every worker calls it).

    Every worker must call it at the same point (a collective).
    """
    from tfdist._tf import import_tensorflow

    tf = import_tensorflow()
    function = _any_functions.get(id(strategy))
    if function is None:
        @tf.function
        def function(value):
            per_replica = strategy.run(lambda: tf.identity(value))
            return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None)

        _any_functions[id(strategy)] = function
    return float(function(tf.constant(1.0 if flag else 0.0))) > 0


class SavePoint:
    """One `fit`'s SIGTERM handling: agree on a step, `save(step)` there, exit 75.

    Args:
      strategy: the model's distribution strategy.
      save: runs the coordinated save of the state after `step` steps on this
        task (every task calls it; it returns once the backup is complete and
        durable) and returns where it went, for the exit line.
      multi_worker: the tasks of `strategy` run one step together (several
        multi_worker_mirrored workers); they agree through the coordination
        service.

    Call `begin()` in on_train_begin, `step_done(step, stride)` after every
    step (or `steps_per_execution` steps) with the number of steps done, and
    `end(step)` in on_train_end.
    """

    def __init__(self, strategy, *, save: Callable[[int], str], multi_worker: bool):
        self._strategy = strategy
        self._save = save
        self._multi = multi_worker
        self._key = f"{_KEY_PREFIX}/{next(_counter)}"
        self._task = _task()
        self._agreed: tuple[int, str] | None = None
        self._announced = False
        self._installed = False
        self._watcher: threading.Thread | None = None
        self.saved_step: int | None = None
        self.steps_seen = 0

    # -- lifecycle ---------------------------------------------------------------------

    def begin(self) -> None:
        self._installed = _recorder.install(self)
        if not self._installed:
            warnings.warn(
                "tfdist: fit runs outside the main thread, so SIGTERM cannot be made a save "
                "point (Python handles signals in the main thread only); a SIGTERM ends this "
                "process without a backup.", RuntimeWarning, stacklevel=3)
            return
        if self._multi:
            self._watcher = threading.Thread(target=self._watch, daemon=True,
                                             name="tfdist-preemption-watcher")
            self._watcher.start()

    def step_done(self, step: int, stride: int = 1) -> None:
        """After a step boundary: saves and exits if this is the agreed step."""
        if not self._installed:
            return
        self.steps_seen += 1
        if self._agreed is not None:
            _recorder.acted = True
            agreed, who = self._agreed
            if step >= agreed:
                self._save_and_exit(step, who)
            return
        if _recorder.received is None or self._announced:
            return
        self._announced = True
        _recorder.acted = True
        if not self._multi:
            self._save_and_exit(step, self._task)
        from tfdist.compat import coordination

        target = step + stride
        if coordination.put(self._key, f"{target} {self._task}"):
            self._wait_for_acknowledgements()
        # Otherwise another worker announced first: our watcher has (or will have,
        # before that step ends) its step.

    def end(self, step: int) -> None:
        """When the fit ends: a SIGTERM since the last boundary still gets its save."""
        if not self._installed:
            return
        pending = _recorder.received is not None
        try:
            if self._multi:
                pending = any_task(self._strategy, pending)
                from tfdist.compat import coordination

                coordination.put(self._key, _END)  # releases the watchers
            if pending:
                who = self._agreed[1] if self._agreed else (
                    self._task if _recorder.received is not None else "another task")
                self._save_and_exit(step, who)
        finally:
            self._installed = False
            _recorder.uninstall(self)

    def close(self) -> None:
        """Stops recording SIGTERM for this save point without a final check (a fit that raised)."""
        if self._installed:
            self._installed = False
            _recorder.uninstall(self)

    # -- agreement ---------------------------------------------------------------------

    def _watch(self) -> None:
        from tfdist.compat import coordination

        value = coordination.get(self._key, None)
        if not value or value == _END:
            return
        step, _, who = value.partition(" ")
        self._agreed = (int(step), who or "a worker")
        coordination.put(f"{self._key}/ack/{self._task}", "1")

    def _wait_for_acknowledgements(self) -> None:
        from tfdist.compat import coordination

        deadline = time.monotonic() + ACK_TIMEOUT
        for task in _synchronous_tasks():
            left = deadline - time.monotonic()
            if left <= 0 or coordination.get(f"{self._key}/ack/{task}", left) is None:
                print(f"tfdist: {task} did not acknowledge the preemption step within "
                      f"{ACK_TIMEOUT:g} s; saving anyway", file=sys.stderr, flush=True)
                return

    # -- the save ----------------------------------------------------------------------

    def _save_and_exit(self, step: int, who: str) -> None:
        _recorder.acted = True
        received = _recorder.received
        where = self._save(step)
        self.saved_step = step
        after = (f", {time.monotonic() - received:.1f} s after this task's SIGTERM"
                 if received is not None else "")
        print(f"{MARKER}{step} (SIGTERM to {who}): {where}{after}; exiting with status "
              f"{PREEMPTED_EXIT_CODE}", file=sys.stderr, flush=True)
        _flush()
        os._exit(PREEMPTED_EXIT_CODE)


__all__ = ["MARKER", "PREEMPTED_EXIT_CODE", "SavePoint", "any_task", "default_sigterm",
           "preempted_step"]

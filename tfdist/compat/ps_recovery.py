"""Worker failures under a tfdist ParameterServerStrategy: recover each worker on its own.

Upstream: TensorFlow's ClusterCoordinator (tensorflow/python/distribute/
coordinator/cluster_coordinator.py, `WorkerPreemptionHandler`) recovers from
a worker failure by calling `context.update_server_def` with the *whole*
cluster ("TODO(haoyuzhang): support partial cluster recovery"). That call
fails or blocks while any worker is down, and every worker thread that saw a
failure waits for it (up to `_WORKER_MAXIMUM_RECOVERY_SEC`, one hour). So
when a second worker dies while the first is being restarted (kill worker:1,
restart it, kill worker:0 while worker:1's replacement is starting), the
restarted worker:1 is never taken back and the coordinator stalls for an hour
with only "Cluster update failed ... Retrying" in its log. Verified on
TF 2.21; no upstream issue found for it.

`attach(coordinator)` (the parameter_server preset's `ps_recovery` feature)
gives the coordinator of a strategy tfdist made a `PartialRecovery`, and
installs two fixes on TensorFlow's `WorkerPreemptionHandler`:
`wait_on_failure` and `stop` of that coordinator's handler go to its
PartialRecovery; every other coordinator's handler passes straight through.
TensorFlow's handler object stays in place (its thread idles), so
`tfdist.compat.uninstall()` gives the coordinator TensorFlow's handling
back. PartialRecovery keeps TensorFlow's rules for what a worker failure is
(`_is_worker_failure`, transient ps and timeout errors), but:

* recovers each worker by itself: a recovery thread watches the failed
  workers' addresses and, when one accepts connections again, updates the
  coordinator's cluster to the workers that are up (a ServerDef listing only
  them), so a worker that is still down never blocks one that is back. The
  update runs with GRPC_FAIL_FAST=true: under TensorFlow's default its
  GetStatus RPC waits for a listed task that died meanwhile until it
  returns (verified: blocked > 40 s; with the setting, UnavailableError at
  once, and the next attempt leaves that worker out). Installing sets
  GRPC_FAIL_FAST to TensorFlow's default, "use_caller", if it is unset;
* gives up clearly: when every worker has been down for `all_lost_timeout`
  seconds (the preset's `connect_timeout`), the scheduled steps fail with
  `tfdist.ParameterServerError` naming the workers, instead of waiting an
  hour; a parameter server that is gone during recovery fails them with an
  UnavailableError (which tfdist reports as a lost parameter server);
* counts the steps TensorFlow re-runs after a failure (`rerun_count`), which
  is what lets tfdist report steps whose update landed twice, and flags each
  re-run (its `first_run_flag()` argument becomes True) so a tfdist train
  step can check whether its update already landed before applying it.

With TF_PSS_ENABLE_COORDINATION_SERVICE set (TensorFlow's experimental
handler) nothing is replaced.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue as queue_lib
import threading
import time
import weakref
from typing import Any, Callable

from tfdist import devices as devices_lib
from tfdist.compat._patch import (CompatError, Fix, install_all, require_attributes,
                                  require_signature, upstream)

logger = logging.getLogger("tfdist")

UPSTREAM = ("tensorflow/python/distribute/coordinator/cluster_coordinator.py "
            "WorkerPreemptionHandler: 'TODO(haoyuzhang): support partial cluster recovery'")

# How often the recovery thread probes failed workers (seconds).
POLL_SECONDS = 0.5
# A worker that accepts connections but cannot be taken back for this long gets a
# warning with the reason (the recovery keeps trying).
SLOW_UPDATE_WARNING_SECONDS = 10.0

# TensorFlow's failure handler (one per coordinator) -> the PartialRecovery attached to it.
_recoveries: "weakref.WeakKeyDictionary[Any, PartialRecovery]" = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def _coordinator_module():
    return upstream("tensorflow.python.distribute.coordinator.cluster_coordinator")


def check() -> None:
    """Raises CompatError unless TensorFlow's coordinator is shaped as this module expects."""
    cc = _coordinator_module()
    require_attributes(cc, "WorkerPreemptionHandler", "Cluster", "Worker", "Closure",
                       "ResourceClosure", "ClosureInputError", "ClosureAbortedError",
                       "_is_worker_failure", what="tensorflow cluster_coordinator")
    # A re-run's flag is swapped in the closure's arguments (Closure._args).
    require_signature(cc.Closure.__init__, "function", "cancellation_mgr", "args", "kwargs",
                      what="ClusterCoordinator Closure")
    require_signature(cc.WorkerPreemptionHandler.wait_on_failure, "on_failure_fn",
                      "on_transient_failure_fn", "on_recovery_fn", "worker_device_name",
                      what="WorkerPreemptionHandler.wait_on_failure")
    require_attributes(cc.Cluster, "_record_and_ignore_transient_ps_failure",
                       "_record_and_ignore_transient_timeouts", what="ClusterCoordinator Cluster")
    # _fail sets the error of the steps still queued.
    require_attributes(cc.Closure, "maybe_call_with_output_remote_value",
                       what="ClusterCoordinator Closure")
    from tensorflow.python.distribute.coordinator import values as coordinator_values

    require_attributes(coordinator_values.RemoteValueImpl, "_set_error",
                       "_wait_and_maybe_error", what="ClusterCoordinator RemoteValueImpl")


def wait_for_step(remote_value) -> None:
    """Waits until a scheduled step is done and raises what it raised, without fetching
    its return value.

    TensorFlow's `RemoteValue.fetch()` does both: it waits, then copies the value from the
    worker that ran the step (`RemoteValueImpl._copy_to_local`, lazily, at the first
    read). When that worker is killed after the step finished and before the copy, the
    copy fails with an UnavailableError naming the worker, although the step ran and its
    update is on the parameter servers: a worker lost at that moment then reads as a lost
    parameter server. Seen in tests/ps/test_failures.py (worker:1 killed during its
    restart). No upstream issue found. For a value of another shape, fetch() as before.
    """
    wait = getattr(remote_value, "_wait_and_maybe_error", None)
    if wait is None:
        remote_value.fetch()
    else:
        wait()


def fetch_unless_worker_gone(remote_value) -> Any:
    """`remote_value.fetch()`, or None when the step finished without error and only the
    copy of its value failed (UnavailableError: the worker that holds it is gone since; see
    wait_for_step). A step that failed, or a parameter server lost, still raises."""
    from tfdist._tf import import_tensorflow

    tf = import_tensorflow()
    wait_for_step(remote_value)  # the step's own error, if any, raises here
    try:
        return remote_value.fetch()
    except tf.errors.UnavailableError:
        if getattr(remote_value, "_error", "unknown") is None:
            return None
        raise


def _step_closure_in(fn: Callable | None):
    """The scheduled step a worker's failure callback `fn` puts back (None for a resource)."""
    cc = _coordinator_module()
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:
            continue
        if isinstance(value, cc.Closure) and not isinstance(value, cc.ResourceClosure):
            return value
    return None


_flags: dict[bool, Any] = {}


def first_run_flag():
    """The argument a step scheduled for the first time gets; a re-run gets True instead.

    tfdist's train steps take it as their last argument, so a step re-run
    after a worker failure can check whether its update already landed.
    """
    if not _flags:
        from tfdist._tf import import_tensorflow

        tf = import_tensorflow()
        _flags[False], _flags[True] = tf.constant(False), tf.constant(True)
    return _flags[False]


def _mark_rerun(closure) -> None:
    """Makes the put-back `closure` a re-run: its first_run flag argument becomes True."""
    args = getattr(closure, "_args", None)
    if _flags and isinstance(args, tuple) and any(a is _flags[False] for a in args):
        closure._args = tuple(_flags[True] if a is _flags[False] else a for a in args)


_env_lock = threading.Lock()


def keep_fail_fast_setting() -> None:
    """Makes GRPC_FAIL_FAST an entry of the environment (TensorFlow's default, "use_caller").

    `_fail_fast_rpcs` then only replaces an existing entry while other threads
    may read the environment (adding one can reallocate it under them).
    ParameterServerStrategy's own docstring asks coordinators to set this value.
    """
    with _env_lock:
        os.environ.setdefault("GRPC_FAIL_FAST", "use_caller")


@contextlib.contextmanager
def _fail_fast_rpcs():
    """GRPC_FAIL_FAST=true around one cluster update (TensorFlow reads it per RPC).

    With TensorFlow's default ("use_caller") the update's first RPC, GetStatus,
    waits for a task that does not answer until it comes back (RFC
    tensorflow/community#355): a worker that dies during the update would
    block recovery for good. Step RPCs are fail-fast under the default
    already, so only waiting RPCs change, for the length of the update.
    """
    with _env_lock:
        previous = os.environ.get("GRPC_FAIL_FAST")
        os.environ["GRPC_FAIL_FAST"] = "true"
    try:
        yield
    finally:
        with _env_lock:
            if previous is None:
                os.environ.pop("GRPC_FAIL_FAST", None)
            else:
                os.environ["GRPC_FAIL_FAST"] = previous


class PartialRecovery:
    """A ClusterCoordinator failure handler that recovers workers one by one (see module doc).

    Args:
      cluster: the coordinator's `Cluster`.
      server_def: the coordinator's ServerDef (the whole cluster).
      all_lost_timeout: seconds every worker may be down before the steps fail.
      reachable: `fn(address) -> bool` (a TCP probe).
      all_lost_error: `fn(message) -> Exception`, the error the steps fail with
        when every worker stayed down.
    """

    def __init__(self, cluster, server_def, *, all_lost_timeout: float,
                 reachable: Callable[[str], bool], all_lost_error: Callable[[str], Exception]):
        self._cluster = cluster
        self._all_lost_error = all_lost_error
        self._server_def = server_def
        self._all_lost_timeout = all_lost_timeout
        self._reachable = reachable
        self._addresses = self._job_addresses(server_def, "worker")
        self._ps_addresses = self._job_addresses(server_def, "ps")
        self._cond = threading.Condition()
        self._down: dict[int, float] = {}  # worker index -> when it failed
        self._failed_error: Exception | None = None
        self._update_failing_since: float | None = None  # a worker is back, updates fail
        self._warned_slow_update = False
        self._running = True
        self.reruns = 0
        self._thread = threading.Thread(target=self._recover_loop, name="tfdist-ps-recovery",
                                        daemon=True)
        self._thread.start()

    @staticmethod
    def _job_addresses(server_def, name: str) -> dict[int, str]:
        for job in server_def.cluster.job:
            if job.name == name:
                return dict(job.tasks)
        return {}

    def stop(self) -> None:
        with self._cond:
            self._running = False
            self._cond.notify_all()

    # --- called on the coordinator's worker threads -----------------------------------

    @contextlib.contextmanager
    def wait_on_failure(self, on_failure_fn=None, on_transient_failure_fn=None,
                        on_recovery_fn=None, worker_device_name="(unknown)"):
        cc = _coordinator_module()
        from tensorflow.python.framework import errors

        try:
            yield
        except (errors.OpError, cc.ClosureInputError, cc.ClosureAbortedError, TypeError) as e:
            # TensorFlow's rules for what is transient and what is a worker failure.
            transient = (self._cluster._record_and_ignore_transient_ps_failure(e)
                         or self._cluster._record_and_ignore_transient_timeouts(e)
                         or (isinstance(e, errors.CancelledError) and "/job:" in str(e)))
            if transient:
                logger.debug("tfdist: transient failure on %s: %s", worker_device_name, e)
                self._rerun(_step_closure_in(on_transient_failure_fn))
                if on_transient_failure_fn:
                    on_transient_failure_fn()
                return
            if (not cc._is_worker_failure(e)
                    or self._cluster.closure_queue._cancellation_mgr.is_cancelled):
                raise
            index = devices_lib.task_index(worker_device_name)
            if index is None or index not in self._addresses:
                raise
            logger.warning("tfdist: worker:%d (%s) failed: %s", index,
                           self._addresses[index], str(e).strip().splitlines()[0][:200])
            self._rerun(_step_closure_in(on_failure_fn))
            if on_failure_fn:
                on_failure_fn(e)
            self._wait_until_back(index)
            logger.warning("tfdist: worker:%d is back; it takes steps again", index)
            if on_recovery_fn:
                with self.wait_on_failure(on_recovery_fn=on_recovery_fn,
                                          on_transient_failure_fn=on_transient_failure_fn,
                                          worker_device_name=worker_device_name):
                    on_recovery_fn()

    def _rerun(self, closure) -> None:
        """Counts a step TensorFlow is about to run again, and flags it as a re-run."""
        if closure is None:
            return
        _mark_rerun(closure)
        with self._cond:
            self.reruns += 1

    def _wait_until_back(self, index: int) -> None:
        with self._cond:
            self._down.setdefault(index, time.monotonic())
            self._cond.notify_all()
            while self._running and index in self._down:
                self._cond.wait(timeout=1.0)

    # --- the recovery thread ------------------------------------------------------------

    def _recover_loop(self) -> None:
        while True:
            with self._cond:
                while self._running and not self._down:
                    self._cond.wait()
                if not self._running:
                    return
                down = dict(self._down)
            try:
                back = {i for i in down if self._reachable(self._addresses[i])}
                if back:
                    self._update(back, down)
                else:
                    self._check_all_lost(down)
            except Exception:  # noqa: BLE001 (a dead recovery thread = workers wait forever)
                logger.warning("tfdist: worker recovery hit an error; it goes on polling",
                               exc_info=True)
            time.sleep(POLL_SECONDS)

    def _server_def_without(self, excluded) -> Any:
        server_def = type(self._server_def)()
        server_def.CopyFrom(self._server_def)
        for job in server_def.cluster.job:
            if job.name == "worker":
                for index in excluded:
                    del job.tasks[index]
        return server_def

    def _update(self, back: set[int], down: dict[int, float]) -> None:
        from tensorflow.python.eager import context

        # Leave out every worker that is down or does not answer now: one that
        # is listed but dead makes the update fail (or, without fail-fast,
        # block in GetStatus until it returns).
        still_down = {i for i, address in self._addresses.items()
                      if i not in back and (i in down or not self._reachable(address))}
        # An update that blocks is said so (TensorFlow's own waits are silent).
        timer = threading.Timer(SLOW_UPDATE_WARNING_SECONDS, logger.warning, args=(
            "tfdist: the cluster update taking back worker(s) %s (leaving out %s) has not "
            "returned after %.0f s", sorted(back), sorted(still_down),
            SLOW_UPDATE_WARNING_SECONDS))
        timer.daemon = True
        timer.start()
        try:
            with _fail_fast_rpcs():
                context.context().update_server_def(self._server_def_without(still_down))
        except Exception as e:  # noqa: BLE001 (any failure: probe again, decide below)
            logger.info("tfdist: cluster update (workers back: %s) failed: %s", sorted(back), e)
            self._note_failed_update(back, e)
            timer.cancel()
            lost_ps = [f"ps:{i} at {a}" for i, a in sorted(self._ps_addresses.items())
                       if not self._reachable(a)]
            if lost_ps:
                self._fail(self._unavailable(
                    f"parameter server {', '.join(lost_ps)} is unreachable while recovering "
                    f"worker(s) {sorted(back)}"))
            return
        timer.cancel()
        if self._warned_slow_update:
            logger.warning("tfdist: the cluster update succeeded after %.0f s",
                           time.monotonic() - self._update_failing_since)
        self._update_failing_since, self._warned_slow_update = None, False
        with self._cond:
            for index in back:
                self._down.pop(index, None)
            self._cond.notify_all()
        logger.info("tfdist: cluster updated; workers back: %s; still down: %s",
                    sorted(back), sorted(still_down))

    def _note_failed_update(self, back: set[int], error: Exception) -> None:
        """Warns once when workers that are back could not be taken back for a while."""
        now = time.monotonic()
        if self._update_failing_since is None:
            self._update_failing_since = now
        if (not self._warned_slow_update
                and now - self._update_failing_since >= SLOW_UPDATE_WARNING_SECONDS):
            self._warned_slow_update = True
            workers = ", ".join(f"worker:{i} at {self._addresses[i]}" for i in sorted(back))
            first_line = (str(error).strip().splitlines() or [""])[0][:300]
            logger.warning(
                "tfdist: %s accept(s) connections again, but the coordinator could not take "
                "them back for %.0f s (still trying): %s: %s", workers,
                now - self._update_failing_since, type(error).__name__, first_line)

    def _check_all_lost(self, down: dict[int, float]) -> None:
        if len(down) < len(self._addresses):
            return
        since = max(down.values())
        if time.monotonic() - since < self._all_lost_timeout:
            return
        queue = self._cluster.closure_queue
        with queue._queue_lock:
            # Fail the steps waiting for a worker (each fit that schedules while
            # every worker is still lost fails at once), never a later fit that
            # starts after a worker came back.
            if queue._queue.empty() or queue._error is not None:
                return
        listed = ", ".join(f"worker:{i} at {a}" for i, a in sorted(self._addresses.items()))
        self._fail(self._all_lost_error(
            f"Every worker has been unreachable for {self._all_lost_timeout:g} s ({listed}): "
            "nothing can run the scheduled steps. Restart the workers on their addresses "
            "(they rejoin by themselves) or raise connect_timeout; the variables on the "
            "parameter servers are intact, so training continues once a worker is back."))

    @staticmethod
    def _unavailable(message: str) -> Exception:
        from tensorflow.python.framework import errors

        return errors.UnavailableError(None, None, message)

    def _fail(self, error: Exception) -> None:
        """Fails the scheduled steps: the coordinator's join()/schedule() raise `error`.

        The steps still queued fail with `error` too, so a coordinator that
        waits on one step's RemoteValue (tfdist's first batch log reads the
        first step's) gets it as well: TensorFlow fails queued steps only
        when join()/schedule() next runs, which that wait never reaches.
        """
        queue = self._cluster.closure_queue
        with queue._queue_lock:
            if queue._error is None:
                queue._error = error
            while True:
                try:
                    closure = queue._queue.get(block=False)
                except queue_lib.Empty:
                    break
                closure.maybe_call_with_output_remote_value(lambda r: r._set_error(error))
                queue._queue_free_slot_condition.notify()
            queue._stop_waiting_condition.notify_all()


def _recovery_of(handler) -> PartialRecovery | None:
    with _lock:
        return _recoveries.get(handler)


def _handler_class():
    return _coordinator_module().WorkerPreemptionHandler


def _check_wait_on_failure(original) -> None:
    require_signature(original, "on_failure_fn", "on_transient_failure_fn", "on_recovery_fn",
                      "worker_device_name", what="WorkerPreemptionHandler.wait_on_failure")


def _make_wait_on_failure(original):
    def wait_on_failure(self, on_failure_fn=None, on_transient_failure_fn=None,
                        on_recovery_fn=None, worker_device_name="(unknown)"):
        recovery = _recovery_of(self)
        target = original if recovery is None else (
            lambda _, *args, **kwargs: recovery.wait_on_failure(*args, **kwargs))
        return target(self, on_failure_fn=on_failure_fn,
                      on_transient_failure_fn=on_transient_failure_fn,
                      on_recovery_fn=on_recovery_fn, worker_device_name=worker_device_name)

    return wait_on_failure


def _check_stop(original) -> None:
    require_signature(original, what="WorkerPreemptionHandler.stop")


def _make_stop(original):
    def stop(self):
        recovery = _recovery_of(self)
        if recovery is not None:
            recovery.stop()
        return original(self)

    return stop


WAIT_ON_FAILURE_FIX = Fix(
    name="ps_recovery.wait_on_failure", issue=UPSTREAM,
    target=lambda: (_handler_class(), "wait_on_failure"),
    check=_check_wait_on_failure, make=_make_wait_on_failure)
STOP_FIX = Fix(
    name="ps_recovery.stop", issue=UPSTREAM, target=lambda: (_handler_class(), "stop"),
    check=_check_stop, make=_make_stop)
FIXES = (WAIT_ON_FAILURE_FIX, STOP_FIX)


def install() -> tuple[str, ...]:
    """Installs both fixes, or neither (idempotent); returns the names installed by this call.

    They route a failure handler's calls to the `PartialRecovery` that `attach`
    gave it, and pass every other handler (coordinators tfdist did not set up)
    straight through to TensorFlow.
    """
    check()
    return install_all(FIXES)


def attach(coordinator, *, all_lost_timeout: float, reachable: Callable[[str], bool],
           all_lost_error: Callable[[str], Exception]) -> bool:
    """Gives `coordinator` (of a strategy tfdist made) a `PartialRecovery`; installs the fixes.

    TensorFlow's own handler stays the coordinator's (its thread idles: the
    fixes route its failures to the PartialRecovery); after
    `tfdist.compat.uninstall()` it handles them again as in stock TensorFlow.

    Returns:
      True if attached now, False if it already was (or TensorFlow's
      coordination-service handler is in use: TF_PSS_ENABLE_COORDINATION_SERVICE).

    Raises:
      CompatError: TensorFlow's coordinator is not shaped as expected.
    """
    cc = _coordinator_module()
    cluster = coordinator._cluster
    handler = cluster.failure_handler
    if os.getenv("TF_PSS_ENABLE_COORDINATION_SERVICE"):
        return False
    if not isinstance(handler, cc.WorkerPreemptionHandler):
        raise CompatError(
            f"The ClusterCoordinator's failure handler is a {type(handler).__name__}, "
            "not TensorFlow's WorkerPreemptionHandler: tfdist's worker recovery was "
            "written for that one.")
    queue = cluster.closure_queue
    require_attributes(queue, "_queue", "_queue_lock", "_stop_waiting_condition", "_error",
                       "_queue_free_slot_condition", "_cancellation_mgr",
                       what="ClusterCoordinator closure queue")
    require_attributes(handler, "_server_def", what="WorkerPreemptionHandler")
    install()
    with _lock:
        if handler in _recoveries:
            return False
        keep_fail_fast_setting()
        _recoveries[handler] = PartialRecovery(
            cluster, handler._server_def, all_lost_timeout=all_lost_timeout,
            reachable=reachable, all_lost_error=all_lost_error)
        return True


def rerun_count(coordinator) -> int:
    """Steps re-run after worker failures on `coordinator` so far (0 without PartialRecovery)."""
    recovery = _recovery_of(coordinator._cluster.failure_handler)
    return recovery.reruns if recovery is not None else 0

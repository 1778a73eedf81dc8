"""tfdist.compat.ps_recovery as fixes: routed by handler, listed, undone, shape-checked.

The recovery itself (workers killed, restarted, all lost, a ps lost) is tested
with real processes in tests/ps/test_failures.py. Here, without a cluster: the
two fixes on TensorFlow's `WorkerPreemptionHandler` send a handler's calls to
the `PartialRecovery` attached to it and pass every other handler (a
coordinator tfdist did not set up) through to TensorFlow, `installed()` lists
them and `uninstall()` restores TensorFlow's methods.
"""

from __future__ import annotations

import contextlib
import inspect

import pytest

import tfdist
from tfdist.compat import _patch, ps_recovery


def _handler_class():
    from tensorflow.python.distribute.coordinator import cluster_coordinator

    return cluster_coordinator.WorkerPreemptionHandler


class _Handler:
    """Stands in for a TensorFlow handler (the fixes read nothing else of it)."""

    _should_preemption_thread_run = True
    stopped = False


class _Recovery:
    def __init__(self):
        self.calls = []

    @contextlib.contextmanager
    def wait_on_failure(self, **kwargs):
        self.calls.append(kwargs["worker_device_name"])
        yield

    def stop(self):
        self.calls.append("stop")


def test_routes_attached_handlers_and_passes_others_through(monkeypatch):
    klass = _handler_class()
    stock_wait, stock_stop = klass.wait_on_failure, klass.stop
    with tfdist.compat.uninstall_after():
        assert ps_recovery.install() == tuple(f.name for f in ps_recovery.FIXES)
        assert ps_recovery.install() == ()  # idempotent
        assert set(f.name for f in ps_recovery.FIXES) <= set(tfdist.compat.installed())
        assert klass.wait_on_failure is not stock_wait

        ours, theirs, recovery = _Handler(), _Handler(), _Recovery()
        monkeypatch.setitem(ps_recovery._recoveries, ours, recovery)
        with klass.wait_on_failure(ours, worker_device_name="/job:worker/task:1"):
            pass
        assert recovery.calls == ["/job:worker/task:1"]
        # Not attached: TensorFlow's own method runs (it asserts its thread runs).
        with klass.wait_on_failure(theirs, worker_device_name="/job:worker/task:0"):
            pass
        theirs._should_preemption_thread_run = False
        with pytest.raises(AssertionError):
            with klass.wait_on_failure(theirs):
                pass
        assert recovery.calls == ["/job:worker/task:1"]

        # stop(): the PartialRecovery's thread too, then TensorFlow's.
        ours._cluster_update_lock = theirs._cluster_update_lock = contextlib.nullcontext()

        class _Event:
            def set(self):
                pass

        ours._cluster_due_for_update_or_finish = theirs._cluster_due_for_update_or_finish = \
            _Event()
        klass.stop(ours)
        klass.stop(theirs)
        assert recovery.calls == ["/job:worker/task:1", "stop"]
        assert ours._should_preemption_thread_run is False
    assert klass.wait_on_failure is stock_wait and klass.stop is stock_stop
    assert not set(f.name for f in ps_recovery.FIXES) & set(tfdist.compat.installed())


def test_shape_checks_refuse_other_signatures():
    with pytest.raises(_patch.CompatError, match="wait_on_failure"):
        ps_recovery.WAIT_ON_FAILURE_FIX.check(lambda self, on_failure_fn=None: None)
    with pytest.raises(_patch.CompatError, match="stop"):
        ps_recovery.STOP_FIX.check(lambda self, timeout: None)


def test_canary_tensorflow_still_recovers_the_whole_cluster_at_once():
    # The reason for the fixes: TensorFlow's handler updates the cluster with every worker
    # (its TODO for partial recovery). When this fails, re-check whether they are needed.
    from tensorflow.python.distribute.coordinator import cluster_coordinator

    source = inspect.getsource(cluster_coordinator.WorkerPreemptionHandler)
    assert "support partial cluster recovery" in source, (
        "TensorFlow's WorkerPreemptionHandler changed its recovery: re-check whether "
        "tfdist.compat.ps_recovery is still needed")
    assert "update_server_def(self._server_def)" in source


def _server_def():
    from tensorflow.core.protobuf import tensorflow_server_pb2

    server_def = tensorflow_server_pb2.ServerDef()
    for name, tasks in (("worker", ["127.0.0.1:1", "127.0.0.1:2"]), ("ps", ["127.0.0.1:3"])):
        job = server_def.cluster.job.add()
        job.name = name
        for i, address in enumerate(tasks):
            job.tasks[i] = address
    return server_def


def test_an_error_in_the_recovery_thread_does_not_end_it(monkeypatch, caplog):
    # The recovery thread is what wakes the coordinator's waiting worker threads: if it
    # died on an unexpected error, they would wait forever.
    import logging
    import threading

    from tensorflow.python.eager import context

    monkeypatch.setattr(ps_recovery, "POLL_SECONDS", 0.05)
    monkeypatch.setattr(context.context(), "update_server_def", lambda server_def: None)
    probes = []

    def reachable(address):
        probes.append(address)
        if len(probes) == 1:
            raise RuntimeError("a probe that fails in an unexpected way")
        return True

    caplog.set_level(logging.WARNING, logger="tfdist")
    recovery = ps_recovery.PartialRecovery(object(), _server_def(), all_lost_timeout=60,
                                           reachable=reachable, all_lost_error=RuntimeError)
    try:
        waiter = threading.Thread(target=recovery._wait_until_back, args=(1,), daemon=True)
        waiter.start()
        waiter.join(timeout=20)
        assert not waiter.is_alive(), "worker:1 was never taken back"
    finally:
        recovery.stop()
    assert len(probes) >= 2
    assert any("worker recovery hit an error" in r.getMessage() for r in caplog.records)


def test_a_worker_back_that_cannot_be_taken_back_is_said_so(monkeypatch, caplog):
    # TensorFlow's own waits during a cluster update are silent: a worker that listens
    # again but cannot rejoin (every update fails, or one blocks) gets a warning with
    # the reason; a recovery that goes through at once says nothing.
    import logging
    import time

    from tensorflow.python.eager import context
    from tensorflow.python.framework import errors

    server_def = _server_def()
    monkeypatch.setattr(ps_recovery, "SLOW_UPDATE_WARNING_SECONDS", 0.2)
    updates = []

    def update_server_def(sent):
        updates.append(sorted(next(j for j in sent.cluster.job if j.name == "worker").tasks))
        if len(updates) in (2, 3):
            raise errors.UnavailableError(None, None, "failed to connect to all addresses")
        if len(updates) == 4:
            time.sleep(0.5)

    monkeypatch.setattr(context.context(), "update_server_def", update_server_def)
    recovery = ps_recovery.PartialRecovery(object(), server_def, all_lost_timeout=60,
                                           reachable=lambda address: True,
                                           all_lost_error=RuntimeError)
    caplog.set_level(logging.WARNING, logger="tfdist")
    try:
        recovery._update({1}, {1: time.monotonic()})  # at once: nothing to say
        assert updates == [[0, 1]] and not caplog.records
        recovery._update({1}, {1: time.monotonic()})
        time.sleep(0.25)
        recovery._update({1}, {1: time.monotonic()})
        recovery._update({1}, {1: time.monotonic()})  # blocks 0.5 s, then goes through
    finally:
        recovery.stop()
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 3, said
    assert "worker:1 at 127.0.0.1:2 accept(s) connections again" in said[0], said
    assert "UnavailableError: failed to connect to all addresses" in said[0], said
    assert "taking back worker(s) [1] (leaving out []) has not returned" in said[1], said
    assert "succeeded after" in said[2], said


def _finished_step(copy_error=None, step_error=None, state=None):
    """A real RemoteValueImpl as the coordinator leaves it once a step is done; its copy to
    the coordinator raises `copy_error` (a worker gone since the step finished)."""
    import tensorflow as tf
    from tensorflow.python.distribute.coordinator import values

    value = values.RemoteValueImpl(None, None)
    if step_error is not None:
        value._set_error(step_error)
    else:
        value._set_values({"loss": tf.constant(0.5)} if state is None else state)
    def copy_to_local():  # no cluster here: the copy is the value itself, or the error
        if copy_error is not None:
            raise copy_error
        return value._values

    value._copy_to_local = copy_to_local
    return value


def _gone():
    import tensorflow as tf

    return tf.errors.UnavailableError(
        None, None, "failed to connect to all addresses; last error: UNKNOWN: "
        "ipv4:127.0.0.1:20711: Failed to connect to remote host: Connection refused")


def test_a_finished_step_whose_worker_is_gone_is_not_an_error():
    """CI saw it: worker:1 killed after running the step the first batch log waits for, and
    before the coordinator copied the step's value. fetch() then raises UnavailableError,
    which reads as a lost parameter server; the step ran, and its update landed."""
    import tensorflow as tf

    value = _finished_step(copy_error=_gone())
    with pytest.raises(tf.errors.UnavailableError):  # negative control: TensorFlow's fetch
        value.fetch()
    value = _finished_step(copy_error=_gone())
    ps_recovery.wait_for_step(value)  # waits, raises nothing
    assert ps_recovery.fetch_unless_worker_gone(value) is None
    # A value that copies is fetched as before.
    fetched = ps_recovery.fetch_unless_worker_gone(_finished_step())
    assert fetched == {"loss": 0.5}


def test_a_failed_step_still_raises_its_own_error():
    import tensorflow as tf

    for wait in (ps_recovery.wait_for_step, ps_recovery.fetch_unless_worker_gone):
        with pytest.raises(ValueError, match="the step's own"):
            wait(_finished_step(step_error=ValueError("the step's own")))
        # A step that failed because a ps is gone is still that error (a lost ps).
        with pytest.raises(tf.errors.UnavailableError):
            wait(_finished_step(step_error=_gone()))


def test_canary_tensorflow_still_copies_a_steps_value_lazily():
    """The reason for wait_for_step: RemoteValueImpl.get() copies the value from the worker
    at the first read. When that changes, re-check whether wait_for_step is needed."""
    from tensorflow.python.distribute.coordinator import values

    source = inspect.getsource(values.RemoteValueImpl.get)
    assert "_copy_to_local" in source and "_wait_and_maybe_error" in source


def test_the_first_batch_log_reads_the_metrics_when_the_steps_worker_is_gone():
    import keras

    from tfdist.ps import trainer

    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse", metrics=["mae"])
    model.fit(keras.ops.ones((4, 2)), keras.ops.ones((4, 1)), verbose=0)
    logs = trainer._BatchLogs(model)
    logs.scheduled(_finished_step(copy_error=_gone()))
    assert sorted(logs.get()) == ["loss", "mae"]


class _ShardCoordinator:
    """Stands in for the coordinator of exact evaluation: shard k's metric state is
    (total k + 1, count 1); the first result of each shard in `gone` cannot be read (its
    worker died after the shard finished)."""

    def __init__(self, gone):
        self.gone, self.calls = set(gone), []

    def schedule(self, function, args):
        import numpy as np

        shard = int(args[1])
        self.calls.append(shard)
        lost = shard in self.gone and self.calls.count(shard) == 1
        return _finished_step(copy_error=_gone() if lost else None,
                              state=[np.float32(shard + 1), np.float32(1)])

    def join(self):
        pass


def _exact_evaluation(coordinator):
    import keras
    import numpy as np

    from tfdist.ps import trainer as trainer_lib

    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")  # its metric state: the loss tracker's total and count
    model.evaluate(np.ones((2, 2)), np.ones((2, 1)), verbose=0)
    trainer = object.__new__(trainer_lib.CoordinatorTrainer)
    trainer.model, trainer.coordinator = model, coordinator
    trainer.build = lambda x: None
    trainer._initial_metric_state = lambda: [np.float32(0), np.float32(0)]
    trainer._shard_function = lambda num_shards, initial: "shard function"
    trainer._per_worker_datasets = lambda x: "per-worker datasets"
    return trainer.evaluate_exactly("dataset", num_shards=4)


def test_exact_evaluation_runs_a_shard_again_when_its_worker_is_gone(monkeypatch):
    import tensorflow as tf

    from tfdist.ps import trainer as trainer_lib

    coordinator = _ShardCoordinator(gone={1})
    logs = _exact_evaluation(coordinator)
    assert coordinator.calls == [0, 1, 2, 3, 1]  # shard 1 ran again
    assert logs["loss"] == (1 + 2 + 3 + 4) / 4  # every shard counted once
    # Negative control: without the re-run, the lost result ends the evaluation.
    monkeypatch.setattr(trainer_lib, "SHARD_REREADS", 0)
    with pytest.raises(tf.errors.UnavailableError):
        _exact_evaluation(_ShardCoordinator(gone={1}))

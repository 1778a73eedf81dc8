"""The coordinator training loop: a compiled Keras model's steps, run on parameter-server workers.

`CoordinatorTrainer` is the loop object (orbit's runner shape): it owns the
traced step functions, the per-worker iterators and the ClusterCoordinator,
and runs a number of steps at a time. It knows nothing about Keras's `fit`
arguments or callbacks; tfdist.ps.keras_api maps `fit`/`evaluate` onto it.

    trainer = CoordinatorTrainer.for_model(model)
    logs = trainer.train(dataset_fn, num_steps=100)          # one epoch
    logs = trainer.evaluate(dataset_fn, num_steps=20)         # batches spread over workers
    logs = trainer.evaluate_exactly(finite_dataset, num_shards=10)

How a step runs: the coordinator *schedules* `num_steps` calls of the model's
own `train_step` (or `test_step`); each idle worker takes the next one, reads
the variables from the parameter servers and writes its update back without
waiting for the other workers. A worker that dies mid-step has its step
re-run on another worker (TensorFlow's ClusterCoordinator does this), so a
step runs at least once: if the dead worker had already applied its update,
that update would land twice. With the preset's `skip_completed_reruns` every
train step carries an id and, after all of its ops ran, records it in a
small ps variable; a re-run (flagged by tfdist.compat.ps_recovery) that
finds its id there applies nothing. What remains: a worker that dies *while* writing its
update leaves part of it applied and the re-run applies all of it (TensorFlow has no
transaction across variables). `train` counts re-runs and the updates that
landed twice anyway (`StepsReport`).

Exactly-once evaluation (`evaluate_exactly`, tf_keras's `pss_evaluation_shards`)
splits a finite dataset into shards; each shard is one scheduled function
that builds that shard on its worker and runs `test_step` over all of it with
its own metric state (a `keras.StatelessScope`), returning the state instead
of writing it. A worker lost mid-shard has the whole shard re-run elsewhere,
and only the run that finished reports back, so every example counts exactly
once. The coordinator adds the shards' metric states (as tf_keras does:
Keras's metrics accumulate sums and counts) into the model's metrics.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import warnings
import weakref
from typing import Any, Callable

from tfdist import state as state_lib
from tfdist._tf import import_tensorflow
from tfdist import compat
from tfdist.compat import keras_build, optimizer_update, ps_keras
from tfdist.ps import data as data_lib

# Batch-level logs are re-read from the parameter servers at most this often
# (seconds): reading them costs RPCs on the coordinator.
BATCH_LOG_INTERVAL = 0.2
# How often a shard of exact evaluation runs again when the worker holding its result is
# gone before the result was read.
SHARD_REREADS = 3

logger = logging.getLogger("tfdist")

_TRAINERS: "weakref.WeakKeyDictionary[Any, CoordinatorTrainer]" = weakref.WeakKeyDictionary()
_TRAINERS_LOCK = threading.Lock()


def coordinator_for(strategy):
    """The strategy's ClusterCoordinator (one per strategy, created on first use)."""
    tf = import_tensorflow()
    return tf.distribute.coordinator.ClusterCoordinator(strategy)


@dataclasses.dataclass(frozen=True)
class StepHooks:
    """What the loop calls around each scheduled step (Keras callbacks, in fit).

    Attributes:
      begin: called with the step index before it is scheduled.
      end: called with the step index and the batch-level logs after it is scheduled.
      stop: polled after each step; True ends the run early (EarlyStopping).
    """

    begin: Callable[[int], None] = lambda step: None
    end: Callable[[int, dict], None] = lambda step, logs: None
    stop: Callable[[], bool] = lambda: False


@dataclasses.dataclass(eq=False)
class _WorkerInput:
    """Per-worker copies of one input (`x`), the iterator the steps read, and how far it is."""

    x: Any
    per_worker: Any
    iterator: Any
    taken: int = 0  # steps taken from `iterator` (a data.EpochDataset's pass)


@dataclasses.dataclass(frozen=True)
class StepsReport:
    """What one `train` call ran.

    Attributes:
      scheduled: steps scheduled (and finished: `train` waits for all of them).
      applied: how far `optimizer.iterations` moved (exact: incremented on the ps).
      rerun: steps TensorFlow re-ran after a worker failure.
      rerun_after_write: re-run steps whose first run had already written to
        the parameter servers (it incremented `optimizer.iterations`, so at
        least part of its update landed, and the re-run applied it again):
        `applied - scheduled`, at most `rerun`. TensorFlow orders the writes of
        one step freely, so how much of the first run landed is unknown.
    """

    scheduled: int
    applied: int
    rerun: int

    @property
    def rerun_after_write(self) -> int:
        return max(0, min(self.applied - self.scheduled, self.rerun))


class _BatchLogs:
    """Batch-level logs: the metrics accumulated on the ps so far, throttled.

    They always name every metric, as Keras's batch logs do (callbacks format
    them: `ModelCheckpoint("m-{loss:.2f}.keras", save_freq=N)`): the first read
    of a run waits for the run's first step to finish, so no log reports the
    metrics' reset state as a result.
    """

    def __init__(self, model):
        self._model = model
        self._logs: dict = {}
        self._read_at = -float("inf")
        self._first = None

    def scheduled(self, remote_value) -> None:
        """Notes a scheduled step (the first one is what the first read waits for)."""
        if self._first is None:
            self._first = remote_value

    def get(self) -> dict:
        now = time.monotonic()
        if self._first is not None and (
                not self._logs or now - self._read_at >= BATCH_LOG_INTERVAL):
            if not self._logs:
                from tfdist.compat import ps_recovery

                # Raises what the step raised; its value stays on the worker (which may
                # be gone by now).
                ps_recovery.wait_for_step(self._first)
            self._logs = ps_keras.pythonify(self._model.get_metrics_result())
            self._read_at = now
        return dict(self._logs)


class CoordinatorTrainer:
    """Runs a compiled Keras model's train/test steps on the workers of a ParameterServerStrategy.

    Args:
      model: a compiled Keras model built under the strategy's scope.
      strategy: its `tf.distribute.ParameterServerStrategy`.
    """

    def __init__(self, model, strategy):
        self.model = model
        self.strategy = strategy
        self.coordinator = coordinator_for(strategy)
        self.compile_token = ps_keras.compile_token(model)
        # The preset's skip_completed_reruns (its ps_recovery feature keeps it).
        self.skip_completed_reruns = bool(getattr(state_lib.state_of(strategy),
                                                  "skip_completed_reruns", False))
        self._functions: dict[Any, Callable] = {}
        self._iterators: dict[tuple[str, int], _WorkerInput] = {}
        self._ledger_variable = None
        self._next_step_id = 0
        self.last_report: StepsReport | None = None

    @classmethod
    def for_model(cls, model) -> "CoordinatorTrainer":
        """The model's trainer; a fresh one after every `compile()` (new step functions)."""
        with _TRAINERS_LOCK:
            trainer = _TRAINERS.get(model)
            if (trainer is None or trainer.compile_token is not ps_keras.compile_token(model)
                    or trainer.strategy is not model.distribute_strategy):
                trainer = cls(model, model.distribute_strategy)
                _TRAINERS[model] = trainer
            return trainer

    @classmethod
    def forget(cls, model) -> None:
        """Drops the model's trainer (its traced steps belong to the old compile)."""
        with _TRAINERS_LOCK:
            _TRAINERS.pop(model, None)

    # --- building -------------------------------------------------------------------

    def build(self, x) -> None:
        """Creates model, metric and optimizer variables on the ps, before any step."""
        model = self.model
        optimizer = model.optimizer
        if (optimizer is not None and not optimizer.built
                and keras_build.ADOPT_OPTIMIZER in compat.installed()):
            # Made before the scope, as keras.io's examples do (keras-team/keras#17187): its
            # step counter and learning rate move onto the parameter servers, as on
            # tfdist's other strategies.
            with self.strategy.scope():
                keras_build.adopt_optimizer(optimizer, self.strategy)
        if optimizer is not None and ps_keras.optimizer_strategy(optimizer) is not self.strategy:
            raise ValueError(
                "The model's optimizer was created outside the parameter-server strategy's "
                "scope, so its variables cannot live on the parameter servers. Received: "
                f"optimizer {optimizer.name!r} made under "
                f"{type(ps_keras.optimizer_strategy(optimizer)).__name__}. Call "
                "model.compile(...) inside `with strategy.scope():`.")
        if optimizer is not None:
            optimizer_update.refuse_accumulation_under_parameter_server(optimizer)
        if not keras_build.has_own_call(model):
            # Nothing to run symbolically (a `train_step` and no `call()`: keras.io's VAE
            # and GAN): its sub-models are built already, and its optimizers create their
            # variables, under this strategy's scope, while the first step is traced on
            # the coordinator (see `tfdist.compat.keras_build`), as Keras does without a
            # strategy.
            return
        with self.strategy.scope():
            ps_keras.symbolic_build(model, data_lib.element_spec(x))
            if model.optimizer is not None and not model.optimizer.built:
                model.optimizer.build(model.trainable_variables)

    def step_function(self, kind: str, *, fed: bool = False) -> Callable:
        """The traced function one worker runs for one step ("train" or "test").

        A step takes the worker's iterator (per-worker input) or, `fed`, the
        batch the coordinator read for it (a `data.CoordinatorFeed`). With
        `skip_completed_reruns`, a train step also takes `(step_id, rerun)`
        and, on a re-run, runs only if the ledger does not already record
        `step_id` as applied (see `_ledger`).
        """
        key = (kind, fed)
        if key not in self._functions:
            tf = import_tensorflow()
            step = self.model.train_step if kind == "train" else self.model.test_step
            strategy = self.strategy

            def run(iterator_or_batch):
                batch = iterator_or_batch if fed else next(iterator_or_batch)
                outputs = strategy.run(step, args=(batch,))
                return strategy.experimental_local_results(outputs)[0]

            if kind == "train" and self.skip_completed_reruns:
                self._ledger(1)
                function = self._once_per_step_id(run)
            else:
                function = run
            # ClusterCoordinator.schedule needs a tf.function (run_eagerly cannot apply);
            # fed batches change shape at an epoch's last, partial batch.
            self._functions[key] = tf.function(function, reduce_retracing=fed)
        return self._functions[key]

    def _ledger(self, steps: int):
        """A ps variable recording, per step id (mod its size), the last id applied.

        TensorFlow re-runs a step whose worker died; if that worker had already
        applied the step's update and recorded it here, the re-run finds the
        record and applies nothing. Ids are unique within an epoch, whose re-runs
        finish before the epoch ends, so `steps` entries suffice.
        """
        if self._ledger_variable is None or self._ledger_variable.shape[0] < steps:
            tf = import_tensorflow()
            with self.strategy.scope():
                self._ledger_variable = tf.Variable(
                    tf.fill([max(steps, 1024)], tf.constant(-1, tf.int64)), trainable=False,
                    name="tfdist_applied_steps")
            for fed in (False, True):  # the train steps capture the ledger
                self._functions.pop(("train", fed), None)
        return self._ledger_variable

    def _once_per_step_id(self, run: Callable) -> Callable:
        tf = import_tensorflow()
        ledger = self._ledger_variable
        capacity = int(ledger.shape[0])

        def once(iterator, step_id, rerun):
            slot = tf.math.floormod(step_id, capacity)
            # Only a re-run (flagged by tfdist's failure handler) reads the ledger:
            # first runs pay no extra round trip before their work.
            applied = tf.cond(rerun, lambda: tf.equal(ledger.sparse_read(slot), step_id),
                              lambda: tf.constant(False))
            seen = {}

            def apply():
                graph = tf.compat.v1.get_default_graph()
                first = len(graph.get_operations())
                outputs = run(iterator)
                # Recorded only after every op of the step ran (TensorFlow orders
                # ops of different variables freely): a worker that dies before
                # this leaves the step to be re-run; after it, nothing is redone.
                # (The function returns only after this stateful op ran.)
                with tf.control_dependencies(graph.get_operations()[first:]):
                    ledger.scatter_update(tf.IndexedSlices(
                        tf.reshape(step_id, [1]), tf.reshape(slot, [1])))
                seen["outputs"] = outputs
                return outputs

            def skip():
                # Same structure as the step's logs; the epoch's logs are read
                # from the metrics, not from a skipped step.
                return tf.nest.map_structure(
                    lambda t: tf.zeros([d or 0 for d in t.shape], t.dtype), seen["outputs"])

            return tf.cond(tf.logical_not(applied), apply, skip)

        return once

    def _input(self, slot: str, x) -> "_WorkerInput":
        """The per-worker copies of `x` and their iterator, kept for the slot's latest input.

        A later call with the same object continues where the workers stand.
        """
        key = (slot, id(x))
        entry = self._iterators.get(key)
        if entry is not None and entry.x is x:
            return entry
        for old in [k for k in self._iterators if k[0] == slot]:
            del self._iterators[old]
        tf = import_tensorflow()
        source = data_lib.for_workers(x, self.strategy)
        if data_lib.is_epoch_dataset(x) and isinstance(source, tf.data.Dataset):
            # Every pass iterates the same dataset on each worker again, as Keras does.
            datasets = ps_keras.per_worker_datasets(self.coordinator, source)
            entry = _WorkerInput(x, datasets, None)  # the first epoch starts it
        elif data_lib.is_epoch_dataset(x):
            # A dataset function (a PerWorkerDataset's): each pass calls it again.
            entry = _WorkerInput(x, self.coordinator.create_per_worker_dataset(source), None)
        else:
            per_worker = self.coordinator.create_per_worker_dataset(source)
            entry = _WorkerInput(x, per_worker, iter(per_worker))
        self._iterators[key] = entry
        return entry

    def _new_pass(self, x, datasets):
        if hasattr(datasets, "build"):  # a per-worker dataset function's
            return iter(datasets)
        return ps_keras.iterators_over(self.coordinator, datasets,
                                       data_lib.on_coordinator(x.dataset))

    def _iterator(self, slot: str, x):
        """An iterator over per-worker copies of `x` (see `_input`)."""
        return self._input(slot, x).iterator

    # --- loops ----------------------------------------------------------------------

    def _step_inputs(self, kind: str, x, num_steps: int | None):
        """Each step's first argument: the per-worker iterator, or the batch read here."""
        if data_lib.is_coordinator_feed(x):
            for step, batch in enumerate(x.epoch()):
                if num_steps is not None and step >= num_steps:
                    return
                yield batch
            return
        if data_lib.is_epoch_dataset(x):
            yield from self._passes(kind, x, num_steps)
            return
        iterator = self._iterator(kind, x)
        for _ in range(num_steps):
            yield iterator

    def _passes(self, slot: str, x, num_steps: int):
        """Steps over a `data.EpochDataset`, read in passes as Keras's `EpochIterator` does.

        Each pass is `x.pass_steps` steps (all workers together, so no worker
        reads past the end of its copy) over new iterators, started where
        Keras starts them (see `data.EpochDataset`); an epoch that reaches the
        end of a pass before `num_steps` ends there, with Keras's warning, and
        the next epoch starts the next pass.
        """
        entry = self._input(slot, x)
        if entry.iterator is None or x.epoch_is_pass:
            entry.iterator, entry.taken = self._new_pass(x, entry.per_worker), 0
        for _ in range(num_steps):
            if entry.taken >= x.pass_steps:
                warnings.warn(
                    "Your input ran out of data; interrupting training. Make sure that your "
                    "dataset or generator can generate at least `steps_per_epoch * epochs` "
                    "batches. You may need to use the `.repeat()` function when building "
                    "your dataset.", stacklevel=5)
                break
            entry.taken += 1
            yield entry.iterator
        if entry.taken >= x.pass_steps:
            entry.iterator, entry.taken = self._new_pass(x, entry.per_worker), 0

    def _run(self, kind: str, x, num_steps: int | None, hooks: StepHooks) -> dict:
        from tfdist.compat import ps_recovery

        tf = import_tensorflow()
        gated = kind == "train" and self.skip_completed_reruns
        if gated:
            self._ledger(num_steps or 1)
        function = self.step_function(kind, fed=data_lib.is_coordinator_feed(x))
        batch_logs = _BatchLogs(self.model)
        last = None
        first_run = ps_recovery.first_run_flag()
        for step, first in enumerate(self._step_inputs(kind, x, num_steps)):
            hooks.begin(step)
            args = (first,)
            if gated:
                # The failure handler swaps first_run for True when it re-runs this step.
                args += (tf.constant(self._next_step_id, tf.int64), first_run)
                self._next_step_id += 1
            last = self.coordinator.schedule(function, args=args)
            batch_logs.scheduled(last)
            try:
                logs = batch_logs.get()
            except Exception:
                self._drop_kept_error()
                raise
            hooks.end(step, logs)
            if hooks.stop():
                break
        self.coordinator.join()
        logs = ps_recovery.fetch_unless_worker_gone(last) if last is not None else {}
        if logs is None:  # the step ran; the worker holding its logs is gone
            logger.warning("tfdist: the worker that ran the last step is gone; its step "
                           "finished, so the logs are the metrics read from the parameter "
                           "servers")
            return ps_keras.pythonify(self.model.get_metrics_result())
        return ps_keras.pythonify(ps_keras.metrics_result_or_logs(self.model, logs))

    def _drop_kept_error(self) -> None:
        """After a step's value raised: the coordinator's copy of the error goes too.

        A failed step leaves its error in the coordinator until the next
        join()/schedule() raises it; without this, the next fit would fail
        with this one's error (after every worker was lost, even once one is back).
        """
        try:
            self.coordinator.join()
        except Exception:  # noqa: BLE001 (the error already raised, or a later step's)
            pass

    def train(self, x, num_steps: int | None, hooks: StepHooks = StepHooks()) -> dict:
        """Runs `num_steps` train steps over the workers (fresh metrics); returns exact logs.

        `x` is per-worker input or a `data.CoordinatorFeed` (then at most
        `num_steps`, or the feed's epoch when None). The logs are the metrics
        read after every step finished. `last_report` says how many steps ran
        and how many landed twice after a worker failure.
        """
        from tfdist.compat import ps_recovery

        self.build(x)
        self.model.reset_metrics()
        optimizer = self.model.optimizer
        before = int(optimizer.iterations.numpy()) if optimizer is not None else 0
        reruns_before = ps_recovery.rerun_count(self.coordinator)
        scheduled = [0]

        def begin(step):
            scheduled[0] = step + 1
            hooks.begin(step)

        logs = self._run("train", x, num_steps, dataclasses.replace(hooks, begin=begin))
        after = int(optimizer.iterations.numpy()) if optimizer is not None else 0
        self.last_report = StepsReport(
            scheduled=scheduled[0], applied=after - before,
            rerun=ps_recovery.rerun_count(self.coordinator) - reruns_before)
        return logs

    def evaluate(self, x, num_steps: int, hooks: StepHooks = StepHooks()) -> dict:
        """Runs `num_steps` test steps spread over the workers (fresh metrics).

        Each worker reads its own copy of `x` from where its iterator stands,
        so batches can be visited twice or never: see `evaluate_exactly`.
        """
        self.build(x)
        self.model.reset_metrics()
        return self._run("test", x, num_steps, hooks)

    # --- exactly-once evaluation --------------------------------------------------------

    def _initial_metric_state(self) -> list:
        """The metric variables' values right after `reset_state()` (computed, not assigned)."""
        import keras

        variables = self.model.metrics_variables
        with keras.StatelessScope() as scope:
            for metric in self.model.metrics:
                metric.reset_state()
        values = []
        for v in variables:
            value = scope.get_current_value(v)
            values.append((v.numpy() if value is None else value.numpy()))
        return values

    def _shard_function(self, num_shards: int, initial: list) -> Callable:
        key = ("exact", num_shards)
        if key in self._functions:
            return self._functions[key]
        tf = import_tensorflow()
        import keras

        model, strategy = self.model, self.strategy
        variables = list(model.metrics_variables)
        initial = [tf.constant(v) for v in initial]

        def test_batch(state, batch):
            def replica_fn(batch):
                with keras.StatelessScope(state_mapping=list(zip(variables, state))) as scope:
                    model.test_step(batch)
                return [scope.get_current_value(v) for v in variables]

            outputs = strategy.run(replica_fn, args=(batch,))
            return [tf.convert_to_tensor(o) for o in strategy.experimental_local_results(
                outputs)[0]]

        def one_shard(dataset, shard_index):
            # Built on the worker that runs this shard; re-run from its start if
            # that worker is lost.
            iterator = iter(dataset.shard(num_shards, shard_index))
            state = list(initial)
            batch = iterator.get_next_as_optional()
            while batch.has_value():
                state = test_batch(state, batch.get_value())
                batch = iterator.get_next_as_optional()
            return state

        self._functions[key] = tf.function(one_shard)
        return self._functions[key]

    def _shard_state(self, function, datasets, shard: int, result) -> list:
        """A finished shard's metric state. When the worker that ran it is gone before the
        state was read (it lives on that worker), the shard runs again elsewhere: each
        shard's state starts from the reset state, so a re-run counts its batches once."""
        from tfdist.compat import ps_recovery

        tf = import_tensorflow()
        for _ in range(SHARD_REREADS):
            state = ps_recovery.fetch_unless_worker_gone(result)
            if state is not None:
                return state
            logger.warning("tfdist: the worker that evaluated shard %d is gone; running the "
                           "shard again", shard)
            result = self.coordinator.schedule(function,
                                               args=(datasets, tf.constant(shard, tf.int64)))
        return result.fetch()

    def _per_worker_datasets(self, x):
        key = ("exact", id(x))
        if key in self._iterators and self._iterators[key].x is x:
            return self._iterators[key].per_worker
        # Every worker builds the whole evaluation set; the shards split it.
        source = data_lib.for_workers(x, self.strategy, whole=True)
        datasets = ps_keras.per_worker_datasets(self.coordinator, source)
        self._iterators[key] = _WorkerInput(x, datasets, None)
        return datasets

    def evaluate_exactly(self, x, num_shards: int, hooks: StepHooks = StepHooks()) -> dict:
        """Evaluates a finite `x` over the workers, every element exactly once.

        Args:
          x: a finite dataset, a function returning one (called on each worker
            with a single-pipeline InputContext: the whole set), or a
            PerWorkerDataset.
          num_shards: how many pieces to split `x` into (one scheduled function
            each; more pieces spread better and lose less to a worker failure).
          hooks: called once per shard (`end` gets empty logs: shard results
            are merged at the end).

        Returns:
          The model's metrics over all of `x`.
        """
        tf = import_tensorflow()
        self.build(x)
        initial = self._initial_metric_state()
        function = self._shard_function(num_shards, initial)
        datasets = self._per_worker_datasets(x)
        results = []
        for shard in range(num_shards):
            hooks.begin(shard)
            results.append(self.coordinator.schedule(
                function, args=(datasets, tf.constant(shard, tf.int64))))
            hooks.end(shard, {})
            if hooks.stop():
                break
        self.coordinator.join()
        merged = [v0.copy() for v0 in initial]
        for shard, result in enumerate(results):
            for i, value in enumerate(self._shard_state(function, datasets, shard, result)):
                merged[i] = merged[i] + (value - initial[i])
        # Into the model's own metrics (on the ps), so callbacks and
        # get_metrics_result() see the exact values, as after Keras's evaluate.
        for variable, value in zip(self.model.metrics_variables, merged):
            variable.assign(value)
        return ps_keras.pythonify(self.model.get_metrics_result())

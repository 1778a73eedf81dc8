"""Parameter-server training for Keras 3: the cluster, the coordinator, `fit`.

    strategy = tfdist.make_strategy("parameter_server", local_workers=2, local_ps=1)
    with strategy.scope():
        model = build_model(); model.compile(optimizer="adam", loss="mse")
    model.fit(dataset_fn, epochs=3, steps_per_epoch=100)

Keras 3 has no ParameterServerStrategy support (keras-team/keras#18624):
its `fit` rejects every input under this strategy. `tfdist.compat.ps_fit`
routes `Model.fit`/`evaluate`/`predict` of a model built under a
ParameterServerStrategy to the functions here, which drive a
`tf.distribute.coordinator.ClusterCoordinator` the way tf_keras does:

* the coordinator (this process) *schedules* `steps_per_epoch` calls of the
  model's own `train_step` per epoch; each idle worker takes the next one,
  reads the variables from the parameter servers, and writes its update back
  without waiting for the other workers (asynchronous training);
* the dataset is created on every worker from `fn(input_context)` (or a copy
  of a `tf.data.Dataset`), so the coordinator never sees where it ends: that
  is why `steps_per_epoch` is required;
* callbacks run on the coordinator; batch-level logs are the metrics as
  accumulated on the parameter servers so far (refreshed at most every
  `BATCH_LOG_INTERVAL` seconds); epoch-level logs are exact, read after all of
  the epoch's steps have finished.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import socket
import sys
import threading
import time
import warnings
from typing import Any, Callable

from tfdist import cluster as cluster_lib
from tfdist import config as config_lib
from tfdist._tf import import_tensorflow

logger = logging.getLogger("tfdist")

# Batch-level callback logs are re-read from the parameter servers at most
# this often (seconds): reading them costs RPCs on the coordinator.
BATCH_LOG_INTERVAL = 0.2

# Worker servers need enough inter-op threads to serve remote function calls
# while their own ops wait on the parameter servers; with the default on a
# 2-core machine, an in-process cluster deadlocks at the first step.
_SERVER_INTER_OP_THREADS = 8

_STEPS_PER_EPOCH_HELP = (
    "The coordinator schedules steps on the workers "
    "without seeing their data, so it cannot know where a dataset ends: pass "
    "steps_per_epoch=N (and make the dataset repeat(), so no worker runs out).")


class ParameterServerError(RuntimeError):
    """A parameter server failed: training cannot continue in this process."""


# --- the cluster ----------------------------------------------------------------


@dataclasses.dataclass
class LocalCluster:
    """Workers and parameter servers running as servers in this process."""

    cluster: cluster_lib.Cluster
    servers: list
    resolver: Any


_LOCAL_CLUSTERS: dict[tuple[int, int], LocalCluster] = {}
_LOCAL_LOCK = threading.Lock()


def _server_config(tf):
    config = tf.compat.v1.ConfigProto()
    config.inter_op_parallelism_threads = _SERVER_INTER_OP_THREADS
    return config


def local_cluster(num_workers: int, num_ps: int) -> LocalCluster:
    """Starts (or reuses) an in-process cluster on free 127.0.0.1 ports.

    TensorFlow servers cannot be stopped, and a process can talk to only one
    cluster at a time, so one cluster per shape is kept for the life of the
    process: re-running a notebook cell reuses it.
    """
    tf = import_tensorflow()
    key = (num_workers, num_ps)
    with _LOCAL_LOCK:
        if key in _LOCAL_CLUSTERS:
            return _LOCAL_CLUSTERS[key]
        if _LOCAL_CLUSTERS:
            warnings.warn(
                f"Starting a second in-process cluster ({num_workers} workers, {num_ps} ps); "
                "strategies made on the earlier one stop working. Restart the process (the "
                "notebook kernel) to free its servers.", stacklevel=3)
        spec = cluster_lib.local_cluster(num_workers=num_workers, num_ps=num_ps)
        cluster_spec = tf.train.ClusterSpec(spec.cluster_dict())
        servers = []
        for task_type, task_id in spec.tasks():
            servers.append(tf.distribute.Server(
                cluster_spec, job_name=task_type, task_index=task_id, protocol="grpc",
                config=_server_config(tf), start=True))
        resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
            cluster_spec, rpc_layer="grpc")
        _LOCAL_CLUSTERS[key] = LocalCluster(spec, servers, resolver)
        logger.info("tfdist: in-process cluster %s", spec.sizes())
        return _LOCAL_CLUSTERS[key]


def wait_for_tasks(addresses: dict[str, str], *, timeout: float,
                   poll: float = 0.2) -> None:
    """Waits until every "host:port" accepts TCP connections.

    Args:
      addresses: task name ("ps:0") -> "host:port".
      timeout: seconds to wait in total.

    Raises:
      ParameterServerError: naming the tasks that never became reachable.
    """
    deadline = time.monotonic() + timeout
    pending = dict(addresses)
    while pending:
        for name, address in list(pending.items()):
            host, port = cluster_lib.split_address(address)
            try:
                with socket.create_connection((host, port), timeout=min(poll * 5, 2.0)):
                    del pending[name]
            except OSError:
                pass
        if not pending:
            return
        if time.monotonic() >= deadline:
            listed = ", ".join(f"{n} at {a}" for n, a in sorted(pending.items()))
            raise ParameterServerError(
                f"Could not reach {listed} within {timeout:g} s. Start those tasks (every "
                "task runs the same script; worker and ps tasks serve until stopped), check "
                "the addresses in TF_CONFIG, or raise connect_timeout.")
        time.sleep(poll)


def serve_forever(tf_config: cluster_lib.TFConfig) -> None:
    """Runs this worker/ps task's TensorFlow server until SIGTERM/SIGINT, then exits 0."""
    tf = import_tensorflow()
    cluster_spec = tf.train.ClusterSpec(_training_cluster(tf_config.cluster))
    server = tf.distribute.Server(
        cluster_spec, job_name=tf_config.task_type, task_index=tf_config.task_id,
        protocol=tf_config.rpc_layer or "grpc", config=_server_config(tf), start=True)
    print(f"tfdist: {tf_config.task_type}:{tf_config.task_id} serving at "
          f"{tf_config.address} pid={os.getpid()} (stop with SIGTERM)", file=sys.stderr, flush=True)

    def stop(signum, frame):
        # Exit without running TensorFlow's server teardown, which can block
        # while the coordinator still holds connections.
        sys.stderr.flush()
        os._exit(0)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    del server  # kept alive by the runtime
    while True:
        time.sleep(3600)


def _training_cluster(cluster: cluster_lib.Cluster) -> dict[str, list[str]]:
    return {k: list(v) for k, v in cluster.cluster_dict().items() if k != "evaluator"}


def _partitioner(tf, options: config_lib.ParameterServerOptions, num_ps: int):
    partitioners = tf.distribute.experimental.partitioners
    if options.shard_count is not None:
        return partitioners.FixedShardsPartitioner(num_shards=options.shard_count)
    if options.min_shard_bytes is not None:
        return partitioners.MinSizePartitioner(
            min_shard_bytes=options.min_shard_bytes,
            max_shards=options.max_shards or num_ps)
    return None


def make_strategy(options: config_lib.ParameterServerOptions):
    """The `parameter_server` preset's factory (see `tfdist.make_strategy`).

    In a TF_CONFIG cluster, worker and ps tasks do not return: they serve
    until stopped and then exit 0, so one script runs on every task.

    Raises:
      ValueError: no cluster (neither TF_CONFIG nor local_workers/local_ps), a
        cluster without ps or workers, or a task type that cannot run here.
      ParameterServerError: a worker or ps unreachable within connect_timeout.
    """
    tf = import_tensorflow()
    if options.is_local:
        local = local_cluster(options.local_workers, options.local_ps)
        resolver, num_ps = local.resolver, options.local_ps
    else:
        tf_config = cluster_lib.tf_config_from_env()
        if tf_config is None:
            raise ValueError(
                "The parameter_server preset needs a cluster. Received: no TF_CONFIG and "
                "no local_workers/local_ps. Pass local_workers=2, local_ps=1 for a cluster "
                "inside this process, or run under `tfdist launch --num_workers=2 "
                "--num_ps=1 --chief -- python script.py`, which sets TF_CONFIG.")
        cluster = tf_config.cluster
        if not cluster.ps:
            raise ValueError(
                f"TF_CONFIG describes a cluster without parameter servers ({cluster.sizes()}). "
                "The parameter_server preset needs at least one 'ps' task: add "
                "\"ps\": [\"host:port\"] to the cluster (tfdist launch --num_ps=1), or use "
                "the multi_worker_mirrored preset for synchronous training without ps.")
        if not cluster.worker:
            raise ValueError(
                f"TF_CONFIG describes a cluster without workers ({cluster.sizes()}). Add "
                "\"worker\": [...] (tfdist launch --num_workers=N).")
        if tf_config.task_type in ("worker", "ps"):
            serve_forever(tf_config)  # never returns
        if tf_config.task_type != "chief":
            raise ValueError(
                f"This process is task {tf_config.task_type}:{tf_config.task_id}; under the "
                "parameter_server preset the 'chief' task runs the training script as "
                "coordinator and worker/ps tasks serve. Run an evaluator as a separate "
                "plain script that loads checkpoints.")
        wait_for_tasks(
            {f"{t}:{i}": a for t in ("ps", "worker")
             for i, a in enumerate(getattr(cluster, t))},
            timeout=options.connect_timeout)
        resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
            tf.train.ClusterSpec(_training_cluster(cluster)), task_type="chief",
            task_id=0, rpc_layer=tf_config.rpc_layer or "grpc")
        num_ps = cluster.num_ps
    # Only the coordinator needs the Keras fixes (servers never import Keras).
    from tfdist.compat import ps_fit, ps_variables

    ps_variables.install()
    ps_fit.install()
    return tf.distribute.ParameterServerStrategy(
        resolver, variable_partitioner=_partitioner(tf, options, num_ps))


def is_parameter_server_strategy(strategy) -> bool:
    """True for a `tf.distribute.ParameterServerStrategy` (V2)."""
    from tfdist.compat.ps_variables import _is_parameter_server_strategy

    return _is_parameter_server_strategy(strategy)


def coordinator_for(strategy):
    """The strategy's ClusterCoordinator (one per strategy, created on first use)."""
    tf = import_tensorflow()
    return tf.distribute.coordinator.ClusterCoordinator(strategy)


# --- datasets -----------------------------------------------------------------


def _check_data(x, what: str):
    tf = import_tensorflow()
    if isinstance(x, tf.data.Dataset) or (callable(x) and not hasattr(x, "shape")):
        return
    raise ValueError(
        f"Under ParameterServerStrategy, {what} must be a function "
        "`fn(input_context) -> tf.data.Dataset` (called on every worker) or a "
        f"tf.data.Dataset. Received: {what} of type {type(x).__name__}. For arrays use "
        "`lambda ctx: tf.data.Dataset.from_tensor_slices((x, y)).shuffle(n)"
        ".repeat().batch(ctx.get_per_replica_batch_size(global_batch_size))`.")


def _element_spec(x):
    """What one batch looks like, computed on the coordinator (nothing is read)."""
    tf = import_tensorflow()
    if isinstance(x, tf.data.Dataset):
        return x.element_spec
    dataset = x(tf.distribute.InputContext())
    if not isinstance(dataset, tf.data.Dataset):
        raise ValueError(
            "The dataset function must return a tf.data.Dataset. Received: "
            f"{type(dataset).__name__} from {getattr(x, '__name__', x)!r}.")
    return dataset.element_spec


def _is_infinite(x) -> bool:
    tf = import_tensorflow()
    return (isinstance(x, tf.data.Dataset)
            and int(x.cardinality()) == int(tf.data.INFINITE_CARDINALITY))


def _per_worker_iterator(model, strategy, x, slot: str):
    """An iterator over per-worker copies of `x`, cached per (model, x)."""
    tf = import_tensorflow()
    cache = model.__dict__.setdefault("_tfdist_ps_iterators", {})
    key = (slot, id(x))
    if key in cache and cache[key][0] is x:
        return cache[key][1]
    coordinator = coordinator_for(strategy)
    if isinstance(x, tf.data.Dataset):
        per_worker = coordinator.create_per_worker_dataset(x)
    else:
        @tf.function
        def per_worker_dataset_fn():
            return strategy.distribute_datasets_from_function(x)

        per_worker = coordinator.create_per_worker_dataset(per_worker_dataset_fn)
    iterator = iter(per_worker)
    cache[key] = (x, iterator)
    return iterator


def _build(model, strategy, x) -> None:
    """Creates model, metric and optimizer variables on the ps, before any step."""
    with strategy.scope():
        model._symbolic_build(data_batch=_element_spec(x))
        if model.optimizer is not None and not model.optimizer.built:
            model.optimizer.build(model.trainable_variables)


def _step_function(model, strategy, kind: str) -> Callable:
    tf = import_tensorflow()
    cache = model.__dict__.setdefault("_tfdist_ps_functions", {})
    if kind not in cache:
        step = model.train_step if kind == "train" else model.test_step

        def one_step(iterator):
            outputs = strategy.run(step, args=(next(iterator),))
            return strategy.experimental_local_results(outputs)[0]

        # ClusterCoordinator.schedule needs a tf.function (run_eagerly cannot apply).
        cache[kind] = tf.function(one_step)
    return cache[kind]


def _check_steps(steps, name: str, help_text: str):
    if steps is None:
        raise ValueError(f"{name} is required under ParameterServerStrategy. Received: "
                         f"{name}=None. {help_text}")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"{name} must be an integer >= 1. Received: {name}={steps!r}.")


def _reject(name: str, value, default, fix: str) -> None:
    if value is not default and value != default:
        raise ValueError(
            f"fit/evaluate under ParameterServerStrategy does not take {name}. "
            f"Received: {name}={value!r}. {fix}")


class _BatchLogs:
    """Batch-level logs: the metrics accumulated on the ps so far, throttled."""

    def __init__(self, model):
        self._model = model
        self._logs: dict = {}
        self._read_at = -float("inf")
        self._first = None

    def scheduled(self, remote_value) -> None:
        """Notes a scheduled step; logs stay empty until the first one finished."""
        if self._first is None:
            self._first = remote_value

    def reset(self) -> None:
        self._logs, self._first, self._read_at = {}, None, -float("inf")

    def _first_done(self) -> bool:
        from tensorflow.python.distribute.coordinator import remote_value

        status = getattr(self._first, "_status", remote_value.RemoteValueStatus.READY)
        return self._first is not None and status is not remote_value.RemoteValueStatus.NOT_READY

    def get(self) -> dict:
        from keras.src.utils.python_utils import pythonify_logs

        now = time.monotonic()
        if now - self._read_at >= BATCH_LOG_INTERVAL and self._first_done():
            self._logs = pythonify_logs(self._model.get_metrics_result())
            self._read_at = now
        return dict(self._logs)


def _final_logs(model, last):
    from keras.src.utils.python_utils import pythonify_logs

    logs = last.fetch() if last is not None else {}
    return pythonify_logs(model._get_metrics_result_or_logs(logs))


def _translate_errors(fn):
    """Turns a lost parameter server into ParameterServerError with the fix."""
    import functools

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        from tensorflow.python.distribute.coordinator import cluster_coordinator

        tf = import_tensorflow()
        try:
            return fn(*args, **kwargs)
        except (cluster_coordinator.PSUnavailableError, tf.errors.UnavailableError,
                tf.errors.CancelledError, tf.errors.AbortedError) as e:
            raise ParameterServerError(
                "Lost a parameter server (or the whole cluster) during training: "
                f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300]}. Variables live on "
                "the ps tasks, so this process cannot continue. Restart the job and resume "
                "from the last checkpoint (keras.callbacks.BackupAndRestore or "
                "ModelCheckpoint; `tfdist launch --max_restarts=R` restarts it for you)."
            ) from e
    return wrapper


@_translate_errors
def fit(model, x=None, y=None, batch_size=None, epochs=1, verbose="auto", callbacks=None,
        validation_split=0.0, validation_data=None, shuffle=True, class_weight=None,
        sample_weight=None, initial_epoch=0, steps_per_epoch=None, validation_steps=None,
        validation_batch_size=None, validation_freq=1):
    """`Model.fit` for a model built under a ParameterServerStrategy.

    Same arguments as `keras.Model.fit`; `x` is `fn(input_context) ->
    tf.data.Dataset` or a `tf.data.Dataset` (copied to every worker: shard it
    yourself or pass a function), and `steps_per_epoch` is required.

    Returns:
      The `History` callback, as `keras.Model.fit`.

    Raises:
      ValueError: missing `steps_per_epoch`, unsupported data or arguments.
      ParameterServerError: a parameter server was lost.
    """
    from keras.src import callbacks as callbacks_module

    model._assert_compile_called("fit")
    strategy = model.distribute_strategy
    _check_data(x, "x")
    _check_steps(steps_per_epoch, "steps_per_epoch", _STEPS_PER_EPOCH_HELP)
    fix = "Put labels, weights and batching inside the dataset."
    _reject("y", y, None, fix)
    _reject("sample_weight", sample_weight, None, fix)
    _reject("class_weight", class_weight, None, "Weight the loss inside the dataset.")
    _reject("batch_size", batch_size, None, "Batch inside the dataset function.")
    _reject("validation_split", validation_split, 0.0, "Pass validation_data=... instead.")
    if validation_data is not None:
        _check_data(validation_data, "validation_data")

    _build(model, strategy, x)
    coordinator = coordinator_for(strategy)
    iterator = _per_worker_iterator(model, strategy, x, "train")
    train_step = _step_function(model, strategy, "train")
    if not isinstance(callbacks, callbacks_module.CallbackList):
        callbacks = callbacks_module.CallbackList(
            callbacks, add_history=True, add_progbar=verbose != 0, verbose=verbose,
            epochs=epochs, steps=steps_per_epoch, model=model)
    model.stop_training = False
    batch_logs = _BatchLogs(model)
    callbacks.on_train_begin()
    # keras.callbacks.BackupAndRestore sets _initial_epoch in on_train_begin.
    initial_epoch = getattr(model, "_initial_epoch", None) or initial_epoch
    training_logs = None
    for epoch in range(initial_epoch, epochs):
        model.reset_metrics()
        batch_logs.reset()
        callbacks.on_epoch_begin(epoch)
        last = None
        for step in range(steps_per_epoch):
            callbacks.on_train_batch_begin(step)
            last = coordinator.schedule(train_step, args=(iterator,))
            batch_logs.scheduled(last)
            callbacks.on_train_batch_end(step, batch_logs.get())
            if model.stop_training:
                break
        coordinator.join()
        epoch_logs = _final_logs(model, last)
        if validation_data is not None and model._should_eval(epoch, validation_freq):
            val_logs = evaluate(model, validation_data, steps=validation_steps,
                                callbacks=callbacks, return_dict=True, _in_fit=True)
            epoch_logs.update({f"val_{k}": v for k, v in val_logs.items()})
        callbacks.on_epoch_end(epoch, epoch_logs)
        training_logs = epoch_logs
        if model.stop_training:
            break
    callbacks.on_train_end(logs=training_logs)
    return model.history


@_translate_errors
def evaluate(model, x=None, y=None, batch_size=None, verbose="auto", sample_weight=None,
             steps=None, callbacks=None, return_dict=False, _in_fit=False, **kwargs):
    """`Model.evaluate` for a model built under a ParameterServerStrategy.

    With `steps`, the coordinator schedules `steps` test steps over the
    workers (the data should `repeat()`). Without `steps`, a finite
    `tf.data.Dataset` is evaluated by the coordinator itself, exactly once
    over its elements (the variables are read from the ps).

    Raises:
      ValueError: no `steps` for a dataset function or an infinite dataset.
    """
    from keras.src import callbacks as callbacks_module

    kwargs.pop("_use_cached_eval_dataset", None)
    if kwargs:
        raise ValueError(f"Arguments not recognized: {kwargs}")
    model._assert_compile_called("evaluate")
    what = "validation_data" if _in_fit else "x"
    _check_data(x, what)
    fix = "Put labels, weights and batching inside the dataset."
    _reject("y", y, None, fix)
    _reject("sample_weight", sample_weight, None, fix)
    _reject("batch_size", batch_size, None, "Batch inside the dataset function.")
    strategy = model.distribute_strategy
    steps_name = "validation_steps" if _in_fit else "steps"
    if steps is None:
        if _is_infinite(x):
            raise ValueError(
                f"{what} is an infinite dataset (it repeats), so evaluation would never end. "
                f"Received: {steps_name}=None. Pass {steps_name}=N to evaluate N batches "
                "spread over the workers, or pass a finite dataset.")
        tf = import_tensorflow()
        if not isinstance(x, tf.data.Dataset):
            raise ValueError(
                f"{steps_name} is required when {what} is a dataset function: the workers "
                "create the data, so the coordinator cannot know where it ends. Received: "
                f"{steps_name}=None. Pass {steps_name}=N (and repeat() the dataset), or a "
                "finite tf.data.Dataset to evaluate on the coordinator.")
        return _on_coordinator(model, "evaluate", x, verbose=verbose, callbacks=callbacks,
                               return_dict=return_dict)
    _check_steps(steps, steps_name, "")

    _build(model, strategy, x)
    coordinator = coordinator_for(strategy)
    iterator = _per_worker_iterator(model, strategy, x, "test")
    test_step = _step_function(model, strategy, "test")
    if not isinstance(callbacks, callbacks_module.CallbackList):
        callbacks = callbacks_module.CallbackList(
            callbacks, add_progbar=verbose != 0, verbose=verbose, epochs=1, steps=steps,
            model=model)
    model.stop_evaluating = False
    batch_logs = _BatchLogs(model)
    callbacks.on_test_begin()
    model.reset_metrics()
    last = None
    for step in range(steps):
        callbacks.on_test_batch_begin(step)
        last = coordinator.schedule(test_step, args=(iterator,))
        batch_logs.scheduled(last)
        callbacks.on_test_batch_end(step, batch_logs.get())
        if model.stop_evaluating:
            break
    coordinator.join()
    logs = _final_logs(model, last)
    callbacks.on_test_end(logs)
    if return_dict:
        return logs
    return model._flatten_metrics_in_order(logs)


def _on_coordinator(model, method: str, *args, **kwargs):
    """Runs Keras's own evaluate/predict on this process (no strategy).

    The ops run here and read the variables from the parameter servers.
    """
    from tfdist.compat import ps_fit

    saved = model._distribute_strategy
    model._distribute_strategy = None
    saved_functions = (model.train_function, model.test_function, model.predict_function)
    model.test_function = model.predict_function = None
    try:
        return ps_fit.original(method)(model, *args, **kwargs)
    finally:
        model._distribute_strategy = saved
        model.train_function, model.test_function, model.predict_function = saved_functions


def predict(model, x, batch_size=None, verbose="auto", steps=None, callbacks=None):
    """`Model.predict` under a ParameterServerStrategy: runs on the coordinator."""
    return _on_coordinator(model, "predict", x, batch_size=batch_size, verbose=verbose,
                           steps=steps, callbacks=callbacks)

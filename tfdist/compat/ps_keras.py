"""The private Keras and TensorFlow members tfdist's parameter-server training reads.

tfdist.ps drives a Keras model the way Keras's own `fit` does, so it needs a
few things Keras and TensorFlow keep private. Each one is behind a small named
function here, which checks that the member still exists and says which
version changed it, so tfdist.ps itself touches only public API:

* Keras `Trainer` members: `_symbolic_build` (build model, loss and metrics
  from a batch spec), `_assert_compile_called`, `_get_metrics_result_or_logs`,
  `_flatten_metrics_in_order`, `_distribute_strategy` (to run Keras's own
  evaluate/predict on the coordinator), `_compile_config` (a new object on
  every `compile()`), `_initial_epoch` (set by `keras.callbacks.BackupAndRestore`);
  `keras.src.utils.python_utils.pythonify_logs`.
* TensorFlow: `ParameterServerStrategy`'s V2 class, the coordinator's
  `PSUnavailableError`, a `RemoteValue`'s status (without blocking on it), and
  `PerWorkerDataset.build()` (the per-worker datasets, not iterators, that exact
  evaluation shards on each worker, as tf_keras does).

Nothing here replaces anything: these are reads.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

from tfdist.compat._patch import CompatError, require_attributes

_TRAINER_MEMBERS = ("_symbolic_build", "_assert_compile_called", "_get_metrics_result_or_logs",
                    "_flatten_metrics_in_order")


def _trainer_class():
    from tfdist._tf import import_tensorflow

    import_tensorflow()
    from keras.src.backend.tensorflow.trainer import TensorFlowTrainer

    return TensorFlowTrainer


def check() -> None:
    """Raises CompatError if a member tfdist.ps reads is missing in this Keras/TensorFlow."""
    require_attributes(_trainer_class(), *_TRAINER_MEMBERS, what="keras TensorFlowTrainer")
    from tensorflow.python.distribute.coordinator import cluster_coordinator, remote_value

    require_attributes(cluster_coordinator, "PSUnavailableError",
                       what="tensorflow cluster_coordinator")
    require_attributes(remote_value.RemoteValueStatus, "NOT_READY",
                       what="tensorflow RemoteValueStatus")


# --- Keras ------------------------------------------------------------------------


def symbolic_build(model: Any, element_spec: Any) -> None:
    """Builds the model, its compiled loss and metrics from one batch's spec (no data read)."""
    model._symbolic_build(data_batch=element_spec)


def assert_compiled(model: Any, method: str) -> None:
    """Raises Keras's own error if `model.compile()` was not called."""
    model._assert_compile_called(method)


def metrics_result_or_logs(model: Any, logs: dict) -> dict:
    """The model's metrics (read from where they live) if `logs` has their keys, else `logs`."""
    return model._get_metrics_result_or_logs(logs)


def flatten_metrics(model: Any, logs: dict) -> Any:
    """`evaluate`'s list form of `logs` (Keras's order of metric names)."""
    return model._flatten_metrics_in_order(logs)


def pythonify(logs: dict | None) -> dict:
    """Logs as Python floats, nested dicts flattened (what Keras hands to callbacks)."""
    from keras.src.utils.python_utils import pythonify_logs

    return pythonify_logs(logs)


def compile_token(model: Any) -> Any:
    """An object that changes on every `model.compile()` (Keras rebuilds its compile config)."""
    return getattr(model, "_compile_config", None)


def restored_initial_epoch(model: Any) -> int | None:
    """The epoch `keras.callbacks.BackupAndRestore` restored in `on_train_begin`, if any."""
    return getattr(model, "_initial_epoch", None)


@contextlib.contextmanager
def without_strategy(model: Any) -> Iterator[None]:
    """Runs Keras's own evaluate/predict on this process: no strategy, fresh step functions.

    The ops run on the coordinator and read the variables from the parameter
    servers; the model's strategy and step functions are put back afterwards.
    """
    saved = model._distribute_strategy
    saved_functions = (model.train_function, model.test_function, model.predict_function)
    model._distribute_strategy = None
    model.test_function = model.predict_function = None
    try:
        yield
    finally:
        model._distribute_strategy = saved
        model.train_function, model.test_function, model.predict_function = saved_functions


# --- TensorFlow ---------------------------------------------------------------------


def is_parameter_server_strategy(strategy: Any) -> bool:
    """True for a `tf.distribute.ParameterServerStrategy` (V2, the one the coordinator drives)."""
    if strategy is None:
        return False
    from tfdist._tf import import_tensorflow

    import_tensorflow()
    from tensorflow.python.distribute import parameter_server_strategy_v2

    return isinstance(strategy, parameter_server_strategy_v2.ParameterServerStrategyV2)


def ps_unavailable_errors() -> tuple[type, ...]:
    """Errors meaning a parameter server (or the whole cluster) is gone."""
    from tfdist._tf import import_tensorflow

    tf = import_tensorflow()
    from tensorflow.python.distribute.coordinator import cluster_coordinator

    return (cluster_coordinator.PSUnavailableError, tf.errors.UnavailableError,
            tf.errors.CancelledError, tf.errors.AbortedError)


def remote_value_done(value: Any) -> bool:
    """True once a scheduled function's RemoteValue finished (or failed); never blocks."""
    from tensorflow.python.distribute.coordinator import remote_value

    status = getattr(value, "_status", None)
    if status is None:
        return True
    return status is not remote_value.RemoteValueStatus.NOT_READY


def per_worker_datasets(coordinator: Any, dataset_or_fn: Any) -> Any:
    """One dataset (not iterator) per worker, as a value `schedule` hands each worker its copy of.

    Raises:
      CompatError: this TensorFlow's per-worker dataset has no `build()`.
    """
    per_worker = coordinator.create_per_worker_dataset(dataset_or_fn)
    build = getattr(per_worker, "build", None)
    if build is None:
        raise CompatError(
            "tf.distribute's PerWorkerDataset has no build() in this TensorFlow version; "
            "tfdist's exactly-once evaluation needs it (see tfdist.compat.SUPPORTED).")
    return build()


def owned_ps_strategy(strategy: Any) -> bool:
    """True for a ParameterServerStrategy made by tfdist (the only kind the PS fixes change)."""
    from tfdist.compat import _owner

    return _owner.owns(strategy) and is_parameter_server_strategy(strategy)


def variant_tensor(dataset: Any) -> Any:
    """The variant tensor behind a tf.data.Dataset (what a Dataset subclass is built on)."""
    value = getattr(dataset, "_variant_tensor", None)
    if value is None:
        raise CompatError(
            "tf.data.Dataset has no _variant_tensor in this TensorFlow version; "
            "tfdist.PerWorkerDataset needs it (see tfdist.compat.SUPPORTED).")
    return value


def optimizer_strategy(optimizer: Any) -> Any:
    """The strategy a Keras (TensorFlow backend) optimizer was created under."""
    return getattr(optimizer, "_distribution_strategy", None)


def num_workers(strategy: Any) -> int:
    """How many workers a ParameterServerStrategy schedules on."""
    return int(strategy.extended._num_workers)

"""The private Keras and TensorFlow members tfdist's parameter-server training reads.

tfdist.ps drives a Keras model the way Keras's own `fit` does, so it needs a
few things Keras and TensorFlow keep private. Each one is behind a small named
function here, which checks that the member still exists and says which
version changed it, so tfdist.ps itself touches only public API:

* Keras `Trainer` members: `_symbolic_build` (build model, loss and metrics
  from a batch spec), `_assert_compile_called`, `_get_metrics_result_or_logs`,
  `_flatten_metrics_in_order`, `_distribute_strategy` (to run Keras's own
  evaluate/predict on the coordinator, with TensorFlow's per-thread strategy
  stack `Graph._distribution_strategy_stack` set aside), `_compile_config` (a new object on
  every `compile()`), `_initial_epoch` (set by `keras.callbacks.BackupAndRestore`);
  `keras.src.utils.python_utils.pythonify_logs`; Keras's data adapters
  (`EpochIterator`, `ArrayDataAdapter`, `can_convert_arrays`,
  `make_class_weight_map_fn`, `train_validation_split`), so arrays, a
  `PyDataset` and `class_weight` are read exactly as Keras reads them.
* TensorFlow: `ParameterServerStrategy`'s V2 class, the coordinator's
  `PSUnavailableError`, and `PerWorkerDataset.build()` (the per-worker
  datasets, not iterators, that exact evaluation shards on each worker, as
  tf_keras does).

Nothing here replaces anything for good: these are reads, and
`without_strategy` sets a model's strategy, step functions and `jit_compile`
(and this thread's strategy scope) aside for one call and puts them back.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Iterator

from tfdist.compat._patch import CompatError, require_attributes, upstream

# model -> (compile token, test function, predict function) that Keras built for the
# coordinator (see without_strategy).
_coordinator_functions: "weakref.WeakKeyDictionary[Any, tuple]" = weakref.WeakKeyDictionary()

_TRAINER_MEMBERS = ("_symbolic_build", "_assert_compile_called", "_get_metrics_result_or_logs",
                    "_flatten_metrics_in_order")


def _trainer_class():
    return upstream("keras.src.backend.tensorflow.trainer.TensorFlowTrainer")


def check() -> None:
    """Raises CompatError if a member tfdist.ps reads is missing in this Keras/TensorFlow."""
    require_attributes(_trainer_class(), *_TRAINER_MEMBERS, what="keras TensorFlowTrainer")
    from tensorflow.python.framework import ops

    require_attributes(ops.Graph, "_distribution_strategy_stack", what="tensorflow Graph")
    check_data_adapters()
    from tensorflow.python.distribute.coordinator import cluster_coordinator

    require_attributes(cluster_coordinator, "PSUnavailableError",
                       what="tensorflow cluster_coordinator")


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
    """Runs Keras's own evaluate/predict here: no strategy, no XLA, the coordinator's functions.

    The ops run on the coordinator and read the variables from the parameter
    servers. Three things Keras would otherwise take from the strategy are
    set aside for the block and put back afterwards:

    * the model's strategy, and this thread's `strategy.scope()` if the
      caller is inside it (keras.io's guides call `evaluate`/`predict` there;
      Keras then asks `tf.distribute.get_strategy()`, which would be the
      parameter-server strategy, for the dataset: "you need to pass this
      dataset to ClusterCoordinator.create_per_worker_dataset");
    * `jit_compile`: XLA cannot read a variable on another task ("Trying to
      access resource ... located in device /job:ps/...");
    * the step functions: the coordinator's own test/predict functions are
      kept per compile, apart from the workers'.
    """
    from tensorflow.python.framework import ops

    graph = ops.get_default_graph()
    saved_stack = graph._distribution_strategy_stack
    saved = model._distribute_strategy
    saved_functions = (model.train_function, model.test_function, model.predict_function)
    saved_jit = model.jit_compile
    token = compile_token(model)
    cached = _coordinator_functions.get(model)
    model.test_function, model.predict_function = (
        cached[1:] if cached is not None and cached[0] is token else (None, None))
    model._distribute_strategy = None
    model.jit_compile = False
    if saved_stack and saved_stack[-1].strategy is saved:
        graph._distribution_strategy_stack = []
    try:
        yield
    finally:
        graph._distribution_strategy_stack = saved_stack
        _coordinator_functions[model] = (token, model.test_function, model.predict_function)
        model._distribute_strategy = saved
        model.jit_compile = saved_jit
        model.train_function, model.test_function, model.predict_function = saved_functions


# --- Keras's data adapters --------------------------------------------------------


def _adapters():
    from tfdist._tf import import_tensorflow

    import_tensorflow()
    from keras.src.trainers import data_adapters, epoch_iterator
    from keras.src.trainers.data_adapters import (
        array_data_adapter,
        array_slicing,
        tf_dataset_adapter,
    )

    return data_adapters, epoch_iterator, array_data_adapter, array_slicing, tf_dataset_adapter


def check_data_adapters() -> None:
    """Raises CompatError if Keras's data adapters lack what tfdist.ps.data reads."""
    _, epoch_iterator, array_data_adapter, array_slicing, tf_dataset_adapter = _adapters()
    require_attributes(epoch_iterator, "EpochIterator", what="keras epoch_iterator")
    require_attributes(epoch_iterator.EpochIterator, "enumerate_epoch", "reset", "num_batches",
                       what="keras EpochIterator")
    require_attributes(array_data_adapter, "ArrayDataAdapter", "can_convert_arrays",
                       what="keras array_data_adapter")
    require_attributes(array_slicing, "train_validation_split", what="keras array_slicing")
    require_attributes(tf_dataset_adapter, "make_class_weight_map_fn",
                       what="keras tf_dataset_adapter")


def epoch_iterator(**kwargs) -> Any:
    """Keras's own `EpochIterator` (NumPy batches, an epoch at a time) over fit's data arguments."""
    return _adapters()[1].EpochIterator(**kwargs)


def is_arrays(x: Any, y: Any = None, sample_weight: Any = None) -> bool:
    """True for what Keras's `ArrayDataAdapter` reads (NumPy arrays, tensors, nests of them)."""
    return _adapters()[2].can_convert_arrays((x, y, sample_weight))


def is_array_adapter(adapter: Any) -> bool:
    return isinstance(adapter, _adapters()[2].ArrayDataAdapter)


def class_weight_map_fn(class_weight: dict) -> Any:
    """Keras's `Dataset.map` function turning `class_weight` into sample weights."""
    return _adapters()[4].make_class_weight_map_fn(class_weight)


def train_validation_split(arrays: Any, validation_split: float) -> tuple:
    """Keras's split of arrays: the last `validation_split` of them become validation data."""
    return _adapters()[3].train_validation_split(arrays, validation_split=validation_split)


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


def iterators_over(coordinator: Any, datasets: Any, dataset: Any) -> Any:
    """A new iterator on every worker over its dataset in `datasets` (from `per_worker_datasets`).

    What `iter()` of a per-worker dataset does (TensorFlow's
    `PerWorkerDatasetFromDatasetFunction.__iter__`), over the datasets already
    on the workers instead of new copies: as `iter()` again on one
    tf.data.Dataset, a `shuffle()` then draws its next order (its seed
    generator belongs to the dataset), where a new copy repeats its first.
    `dataset` is the coordinator's copy (for the iterators' type spec).

    Raises:
      CompatError: a member this reads is missing in this TensorFlow.
    """
    from tensorflow.python.distribute import input_lib
    from tensorflow.python.distribute.coordinator import values as coordinator_values

    require_attributes(coordinator, "_create_per_worker_resources", what="ClusterCoordinator")
    require_attributes(coordinator_values, "PerWorkerDistributedIterator",
                       what="tensorflow coordinator values")
    require_attributes(input_lib, "get_iterator_spec_from_dataset", what="tensorflow input_lib")
    per_worker = coordinator._create_per_worker_resources(iter, args=(datasets,))
    spec = input_lib.get_iterator_spec_from_dataset(coordinator.strategy, dataset)
    for value in per_worker._values:
        value._type_spec = spec
    return coordinator_values.PerWorkerDistributedIterator(per_worker._values)


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

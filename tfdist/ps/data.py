"""Input for parameter-server training: what each worker reads.

Under parameter-server training the coordinator schedules steps; the data
come from one of two places:

* **per-worker datasets** (the workers read their own copy; nothing goes
  through the coordinator):
  - `fn(input_context) -> tf.data.Dataset`, called on every worker, as in
    TensorFlow's tutorial (every worker gets the same `input_context`:
    TensorFlow gives each worker one input pipeline of its own);
  - a `tf.data.Dataset`, copied to every worker (each iterates its own copy
    from the start);
  - a `PerWorkerDataset(fn)`: the function route wrapped in a
    `tf.data.Dataset`, for models whose own `fit` accepts only datasets
    (KerasHub task models preprocess in `fit` and reject a bare function). It
    is a real dataset on the coordinator (built from
    `fn(tf.distribute.InputContext())`, so code that inspects or maps it
    works), and every transformation applied to it (`map`, `batch`,
    `prefetch`, ...) is recorded, so each worker runs `fn(its input_context)`
    followed by the same transformations;
  - NumPy arrays (and tensors, nests of them), batched and shuffled by
    Keras's own array adapter into a dataset each worker gets a copy of.
* **batches read on the coordinator** (`CoordinatorFeed`): a
  `keras.utils.PyDataset` or a Python generator is Python code that only this
  process can run, so Keras's own adapter reads it here, one batch per step,
  and each step carries its batch to the worker that runs it. So do arrays
  too large to copy to every worker inside a dataset's graph (TensorFlow
  serializes a dataset as a GraphDef, at most 2 GB).

`training_data` turns fit's arguments into one of these; `class_weight`
becomes sample weights the way Keras computes them (a dataset map, or
Keras's adapters). `for_workers` is what ClusterCoordinator takes for a
per-worker dataset; it also covers a dataset function that captured a
dataset built outside it.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable, Iterator

from tfdist._tf import import_tensorflow

DatasetFn = Callable[[Any], Any]

# tf.data.Dataset methods that return a transformed dataset; PerWorkerDataset
# records each of them.
_TRANSFORMATIONS = (
    "apply", "batch", "bucket_by_sequence_length", "cache", "enumerate", "filter",
    "flat_map", "group_by_window", "ignore_errors", "interleave", "map", "padded_batch",
    "prefetch", "ragged_batch", "rebatch", "rejection_resample", "repeat", "scan", "shard",
    "shuffle", "skip", "snapshot", "sparse_batch", "take", "take_while", "unbatch",
    "unique", "window", "with_options",
)

# Arrays up to this many bytes are copied to every worker inside a dataset's graph;
# larger ones are read on the coordinator and sent with each step.
ARRAY_BYTES_PER_WORKER_COPY = 1 << 30

logger = logging.getLogger("tfdist")

tf = import_tensorflow()


class PerWorkerDataset(tf.data.Dataset):
    """A `tf.data.Dataset` that each parameter-server worker creates from `dataset_fn`.

    Use it where a model's own `fit`/`evaluate` accepts only datasets
    (KerasHub task models): they pass it through (and map their preprocessing
    over it), and tfdist runs `dataset_fn(input_context)` followed by the same
    transformations on every worker. Elsewhere it works like `dataset_fn`.

    Args:
      dataset_fn: `fn(input_context) -> tf.data.Dataset`, called on every
        worker with that worker's `tf.distribute.InputContext` (and once here,
        with a default InputContext, for the coordinator's copy).

    Raises:
      ValueError: `dataset_fn` is not a function returning a tf.data.Dataset.

    Example:
      >>> def dataset_fn(ctx):
      ...     ds = tf.data.Dataset.from_tensor_slices((x, y)).repeat()
      ...     return ds.shard(ctx.num_input_pipelines, ctx.input_pipeline_id).batch(64)
      >>> task_model.fit(tfdist.PerWorkerDataset(dataset_fn), steps_per_epoch=100)
    """

    def __init__(self, dataset_fn: DatasetFn, *, _local=None):
        if not callable(dataset_fn) or isinstance(dataset_fn, tf.data.Dataset):
            raise ValueError(
                "PerWorkerDataset takes a function `fn(input_context) -> tf.data.Dataset`. "
                f"Received: {type(dataset_fn).__name__}. A dataset you already have can be "
                "passed to fit directly (each worker then reads its own copy of it).")
        local = _local if _local is not None else _call(dataset_fn, tf.distribute.InputContext())
        self._dataset_fn = dataset_fn
        self._local = local
        from tfdist.compat import ps_keras

        super().__init__(ps_keras.variant_tensor(local))

    def _inputs(self):
        return [self._local]

    @property
    def element_spec(self):
        return self._local.element_spec

    def create(self, input_context) -> Any:
        """The dataset one worker reads (runs on that worker)."""
        return self._dataset_fn(input_context)

    def _derive(self, name: str, args: tuple, kwargs: dict):
        fn = self._dataset_fn
        local = getattr(self._local, name)(*args, **kwargs)
        if not isinstance(local, tf.data.Dataset):
            return local
        return PerWorkerDataset(lambda ctx: getattr(fn(ctx), name)(*args, **kwargs),
                                _local=local)

    def __repr__(self):
        name = getattr(self._dataset_fn, "__name__", type(self._dataset_fn).__name__)
        return f"<PerWorkerDataset of {name}, element_spec={self.element_spec}>"


def _recorder(name: str):
    def method(self, *args, **kwargs):
        return self._derive(name, args, kwargs)

    method.__name__ = method.__qualname__ = name
    method.__doc__ = (f"`tf.data.Dataset.{name}`, applied on every worker after `dataset_fn` "
                      "(and here, to the coordinator's copy).")
    return method


for _name in _TRANSFORMATIONS:
    if hasattr(tf.data.Dataset, _name):
        setattr(PerWorkerDataset, _name, _recorder(_name))
del _name


def is_per_worker_dataset(x: Any) -> bool:
    return isinstance(x, PerWorkerDataset)


def _call(dataset_fn: DatasetFn, input_context) -> Any:
    dataset = dataset_fn(input_context)
    if not isinstance(dataset, tf.data.Dataset):
        raise ValueError(
            "The dataset function must return a tf.data.Dataset. Received: "
            f"{type(dataset).__name__} from {getattr(dataset_fn, '__name__', dataset_fn)!r}.")
    return dataset


def is_dataset_like(x: Any) -> bool:
    """A function, `tf.data.Dataset` or PerWorkerDataset: read by every worker itself."""
    return isinstance(x, tf.data.Dataset) or (callable(x) and not hasattr(x, "shape"))


def dataset_fn_of(x: Any) -> DatasetFn | None:
    """The per-worker function behind `x` (None for a plain tf.data.Dataset, arrays, a feed)."""
    if is_epoch_dataset(x):
        x = x.dataset
    if is_per_worker_dataset(x):
        return x.create
    if isinstance(x, tf.data.Dataset) or not is_dataset_like(x):
        return None
    return x


def worker_input_context(strategy) -> Any:
    """The InputContext every worker's `fn(input_context)` gets under ParameterServerStrategy."""
    return tf.distribute.InputContext(num_input_pipelines=1, input_pipeline_id=0,
                                      num_replicas_in_sync=strategy.num_replicas_in_sync)


def on_coordinator(x: Any) -> Any:
    """What one worker's dataset looks like, built here (nothing is read)."""
    if isinstance(x, tf.data.Dataset):
        return x
    return _call(x, tf.distribute.InputContext())


def element_spec(x: Any) -> Any:
    """One batch's spec, computed on the coordinator (nothing is read)."""
    if is_coordinator_feed(x):
        return x.element_spec
    if is_epoch_dataset(x):
        x = x.dataset
    return on_coordinator(x).element_spec


def is_infinite(x: Any) -> bool:
    """True if each worker's copy of `x` repeats forever."""
    return int(on_coordinator(x).cardinality()) == int(tf.data.INFINITE_CARDINALITY)


# --- what ClusterCoordinator.create_per_worker_dataset takes -------------------------


def for_workers(x: Any, strategy, *, whole: bool = False) -> Any:
    """What `ClusterCoordinator.create_per_worker_dataset` takes for per-worker input `x`.

    A dataset is copied to the workers as it is. A function is traced into a
    `tf.function` each worker runs (`strategy.distribute_datasets_from_function`,
    or with `whole`, the function itself with a single-pipeline InputContext:
    the whole set, which exact evaluation shards itself). A function that
    uses a dataset built outside it (`lambda ctx: ds.repeat()`) captures that
    dataset's handle, which exists only in this process and cannot be sent
    to a worker (TensorFlow: "Unable to parse tensor proto"); since every
    worker calls the function with the same InputContext, calling it here
    once and copying the dataset it returns to every worker is the same
    input, and that is what happens then.
    """
    if is_epoch_dataset(x):
        x = x.dataset
    fn = dataset_fn_of(x)
    if fn is None:
        return x
    context = (tf.distribute.InputContext() if whole else worker_input_context(strategy))
    if whole:
        traced = tf.function(lambda: fn(context))
    else:
        traced = tf.function(lambda: strategy.distribute_datasets_from_function(fn))
    if _captures_a_dataset(traced):
        logger.info(
            "tfdist: the dataset function %r uses a tf.data.Dataset built outside it; it is "
            "called once on the coordinator and the dataset it returns is copied to every "
            "worker (the same input: every worker gets the same InputContext).",
            getattr(fn, "__name__", fn))
        return _call(fn, context)
    return traced


def _captures_a_dataset(traced) -> bool:
    def no_variables(next_creator, **kwargs):
        raise ValueError("Creating variables in a dataset function is not allowed. Received: a "
                         f"variable {kwargs.get('name')!r} created while tracing it.")

    with tf.variable_creator_scope(no_variables):
        concrete = traced.get_concrete_function()
    return any(t.dtype == tf.variant for t in concrete.graph.external_captures)


# --- batches read on the coordinator -------------------------------------------------


class CoordinatorFeed:
    """Batches Keras's own data adapter reads on the coordinator, one per scheduled step.

    For input that only this process can read: a `keras.utils.PyDataset`
    (its `__getitem__`, workers and `on_epoch_end` run here, as in Keras's
    own `fit`), a Python generator, or arrays too large to copy into every
    worker's dataset. Each step carries its batch to the worker that runs it.

    Args:
      epochs: a Keras `EpochIterator` over the data (see `training_data`).
    """

    def __init__(self, epochs):
        self._epochs = epochs
        self.element_spec = epochs.data_adapter.get_tf_dataset().element_spec

    @property
    def steps_per_epoch(self) -> int | None:
        """Steps in one epoch (None: a generator without length, which ends by itself)."""
        return self._epochs.num_batches

    def epoch(self) -> Iterator[Any]:
        """This epoch's batches as tensors (Keras's epoch: steps_per_epoch, or one pass)."""
        import keras

        for _, _, batches in self._epochs.enumerate_epoch():
            for batch in batches:
                yield keras.tree.map_structure(tf.convert_to_tensor, batch)

    def close(self) -> None:
        """Ends the adapter's epoch (stops a PyDataset's workers), as Keras's fit does."""
        self._epochs.reset()


def is_coordinator_feed(x: Any) -> bool:
    return isinstance(x, CoordinatorFeed)


@dataclasses.dataclass(frozen=True, eq=False)
class EpochDataset:
    """A finite dataset that the workers read in passes, each from its start, as Keras does.

    Keras's own `fit` reads finite data with a new iterator of the same
    Dataset for every pass, so what a new iterator does is what a pass does:
    a `Dataset.shuffle` draws its next order, and Keras's array adapter, whose
    permutation comes from a random op inside the dataset, gives the same
    order every pass when a global seed is set. The dataset is copied to the
    workers once; each pass every worker starts a new iterator over its copy
    (a repeated dataset would run those random ops on, not restart them). A
    pass is `pass_steps` steps of all workers together, so no worker runs out
    (see `CoordinatorTrainer`).

    Without `steps_per_epoch` (`epoch_is_pass`) Keras starts a new iterator at
    the start of every epoch and also when a pass ends, so each epoch after the
    first draws the shuffle's next order but one; with `steps_per_epoch` an
    epoch continues the iterator the last one left, and a new one starts only
    when a pass ends.
    """

    dataset: Any
    pass_steps: int
    epoch_is_pass: bool = False


def is_epoch_dataset(x: Any) -> bool:
    return isinstance(x, EpochDataset)


# --- fit's data arguments --------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TrainingData:
    """What `fit`'s data arguments become.

    Attributes:
      source: what `CoordinatorTrainer.train` reads: a function, Dataset,
        PerWorkerDataset or `EpochDataset` (each worker reads its own copy),
        or a `CoordinatorFeed`.
      steps_per_epoch: steps per epoch; None only for a feed that ends by itself.
    """

    source: Any
    steps_per_epoch: int | None


def training_data(x: Any, *, y=None, sample_weight=None, batch_size=None, shuffle=True,
                  class_weight=None, steps_per_epoch=None) -> TrainingData:
    """Turns `fit`'s data arguments into what the workers read.

    Per-worker input (a function, Dataset, PerWorkerDataset) is used as it is,
    with `class_weight` mapped over it, except that a finite dataset becomes
    an `EpochDataset`, read in passes as Keras reads it (an epoch is one pass
    without `steps_per_epoch`). Arrays go through Keras's own array adapter
    (batching, shuffling, sample and class weights) into an `EpochDataset`; a
    PyDataset or generator through Keras's adapter on the coordinator
    (`CoordinatorFeed`).

    Raises:
      ValueError: arguments a form does not take (`y`, `sample_weight`,
        `batch_size` with per-worker input), or no way to know where an epoch
        ends (`steps_per_epoch` missing for a dataset function or a dataset
        that repeats or has unknown length).
    """
    if is_dataset_like(x):
        fix = "Put labels, weights and batching inside the dataset."
        for name, value in (("y", y), ("sample_weight", sample_weight),
                            ("batch_size", batch_size)):
            if value is not None:
                raise ValueError(
                    f"fit under ParameterServerStrategy does not take {name} when x is a "
                    f"dataset or a dataset function. Received: {name}={value!r}. {fix}")
        if class_weight is not None:
            x = with_class_weight(x, class_weight)
        passes = _in_passes(x, steps_per_epoch)
        return TrainingData(passes or x, steps_per_epoch or passes.pass_steps)
    from tfdist.compat import ps_keras

    epochs = _keras_epochs(x, y=y, sample_weight=sample_weight, batch_size=batch_size,
                           steps_per_epoch=steps_per_epoch, shuffle=shuffle,
                           class_weight=class_weight)
    adapter = epochs.data_adapter
    if (ps_keras.is_array_adapter(adapter)
            and _nbytes((x, y, sample_weight)) <= ARRAY_BYTES_PER_WORKER_COPY):
        # Keras's dataset for one pass (batched, shuffled), read in passes as Keras does.
        passes = EpochDataset(adapter.get_tf_dataset(), adapter.num_batches,
                              epoch_is_pass=steps_per_epoch is None)
        return TrainingData(passes, steps_per_epoch or passes.pass_steps)
    feed = CoordinatorFeed(epochs)
    return TrainingData(feed, feed.steps_per_epoch)


def evaluation_dataset(x: Any, y=None, sample_weight=None, batch_size=None) -> Any:
    """Arrays as the finite, unshuffled dataset Keras's own evaluate would read."""
    epochs = _keras_epochs(x, y=y, sample_weight=sample_weight, batch_size=batch_size,
                           steps_per_epoch=None, shuffle=False, class_weight=None)
    return epochs.data_adapter.get_tf_dataset()


def _keras_epochs(x, **kwargs):
    from tfdist.compat import ps_keras

    try:
        return ps_keras.epoch_iterator(x=x, **kwargs)
    except ValueError as e:
        if "Unrecognized data type" not in str(e):
            raise
        raise ValueError(
            "Under ParameterServerStrategy, x must be a function `fn(input_context) -> "
            "tf.data.Dataset` (called on every worker), a tf.data.Dataset, "
            "tfdist.PerWorkerDataset(fn), NumPy arrays or tensors (with y), or a "
            f"keras.utils.PyDataset. Received: x of type {type(x).__name__}.") from e


def _in_passes(x, steps_per_epoch) -> EpochDataset | None:
    """A finite dataset as an EpochDataset (None: x is used as it is, steps_per_epoch given)."""
    if dataset_fn_of(x) is not None and not is_per_worker_dataset(x):
        if steps_per_epoch is None:
            raise ValueError(
                "steps_per_epoch is required under ParameterServerStrategy when x is a "
                "dataset function. Received: steps_per_epoch=None. The coordinator schedules "
                "steps on the workers without seeing their data, so it cannot know where an "
                "epoch ends: pass steps_per_epoch=N (and make the dataset repeat(), so no "
                "worker runs out).")
        return None
    cardinality = int(on_coordinator(x).cardinality())
    if cardinality > 0:
        return EpochDataset(x, cardinality, epoch_is_pass=steps_per_epoch is None)
    if steps_per_epoch is not None:
        return None
    if cardinality == int(tf.data.INFINITE_CARDINALITY):
        raise ValueError(
            "steps_per_epoch is required under ParameterServerStrategy when x repeats "
            "forever. Received: steps_per_epoch=None with an infinite dataset. Pass "
            "steps_per_epoch=N.")
    raise ValueError(
        "steps_per_epoch is required under ParameterServerStrategy when the number of "
        "batches in x is unknown (a filter(), flat_map() or from_generator() hides it). "
        f"Received: steps_per_epoch=None, x.cardinality()={cardinality}. Pass "
        "steps_per_epoch=N (and make the dataset repeat(), so no worker runs out), or "
        "x.apply(tf.data.experimental.assert_cardinality(N)).")


def with_class_weight(x: Any, class_weight: dict) -> Any:
    """`x` with Keras's class-weight map applied (on every worker, for a function)."""
    from tfdist.compat import ps_keras

    map_fn = ps_keras.class_weight_map_fn(class_weight)
    if isinstance(x, tf.data.Dataset):  # PerWorkerDataset records it
        return x.map(map_fn)

    def weighted(input_context):
        return _call(x, input_context).map(map_fn)

    weighted.__name__ = getattr(x, "__name__", "dataset_fn")
    return weighted


def _nbytes(arrays) -> int:
    import keras

    total = 0
    for a in keras.tree.flatten(arrays):
        if a is None:
            continue
        if hasattr(a, "nbytes"):
            total += int(a.nbytes)
        elif hasattr(a, "shape") and hasattr(a, "dtype"):
            total += int(tf.TensorShape(a.shape).num_elements() or 0) * tf.as_dtype(a.dtype).size
    return total

"""Input for parameter-server training: what each worker reads.

Under parameter-server training the coordinator never reads data: every
worker creates its own copy of the input and the coordinator only schedules
steps. Three kinds of input are accepted:

* `fn(input_context) -> tf.data.Dataset`, called on every worker (shard with
  `input_context.input_pipeline_id`), as in TensorFlow's tutorial;
* a `tf.data.Dataset`, copied to every worker (each iterates its own copy from
  the start);
* a `PerWorkerDataset(fn)`: the function route wrapped in a `tf.data.Dataset`,
  for models whose own `fit` accepts only datasets (KerasHub task models
  preprocess in `fit` and reject a bare function). It is a real dataset on the
  coordinator (built from `fn(tf.distribute.InputContext())`, so code that
  inspects or maps it works), and every transformation applied to it
  (`map`, `batch`, `prefetch`, ...) is recorded, so each worker runs
  `fn(its input_context)` followed by the same transformations.
"""

from __future__ import annotations

from typing import Any, Callable

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


def check_data(x: Any, what: str) -> None:
    """Raises ValueError unless `x` is input parameter-server training can use."""
    if isinstance(x, tf.data.Dataset) or (callable(x) and not hasattr(x, "shape")):
        return
    raise ValueError(
        f"Under ParameterServerStrategy, {what} must be a function "
        "`fn(input_context) -> tf.data.Dataset` (called on every worker), a "
        f"tf.data.Dataset, or tfdist.PerWorkerDataset(fn). Received: {what} of type "
        f"{type(x).__name__}. For arrays use `lambda ctx: tf.data.Dataset."
        "from_tensor_slices((x, y)).shuffle(n).repeat()"
        ".batch(ctx.get_per_replica_batch_size(global_batch_size))`.")


def dataset_fn_of(x: Any) -> DatasetFn | None:
    """The per-worker function behind `x` (None for a plain tf.data.Dataset)."""
    if is_per_worker_dataset(x):
        return x.create
    if isinstance(x, tf.data.Dataset):
        return None
    return x


def on_coordinator(x: Any) -> Any:
    """What one worker's dataset looks like, built here (nothing is read)."""
    if isinstance(x, tf.data.Dataset):
        return x
    return _call(x, tf.distribute.InputContext())


def element_spec(x: Any) -> Any:
    """One batch's spec, computed on the coordinator (nothing is read)."""
    return on_coordinator(x).element_spec


def is_infinite(x: Any) -> bool:
    """True if each worker's copy of `x` repeats forever."""
    return int(on_coordinator(x).cardinality()) == int(tf.data.INFINITE_CARDINALITY)

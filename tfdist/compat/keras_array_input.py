"""NumPy input to a multi-worker `fit`: one order on every worker, each reading only its share.

Keras 3's `ArrayDataAdapter.get_tf_dataset` (what `fit`, `evaluate` and
`predict` use for NumPy arrays and tensors on the TensorFlow backend) builds a
dataset of global batches: a pipeline of example indices (`tf.range`, drawn
into an order with `tf.random.shuffle` when shuffling, cut into batches),
each batch gathered from the whole arrays with `tf.gather`, and the DATA
auto-shard policy. Under MultiWorkerMirroredStrategy every worker runs that
whole pipeline; `experimental_distribute_dataset` cuts each global batch into
its replicas' pieces and each worker keeps its own. Two defects follow:

- Order. The shares only partition the data if every worker draws the same
  order. Without a global seed each process draws its own: with 2 workers, 32
  examples and a global batch of 8, one epoch trained 9 examples twice and 9
  never. Keras's own multi-process input (`keras.distribution`,
  keras-team/keras#23043 and #23046) seeds the order by epoch; its path under
  a `tf.distribute` strategy does not.
- Cost. Every worker gathers every worker's rows: N times what it trains on.
  Measured (the same DATA split in one process on one core, 64 examples of
  32x32x16 float32 per worker): 0.62 ms per step at 1 worker, 1.97 at 4, 10.74
  at 16.

The fix, for the epoch iterators (`TFEpochIterator`) of a strategy tfdist made
that spans several workers, over Keras's array adapter with dense inputs:
- Keras's own pipeline runs over the example indices alone (the adapter's
  inputs replaced by `np.arange`), so the index batches come in Keras's order
  with Keras's partial last batch. When it shuffles in a process that set no
  global seed, the workers first agree on a seed (each draws a random number
  and one all-reduce sums them), and the pipeline is built with that as
  TensorFlow's global seed, unset right after; nothing else is seeded.
- Each worker's dataset (`distribute_datasets_from_function`) cuts the index
  batches the way `experimental_distribute_dataset` and DATA sharding cut the
  data (TensorFlow's own rebatch: by `batch_sizes_for_worker` where the batch
  size is static, else its legacy even split, whose partial last batch goes
  to every worker; then `shard(workers, worker)`), and gathers only those
  rows.
So every step trains the examples Keras's path would put there (the same,
bit for bit, in a seeded process or without shuffling), and a worker gathers
1/N of the rows. With an agreed seed, each later pass (the next epoch) is
built again under a new one: a new order every epoch, the same on every
worker, each example trained once per epoch. Passes straight through for
other strategies, one worker, other inputs, and inputs other than dense
arrays and tensors (sparse, ragged: there only the order is agreed). Undone
by `tfdist.compat.uninstall()`.

Canary: tests/compat/test_array_input.py trains 2 workers with the fix and
without it (the stock path): without it the workers' shuffled examples
overlap and each gathers the whole global batch; with it every example is
trained once per epoch, in the steps Keras would use when nothing is
shuffled, and each worker gathers half the global batch.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import secrets
import threading

from tfdist.compat import _patch, keras_epoch_iterator, keras_multi_worker

UPSTREAM_ISSUE = ("keras-team/keras#23043 and #23046 (keras.distribution's array input seeded "
                  "by epoch; under a tf.distribute strategy Keras draws each worker's order "
                  "unseeded, and each worker gathers every worker's rows: DATA auto-shard)")
# On an epoch iterator whose dataset this fix built with an agreed seed: True once its first
# pass has begun (each later pass is built again under a new agreed seed).
_SHARED = "_tfdist_shared_shuffle"
_building = threading.local()  # the strategy whose epoch iterator is building its dataset

_array_adapter_class = keras_epoch_iterator._array_adapter_class
_tf_epoch_iterator_class = keras_epoch_iterator._tf_epoch_iterator_class


def _unseeded() -> bool:
    """True if this process set no TensorFlow global seed (every op draws its own)."""
    from tensorflow.python.eager import context

    return context.global_seed() is None


def _agreed_seed(strategy) -> int:
    """A seed every worker of `strategy` gets the same: the sum of one draw per worker."""
    from tfdist._tf import import_tensorflow

    tf = import_tensorflow()
    mine = secrets.randbelow(2 ** 30)
    total = strategy.reduce("SUM", strategy.run(lambda: tf.constant(mine, tf.int64)), axis=None)
    return int(total.numpy()) % (2 ** 31 - 1) + 1


@contextlib.contextmanager
def _global_seed(seed: int):
    from tfdist._tf import import_tensorflow

    tf = import_tensorflow()
    tf.random.set_seed(seed)
    try:
        yield
    finally:
        tf.random.set_seed(None)


# --- ArrayDataAdapter.get_tf_dataset: each worker's share of Keras's order ---------------


def _check_dataset(original) -> None:
    _patch.require_signature(original, what="ArrayDataAdapter.get_tf_dataset")
    source = inspect.getsource(inspect.unwrap(original))
    for needed in ("tf.random.shuffle", "tf.gather", "self._inputs", "AutoShardPolicy.DATA"):
        if needed not in source:
            raise _patch.CompatError(
                f"ArrayDataAdapter.get_tf_dataset no longer uses {needed}; the tfdist fix that "
                "splits it between workers was written for Keras 3.10-3.15, which draw the "
                "order with tf.random.shuffle, gather each batch from self._inputs and shard "
                "by DATA.")
    from tensorflow.python.data.experimental.ops import distribute
    from tensorflow.python.eager import context

    _patch.require_attributes(context, "global_seed", what="tensorflow.python.eager.context")
    _patch.require_attributes(distribute, "batch_sizes_for_worker", "compute_batch_size",
                              "_LegacyRebatchDataset",
                              what="tensorflow.python.data.experimental.ops.distribute")
    _patch.require_attributes(_array_slicing(), "convert_to_sliceable",
                              what="keras.src.trainers.data_adapters.array_slicing")


def _distributed_dataset_class():
    from tfdist._tf import import_tensorflow

    return import_tensorflow().distribute.DistributedDataset


def _array_slicing():
    return _patch.upstream("keras.src.trainers.data_adapters.array_slicing")


def _dataset_applies(self) -> bool:
    return getattr(_building, "strategy", None) is not None


def _dense_inputs(self):
    """The adapter's inputs as Keras hands them to tf.data (NumPy arrays, tensors; tuples
    for lists), or None if any is neither a NumPy array nor a dense tensor (sparse, ragged:
    Keras's own code gathers those)."""
    import numpy as np
    from keras import tree

    from tfdist._tf import import_tensorflow

    tf = import_tensorflow()
    inputs = tree.lists_to_tuples(_array_slicing().convert_to_sliceable(
        self._inputs, target_backend="tensorflow"))
    leaves = [x for x in tree.flatten(inputs) if x is not None]  # None: no sample weights
    if not leaves or not all(
            isinstance(x, np.ndarray) or (tf.is_tensor(x) and not isinstance(
                x, (tf.SparseTensor, tf.RaggedTensor))) for x in leaves):
        return None
    return inputs


def _index_batches(original, adapter):
    """Keras's own dataset for `adapter` over the example indices alone: its order, its
    batches, its partial last batch (`original` is Keras's get_tf_dataset)."""
    import numpy as np

    indices_only = copy.copy(adapter)
    indices_only._inputs = np.arange(adapter._num_samples, dtype="int64")
    return original(indices_only)


def _rebatched(batches, workers: int, worker: int, replicas: int):
    """`batches` cut as input_lib's rebatch_fn cuts them for `worker` of `workers` with
    `replicas` in sync: by batch_sizes_for_worker where the batch size is static (no partial
    batch), else the legacy rebatch into `replicas` pieces of ceil(batch / replicas)."""
    from tensorflow.python.data.experimental.ops import distribute

    static_batch = int(distribute.compute_batch_size(batches))
    if static_batch != -1:
        return batches.rebatch(distribute.batch_sizes_for_worker(
            static_batch, workers, replicas // workers, worker))
    return distribute._LegacyRebatchDataset(batches, replicas)


def _split(batches, workers: int, worker: int, replicas: int):
    """What `experimental_distribute_dataset` under DATA sharding gives `worker` of
    `batches`: the rebatched pieces, then every `workers`-th from `worker`."""
    return _rebatched(batches, workers, worker, replicas).shard(workers, worker)


def _gathered(index_batches, inputs):
    """The rows of `inputs` (as Keras hands them to tf.data) at each batch of indices."""
    from keras import tree

    from tfdist._tf import import_tensorflow

    tf = import_tensorflow()

    def gather(indices, data):
        return tree.map_structure(
            lambda x: None if x is None else tf.gather(x, indices, axis=0), data)

    # As Keras does: the arrays enter the pipeline once, zipped with the index batches.
    dataset = tf.data.Dataset.zip((index_batches, tf.data.Dataset.from_tensors(inputs).repeat()))
    # No auto-shard option is set: distribute_datasets_from_function shards nothing itself
    # (and changing the DATA option Keras's index pipeline carries logs a warning).
    return dataset.map(gather, num_parallel_calls=tf.data.AUTOTUNE).prefetch(tf.data.AUTOTUNE)


def _per_worker_dataset(original, adapter, inputs, strategy):
    """`strategy`'s distributed dataset of `adapter`'s batches, each worker gathering only
    the rows that TensorFlow's DATA sharding of Keras's dataset gives its replicas."""
    index_batches = _index_batches(original, adapter)

    def dataset_fn(context):
        mine = _split(index_batches, context.num_input_pipelines, context.input_pipeline_id,
                      context.num_replicas_in_sync)
        return _gathered(mine, inputs)

    return strategy.distribute_datasets_from_function(dataset_fn)


def worker_datasets(x, y, *, batch_size: int, shuffle, workers: int, worker: int = 0) -> dict:
    """{"keras": ..., "tfdist": ...}: worker `worker`'s dataset when `fit(x, y, batch_size,
    shuffle)` runs on `workers` workers of one replica each, as Keras's path builds it (the
    whole dataset, cut by TensorFlow's rebatch and DATA shard) and as this fix does. For
    measuring in one process what each worker's input costs
    (experiments/bench_array_input.py).

    Raises:
      ValueError: `x` or `y` is not a dense NumPy array or tensor.
    """
    from tensorflow.python.distribute import input_ops

    adapter = _array_adapter_class()(x, y, batch_size=batch_size, shuffle=shuffle)
    original = (_patch.stored_original(DATASET.name) if DATASET.name in _patch.installed()
                else type(adapter).get_tf_dataset)
    inputs = _dense_inputs(adapter)
    if inputs is None:
        raise ValueError("worker_datasets takes dense NumPy arrays or tensors. Received: x of "
                         f"type {type(x).__name__}, y of type {type(y).__name__}. Pass "
                         "np.asarray(...) of them.")
    whole = _rebatched(original(adapter), workers, worker, workers)
    return {"keras": input_ops.auto_shard_dataset(whole, workers, worker, workers),
            "tfdist": _gathered(_split(_index_batches(original, adapter), workers, worker,
                                       workers), inputs)}


def _make_dataset(original):
    @_patch.passthrough(original, _dataset_applies)
    def get_tf_dataset(self):
        strategy = _building.strategy
        seeded = (_global_seed(_agreed_seed(strategy)) if self._shuffle and _unseeded()
                  else contextlib.nullcontext())
        inputs = _dense_inputs(self)
        with seeded:
            if inputs is None:
                return original(self)
            return _per_worker_dataset(original, self, inputs, strategy)

    return get_tf_dataset


DATASET = _patch.Fix(
    name="keras_array_input.get_tf_dataset",
    issue=UPSTREAM_ISSUE,
    target=lambda: (_array_adapter_class(), "get_tf_dataset"),
    check=_check_dataset,
    make=_make_dataset,
)


@contextlib.contextmanager
def _building_for(strategy):
    _building.strategy = strategy
    try:
        yield
    finally:
        _building.strategy = None


# --- TFEpochIterator.__init__: its dataset built by the fix above ---------------------------


def _check_init(original) -> None:
    _patch.require_signature(original, "distribute_strategy", "args", "kwargs",
                             what="TFEpochIterator.__init__")
    _patch.require_attributes(keras_multi_worker._trainer_module(),
                              "_collective_all_reduce_multi_worker",
                              what="keras.src.backend.tensorflow.trainer")


def _init_applies(self, distribute_strategy=None, *args, **kwargs) -> bool:
    return keras_multi_worker._multi_worker_owned(distribute_strategy)


def _make_init(original):
    @_patch.passthrough(original, _init_applies)
    def __init__(self, distribute_strategy=None, *args, **kwargs):
        with _building_for(distribute_strategy):
            original(self, distribute_strategy, *args, **kwargs)
        adapter = getattr(self, "data_adapter", None)
        if isinstance(adapter, _array_adapter_class()) and adapter._shuffle and _unseeded():
            setattr(self, _SHARED, False)  # its first pass reads the dataset built above

    return __init__


INIT = _patch.Fix(
    name="keras_array_input.epoch_iterator_init",
    issue=UPSTREAM_ISSUE,
    target=lambda: (_tf_epoch_iterator_class(), "__init__"),
    check=_check_init,
    make=_make_init,
)


# --- TFEpochIterator._get_iterator: a new agreed order for every later pass ----------------


def _check_get_iterator(original) -> None:
    _patch.require_signature(original, what="TFEpochIterator._get_iterator")


def _get_iterator_applies(self) -> bool:
    # Not for the end-of-epoch iterator that keras_epoch_iterator skips (nothing is read).
    return (getattr(self, _SHARED, None) is not None
            and not getattr(self, keras_epoch_iterator._SKIP, False))


def _make_get_iterator(original):
    @_patch.passthrough(original, _get_iterator_applies)
    def _get_iterator(self):
        if getattr(self, _SHARED):  # every pass after the first: a new agreed seed
            strategy = self._distribute_strategy
            with _building_for(strategy):
                dataset = self.data_adapter.get_tf_dataset()
            if not isinstance(dataset, _distributed_dataset_class()):  # not dense: Keras's own
                dataset = strategy.experimental_distribute_dataset(dataset)
            self._distributed_dataset = dataset
        setattr(self, _SHARED, True)
        return original(self)

    return _get_iterator


GET_ITERATOR = _patch.Fix(
    name="keras_array_input.get_iterator",
    issue=UPSTREAM_ISSUE,
    target=lambda: (_tf_epoch_iterator_class(), "_get_iterator"),
    check=_check_get_iterator,
    make=_make_get_iterator,
)

FIXES = (DATASET, INIT, GET_ITERATOR)
NAMES = tuple(fix.name for fix in FIXES)


def install() -> tuple[str, ...]:
    """Makes the workers of tfdist's multi-worker strategies read NumPy input in one order,
    each gathering only its own share.

    Returns:
      The names of the fixes this call installed (() if they already were).

    Raises:
      CompatError: Keras's code is not shaped as the fix expects (nothing is
        installed then); UnsupportedVersionError outside the supported range.
    """
    return _patch.install_all(FIXES)


__all__ = ["FIXES", "NAMES", "install"]

"""NumPy input to a multi-worker `fit` shuffled in one order on every worker.

Keras 3's `ArrayDataAdapter.get_tf_dataset` (what `fit` uses for NumPy arrays
and tensors on the TensorFlow backend) draws each pass's order with
`tf.random.shuffle` inside the dataset (`shuffle=True`, Keras's default; or
per batch with `shuffle="batch"`). Under MultiWorkerMirroredStrategy every
worker builds that whole dataset and keeps its share of each global batch
(the DATA auto-shard the adapter asks for), so the shares only partition the
data if every worker draws the same order. Without a global seed each
process draws its own: with 2 workers, 32 examples and a global batch of 8,
one epoch trained 9 examples twice and 9 never. Keras's own multi-process
input (`keras.distribution`, keras-team/keras#23043 and #23046) seeds the
order by epoch; its path under a `tf.distribute` strategy does not.

The fix, for the epoch iterators of a strategy tfdist made that spans several
workers (`TFEpochIterator`), over Keras's array adapter with shuffling, in a
process that set no global seed: the workers agree on a seed (each draws a
random number, and one all-reduce sums them), and the adapter's dataset is
built with that as TensorFlow's global seed, which is unset again right
after; nothing else in the process is seeded. Each later `_get_iterator`
(the next epoch) builds the dataset again under a new agreed seed, so every
epoch has a new order, the same on every worker, and each example is trained
once per epoch. Passes straight through for other strategies, other inputs,
`shuffle=False`, and a process with a global seed (`keras.utils.
set_random_seed`, `tf.random.set_seed`): there every worker already draws
the same order from the same seed (and Keras draws that order at every epoch
of one `fit` call, as it does unfixed). Undone by `tfdist.compat.uninstall()`.

Canary: tests/compat/test_array_shuffle.py trains 2 workers for 2 epochs with
the fix and without it (the stock path): without it the workers' examples
overlap, with it every example is trained once per epoch in a new order.
"""

from __future__ import annotations

import contextlib
import inspect
import secrets
import threading

from tfdist.compat import _patch, keras_epoch_iterator, keras_multi_worker

UPSTREAM_ISSUE = ("keras-team/keras#23043 and #23046 (keras.distribution's array input seeded "
                  "by epoch; under a tf.distribute strategy Keras draws each worker's order "
                  "unseeded)")
# On an epoch iterator whose dataset this fix built: True once its first pass has begun.
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


# --- ArrayDataAdapter.get_tf_dataset: built under the workers' agreed seed -----------------


def _check_dataset(original) -> None:
    _patch.require_signature(original, what="ArrayDataAdapter.get_tf_dataset")
    source = inspect.getsource(inspect.unwrap(original))
    if "tf.random.shuffle" not in source:
        raise _patch.CompatError(
            "ArrayDataAdapter.get_tf_dataset no longer draws its order with tf.random.shuffle; "
            "the tfdist fix that makes every worker draw the same order was written for it "
            "(Keras 3.10-3.15).")
    from tensorflow.python.eager import context

    _patch.require_attributes(context, "global_seed", what="tensorflow.python.eager.context")


def _dataset_applies(self) -> bool:
    return getattr(_building, "strategy", None) is not None and bool(self._shuffle)


def _make_dataset(original):
    @_patch.passthrough(original, _dataset_applies)
    def get_tf_dataset(self):
        with _global_seed(_agreed_seed(_building.strategy)):
            return original(self)

    return get_tf_dataset


DATASET = _patch.Fix(
    name="keras_array_shuffle.get_tf_dataset",
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
    return keras_multi_worker._multi_worker_owned(distribute_strategy) and _unseeded()


def _make_init(original):
    @_patch.passthrough(original, _init_applies)
    def __init__(self, distribute_strategy=None, *args, **kwargs):
        with _building_for(distribute_strategy):
            original(self, distribute_strategy, *args, **kwargs)
        adapter = getattr(self, "data_adapter", None)
        if isinstance(adapter, _array_adapter_class()) and adapter._shuffle:
            setattr(self, _SHARED, False)  # its first pass reads the dataset built above

    return __init__


INIT = _patch.Fix(
    name="keras_array_shuffle.epoch_iterator_init",
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
            self._distributed_dataset = strategy.experimental_distribute_dataset(dataset)
        setattr(self, _SHARED, True)
        return original(self)

    return _get_iterator


GET_ITERATOR = _patch.Fix(
    name="keras_array_shuffle.get_iterator",
    issue=UPSTREAM_ISSUE,
    target=lambda: (_tf_epoch_iterator_class(), "_get_iterator"),
    check=_check_get_iterator,
    make=_make_get_iterator,
)

FIXES = (DATASET, INIT, GET_ITERATOR)
NAMES = tuple(fix.name for fix in FIXES)


def install() -> tuple[str, ...]:
    """Makes every worker of tfdist's multi-worker strategies shuffle NumPy input alike.

    Returns:
      The names of the fixes this call installed (() if they already were).

    Raises:
      CompatError: Keras's code is not shaped as the fix expects (nothing is
        installed then); UnsupportedVersionError outside the supported range.
    """
    return _patch.install_all(FIXES)


__all__ = ["FIXES", "NAMES", "install"]

"""One distributed data iterator per epoch instead of two.

Keras 3's `EpochIterator._enumerate_iterator`, when `fit` runs without
`steps_per_epoch` (numpy arrays, a dataset of known length), makes a new data
iterator at the start of every epoch and, after the epoch's last step,
another one that the next epoch's start throws away unused (it makes a new
one whenever `steps_per_epoch` is None). Over a plain `tf.data.Dataset` that
iterator costs about a millisecond. Under a MirroredStrategy the iterator is
`iter()` of a `DistributedDataset`: an `OwnedMultiDeviceIterator` that traces
its per-device functions anew each time (147-618 ms per build measured on a
loaded 2-core machine with 2 logical CPUs); under a MultiWorkerMirroredStrategy
an auto-sharded per-worker iterator (58-276 ms with 2 workers on 2 quiet
cores). So every epoch paid for two of them; docs/performance.md has the
figures (`experiments/bench_peers.py`). The mirrored and multi_worker_mirrored
presets install this fix.

The fix, for epoch iterators over a strategy tfdist made (TensorFlow's
`TFEpochIterator`), over NumPy arrays or tensors (Keras's `ArrayDataAdapter`)
and without `steps_per_epoch`: while Keras's own loop runs
its end-of-epoch step, `TFEpochIterator._get_iterator` hands it an empty tuple
instead of the distributed dataset, so the iterator the next epoch would
discard is never built. Keras's loop is otherwise run unchanged (its batches,
its `on_epoch_end`, its counters); the next epoch builds its iterator as
before, so the data and the weights are those of Keras's own loop. Epoch
iterators of other strategies, with `steps_per_epoch` (where the end-of-epoch
iterator is the next epoch's), and over any other input pass straight
through: a tf.data dataset's `shuffle()` draws its next order when an
iterator is made, so skipping one would change the order of every later
epoch (measured: 0.064 on the weights after 3 epochs).

Upstream: none found (keras-team/keras `epoch_iterator.py` makes the
end-of-epoch iterator whatever `steps_per_epoch` is).
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

from tfdist.compat import _owner, _patch
from tfdist.compat._patch import CompatError, Fix

ISSUE = ("none found (Keras 3's EpochIterator makes an end-of-epoch data iterator that the "
         "next epoch discards when steps_per_epoch is None)")
_SKIP = "_tfdist_skip_end_of_epoch_iterator"


def _epoch_iterator_class():
    return _patch.upstream("keras.src.trainers.epoch_iterator.EpochIterator")


def _tf_epoch_iterator_class():
    return _patch.upstream("keras.src.backend.tensorflow.trainer.TFEpochIterator")


def _array_adapter_class():
    return _patch.upstream("keras.src.trainers.data_adapters.array_data_adapter.ArrayDataAdapter")


def _applies(self, *args, **kwargs) -> bool:
    # Only Keras's own array input (NumPy arrays, tensors): its shuffle is a permutation
    # drawn as the batches are read, so an iterator that is never read draws nothing. A
    # tf.data dataset's shuffle() draws its next order when an iterator is made, so
    # skipping the discarded one would change which order each later epoch takes.
    return (self.steps_per_epoch is None
            and isinstance(getattr(self, "data_adapter", None), _array_adapter_class())
            and _owner.owns(getattr(self, "_distribute_strategy", None)))


# --- EpochIterator._enumerate_iterator: marks the end-of-epoch step ------------------------


def _check_enumerate(original: Any) -> None:
    _patch.require_signature(original, what="EpochIterator._enumerate_iterator")
    if not inspect.isgeneratorfunction(inspect.unwrap(original)):
        raise CompatError(
            "EpochIterator._enumerate_iterator is no longer a generator of steps; the tfdist "
            "fix that skips the discarded end-of-epoch iterator was written for one "
            "(Keras 3.10-3.15).")
    import numpy as np

    probe = _epoch_iterator_class()(x=np.zeros((2, 1), "float32"), batch_size=1)
    _patch.require_attributes(probe, "steps_per_epoch", "_num_batches", "_steps_seen",
                              "data_adapter", what="keras EpochIterator()")
    if not isinstance(probe.data_adapter, _array_adapter_class()):
        raise CompatError("Keras's EpochIterator no longer reads NumPy arrays through "
                          "ArrayDataAdapter; the tfdist fix that skips the discarded "
                          "end-of-epoch iterator applies to that adapter only.")


def _make_enumerate(original):
    # A generator function itself (not `_patch.passthrough`), as the fixes that
    # iterate Keras's epoch iterator check that it is one.
    @functools.wraps(original)
    def _enumerate_iterator(self):
        if not _applies(self):
            yield from original(self)
            return
        steps = original(self)
        try:
            for item in steps:
                yield item
                # Resumed after the epoch's last step: Keras's loop now runs its
                # end-of-epoch code, whose new iterator the next epoch discards.
                if self._num_batches and self._steps_seen >= self._num_batches:
                    setattr(self, _SKIP, True)
        finally:
            setattr(self, _SKIP, False)
            steps.close()

    return _enumerate_iterator


ENUMERATE = Fix(
    name="keras_epoch_iterator.enumerate_iterator",
    issue=ISSUE,
    target=lambda: (_epoch_iterator_class(), "_enumerate_iterator"),
    check=_check_enumerate,
    make=_make_enumerate,
)


# --- TFEpochIterator._get_iterator: no iterator for the end-of-epoch step ------------------


def _check_get_iterator(original: Any) -> None:
    _patch.require_signature(original, what="TFEpochIterator._get_iterator")
    parameters = inspect.signature(_tf_epoch_iterator_class().__init__).parameters
    if "distribute_strategy" not in parameters:
        raise CompatError("TFEpochIterator no longer takes distribute_strategy; the tfdist fix "
                          "that skips the discarded end-of-epoch iterator reads it.")


def _make_get_iterator(original):
    @_patch.passthrough(original, lambda self: getattr(self, _SKIP, False))
    def _get_iterator(self):
        return ()  # iter(()) is free; the next epoch replaces it before any step

    return _get_iterator


GET_ITERATOR = Fix(
    name="keras_epoch_iterator.get_iterator",
    issue=ISSUE,
    target=lambda: (_tf_epoch_iterator_class(), "_get_iterator"),
    check=_check_get_iterator,
    make=_make_get_iterator,
)

FIXES = (ENUMERATE, GET_ITERATOR)
NAMES = tuple(fix.name for fix in FIXES)


def install() -> tuple[str, ...]:
    """Skips the end-of-epoch data iterator Keras discards, for tfdist's strategies.

    Returns:
      The names of the fixes this call installed.
    """
    return _patch.install_all(FIXES)


__all__ = ["FIXES", "NAMES", "install"]

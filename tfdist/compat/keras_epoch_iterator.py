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

The same wrapper also lets go of each epoch's used iterator off the main
thread, for every input over a strategy tfdist made without
`steps_per_epoch`. Keras's `fit` drops the previous epoch's iterator when
its loop variable takes the next one, and the C++ destructor of a tf.data
iterator waits for the iterator's autotuning thread
(`RootDataset::Iterator::~Iterator` -> `model::Model::OptimizeLoop`), which
can sleep for its whole optimisation period (doubled after each
optimisation, up to 60 s) instead of waking on cancellation (a lost wakeup in
TensorFlow: `CancellationManager::StartCancel` runs the callback that wakes
the loop before `IsCancelled()` turns true, so the loop, if it runs first,
waits again; every time in a process pinned to one core): measured at up
to 6.5 s per epoch boundary under multi_worker_mirrored, the other workers
waiting in the next all-reduce (docs/performance.md, "An epoch's first step
can stall for seconds"). The wrapper keeps a reference to each epoch's
iterator and, once the next epoch's first step has run, hands it to a thread
that drops it, so the wait happens there (the destructor runs without the
GIL). The last epoch's goes to such a thread when Keras lets go of the epoch
iterator (`fit` returning), as a `fit` called once per epoch would otherwise
pay the wait on the main thread at every return. The thread is not a daemon:
the interpreter waits for it at exit, as the main thread would have waited
for the destructor itself. A daemon thread
still inside the destructor when the interpreter finalises is killed as it
takes the GIL back, and the C++ unwinding aborts the process ("FATAL:
exception not rethrown"; seen in CI). The data, the steps and the weights are
unchanged.
"""

from __future__ import annotations

import functools
import inspect
import sys
import threading
import time
import weakref
from typing import Any

from tfdist.compat import _owner, _patch
from tfdist.compat._patch import CompatError, Fix

ISSUE = ("none found (Keras 3's EpochIterator makes an end-of-epoch data iterator that the "
         "next epoch discards when steps_per_epoch is None; TensorFlow's tf.data iterator "
         "destructor can wait out its autotuning period, a lost wakeup between "
         "CancellationManager::StartCancel and Model::OptimizeLoop)")
_SKIP = "_tfdist_skip_end_of_epoch_iterator"
_HELD = "_tfdist_held_data_iterators"


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


def _releases(self) -> bool:
    # A new iterator every epoch (no steps_per_epoch), over a strategy tfdist made.
    return (self.steps_per_epoch is None
            and _owner.owns(getattr(self, "_distribute_strategy", None)))


def _release_in_background(holder: list) -> None:
    """Drops `holder`'s items from a thread of their own: their destructors run there.

    Not a daemon, so that exit waits for it (see the module docstring).
    """
    threading.Thread(target=_let_go, args=(holder,), name="tfdist-release-data-iterator",
                     daemon=False).start()


def _let_go(holder: list, bound: float = 1.0) -> None:
    # Handed over while Keras may still be dropping its own references (the epoch
    # iterator's `_current_iterator`, `fit`'s loop variable): wait, briefly, until the
    # holder's is the last one, so that the destructor runs here and not on the main thread.
    deadline = time.monotonic() + bound
    while (any(sys.getrefcount(x) > _OURS for x in holder)
           and time.monotonic() < deadline):
        time.sleep(0.005)
    holder.clear()


# References to an item of `holder` inside `_let_go`'s test: the list, the generator
# expression's variable and getrefcount's argument.
_OURS = 3


def _held(self) -> list:
    """The data iterators this epoch iterator holds (the current epoch's), made on first use.

    When Keras lets go of the epoch iterator (`fit`, `evaluate` returning), the last epoch's
    data iterator goes to the release thread too.
    """
    holder = self.__dict__.get(_HELD)
    if holder is None:
        holder = []
        setattr(self, _HELD, holder)
        weakref.finalize(self, _release_in_background, holder).atexit = False
    return holder


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
        skips, releases = _applies(self), _releases(self)
        if not skips and not releases:
            yield from original(self)
            return
        steps = original(self)
        previous: list = []
        try:
            for item in steps:
                # Keras 3.10 yields (step, data iterator), 3.15 (first step, last step,
                # data iterator).
                if releases and isinstance(item, tuple) and len(item) in (2, 3):
                    held = _held(self)
                    if not held or held[-1] is not item[-1]:
                        # This epoch's iterator: hold it; the one held before is the last
                        # epoch's, which fit's loop variable lets go of on this yield.
                        previous, held[:] = held[:], [item[-1]]
                yield item
                if previous:
                    _release_in_background(previous)
                    previous = []
                # Resumed after the epoch's last step: Keras's loop now runs its
                # end-of-epoch code, whose new iterator the next epoch discards.
                if skips and self._num_batches and self._steps_seen >= self._num_batches:
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

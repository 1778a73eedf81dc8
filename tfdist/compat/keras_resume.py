"""Resuming Keras's `fit` in the middle of an epoch.

Keras 3's `fit` can start at an epoch (`initial_epoch`, which Keras's own
`BackupAndRestore` sets through `Trainer._initial_epoch`) but not at a step
inside one: `EpochIterator._enumerate_iterator` always yields the batches
0 .. steps_per_epoch-1 of every epoch. Keras's `BackupAndRestore(save_freq=N)`
writes the batch it saved at into its metadata and ignores it on restore,
so a run resumed from a mid-epoch backup repeats the steps before the backup
of that epoch, on weights that already learned from them.

`start_next_epoch_at(k)` makes the next epoch this thread enumerates begin at
batch k: the first k steps are not yielded (the loop's batch indices stay
k, k+1, ..., so callbacks and progress bars count right). With `consume=n`
the first n batches of the data iterator are read and dropped before the
first step (for backups that do not skip data themselves). Epoch iterators
with nothing registered pass straight through; what is registered belongs
to the tfdist backup callback that registered it (tfdist.BackupAndRestore,
or Keras's BackupAndRestore under a tfdist strategy), in the thread that
runs its `fit`.

Upstream: none found. Keras 3.15's BackupAndRestore writes `batch` into its
metadata and never reads it back.
"""

from __future__ import annotations

import inspect
import threading
from typing import Any

from tfdist.compat import _patch
from tfdist.compat._patch import CompatError, Fix, passthrough

ISSUE = ("none found (Keras 3's BackupAndRestore(save_freq=N) saves the batch and resumes "
         "at the start of its epoch)")
NAME = "keras_resume.enumerate_iterator"

_pending = threading.local()


def start_next_epoch_at(step: int, *, steps_per_execution: int = 1, consume: int = 0,
                        consume_across_epochs: int | None = None,
                        what: str = "the backup") -> None:
    """The next epoch enumerated in this thread starts at batch `step`.

    Args:
      step: batches of that epoch already trained.
      steps_per_execution: the model's; `step` must be a multiple of it.
      consume: batches to read and drop from the epoch's data iterator first
        (a backup that does not skip data itself).
      consume_across_epochs: the same when the iterator runs across epochs
        (`fit` got `steps_per_epoch`, so Keras keeps one iterator); default
        `consume`. Reduced modulo the dataset's batches when that is known.
      what: names the backup in errors.

    Raises:
      ValueError: `step` is not a multiple of `steps_per_execution` (steps run
        in groups of that size, so the epoch cannot start between them).
      CompatError: this Keras's epoch iterator is not shaped as the fix expects.
    """
    if step % steps_per_execution:
        raise ValueError(
            f"{what} was taken after {step} steps of an epoch, which is not a multiple of "
            f"steps_per_execution={steps_per_execution}: fit cannot start between the steps "
            f"of one execution. Resume with the steps_per_execution the backup was made with.")
    across = consume if consume_across_epochs is None else consume_across_epochs
    if not (step or consume or across):
        clear()
        return
    install()
    _pending.value = (int(step), int(consume), int(across))


def install() -> tuple[str, ...]:
    """Installs the fix (idempotent); returns the names installed by this call.

    `start_next_epoch_at` installs it when a backup has a position to resume.
    """
    return _patch.install_all((FIX,))


def take_pending() -> tuple[int, int] | None:
    """(step, batches to drop) registered for this thread's next epoch, removing it.

    For training loops that do not use Keras's epoch iterator (tfdist's
    parameter-server loop), so what a backup registered is not left for an
    unrelated `fit` later in the thread.
    """
    value = getattr(_pending, "value", None)
    _pending.value = None
    return None if value is None else (value[0], value[1])


def clear() -> None:
    """Forgets what this thread registered."""
    _pending.value = None


def _has_pending(*args, **kwargs) -> bool:
    return getattr(_pending, "value", None) is not None


def _make(original):
    @passthrough(original, _has_pending)
    def _enumerate_iterator(self):
        step, consume, across = _pending.value
        _pending.value = None
        if self.steps_per_epoch:
            batches = getattr(self, "_num_batches", None)
            consume = across % batches if batches else across
        for item in original(self):
            if consume:
                iterator = item[-1]
                for _ in range(consume):
                    next(iterator)
                consume = 0
            if item[0] < step:
                continue
            yield item

    return _enumerate_iterator


def _target():
    from tfdist._tf import import_tensorflow

    import_tensorflow()
    from keras.src.trainers import epoch_iterator

    return epoch_iterator.EpochIterator, "_enumerate_iterator"


def _check(original: Any) -> None:
    _patch.require_signature(original, what="EpochIterator._enumerate_iterator")
    if not inspect.isgeneratorfunction(inspect.unwrap(original)):
        raise CompatError(
            "EpochIterator._enumerate_iterator is no longer a generator of steps; the tfdist "
            "fix that resumes fit mid-epoch was written for one (Keras 3.10-3.15).")
    owner, _ = _target()
    _patch.require_attributes(owner, "__iter__", "__next__", what="keras EpochIterator")
    import numpy as np

    probe = owner(x=np.zeros((2, 1), "float32"), batch_size=1)
    _patch.require_attributes(probe, "steps_per_epoch", "_num_batches", "steps_per_execution",
                              what="keras EpochIterator()")


FIX = Fix(name=NAME, issue=ISSUE, target=_target, check=_check, make=_make)


__all__ = ["FIX", "NAME", "clear", "start_next_epoch_at", "take_pending"]

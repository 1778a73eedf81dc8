"""Multi-worker-safe backup and exact resume for Keras 3 `model.fit`.

Keras 3's `keras.callbacks.BackupAndRestore` is not multi-worker aware (every
worker writes the same `latest.weights.h5`: FileExistsError / HDF5 lock
errors) and restores the epoch but not the position in the data, so a
resumed run differs from an uninterrupted one. This callback:

- saves at the end of every epoch (or every `save_every_epochs`) the model's
  variables, the optimizer's variables (its step counter and slots) and the
  position: completed epochs, and steps per epoch;
- writes on the chief only, atomically (a temporary file, then `os.replace`,
  then a small JSON pointer written the same way), so a kill at any moment
  leaves the previous complete backup;
- restores the same backup on every worker when training starts (all tasks
  read the chief's files; on one machine or a shared file system);
- restores the data position: with `backup.dataset(ds)` the input pipeline
  skips the batches already trained on. This is exact when the dataset is
  deterministic (fixed shuffle seed, `.repeat()` before `.batch()`) and `fit`
  gets `steps_per_epoch`: batch k of the resumed run is batch k of the
  uninterrupted one.

Reading and writing variable values needs no collective, so the chief can
save alone while the other workers go on (nothing blocks if a worker dies).

    backup = tfdist.BackupAndRestore("/shared/backup")
    train = backup.dataset(make_dataset())        # skips what was trained
    model.fit(train, epochs=10, steps_per_epoch=100, callbacks=[backup])

Run under `tfdist launch --max_restarts=N`: a killed worker restarts the
group and training continues from the last epoch that finished.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from typing import Any

import numpy as np

from tfdist import chief as chief_lib

_STATE = "tfdist_backup.json"
_FORMAT = 1


def _atomic_write_bytes(path: str, write) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def read_state(backup_dir: str) -> dict[str, Any] | None:
    """The last complete backup's position ({} keys: epoch, steps_per_epoch, file), or None."""
    path = os.path.join(backup_dir, _STATE)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        state = json.load(f)
    if state.get("format") != _FORMAT:
        raise ValueError(
            f"{path} was written by another tfdist backup format ({state.get('format')!r}; "
            f"this tfdist reads {_FORMAT}). Delete the backup directory to start over.")
    return state


def repeat_shuffled(dataset, *, buffer_size: int, seed: int):
    """`dataset` repeated forever, reshuffled each pass with seed `seed + pass`.

    Unlike `dataset.shuffle(b, seed=s).repeat()`, whose order depends on how
    many iterators the same dataset object has made (Keras makes a throw-away
    one for the symbolic build), every fresh iterator here yields the same
    sequence, so `BackupAndRestore.dataset()` can resume it exactly. Batch it
    afterwards.
    """
    from tfdist._tf import import_tensorflow

    tf = import_tensorflow()
    if isinstance(buffer_size, bool) or not isinstance(buffer_size, int) or buffer_size < 1:
        raise ValueError(f"buffer_size must be an integer >= 1. Received: "
                         f"buffer_size={buffer_size!r}")
    return tf.data.Dataset.range(2**62).flat_map(
        lambda epoch: dataset.shuffle(buffer_size, seed=seed + epoch,
                                      reshuffle_each_iteration=False))


def _make_callback_base():
    from tfdist._tf import import_tensorflow

    import_tensorflow()
    import keras

    return keras.callbacks.Callback


class BackupAndRestore(_make_callback_base()):
    """Backs up model + optimizer + data position on the chief; restores them on every worker.

    Args:
      backup_dir: directory for the backup (created on the chief). Every task
        must see the same directory (one machine, or a shared file system).
      save_every_epochs: back up after every N-th epoch (and the last).
      delete_on_finish: remove the backup when `fit` completes, like Keras's
        BackupAndRestore (so the next run starts fresh).

    Attributes:
      initial_epoch: epochs completed by the backup found at construction.
      initial_step: batches already trained (`initial_epoch * steps_per_epoch`).
    """

    def __init__(self, backup_dir: str, *, save_every_epochs: int = 1,
                 delete_on_finish: bool = True):
        super().__init__()
        if not isinstance(backup_dir, (str, os.PathLike)) or not os.fspath(backup_dir):
            raise ValueError(f"backup_dir must be a directory path. Received: "
                             f"backup_dir={backup_dir!r}")
        if isinstance(save_every_epochs, bool) or not isinstance(
                save_every_epochs, int) or save_every_epochs < 1:
            raise ValueError(f"save_every_epochs must be an integer >= 1. Received: "
                             f"save_every_epochs={save_every_epochs!r}")
        self.backup_dir = os.fspath(backup_dir)
        self.save_every_epochs = save_every_epochs
        self.delete_on_finish = delete_on_finish
        self._state = read_state(self.backup_dir)
        self._dataset_skipped: int | None = None
        self._is_chief = chief_lib.is_chief()

    @property
    def initial_epoch(self) -> int:
        return 0 if self._state is None else int(self._state["epoch"])

    @property
    def initial_step(self) -> int:
        if self._state is None:
            return 0
        return int(self._state["epoch"]) * int(self._state["steps_per_epoch"])

    def dataset(self, dataset):
        """`dataset` minus the batches the backup already trained on.

        Pass the batched (global-batch) `tf.data.Dataset` you give to `fit`;
        make it deterministic (seeded shuffle, `.repeat()`) for exact resume.
        """
        self._dataset_skipped = self.initial_step
        return dataset.skip(self.initial_step) if self.initial_step else dataset

    # -- Keras hooks -------------------------------------------------------------

    def on_train_begin(self, logs=None):
        steps = self.params.get("steps")
        if self._state is None:
            return
        if self._dataset_skipped != self.initial_step:
            raise ValueError(
                f"A backup in {self.backup_dir} resumes after {self.initial_step} batches, but "
                f"the training data was not advanced to that point. Pass the dataset through "
                f"backup.dataset(ds) before fit (after creating this callback), or delete the "
                f"backup directory to start over.")
        if steps != self._state["steps_per_epoch"]:
            raise ValueError(
                f"The backup in {self.backup_dir} was made with steps_per_epoch="
                f"{self._state['steps_per_epoch']}; this fit uses {steps}. Use the same "
                f"steps_per_epoch to resume, or delete the backup directory.")
        self._restore()
        # The same private attribute keras.callbacks.BackupAndRestore sets.
        self.model._initial_epoch = self.initial_epoch

    def on_epoch_end(self, epoch, logs=None):
        done = epoch + 1
        if done % self.save_every_epochs == 0 or done == self.params.get("epochs"):
            self._save(done)

    def on_train_end(self, logs=None):
        if self.delete_on_finish and self._is_chief and not self.model.stop_training:
            shutil.rmtree(self.backup_dir, ignore_errors=True)

    # -- save / restore ----------------------------------------------------------

    def _variables(self):
        variables = list(self.model.variables)
        optimizer = getattr(self.model, "optimizer", None)
        if optimizer is not None:
            variables += list(optimizer.variables)
        return variables

    def _save(self, epochs_done: int) -> None:
        steps = self.params.get("steps")
        if not steps:
            raise ValueError(
                "tfdist.BackupAndRestore needs fit(..., steps_per_epoch=N) to know the data "
                "position. Received: steps_per_epoch=None.")
        if not self._is_chief:
            return
        os.makedirs(self.backup_dir, exist_ok=True)
        values = {f"v{i:05d}": np.asarray(v.numpy()) for i, v in enumerate(self._variables())}
        name = f"backup-epoch{epochs_done:06d}.npz"
        _atomic_write_bytes(os.path.join(self.backup_dir, name),
                            lambda f: np.savez(f, **values))
        state = {"format": _FORMAT, "epoch": epochs_done, "steps_per_epoch": int(steps),
                 "file": name, "num_variables": len(values)}
        _atomic_write_bytes(os.path.join(self.backup_dir, _STATE),
                            lambda f: f.write(json.dumps(state).encode()))
        for old in os.listdir(self.backup_dir):
            if old.startswith("backup-epoch") and old != name:
                os.remove(os.path.join(self.backup_dir, old))

    def _restore(self) -> None:
        optimizer = getattr(self.model, "optimizer", None)
        if optimizer is not None and not optimizer.built:
            with self.model.distribute_strategy.scope():
                optimizer.build(self.model.trainable_variables)
        variables = self._variables()
        with np.load(os.path.join(self.backup_dir, self._state["file"])) as data:
            if len(data.files) != len(variables):
                raise ValueError(
                    f"The backup in {self.backup_dir} holds {len(data.files)} variables; this "
                    f"model and optimizer have {len(variables)}. It was made by another "
                    f"model: delete the backup directory to start over.")
            for i, variable in enumerate(variables):
                value = data[f"v{i:05d}"]
                if tuple(value.shape) != tuple(variable.shape):
                    raise ValueError(
                        f"Variable {variable.path} has shape {tuple(variable.shape)} but the "
                        f"backup holds {tuple(value.shape)}: the backup is from another "
                        f"model. Delete {self.backup_dir} to start over.")
                variable.assign(value)

"""Keras's own `keras.callbacks.BackupAndRestore` under tfdist's strategies: SIGTERM, mid-epoch.

What users already have in their scripts, made to do what `tfdist.BackupAndRestore`
does, for models under a strategy tfdist made (every preset):

- **SIGTERM is a save point** (`tfdist.preemption.SavePoint`): the tasks agree on
  a step, Keras's own save runs there, and the tasks exit with status 75. The
  stock callback has no notion of SIGTERM (tf_keras's had `save_before_preemption`);
  under a 30 s grace period a job finishes its steps, is killed, and its backup
  was already deleted at the end of `fit`.
- **Mid-epoch resume.** With `save_freq=N` Keras writes the batch it saved at
  into `training_metadata.json` and ignores it on restore: the resumed run
  repeats the epoch's first steps on weights that already learned from them.
  Here the restored `fit` starts at that batch (`tfdist.compat.keras_resume`)
  and the data iterator is advanced past the batches the interrupted run read
  (the epoch's, or since the start of training when `steps_per_epoch` keeps one
  iterator across epochs), so the resumed run equals an uninterrupted one for
  a deterministic pipeline.
- **Consistent files.** Keras truncates `training_metadata.json` before writing
  it, and writes the weights in place (single process), so a kill during a save
  can leave an empty or half-written file. Here both are written to a temporary
  file and renamed; the metadata also records `optimizer.iterations`, and a
  restore whose weights and metadata come from different saves (a kill between
  the two renames) is a `BackupError`-style `ValueError` naming both files,
  never a silent resume at the wrong position.

The position is kept in Keras's own metadata file, next to its keys
(`tfdist_steps_in_epoch`, `tfdist_iterations`); Keras's own `_load_model` reads
only `epoch`, so the files still load with stock Keras.

Each fix passes straight through unless the callback's model belongs to a
strategy tfdist made (`tfdist.compat._owner`). Under multi_worker_mirrored the
writes of non-chief workers go to scratch (`tfdist.compat.keras_files`).

Upstream: none found for the SIGTERM save point in Keras 3 (tf_keras's
BackupAndRestore had `save_before_preemption`); keras-team/keras#20585 for
Keras 3 under MultiWorkerMirroredStrategy.
"""

from __future__ import annotations

import json
import os
from typing import Any

from tfdist.compat import _owner, _patch
from tfdist.compat._patch import Fix, install_all, passthrough, require_attributes

ISSUE = ("none found (Keras 3's BackupAndRestore: no SIGTERM save point, mid-epoch "
         "position written and ignored); keras-team/keras#20585")
_STEPS = "tfdist_steps_in_epoch"
_ITERATIONS = "tfdist_iterations"
_STATE = "_tfdist_backup_state"


class _State:
    """What the fixes keep on one callback during one fit."""

    def __init__(self, epoch: int, in_epoch: int):
        self.epoch = epoch
        self.in_epoch = in_epoch  # steps done in the current epoch
        self.last_batch = in_epoch - 1
        self.step = 0
        self.save_point = None


def _strategy(callback) -> Any:
    model = getattr(callback, "_model", None) or getattr(callback, "model", None)
    return getattr(model, "_distribute_strategy", None) if model is not None else None


def _applies(callback, *args, **kwargs) -> bool:
    return _owner.owns(_strategy(callback))


def _role(callback) -> str | None:
    from tfdist.compat import keras_files

    return keras_files.role(_strategy(callback))


def _read_metadata(path: str) -> dict | None:
    from tfdist._tf import import_tensorflow

    tf = import_tensorflow()
    if not tf.io.gfile.exists(path):
        return None
    with tf.io.gfile.GFile(path, "r") as f:
        text = f.read()
    try:
        data = json.loads(text)
    except ValueError:
        raise ValueError(
            f"keras.callbacks.BackupAndRestore cannot resume: {path} is not valid JSON (a save "
            f"was interrupted by an older version). Delete the backup folder "
            f"{os.path.dirname(path)} to start over.") from None
    return data if isinstance(data, dict) else None


def _write_metadata(path: str, data: dict) -> None:
    from tfdist.compat import keras_files

    def write(target):
        with open(target, "w") as f:
            f.write(json.dumps(data))
            f.flush()
            os.fsync(f.fileno())

    keras_files.write_as("chief", path, write)


def _iterations(model) -> int | None:
    optimizer = getattr(model, "optimizer", None)
    iterations = getattr(optimizer, "iterations", None)
    try:
        return int(iterations.numpy()) if iterations is not None else None
    except (AttributeError, TypeError, ValueError):
        return None


def _join_if_parameter_server(model) -> None:
    from tfdist.compat import ps_keras

    strategy = model.distribute_strategy
    if ps_keras.is_parameter_server_strategy(strategy):
        from tfdist._tf import import_tensorflow

        tf = import_tensorflow()
        tf.distribute.coordinator.ClusterCoordinator(strategy).join()


# --- the fixes ----------------------------------------------------------------------


def _make_on_train_begin(original):
    @passthrough(original, _applies)
    def on_train_begin(self, logs=None):
        stale = getattr(self, _STATE, None)
        if stale is not None:
            stale.save_point.close()  # the last fit with this callback raised
            setattr(self, _STATE, None)
        original(self, logs)
        from tfdist import preemption
        from tfdist.compat import keras_files, keras_resume

        model = self.model
        metadata = _read_metadata(self._training_metadata_path)
        epoch = int(metadata.get("epoch", 0)) if metadata else 0
        in_epoch = int(metadata.get(_STEPS, 0)) if metadata else 0
        saved_iterations = metadata.get(_ITERATIONS) if metadata else None
        if saved_iterations is not None and _iterations(model) != saved_iterations:
            raise ValueError(
                f"keras.callbacks.BackupAndRestore cannot resume from {self.backup_dir}: "
                f"{os.path.basename(self._weights_path)} holds optimizer.iterations="
                f"{_iterations(model)} but {os.path.basename(self._training_metadata_path)} "
                f"was written at {saved_iterations}: the two files come from different saves "
                f"(the job was killed between them). Delete {self.backup_dir} to start over, "
                f"or use double_checkpoint=True to keep the previous pair.")
        steps = self.params.get("steps")
        if metadata and steps:
            from tfdist.compat import ps_keras

            # Data already read by the interrupted run: this epoch's batches, or every batch
            # since the start when one iterator runs across epochs (steps_per_epoch set).
            # tfdist's parameter-server loop makes its workers' iterators itself: the epoch
            # starts at the step, the data is not advanced (as Keras's own restore).
            ps = ps_keras.is_parameter_server_strategy(model.distribute_strategy)
            keras_resume.start_next_epoch_at(
                in_epoch, steps_per_execution=max(1, int(getattr(model, "steps_per_execution",
                                                                 1) or 1)),
                consume=0 if ps else in_epoch,
                consume_across_epochs=0 if ps else epoch * int(steps) + in_epoch,
                what=f"the backup in {self.backup_dir}")
        self._current_epoch = epoch
        self._last_batch_seen = max(0, in_epoch - 1)
        state = _State(epoch, in_epoch)
        state.step = epoch * int(steps or 0) + in_epoch
        strategy = model.distribute_strategy
        state.save_point = preemption.SavePoint(
            strategy, save=lambda step: _preemption_save(self, step),
            multi_worker=keras_files.is_multi_worker(strategy))
        setattr(self, _STATE, state)
        state.save_point.begin()

    return on_train_begin


def _preemption_save(callback, step: int) -> str:
    from tfdist.compat import keras_files

    callback._save_model()
    strategy = callback.model.distribute_strategy
    if keras_files.is_multi_worker(strategy):
        from tfdist._tf import import_tensorflow

        tf = import_tensorflow()
        try:
            keras_files.barrier(strategy)  # the chief entered it with its files written
        except tf.errors.OpError:
            pass  # a peer that left the barrier first exited: the files say the rest
        metadata = _read_metadata(callback._training_metadata_path) or {}
        if metadata.get(_ITERATIONS) != _iterations(callback.model):
            raise ValueError(
                f"keras.callbacks.BackupAndRestore: the tasks agreed to back up step {step} "
                f"before exiting on SIGTERM, but {callback._training_metadata_path} does not "
                f"hold it: the chief did not finish the backup (it died, or cannot write "
                f"there). The next run resumes from what is there.")
    who = "by the chief " if _role(callback) == "other" else ""
    return (f"keras.callbacks.BackupAndRestore saved step {step} {who}in "
            f"{callback.backup_dir}")


def _make_on_train_batch_end(original):
    @passthrough(original, lambda self, *a, **k: getattr(self, _STATE, None) is not None)
    def on_train_batch_end(self, batch, logs=None):
        state = getattr(self, _STATE)
        stride = batch - state.last_batch if batch > state.last_batch else batch + 1
        state.last_batch = batch
        state.in_epoch = batch + 1
        steps = self.params.get("steps") or 0
        state.step = state.epoch * steps + batch + 1
        original(self, batch, logs)
        state.save_point.step_done(state.step, stride)

    return on_train_batch_end


def _make_on_epoch_end(original):
    @passthrough(original, lambda self, *a, **k: getattr(self, _STATE, None) is not None)
    def on_epoch_end(self, epoch, logs=None):
        state = getattr(self, _STATE)
        state.epoch, state.in_epoch, state.last_batch = epoch + 1, 0, -1
        original(self, epoch, logs)

    return on_epoch_end


def _make_on_train_end(original):
    @passthrough(original, lambda self, *a, **k: getattr(self, _STATE, None) is not None)
    def on_train_end(self, logs=None):
        state = getattr(self, _STATE)
        setattr(self, _STATE, None)
        state.save_point.end(state.step)  # a SIGTERM since the last step: save, exit 75
        original(self, logs)

    return on_train_end


def _make_save_model(original):
    @passthrough(original, lambda self, *a, **k: _applies(self) and _role(self) != "other")
    def _save_model(self):
        from tfdist._tf import import_tensorflow
        from tfdist.compat import keras_files

        tf = import_tensorflow()
        _join_if_parameter_server(self.model)
        state = getattr(self, _STATE, None)
        if not tf.io.gfile.exists(self.backup_dir):
            tf.io.gfile.makedirs(self.backup_dir)
        if self.double_checkpoint:
            for path, previous in ((self._weights_path, self._prev_weights_path),
                                   (self._training_metadata_path,
                                    self._prev_training_metadata_path)):
                if tf.io.gfile.exists(path):
                    tf.io.gfile.copy(path, previous, overwrite=True)
        keras_files.write_as("chief", self._weights_path,
                             lambda path: self.model.save_weights(filepath=path, overwrite=True))
        _write_metadata(self._training_metadata_path, {
            "epoch": self._current_epoch, "batch": self._last_batch_seen,
            _STEPS: state.in_epoch if state is not None else 0,
            _ITERATIONS: _iterations(self.model)})

    return _save_model


def _callbacks():
    from tfdist._tf import import_tensorflow

    import_tensorflow()
    import keras

    return keras.callbacks


def _check_callback(original) -> None:
    callbacks = _callbacks()
    require_attributes(callbacks.BackupAndRestore, "_load_model", "_save_model",
                       "_should_save_on_batch")
    probe = callbacks.BackupAndRestore("unused")
    require_attributes(probe, "_weights_path", "_training_metadata_path", "_prev_weights_path",
                       "_prev_training_metadata_path", "_current_epoch", "_last_batch_seen",
                       "double_checkpoint", "backup_dir",
                       what="keras.callbacks.BackupAndRestore()")


def _fixes() -> tuple[Fix, ...]:
    target = lambda name: lambda: (_callbacks().BackupAndRestore, name)  # noqa: E731
    return (
        Fix(name="keras_backup.on_train_begin", issue=ISSUE, target=target("on_train_begin"),
            check=lambda f: (_patch.require_signature(f, "logs"), _check_callback(f)),
            make=_make_on_train_begin),
        Fix(name="keras_backup.on_train_batch_end", issue=ISSUE,
            target=target("on_train_batch_end"),
            check=lambda f: _patch.require_signature(f, "batch", "logs"),
            make=_make_on_train_batch_end),
        Fix(name="keras_backup.on_epoch_end", issue=ISSUE, target=target("on_epoch_end"),
            check=lambda f: _patch.require_signature(f, "epoch", "logs"),
            make=_make_on_epoch_end),
        Fix(name="keras_backup.on_train_end", issue=ISSUE, target=target("on_train_end"),
            check=lambda f: _patch.require_signature(f, "logs"), make=_make_on_train_end),
        Fix(name="keras_backup.save_model", issue=ISSUE, target=target("_save_model"),
            check=lambda f: _patch.require_signature(f), make=_make_save_model),
    )


NAMES: tuple[str, ...] = ("keras_backup.on_train_begin", "keras_backup.on_train_batch_end",
                          "keras_backup.on_epoch_end", "keras_backup.on_train_end",
                          "keras_backup.save_model")


def install() -> tuple[str, ...]:
    """Installs every fix once (idempotent), all or none. Returns the names installed now."""
    return install_all(_fixes())


def install_or_warn() -> bool:
    """`install()`, turning a refusal into a warning. True if active."""
    import warnings

    try:
        install()
    except _patch.CompatError as e:
        warnings.warn(
            f"tfdist could not make keras.callbacks.BackupAndRestore stop on SIGTERM and "
            f"resume mid-epoch ({e}); it keeps Keras's own behaviour. tfdist.BackupAndRestore "
            f"does both.", RuntimeWarning, stacklevel=2)
        return False
    return True


def uninstall() -> tuple[str, ...]:
    """Restores Keras's own BackupAndRestore. Returns the names removed."""
    return _patch.uninstall(NAMES)


__all__ = ["NAMES", "install", "install_or_warn", "uninstall"]

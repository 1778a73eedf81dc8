"""Keras's own file writers under MultiWorkerMirroredStrategy: one intact file, the chief's.

Every worker of a multi-worker job runs the same script, so
`ModelCheckpoint("ckpt.weights.h5")`, `model.save("m.keras")`,
`model.save_weights(...)`, `model.export(...)`, `TensorBoard(log_dir)`,
`CSVLogger(path)` and `BackupAndRestore(dir)` write one path from every
worker at once. tf_keras handled this (`distribute/distributed_file_utils.py`:
non-chief workers wrote to a temporary path that was then removed); Keras 3
dropped it, and the writes collide: h5py truncates a file before it takes its
lock, so a losing worker zeroes the winner's weights (the file still loads),
`.keras` archives end up as BadZipFile, SavedModels do not load, TensorBoard
gets one event file per worker, and Keras's BackupAndRestore dies with
"unable to lock file" at the end of epoch 1. Upstream: Keras 3's multi-worker
gaps are tracked in keras-team/keras#20585 (which is about `fit`; no Keras 3
report of the file collision was found); the same race under tf.keras, before
tf_keras handled it: tensorflow/tensorflow#38635, #31252.

What a worker may skip: nothing. Saving reads every variable, and reading a
sync-on-read variable (metrics, statistics kept per replica) in cross-replica
context is an all-reduce, so a worker that skips a save leaves the chief in a
collective nobody joins (measured: `save_weights` and `export` on the chief
alone, with one on-read variable, abort with "Shape mismatch in the
collective"). So, as tf_keras did, every worker runs the same save; only the
target differs:

- non-chief workers write into a fresh directory inside their scratch
  (`tfdist.chief.scratch_dir()`), removed right after the write (for
  TensorBoard when training ends; CSV files are unlinked as soon as they are
  open);
- the chief writes the user's path, atomically where the path is local: into
  a hidden sibling (`.tfdist-partial-<pid>-<name>`) that replaces the target
  once complete, so a kill during a save leaves the previous file intact.
  Partial siblings left by a killed chief are removed by its next save;
- every worker returns from a save once the chief's file is in place (a
  one-number all-reduce after the write), so a script that saves and then
  loads the path on every worker (keras.io's "save, then load_model") reads
  the chief's file instead of racing its write ("File not found").

Every fix passes straight through unless the model (or the exported
variables) belongs to a MultiWorkerMirroredStrategy made by tfdist that
spans more than one worker: a user's own strategy, a one-worker job and
plain Keras are untouched.

| fix | replaces | covers |
|---|---|---|
| save_model | `saving_lib.save_model` | `model.save("*.keras")`, `keras.saving.save_model`, ModelCheckpoint |
| save_weights | `saving_lib.save_weights_only` | `model.save_weights`, ModelCheckpoint(save_weights_only=True) |
| save_model_to_hdf5 | `legacy_h5_format.save_model_to_hdf5` | `model.save("*.h5")` |
| export | `SavedModelExportArchive.write_out` (Keras 3.14+), `ExportArchive.write_out` (3.10-3.13) | `model.export`, `keras.export.ExportArchive` |
| tensorboard.* | `TensorBoard.set_model`, `.on_train_end` | event files, profiles, projector config |
| csv_logger | `CSVLogger.on_train_begin` | the CSV file |
| backup_and_restore.* | `BackupAndRestore._save_model`, `.on_train_begin`, `.on_train_end` | the chief writes and deletes the backup, every worker restores the chief's copy |

`install_or_warn()` is called by the multi_worker_mirrored preset (a Keras
whose code changed under a fix gets a warning and Keras's own behaviour);
`uninstall()` puts every original back.
"""  # noqa: E501 (the table's rows)

from __future__ import annotations

import contextlib
import os
import shutil
import warnings
from typing import Any, Callable

from tfdist import chief as chief_lib
from tfdist import state as state_lib
from tfdist._tf import import_tensorflow
from tfdist.compat import _owner
from tfdist.compat._patch import (CompatError, Fix, install_all, passthrough,
                                  require_attributes, require_signature,
                                  uninstall as _uninstall)

ISSUE = ("keras-team/keras#20585 (Keras 3 under MultiWorkerMirroredStrategy); "
         "tensorflow/tensorflow#38635 (every worker saving one path)")

_PARTIAL = ".tfdist-partial-"
_OLD = ".tfdist-old-"

# --- who writes -------------------------------------------------------------------

def role(strategy: Any) -> str | None:
    """'chief' or 'other' under a multi-worker MWMS tfdist made; None (pass through) otherwise."""
    state = state_lib.state_of(strategy)
    if state is None:
        return None
    with state_lib.lock():
        if not state.file_role_known:
            state.file_role = None
            if is_multi_worker(strategy):
                state.file_role = "chief" if strategy.extended.should_checkpoint else "other"
            state.file_role_known = True
        return state.file_role


def _model_role(model: Any) -> str | None:
    return role(getattr(model, "_distribute_strategy", None))


def _archive_strategy(archive: Any) -> Any:
    trackable = getattr(archive, "_tf_trackable", None)
    for variable in getattr(trackable, "variables", None) or ():
        strategy = _owner.strategy_of_variable(variable)
        if strategy is not None:
            return strategy
    return None


def _archive_role(archive: Any) -> str | None:
    strategy = _archive_strategy(archive)
    return None if strategy is None else role(strategy)


def is_multi_worker(strategy: Any) -> bool:
    """True for a MultiWorkerMirroredStrategy (anyone's) that spans more than one worker."""
    tf = import_tensorflow()
    return (isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy)
            and strategy.extended._in_multi_worker_mode())


def set_initial_epoch(model: Any, epoch: int) -> None:
    """Makes the running `fit` start at `epoch`, as keras.callbacks.BackupAndRestore does.

    Raises:
      CompatError: this Keras version has no `Trainer._initial_epoch`.
    """
    require_attributes(model, "_initial_epoch", what="the Keras model (Trainer)")
    model._initial_epoch = epoch


def barrier(strategy: Any) -> None:
    """Returns once every worker of `strategy` has called it (a one-number all-reduce).

    The traced function is kept on the record of a strategy tfdist made (a
    user's strategy, under tfdist.BackupAndRestore, traces it each time).
    """
    tf = import_tensorflow()
    state = state_lib.state_of(strategy)
    with state_lib.lock():
        function = None if state is None else state.barrier
        if function is None:
            @tf.function
            def function():
                one = strategy.run(lambda: tf.constant(1.0))
                return strategy.reduce(tf.distribute.ReduceOp.SUM, one, axis=None)

            if state is not None:
                state.barrier = function
    function()


# --- where to write ---------------------------------------------------------------


def _is_path(filepath: Any) -> bool:
    return isinstance(filepath, (str, os.PathLike)) and bool(os.fspath(filepath))


def _is_local(path: str) -> bool:
    return "://" not in path


def _pid_of(name: str, prefix: str) -> int | None:
    head = name[len(prefix):].split("-", 1)[0]
    return int(head) if head.isdigit() else None


def sweep_partial_writes(path: str) -> None:
    """Removes the hidden siblings of `path` that killed writers left behind.

    A `.tfdist-old-<pid>-<name>` whose writer died between moving the old
    directory away and moving the new one in is moved back if `path` is
    missing (the previous save stays available).
    """
    parent, base = os.path.split(os.path.abspath(path))
    try:
        names = os.listdir(parent)
    except OSError:
        return
    for name in names:
        for prefix in (_PARTIAL, _OLD):
            if not (name.startswith(prefix) and name.endswith("-" + base)):
                continue
            pid = _pid_of(name, prefix)
            if pid is None or pid == os.getpid() or chief_lib.process_alive(pid):
                continue
            stale = os.path.join(parent, name)
            if prefix == _OLD and not os.path.lexists(path):
                os.replace(stale, path)
            elif os.path.isdir(stale) and not os.path.islink(stale):
                shutil.rmtree(stale, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):
                    os.remove(stale)


def _write_atomically(path: str, write: Callable[[str], Any], *, directory: bool) -> Any:
    parent, base = os.path.split(os.path.abspath(path))
    if (not _is_local(path) or not os.path.isdir(parent) or os.path.islink(path)
            or (os.path.lexists(path) and os.path.isdir(path) != directory)):
        return write(path)  # nothing to gain; Keras's own behaviour and errors
    sweep_partial_writes(path)
    partial = os.path.join(parent, f"{_PARTIAL}{os.getpid()}-{base}")
    _remove(partial)
    try:
        result = write(partial)
        if not directory:
            os.replace(partial, path)
        elif not os.path.exists(path):
            os.rename(partial, path)
        else:
            old = os.path.join(parent, f"{_OLD}{os.getpid()}-{base}")
            _remove(old)
            os.rename(path, old)
            os.rename(partial, path)
            _remove(old)
        return result
    except BaseException:
        _remove(partial)
        raise


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)


def write_as(who: str, filepath: Any, write: Callable[[Any], Any], *,
             directory: bool = False, atomic: bool = True) -> Any:
    """Runs `write(target)` with the target this worker should use for `filepath`.

    Args:
      who: 'chief' (the user's path, atomically when `atomic`) or 'other'
        (a fresh scratch directory, removed afterwards).
      filepath: the path every worker was given.
      write: does the save given the path to write.
      directory: the save writes a directory (SavedModel, unzipped model).
      atomic: the chief may write to a sibling and rename (False for saves
        that write several files next to `filepath`, e.g. sharded weights).
    """
    path = os.fspath(filepath)
    if who == "chief":
        return _write_atomically(path, write, directory=directory) if atomic else write(path)
    scratch = chief_lib.new_scratch("keras")
    try:
        name = os.path.basename(os.path.normpath(path)) or "out"
        return write(os.path.join(scratch, name))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def write_for_every_worker(strategy: Any, filepath: Any, write: Callable[[Any], Any],
                           **kwargs) -> Any:
    """`write_as` with this worker's role, then a barrier: every worker returns once the
    chief's file is complete (renamed into place), so a script that saves and then
    loads the path on every worker (keras.io's "save, then load_model") reads it."""
    try:
        return write_as(role(strategy), filepath, write, **kwargs)
    finally:
        barrier(strategy)


# --- the saving functions ---------------------------------------------------------


def _saving_lib():
    import_tensorflow()
    from keras.src.saving import saving_lib

    return saving_lib


def _legacy_h5():
    import_tensorflow()
    from keras.src.legacy.saving import legacy_h5_format

    return legacy_h5_format


def _export_archive_class():
    import_tensorflow()
    try:  # Keras 3.14+: one archive class per backend
        from keras.src.export.saved_model_export_archive import SavedModelExportArchive
    except ModuleNotFoundError:  # Keras 3.10-3.13: ExportArchive writes the SavedModel itself
        from keras.src.export.saved_model import ExportArchive

        return ExportArchive
    return SavedModelExportArchive


def _callbacks():
    import_tensorflow()
    import keras

    return keras.callbacks


def _applies_to_model(model, filepath, *args, **kwargs) -> bool:
    return _is_path(filepath) and _model_role(model) is not None


def _make_save_model(original):
    @passthrough(original, _applies_to_model)
    def save_model(model, filepath, *args, **kwargs):
        zipped = kwargs.get("zipped", args[1] if len(args) > 1 else True)
        return write_for_every_worker(model._distribute_strategy, filepath,
                                      lambda path: original(model, path, *args, **kwargs),
                                      directory=not zipped)

    return save_model


def _make_save_weights(original):
    @passthrough(original, _applies_to_model)
    def save_weights_only(model, filepath, *args, **kwargs):
        sharded = kwargs.get("max_shard_size", args[0] if args else None) is not None
        return write_for_every_worker(model._distribute_strategy, filepath,
                                      lambda path: original(model, path, *args, **kwargs),
                                      atomic=not sharded)

    return save_weights_only


def _make_save_hdf5(original):
    @passthrough(original, _applies_to_model)
    def save_model_to_hdf5(model, filepath, *args, **kwargs):
        return write_for_every_worker(model._distribute_strategy, filepath,
                                      lambda path: original(model, path, *args, **kwargs))

    return save_model_to_hdf5


def _make_write_out(original):
    @passthrough(original, lambda self, filepath, *a, **k: (
        _is_path(filepath) and _archive_role(self) is not None))
    def write_out(self, filepath, *args, **kwargs):
        return write_for_every_worker(_archive_strategy(self), filepath,
                                      lambda path: original(self, path, *args, **kwargs),
                                      directory=True)

    return write_out


# --- callbacks --------------------------------------------------------------------


def _callback_role(callback) -> str | None:
    return _model_role(getattr(callback, "_model", None) or getattr(callback, "model", None))


def _make_tensorboard_set_model(original):
    @passthrough(original, lambda self, model: _model_role(model) == "other")
    def set_model(self, model):
        previous = getattr(self, "_tfdist_scratch", None)
        scratch = chief_lib.new_scratch("tensorboard")
        log_dir = self.log_dir
        self.log_dir = scratch  # set_model derives every directory it writes from log_dir
        try:
            original(self, model)
        finally:
            self.log_dir = log_dir
        self._tfdist_scratch = scratch
        if previous:
            shutil.rmtree(previous, ignore_errors=True)

    return set_model


def _make_tensorboard_on_train_end(original):
    @passthrough(original, lambda self, *a, **k: getattr(self, "_tfdist_scratch", None))
    def on_train_end(self, logs=None):
        try:
            original(self, logs)
        finally:
            scratch, self._tfdist_scratch = self._tfdist_scratch, None
            shutil.rmtree(scratch, ignore_errors=True)

    return on_train_end


def _make_csv_on_train_begin(original):
    @passthrough(original, lambda self, *a, **k: _callback_role(self) == "other")
    def on_train_begin(self, logs=None):
        scratch = chief_lib.new_scratch("csv")
        filename = self.filename
        self.filename = os.path.join(scratch, os.path.basename(filename) or "log.csv")
        try:
            original(self, logs)
        finally:
            self.filename = filename
            # The open file lives on unlinked (POSIX) until on_train_end closes it.
            shutil.rmtree(scratch, ignore_errors=True)

    return on_train_begin


def _make_backup_save(original):
    @passthrough(original, lambda self, *a, **k: _callback_role(self) == "other")
    def _save_model(self):
        # The same save as the chief (its collectives must be matched); the
        # weights go to scratch (the save_weights fix) and nothing else is written.
        self.model.save_weights(filepath=self._weights_path, overwrite=True)

    return _save_model


def _make_backup_train_begin(original):
    @passthrough(original, lambda self, *a, **k: _callback_role(self) == "other")
    def on_train_begin(self, logs=None):
        # Keras falls back to the previous backup by copying it over the
        # damaged one; only the chief may write there, so the others load a
        # private copy of the previous backup (Keras loads only *.weights.h5).
        tf = import_tensorflow()
        try:
            self._load_model()
        except OSError:
            if not tf.io.gfile.exists(self._prev_weights_path):
                raise
            scratch = chief_lib.new_scratch("backup")
            latest = (self._weights_path, self._training_metadata_path)
            try:
                self._weights_path = os.path.join(scratch, "previous.weights.h5")
                tf.io.gfile.copy(self._prev_weights_path, self._weights_path)
                self._training_metadata_path = self._prev_training_metadata_path
                self._load_model()
            finally:
                self._weights_path, self._training_metadata_path = latest
                shutil.rmtree(scratch, ignore_errors=True)

    return on_train_begin


def _make_backup_train_end(original):
    @passthrough(original, lambda self, *a, **k: _callback_role(self) is not None)
    def on_train_end(self, logs=None):
        if _callback_role(self) == "chief":
            original(self, logs)
        # Nobody starts the next fit (and reads the backup folder) before the
        # chief has finished deleting it.
        barrier(self.model.distribute_strategy)

    return on_train_end


def _check_backup_and_restore(original) -> None:
    callbacks = _callbacks()
    require_attributes(callbacks.BackupAndRestore, "_load_model", "_save_model")
    probe = callbacks.BackupAndRestore("unused")
    require_attributes(probe, "_weights_path", "_training_metadata_path", "_prev_weights_path",
                       "_prev_training_metadata_path", what="keras.callbacks.BackupAndRestore()")


def _fixes() -> tuple[Fix, ...]:
    return (
        Fix(name="keras_files.save_model", issue=ISSUE,
            target=lambda: (_saving_lib(), "save_model"),
            check=lambda f: require_signature(f, "model", "filepath", "weights_format",
                                              "zipped"),
            make=_make_save_model),
        Fix(name="keras_files.save_weights", issue=ISSUE,
            target=lambda: (_saving_lib(), "save_weights_only"),
            check=lambda f: require_signature(f, "model", "filepath", "max_shard_size",
                                              "objects_to_skip"),
            make=_make_save_weights),
        Fix(name="keras_files.save_model_to_hdf5", issue=ISSUE,
            target=lambda: (_legacy_h5(), "save_model_to_hdf5"),
            check=lambda f: require_signature(f, "model", "filepath", "overwrite",
                                              "include_optimizer"),
            make=_make_save_hdf5),
        Fix(name="keras_files.export", issue=ISSUE,
            target=lambda: (_export_archive_class(), "write_out"),
            check=lambda f: require_signature(f, "filepath", "options", "verbose"),
            make=_make_write_out),
        Fix(name="keras_files.tensorboard.set_model", issue=ISSUE,
            target=lambda: (_callbacks().TensorBoard, "set_model"),
            check=lambda f: (require_signature(f, "model"),
                             require_attributes(_callbacks().TensorBoard(), "log_dir",
                                                "_close_writers")),
            make=_make_tensorboard_set_model),
        Fix(name="keras_files.tensorboard.on_train_end", issue=ISSUE,
            target=lambda: (_callbacks().TensorBoard, "on_train_end"),
            check=lambda f: require_signature(f, "logs"),
            make=_make_tensorboard_on_train_end),
        Fix(name="keras_files.csv_logger", issue=ISSUE,
            target=lambda: (_callbacks().CSVLogger, "on_train_begin"),
            check=lambda f: (require_signature(f, "logs"),
                             require_attributes(_callbacks().CSVLogger("unused.csv"),
                                                "filename")),
            make=_make_csv_on_train_begin),
        Fix(name="keras_files.backup_and_restore.save", issue=ISSUE,
            target=lambda: (_callbacks().BackupAndRestore, "_save_model"),
            check=lambda f: (require_signature(f), _check_backup_and_restore(f)),
            make=_make_backup_save),
        Fix(name="keras_files.backup_and_restore.on_train_begin", issue=ISSUE,
            target=lambda: (_callbacks().BackupAndRestore, "on_train_begin"),
            check=lambda f: require_signature(f, "logs"),
            make=_make_backup_train_begin),
        Fix(name="keras_files.backup_and_restore.on_train_end", issue=ISSUE,
            target=lambda: (_callbacks().BackupAndRestore, "on_train_end"),
            check=lambda f: require_signature(f, "logs"),
            make=_make_backup_train_end),
    )


NAMES: tuple[str, ...] = (
    "keras_files.save_model", "keras_files.save_weights", "keras_files.save_model_to_hdf5",
    "keras_files.export", "keras_files.tensorboard.set_model",
    "keras_files.tensorboard.on_train_end", "keras_files.csv_logger",
    "keras_files.backup_and_restore.save", "keras_files.backup_and_restore.on_train_begin",
    "keras_files.backup_and_restore.on_train_end")


def install() -> tuple[str, ...]:
    """Installs every fix once (idempotent), all or none. Returns the names installed now.

    Raises:
      CompatError: a Keras function is not shaped as the fix expects (then
        nothing is installed by this call).
    """
    return install_all(_fixes())


def install_or_warn() -> bool:
    """`install()`, turning a refusal into a warning (the preset stays usable). True if active."""
    try:
        install()
    except CompatError as e:
        warnings.warn(
            f"tfdist could not make Keras's file writers multi-worker safe ({e}). Under "
            "multi_worker_mirrored, every worker will write ModelCheckpoint, model.save, "
            "TensorBoard and BackupAndRestore files itself; pass paths through "
            "tfdist.chief_path() to avoid collisions.", RuntimeWarning, stacklevel=2)
        return False
    return True


def uninstall() -> tuple[str, ...]:
    """Restores Keras's own writers. Returns the names removed."""
    return _uninstall(NAMES)


__all__ = ["CompatError", "NAMES", "barrier", "install", "install_or_warn", "is_multi_worker",
           "role",
           "set_initial_epoch", "sweep_partial_writes", "uninstall", "write_as"]

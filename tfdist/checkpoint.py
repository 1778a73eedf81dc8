"""Multi-worker-safe backup, exact resume (mid-epoch too), and SIGTERM as a save point.

Keras 3's `keras.callbacks.BackupAndRestore` restores the epoch but not the
position in the data, so a resumed run differs from an uninterrupted one
(under tfdist's multi_worker_mirrored preset it at least writes once, from
the chief: tfdist.compat.keras_files). This callback:

- saves at the end of every epoch (or every `save_every_epochs`), or every
  `save_freq` steps, every variable reachable from the model and its
  optimizer, **keyed by its path in the object graph**
  (`model/encoder/dense/_kernel`; an optimizer slot by the path of the
  variable it belongs to: `optimizer/slots/model/encoder/dense/_kernel/momentum`),
  and the position: steps done and steps per epoch. Reordered variables of
  equal shape restore to the right place; a backup of another model is refused;
- reads the values on every worker (reading a sync-on-read variable is an
  all-reduce, so all workers must take part) into host memory, and writes
  them on the chief only, off the training thread (`async_write`; the next
  save or the end of `fit` waits for it), atomically (a temporary file,
  fsync, `os.replace`, then a small JSON pointer written the same way), so a
  kill at any moment leaves the previous complete backup;
- restores the same backup on every worker when training starts (all tasks
  read the chief's files: one machine or a shared file system), after
  checking every file it reads: a damaged, missing or foreign backup is a
  `BackupError` naming the file and what to do, never a silent restart from
  step 0 or a silent restore of wrong values (NaN/Inf included);
- restores the data position: with `backup.dataset(ds)` the input pipeline
  skips the batches already trained on, and a backup taken in the middle of
  an epoch resumes in the middle of that epoch (the first epoch of the
  resumed `fit` runs the steps that were left). This is exact when every
  fresh iterator of the dataset yields the same sequence (`repeat_shuffled`,
  or a seeded shuffle with `reshuffle_each_iteration=False`) and `fit` gets
  `steps_per_epoch`; `dataset()` warns once when the pipeline cannot resume
  exactly, naming why;
- makes SIGTERM a save point (`tfdist.preemption`): the tasks agree on a
  step boundary, save there, and exit with status 75.

    backup = tfdist.BackupAndRestore("/shared/backup", save_freq=200)
    train = backup.dataset(make_dataset())        # skips what was trained
    model.fit(train, epochs=10, steps_per_epoch=1000, callbacks=[backup])

Run under `tfdist launch --max_restarts=N`: a killed worker restarts the
group and training continues from the last backup.
"""

from __future__ import annotations

import collections
import json
import os
import re
import stat
import sys
import tempfile
import threading
import warnings
import zipfile
import zlib
from typing import Any

import numpy as np

from tfdist import chief as chief_lib

_STATE = "tfdist_backup.json"
_FORMAT = 3
_FILE = re.compile(r"backup-step(\d{12})\.npz")
_OLD_FILE = re.compile(r"backup-epoch(\d{6})\.npz")  # format 2 (tfdist 0.2): epoch ends only
_TMP = ".tmp-"
_MANIFEST = "manifest"
_MAX_POINTER_BYTES = 1 << 16
_SLOTS = "slots"


def backup_file_name(step: int) -> str:
    """The name of the backup taken after `step` steps."""
    return f"backup-step{step:012d}.npz"


class BackupError(ValueError):
    """A backup that cannot be resumed from. The message names the file and what to do."""


def _damaged(path: str, problem: str, backup_dir: str) -> BackupError:
    return BackupError(
        f"tfdist.BackupAndRestore cannot resume from {path}: {problem}. Restore the backup "
        f"from a copy, or delete {backup_dir} to start training from scratch.")


def _atomic_write_bytes(path: str, write) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=_TMP, dir=directory)
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


def _regular_file(path: str, backup_dir: str) -> None:
    """Raises unless `path` is a regular file (a FIFO would block the reader forever)."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        raise _damaged(path, "the file is missing", backup_dir) from None
    except OSError as e:
        raise _damaged(path, f"cannot read it ({e.strerror or e})", backup_dir) from None
    if not stat.S_ISREG(info.st_mode):
        kind = ("a symbolic link" if stat.S_ISLNK(info.st_mode) else "a directory"
                if stat.S_ISDIR(info.st_mode) else "not a regular file")
        raise _damaged(path, f"it is {kind}, not a file tfdist wrote", backup_dir)


def _is_int(value: Any, minimum: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def _check_position(data: Any, path: str, backup_dir: str) -> dict[str, Any]:
    """The pointer's position as {step, steps_per_epoch, file, format} (format 2 converted)."""
    if not isinstance(data, dict):
        raise _damaged(path, f"expected a JSON object, found {type(data).__name__}",
                       backup_dir)
    if data.get("format") == 1:
        raise BackupError(
            f"tfdist.BackupAndRestore cannot resume from {path}: it was written by an older "
            f"tfdist that saved variables by position, which cannot be matched safely. "
            f"Delete {backup_dir} to start training from scratch.")
    if data.get("format") not in (2, _FORMAT):
        raise _damaged(path, f"format is {data.get('format')!r}; this tfdist reads formats "
                       f"2 and {_FORMAT}", backup_dir)
    counter = "epoch" if data["format"] == 2 else "step"
    for key, minimum in ((counter, 1), ("steps_per_epoch", 1)):
        if not _is_int(data.get(key), minimum):
            raise _damaged(path, f"{key!r} must be an integer >= {minimum}, found "
                           f"{data.get(key)!r}", backup_dir)
    if data["format"] == 2:
        expected = f"backup-epoch{data['epoch']:06d}.npz"
        step = data["epoch"] * data["steps_per_epoch"]
    else:
        expected = backup_file_name(data["step"])
        step = data["step"]
    if data.get("file") != expected:
        raise _damaged(path, f"'file' must be {expected!r} (a file inside the folder), found "
                       f"{data.get('file')!r}", backup_dir)
    return {"format": data["format"], "step": step, "steps_per_epoch": data["steps_per_epoch"],
            "file": expected, "num_replicas": data.get("num_replicas")}


def read_state(backup_dir: str) -> dict[str, Any] | None:
    """The last complete backup's position (keys: step, steps_per_epoch, file), or None.

    None means there is no backup: the folder does not exist or holds no
    tfdist backup file. A folder with backup files but no readable, valid
    pointer is an error, so training never restarts from step 0 silently.

    Raises:
      BackupError: the backup is damaged (the message names the file).
    """
    backup_dir = os.fspath(backup_dir)
    if not os.path.lexists(backup_dir):
        return None
    if not os.path.isdir(backup_dir):
        raise BackupError(
            f"tfdist.BackupAndRestore: backup_dir {backup_dir} is not a directory. Pass a "
            f"directory path (it is created on the first backup).")
    try:
        names = sorted(os.listdir(backup_dir))
    except OSError as e:
        raise BackupError(f"tfdist.BackupAndRestore cannot list {backup_dir} "
                          f"({e.strerror or e}). Give this task read access to it.") from None
    path = os.path.join(backup_dir, _STATE)
    if not os.path.lexists(path):
        files = [n for n in names if _FILE.fullmatch(n) or _OLD_FILE.fullmatch(n)]
        if files:
            raise _damaged(path, f"the pointer file is missing but the folder holds "
                           f"{files[-1]}; tfdist will not silently start over from step 0",
                           backup_dir)
        return None
    _regular_file(path, backup_dir)
    try:
        with open(path, "rb") as f:
            raw = f.read(_MAX_POINTER_BYTES + 1)
    except OSError as e:
        raise _damaged(path, f"cannot read it ({e.strerror or e})", backup_dir) from None
    if len(raw) > _MAX_POINTER_BYTES:
        raise _damaged(path, f"it is larger than {_MAX_POINTER_BYTES} bytes: not a pointer "
                       f"tfdist wrote", backup_dir)
    try:
        state = json.loads(raw.decode("utf-8"), parse_constant=_reject_constant)
    except (UnicodeDecodeError, ValueError) as e:
        problem = "it is empty" if not raw.strip() else f"it is not valid JSON ({e})"
        raise _damaged(path, problem, backup_dir) from None
    state = _check_position(state, path, backup_dir)
    _regular_file(os.path.join(backup_dir, state["file"]), backup_dir)
    return state


def _reject_constant(name: str):
    raise ValueError(f"{name} is not a number JSON allows")


_PASS_GRAPH_SEED = 87654321  # TensorFlow's own default graph seed (random_seed.DEFAULT_GRAPH_SEED)


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

    def one_pass(epoch):
        # This runs while TensorFlow traces the dataset function (a graph). TF's
        # random_seed.get_seed compares (global seed, op seed) with (0, 0) in Python, which
        # fails for a tensor op seed ("Using a symbolic tf.Tensor as a Python bool") when the
        # user's global seed is 0 (keras.utils.set_random_seed(0)). Setting this function
        # graph's own seed (public API; only this graph) avoids that and makes the order
        # depend on `seed` alone, whatever the process's global seed.
        tf.compat.v1.set_random_seed(_PASS_GRAPH_SEED)
        return dataset.shuffle(buffer_size, seed=seed + epoch, reshuffle_each_iteration=False)

    return tf.data.Dataset.range(2**62).flat_map(one_pass)


# --- what is saved ----------------------------------------------------------------


def tracked_variables(model) -> "collections.OrderedDict[str, Any]":
    """Every variable reachable from `model` and its optimizer, keyed by object path.

    The walk follows the TensorFlow object graph (`tf.train.TrackableView`,
    the names `tf.train.Checkpoint` uses: attribute names, list indices,
    dict keys), breadth first with sorted names (public ones first), so a key
    does not depend on the order variables were created in. Keras optimizer slots are keyed by
    the variable they belong to (Keras names a slot `<variable path with
    '_'>_<slot>`), not by their position in the optimizer. Metrics are
    skipped: Keras resets them every epoch.

    Any other state kept in variables that the model, a layer or the
    optimizer holds as an attribute (directly or in a list/dict attribute) is
    included, e.g. error-feedback residuals kept on the optimizer.
    """
    from tfdist._tf import import_tensorflow

    tf = import_tensorflow()
    import keras

    roots = [("model", model)]
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None:
        roots.append(("optimizer", optimizer))
    found: dict[int, tuple[str, Any]] = {}
    seen: set[int] = set()
    # One root at a time, the model first (without its optimizer): the optimizer
    # also lists the model's variables (`_trainable_variables/0`), which must keep
    # their model path.
    for root in roots:
        queue = collections.deque([root])
        while queue:
            path, obj = queue.popleft()
            if id(obj) in seen:
                continue
            if obj is optimizer and path != "optimizer":
                continue  # walked as its own root
            seen.add(id(obj))
            if isinstance(obj, (keras.Variable, tf.Variable)):
                found[id(obj)] = (path, obj)
                continue
            if isinstance(obj, keras.metrics.Metric):
                continue
            try:
                children = tf.train.TrackableView(obj).children(obj)
            except (TypeError, AttributeError, ValueError):
                continue
            # Public attribute names first: a variable Keras also lists in a private,
            # positional collection (`_variables/3`) is keyed by the name it was given.
            for name in sorted(children, key=lambda n: (n.startswith("_"), n)):
                queue.append((f"{path}/{name}", children[name]))

    # Keras's own lists are the reference for what a model holds: what the graph
    # does not reach (a SeedGenerator's state) is keyed by its Keras path.
    for root, owner in (("model", model), ("optimizer", optimizer)):
        for variable in (getattr(owner, "variables", None) or ()) if owner is not None else ():
            if id(variable) not in found:
                found[id(variable)] = (f"{root}/keras_path/{variable.path}", variable)

    model_paths = {}
    for path, variable in found.values():
        if path.startswith("model/") and isinstance(variable, keras.Variable):
            model_paths[variable.path.replace("/", "_") + "_"] = path
    out: "collections.OrderedDict[str, Any]" = collections.OrderedDict()
    for path, variable in found.values():
        key = path
        if path.startswith("optimizer/") and isinstance(variable, keras.Variable):
            key = _slot_key(variable.name, model_paths) or path
        if key in out:  # two slots mapped to one key: keep both by graph path
            key = path
        out[key] = variable
    return out


def _slot_key(name: str, model_paths: dict[str, str]) -> str | None:
    matches = [prefix for prefix in model_paths
               if name.startswith(prefix) and len(name) > len(prefix)]
    if not matches:
        return None
    longest = max(len(m) for m in matches)
    best = [m for m in matches if len(m) == longest]
    if len(best) != 1:
        return None  # ambiguous names: the graph path is the safer key
    return f"optimizer/{_SLOTS}/{model_paths[best[0]]}/{name[longest:]}"


def _value(variable) -> np.ndarray:
    """The variable's value in host memory, owned by this array (so a later update or an
    asynchronous write cannot see another value)."""
    value = np.asarray(variable.numpy())
    return value if value.flags.owndata else value.copy()


def _non_finite(value: np.ndarray) -> bool:
    return value.dtype.kind in "fc" and not bool(np.isfinite(value).all())


def _check_save_freq(save_freq) -> None:
    if save_freq == "epoch":
        return
    if isinstance(save_freq, bool) or not isinstance(save_freq, int) or save_freq < 1:
        raise ValueError(f"save_freq must be 'epoch' or a number of steps >= 1. Received: "
                         f"save_freq={save_freq!r}")


# --- the callback ----------------------------------------------------------------


_warned: set[str] = set()


def _make_callback_base():
    from tfdist._tf import import_tensorflow

    import_tensorflow()
    import keras

    return keras.callbacks.Callback


class _Writer:
    """Writes one backup at a time off the training thread; errors surface on the next call."""

    def __init__(self):
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def submit(self, write, *, wait: bool) -> None:
        self.wait()
        if wait:
            write()
            return

        def run():
            try:
                write()
            except BaseException as e:  # noqa: BLE001 - handed to the training thread
                self._error = e

        # Not a daemon: a process that ends normally finishes the write first.
        self._thread = threading.Thread(target=run, name="tfdist-backup-writer")
        self._thread.start()

    def wait(self) -> None:
        """Returns once the last write is on disk; raises what it raised."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        error, self._error = self._error, None
        if error is not None:
            raise error


class BackupAndRestore(_make_callback_base()):
    """Backs up model + optimizer + data position on the chief; restores them on every worker.

    Args:
      backup_dir: directory for the backup (created on the chief). Every task
        must see the same directory (one machine, or a shared file system).
        Use it for nothing else: the callback deletes its own files in it.
      save_freq: "epoch" (back up after every `save_every_epochs`-th epoch),
        or a number of steps N: back up after every N-th step, counted from
        the start of training (mid-epoch backups resume mid-epoch). The end
        of the last epoch is backed up either way.
      save_every_epochs: with save_freq="epoch", back up after every N-th
        epoch (and the last).
      delete_on_finish: remove the backup when `fit` completes, like Keras's
        BackupAndRestore (so the next run starts fresh).
      async_write: write the file off the training thread (the values are
        copied to host memory first, on the training thread); the next save
        and the end of `fit` wait for it. False: write before training goes on.
      preemption: make SIGTERM a save point while `fit` runs: the tasks agree
        on a step, back up there and exit with status 75
        (`tfdist.preemption.PREEMPTED_EXIT_CODE`).

    Attributes:
      initial_epoch: epochs completed by the backup found at construction.
      initial_step: batches already trained (`initial_epoch * steps_per_epoch`
        plus the steps of the epoch the backup was taken in).

    Raises:
      BackupError: at construction, when `backup_dir` holds a damaged backup.
    """

    def __init__(self, backup_dir: str, *, save_freq: int | str = "epoch",
                 save_every_epochs: int = 1, delete_on_finish: bool = True,
                 async_write: bool = True, preemption: bool = True):
        super().__init__()
        if not isinstance(backup_dir, (str, os.PathLike)) or not os.fspath(backup_dir):
            raise ValueError(f"backup_dir must be a directory path. Received: "
                             f"backup_dir={backup_dir!r}")
        _check_save_freq(save_freq)
        if isinstance(save_every_epochs, bool) or not isinstance(
                save_every_epochs, int) or save_every_epochs < 1:
            raise ValueError(f"save_every_epochs must be an integer >= 1. Received: "
                             f"save_every_epochs={save_every_epochs!r}")
        self.backup_dir = os.fspath(backup_dir)
        self.save_freq = save_freq
        self.save_every_epochs = save_every_epochs
        self.delete_on_finish = delete_on_finish
        self.async_write = async_write
        self.preemption = preemption
        self._state = read_state(self.backup_dir)
        self._dataset_skipped: int | None = None
        self._dataset = None
        self._last_saved: int | None = None  # step of the last save handed to the writer
        self._is_chief = chief_lib.is_chief()
        self._writer = _Writer()
        self._save_point = None
        self._epoch = 0
        self._batch_begin = 0
        self._step = 0
        self._check_first_batch: int | None = None

    @property
    def initial_step(self) -> int:
        return 0 if self._state is None else int(self._state["step"])

    @property
    def initial_epoch(self) -> int:
        if self._state is None:
            return 0
        return int(self._state["step"]) // int(self._state["steps_per_epoch"])

    def dataset(self, dataset):
        """`dataset` minus the batches the backup already trained on.

        Pass the batched (global-batch) `tf.data.Dataset` you give to `fit`;
        make it deterministic (`repeat_shuffled`, or a seeded shuffle with
        `reshuffle_each_iteration=False`) for exact resume. Warns once when
        the pipeline cannot be resumed exactly, naming why.
        """
        from tfdist.compat import keras_files_data

        reasons = keras_files_data.inexact_resume_reasons(dataset)
        message = "; ".join(reasons)
        if reasons and message not in _warned:
            _warned.add(message)
            warnings.warn(
                f"tfdist.BackupAndRestore: this dataset cannot be resumed exactly after a "
                f"restart, because it has {message}. A resumed run will train on other "
                f"batches than an uninterrupted one. Fix: build it with "
                f"tfdist.checkpoint.repeat_shuffled(examples, buffer_size=N, seed=S) "
                f"(reshuffled every pass, the same in every process) or "
                f"shuffle(N, seed=S, reshuffle_each_iteration=False), and "
                f"deterministic=True for parallel map/interleave.", UserWarning, stacklevel=2)
        self._dataset_skipped = self.initial_step
        return dataset.skip(self.initial_step) if self.initial_step else dataset

    # -- Keras hooks -------------------------------------------------------------

    def on_train_begin(self, logs=None):
        steps = self.params.get("steps")
        self._step = 0
        self._last_saved = None
        self._check_first_batch = None
        if self._save_point is not None:
            self._save_point.close()  # the last fit with this callback raised
            self._save_point = None
        if self.preemption:
            # Before the restore: a SIGTERM while it runs is taken up at the first step.
            from tfdist import preemption
            from tfdist.compat import keras_files

            strategy = self.model.distribute_strategy
            self._save_point = preemption.SavePoint(
                strategy, save=self._preemption_save,
                multi_worker=keras_files.is_multi_worker(strategy))
            self._save_point.begin()
        if self._state is not None:
            try:
                self._resume(steps)
            except BaseException:
                if self._save_point is not None:
                    self._save_point.close()
                    self._save_point = None
                raise

    def _resume(self, steps) -> None:
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
        from tfdist.compat import keras_files, keras_resume

        keras_files.set_initial_epoch(self.model, self.initial_epoch)
        self._step = self.initial_step
        self._last_saved = self.initial_step
        in_epoch = self.initial_step % int(steps)
        if in_epoch:
            keras_resume.start_next_epoch_at(in_epoch, steps_per_execution=_steps_per_execution(
                self.model), what=f"the backup in {self.backup_dir}")
            self._check_first_batch = in_epoch
        replicas = self.model.distribute_strategy.num_replicas_in_sync
        saved_on = self._state.get("num_replicas")
        if saved_on and saved_on != replicas:
            print(f"tfdist.BackupAndRestore: resuming at step {self.initial_step} on "
                  f"{replicas} replica(s); the backup was made on {saved_on}. The global "
                  f"batch stays what the dataset yields; each replica now takes 1/{replicas} "
                  f"of it.", file=sys.stderr, flush=True)

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        self._batch_begin = batch

    def on_train_batch_end(self, batch, logs=None):
        steps = self.params.get("steps") or 0
        if self._check_first_batch is not None:
            expected, self._check_first_batch = self._check_first_batch, None
            if self._batch_begin != expected:
                raise BackupError(
                    f"tfdist.BackupAndRestore: resuming from {self.backup_dir} in the middle "
                    f"of epoch {self._epoch + 1}, fit should have started at batch {expected} "
                    f"of it but started at batch {self._batch_begin}. Pass this callback "
                    f"to fit together with the dataset from backup.dataset(ds).")
        self._step = self._epoch * steps + batch + 1
        stride = batch - self._batch_begin + 1
        if (self.save_freq != "epoch"
                and self._step // self.save_freq > (self._step - stride) // self.save_freq):
            self._save(self._step)
        if self._save_point is not None:
            self._save_point.step_done(self._step, stride)

    def on_epoch_end(self, epoch, logs=None):
        done = epoch + 1
        step = done * (self.params.get("steps") or 0)
        last = done == self.params.get("epochs")
        if self.save_freq == "epoch":
            due = done % self.save_every_epochs == 0 or last
        else:
            due = last
        if due and self._last_saved != step:
            self._save(step)

    def on_train_end(self, logs=None):
        if self._save_point is not None:
            save_point, self._save_point = self._save_point, None
            save_point.end(self._step)  # saves and exits if a SIGTERM came since the last step
        self._wait_for_writer()
        if self.delete_on_finish and not self.model.stop_training:
            if self._is_chief:
                self._remove_backup_files()
                try:
                    os.rmdir(self.backup_dir)
                except OSError:
                    pass  # not empty (the user's files) or already gone
            from tfdist.compat import keras_files

            strategy = self.model.distribute_strategy
            if keras_files.is_multi_worker(strategy):
                # Nobody reads the folder for the next fit before the chief emptied it.
                keras_files.barrier(strategy)

    # -- save / restore ----------------------------------------------------------

    def _variables(self):
        return tracked_variables(self.model)

    def _remove_backup_files(self, keep: tuple[str, ...] = ()) -> None:
        """Removes this callback's files in the folder (the pointer too) except `keep`."""
        try:
            names = os.listdir(self.backup_dir)
        except OSError:
            return
        for name in names:
            if name in keep:
                continue
            if (_FILE.fullmatch(name) or _OLD_FILE.fullmatch(name) or name.startswith(_TMP)
                    or name == _STATE):
                try:
                    os.remove(os.path.join(self.backup_dir, name))
                except OSError:
                    pass

    def _wait_for_writer(self) -> None:
        try:
            self._writer.wait()
        except OSError as e:
            raise BackupError(
                f"tfdist.BackupAndRestore cannot write a backup to {self.backup_dir} "
                f"({e.strerror or e}). Give the chief write access to it, free some space, "
                f"or choose another backup_dir.") from None

    def _describe(self, step: int) -> str:
        steps = self.params.get("steps") or 1
        epoch, in_epoch = divmod(step, steps)
        where = (f"end of epoch {epoch}" if not in_epoch
                 else f"step {in_epoch} of epoch {epoch + 1}")
        return f"step {step} ({where})"

    def _save(self, step: int, *, wait: bool = False) -> None:
        """Backs up the state after `step` steps (every worker calls it)."""
        steps = self.params.get("steps")
        if not steps:
            raise ValueError(
                "tfdist.BackupAndRestore needs fit(..., steps_per_epoch=N) to know the data "
                "position. Received: steps_per_epoch=None.")
        from tfdist.compat import ps_keras

        strategy = self.model.distribute_strategy
        if ps_keras.is_parameter_server_strategy(strategy):
            # The coordinator schedules steps ahead: the backup holds every scheduled step.
            from tfdist.ps import trainer

            trainer.coordinator_for(strategy).join()
        # Every worker reads every value in the same order: a read may be a collective.
        values = [(key, _value(variable)) for key, variable in self._variables().items()]
        self._last_saved = step
        if not self._is_chief:
            return
        bad = next((key for key, value in values if _non_finite(value)), None)
        if bad is not None:
            self._wait_for_writer()
            kept = self._kept()
            kept = f"the backup of {kept} is kept" if kept else "no backup is kept"
            warnings.warn(
                f"tfdist.BackupAndRestore: not backing up {self._describe(step)}: variable "
                f"{bad} holds NaN or Inf (training diverged); {kept}.", RuntimeWarning,
                stacklevel=2)
            return
        name = backup_file_name(step)
        position = {"format": _FORMAT, "step": step, "steps_per_epoch": int(steps)}
        manifest = {**position, "keys": [key for key, _ in values]}
        arrays = {f"v{i:05d}": value for i, (_, value) in enumerate(values)}
        arrays[_MANIFEST] = np.array(json.dumps(manifest))
        state = {**position, "file": name,
                 "num_replicas": int(strategy.num_replicas_in_sync)}
        describe = self._describe(step)

        def write():
            try:
                os.makedirs(self.backup_dir, exist_ok=True)
                # Partial files of a killed save go; the complete backup stays until the
                # pointer names the new one.
                current = self._on_disk()
                self._remove_backup_files(keep=(_STATE,) + ((current,) if current else ()))
                _atomic_write_bytes(os.path.join(self.backup_dir, name),
                                    lambda f: np.savez(f, **arrays))
                _atomic_write_bytes(os.path.join(self.backup_dir, _STATE),
                                    lambda f: f.write(json.dumps(state).encode()))
            except OSError as e:
                raise BackupError(
                    f"tfdist.BackupAndRestore cannot write the backup of {describe} to "
                    f"{self.backup_dir} ({e.strerror or e}). Give the chief write access to "
                    f"it, free some space, or choose another backup_dir.") from None
            self._remove_backup_files(keep=(_STATE, name))

        self._writer.submit(write, wait=wait or not self.async_write)

    def _on_disk(self) -> str | None:
        """The file the pointer names now, if any (read by the writer only)."""
        try:
            with open(os.path.join(self.backup_dir, _STATE)) as f:
                name = json.load(f).get("file")
        except (OSError, ValueError, AttributeError):
            return None
        return name if isinstance(name, str) else None

    def _kept(self) -> str | None:
        name = self._on_disk()
        match = _FILE.fullmatch(name or "")
        if match:
            return self._describe(int(match.group(1)))
        match = _OLD_FILE.fullmatch(name or "")
        return f"the end of epoch {int(match.group(1))}" if match else None

    def _preemption_save(self, step: int) -> str:
        """The save at the agreed preemption step: complete and on disk when this returns."""
        if self._last_saved != step:
            self._save(step, wait=True)
        self._wait_for_writer()
        from tfdist.compat import keras_files

        strategy = self.model.distribute_strategy
        if keras_files.is_multi_worker(strategy):
            from tfdist._tf import import_tensorflow

            tf = import_tensorflow()
            try:
                keras_files.barrier(strategy)  # the chief entered it with its file written
            except tf.errors.OpError:
                pass  # a peer that left the barrier first exited: the files say the rest
            state = read_state(self.backup_dir)
            if state is None or state["step"] != step:
                raise BackupError(
                    f"tfdist.BackupAndRestore: the tasks agreed to back up step {step} before "
                    f"exiting on SIGTERM, but {self.backup_dir} holds "
                    f"{'no backup' if state is None else 'step ' + str(state['step'])}: the "
                    f"chief did not finish it (it died, or cannot write there). The next run "
                    f"resumes from what is there.")
        who = "" if self._is_chief else "by the chief "
        return f"backup of {self._describe(step)} saved {who}in {self.backup_dir}"

    def _restore(self) -> None:
        optimizer = getattr(self.model, "optimizer", None)
        if optimizer is not None and not optimizer.built:
            with self.model.distribute_strategy.scope():
                optimizer.build(self.model.trainable_variables)
        variables = self._variables()
        path = os.path.join(self.backup_dir, self._state["file"])
        values = self._read_values(path)
        missing = [key for key in variables if key not in values]
        extra = [key for key in values if key not in variables]
        if missing or extra:
            parts = []
            if missing:
                parts.append(f"it has no value for {_some(missing)}")
            if extra:
                parts.append(f"this model and optimizer have nothing at {_some(extra)}")
            raise BackupError(
                f"tfdist.BackupAndRestore cannot resume from {path}: it was made by another "
                f"model or optimizer: {'; '.join(parts)}. Delete {self.backup_dir} to start "
                f"training from scratch.")
        for key, variable in variables.items():
            value = values[key]
            shape, dtype = tuple(variable.shape), _dtype_name(variable)
            if tuple(value.shape) != shape:
                raise BackupError(
                    f"tfdist.BackupAndRestore cannot resume from {path}: {key} has shape "
                    f"{tuple(value.shape)} in the backup and {shape} in this model: the "
                    f"backup is from another model. Delete {self.backup_dir} to start over.")
            if str(value.dtype) != dtype:
                raise _damaged(path, f"{key} is {value.dtype} in the backup and {dtype} in "
                               f"this model", self.backup_dir)
            if _non_finite(value):
                raise _damaged(path, f"{key} holds NaN or Inf", self.backup_dir)
        for key, variable in variables.items():
            variable.assign(values[key])

    def _read_values(self, path: str) -> dict[str, np.ndarray]:
        _regular_file(path, self.backup_dir)
        old = self._state["format"] == 2
        expected = ({"epoch": self._state["step"] // self._state["steps_per_epoch"]} if old
                    else {"step": self._state["step"]})
        expected["steps_per_epoch"] = self._state["steps_per_epoch"]
        try:
            with np.load(path, allow_pickle=False) as data:
                if not isinstance(data, np.lib.npyio.NpzFile):
                    raise ValueError("not an .npz archive")
                manifest = json.loads(str(data[_MANIFEST][()]), parse_constant=_reject_constant)
                keys = manifest.get("keys") if isinstance(manifest, dict) else None
                if (not isinstance(keys, list) or not all(isinstance(k, str) for k in keys)
                        or len(set(keys)) != len(keys)):
                    raise ValueError("its manifest has no list of distinct variable keys")
                for field, value in expected.items():
                    if manifest.get(field) != value:
                        raise ValueError(
                            f"it holds {field}={manifest.get(field)!r} but the pointer "
                            f"{_STATE} says {value!r}")
                values = {key: data[f"v{i:05d}"] for i, key in enumerate(keys)}
        except BackupError:
            raise
        except (OSError, EOFError, ValueError, KeyError, TypeError, zipfile.BadZipFile,
                zlib.error) as e:
            raise _damaged(path, f"it is damaged ({type(e).__name__}: {_one_line(e)})",
                           self.backup_dir) from None
        return values


def _steps_per_execution(model) -> int:
    value = getattr(model, "steps_per_execution", 1)
    try:
        return max(1, int(value))
    except (TypeError, ValueError):
        return 1


def _dtype_name(variable) -> str:
    dtype = variable.dtype
    return getattr(dtype, "name", None) or str(dtype)


def _some(keys: list[str]) -> str:
    more = f" (and {len(keys) - 3} more)" if len(keys) > 3 else ""
    return ", ".join(keys[:3]) + more


def _one_line(error: BaseException) -> str:
    text = " ".join(str(error).split())
    return text if len(text) <= 200 else text[:197] + "..."


__all__ = ["BackupAndRestore", "BackupError", "backup_file_name", "read_state", "repeat_shuffled",
           "tracked_variables"]

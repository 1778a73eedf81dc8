"""Only the chief writes: where each task of a multi-worker job may write.

Under MultiWorkerMirroredStrategy every worker runs the same script. If
each one writes checkpoints, SavedModels and TensorBoard logs to the same
path they collide. Some writes must still happen on every worker (saving a
model whose variables are sync-on-read runs an all-reduce per variable, so
a worker that skips the save leaves the chief waiting), so non-chief tasks
get a private scratch directory instead of no path at all.

    model.save(tfdist.chief_path("out/model.keras"))
    callbacks = [keras.callbacks.TensorBoard(tfdist.chief_path("out/logs"))]

Where scratch lives: inside `$TFDIST_SCRATCH_DIR` when it is set (a
per-job directory that `tfdist launch` may create and remove), else in the
system temporary directory. Each process has its own directory there,
`tfdist_<task>_<pid>_<random>`, deleted when the process exits. A process
killed by SIGKILL cannot delete its own: the next tfdist process on the
same machine that needs scratch removes the directories whose owner
process is gone (each holds a small `.owner` record: host, pid, start time).

No TensorFlow is imported here; the task comes from TF_CONFIG.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import socket
import stat
import sys
import tempfile
import threading
from typing import Mapping

from tfdist import cluster as cluster_lib

SCRATCH_ENV = "TFDIST_SCRATCH_DIR"
_PREFIX = "tfdist_"
_OWNER = ".owner"

_lock = threading.Lock()
_scratch: dict[str, str] = {}  # scratch root -> this process's directory in it


def _config(environ: Mapping[str, str] | None):
    return cluster_lib.tf_config_from_env(environ)


def is_chief(environ: Mapping[str, str] | None = None) -> bool:
    """True if this process is the task that writes: chief:0, else worker:0.

    Without TF_CONFIG (a one-process run) the process is the chief.

    Raises:
      TFConfigError: TF_CONFIG is set but invalid.
    """
    config = _config(environ)
    return True if config is None else config.is_chief


def task_name(environ: Mapping[str, str] | None = None) -> str:
    """'worker:1', 'chief:0', ... ('local' without TF_CONFIG)."""
    config = _config(environ)
    return "local" if config is None else f"{config.task_type}:{config.task_id}"


# Set by `tfdist launch` in every task: "main" or "all" (its --output).
OUTPUT_ENV = "TFDIST_OUTPUT"


def fit_verbose(environ: Mapping[str, str] | None = None, *, stream=None) -> int | str:
    """The `verbose` for `model.fit` in this task: progress shown once, readable where it goes.

        model.fit(dataset, epochs=3, verbose=tfdist.fit_verbose())

    - "auto" (Keras's progress bar) on the chief (worker 0 without one, or a
      one-process run) when its output is drawn live: a terminal, a notebook,
      or `tfdist launch` (which shows one bar for the job, and plain lines
      without escape codes when its own output is a pipe);
    - 2 (one plain line per epoch) on the chief writing to a file or pipe
      directly (SLURM's `srun`, Ray, `nohup`), where Keras's bar would be
      escape codes and carriage returns;
    - 0 on every other task (its progress repeats the chief's), unless
      `tfdist launch --output=all` asked for every task's output.

    Args:
      environ: the environment to read TF_CONFIG and TFDIST_OUTPUT from
        (default: os.environ).
      stream: where Keras writes (default: sys.stdout).

    Raises:
      TFConfigError: TF_CONFIG is set but invalid.
    """
    environ = os.environ if environ is None else environ
    launched = environ.get(OUTPUT_ENV)
    if launched != "all" and not is_chief(environ):
        return 0
    if launched is not None:
        return "auto"
    stream = sys.stdout if stream is None else stream
    try:
        live = bool(stream.isatty())
    except (AttributeError, ValueError, OSError):
        live = False
    return "auto" if live or "ipykernel" in sys.modules else 2


# --- scratch ----------------------------------------------------------------------


def scratch_root(environ: Mapping[str, str] | None = None) -> str:
    """The directory that holds every task's scratch: $TFDIST_SCRATCH_DIR or the temp dir.

    Raises:
      ValueError: TFDIST_SCRATCH_DIR names something that is not a directory
        and cannot be created.
    """
    environ = os.environ if environ is None else environ
    root = environ.get(SCRATCH_ENV, "").strip()
    if not root:
        return tempfile.gettempdir()
    try:
        os.makedirs(root, mode=0o700, exist_ok=True)
    except OSError as e:
        raise ValueError(
            f"{SCRATCH_ENV} must name a directory tfdist can create files in. Received: "
            f"{SCRATCH_ENV}={root!r} ({e.strerror or e}). Unset it to use the system "
            "temporary directory, or point it at a writable directory.") from None
    return root


def _process_start(pid: int) -> str | None:
    """The start time of `pid` in clock ticks since boot (Linux), or None if unknown."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(") ", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def process_alive(pid: int, start: str | None = None) -> bool:
    """True while process `pid` runs on this host (and, given `start`, is the same process)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # someone else's process: alive
    if start is not None:
        now = _process_start(pid)
        if now is not None and now != start:
            return False  # the pid was reused by another process
    return True


def sweep_stale_scratch(root: str) -> list[str]:
    """Removes scratch directories in `root` whose owner process has died.

    Only directories this user owns, made on this host by tfdist (with an
    `.owner` record) are considered; one whose owner is still running, or
    whose record cannot be read, is left alone.

    Returns:
      The paths removed.
    """
    removed = []
    host, uid = socket.gethostname(), os.getuid()
    try:
        names = os.listdir(root)
    except OSError:
        return removed
    for name in names:
        if not name.startswith(_PREFIX):
            continue
        path = os.path.join(root, name)
        try:
            info = os.lstat(path)
            if not stat.S_ISDIR(info.st_mode) or info.st_uid != uid:
                continue
            with open(os.path.join(path, _OWNER)) as f:
                owner = json.load(f)
            pid, start = int(owner["pid"]), owner.get("start")
            if owner.get("host") != host or pid == os.getpid() or process_alive(pid, start):
                continue
        except (OSError, ValueError, KeyError, TypeError):
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def _remove(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


def scratch_dir(environ: Mapping[str, str] | None = None) -> str:
    """This process's private scratch directory (created on first use, removed at exit).

    The first call also removes scratch left behind by killed processes
    (`sweep_stale_scratch`).
    """
    root = scratch_root(environ)
    with _lock:
        path = _scratch.get(root)
        if path is not None and os.path.isdir(path):
            return path
        sweep_stale_scratch(root)
        task = task_name(environ).replace(":", "")
        path = tempfile.mkdtemp(prefix=f"{_PREFIX}{task}_{os.getpid()}_", dir=root)
        with open(os.path.join(path, _OWNER), "w") as f:
            json.dump({"host": socket.gethostname(), "pid": os.getpid(),
                       "start": _process_start(os.getpid())}, f)
        _scratch[root] = path
        atexit.register(_remove, path)
        return path


def new_scratch(what: str, environ: Mapping[str, str] | None = None) -> str:
    """A fresh, empty directory inside `scratch_dir()`; the caller removes it when done."""
    return tempfile.mkdtemp(prefix=f"{what}_", dir=scratch_dir(environ))


def chief_path(path: str, environ: Mapping[str, str] | None = None) -> str:
    """`path` on the chief; a private throw-away path on every other task.

    Args:
      path: where the chief should write (a file or a directory).
      environ: the environment holding TF_CONFIG (default: os.environ).

    Returns:
      `path` itself on the chief. On other tasks, a path with the same base
      name inside this process's scratch directory (`scratch_dir()`), which
      is deleted when the process exits (or, after a SIGKILL, by the next
      tfdist process that needs scratch), so those tasks can run the same
      save code without touching the chief's files.

    Example:
      >>> model.save(tfdist.chief_path("out/model.keras"))  # doctest: +SKIP
    """
    if not isinstance(path, (str, os.PathLike)) or not str(path):
        raise ValueError(f"path must be a non-empty path string. Received: path={path!r}")
    path = os.fspath(path)
    config = _config(environ)
    if config is None or config.is_chief:
        return path
    name = os.path.basename(os.path.normpath(path)) or "out"
    return os.path.join(scratch_dir(environ), name)

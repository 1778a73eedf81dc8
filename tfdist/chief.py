"""Only the chief writes: where each task of a multi-worker job may write.

Under MultiWorkerMirroredStrategy every worker runs the same script. If
each one writes checkpoints, SavedModels and TensorBoard logs to the same
path they collide (Keras's BackupAndRestore fails with FileExistsError or an
HDF5 lock error). Some writes must still happen on every worker (e.g. saving
a model under MWMS runs collectives), so non-chief tasks get a private
temporary directory instead of no path at all, deleted when the process ends.

    model.save(tfdist.chief_path("out/model.keras"))
    callbacks = [keras.callbacks.TensorBoard(tfdist.chief_path("out/logs"))]

No TensorFlow is imported here; the task comes from TF_CONFIG.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
import threading
from typing import Mapping

from tfdist import cluster as cluster_lib

_lock = threading.Lock()
_task_dirs: dict[str, str] = {}


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


def _remove(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


def chief_path(path: str, environ: Mapping[str, str] | None = None) -> str:
    """`path` on the chief; a private throw-away path on every other task.

    Args:
      path: where the chief should write (a file or a directory).
      environ: the environment holding TF_CONFIG (default: os.environ).

    Returns:
      `path` itself on the chief. On other tasks, a path with the same base
      name inside a per-task temporary directory that is deleted when the
      process exits, so those tasks can run the same save code without
      touching the chief's files.

    Example:
      >>> model.save(tfdist.chief_path("out/model.keras"))  # doctest: +SKIP
    """
    if not isinstance(path, (str, os.PathLike)) or not str(path):
        raise ValueError(f"path must be a non-empty path string. Received: path={path!r}")
    path = os.fspath(path)
    config = _config(environ)
    if config is None or config.is_chief:
        return path
    key = f"{config.task_type}{config.task_id}"
    with _lock:
        base = _task_dirs.get(key)
        if base is None:
            base = tempfile.mkdtemp(prefix=f"tfdist_{key}_")
            _task_dirs[key] = base
            atexit.register(_remove, base)
    name = os.path.basename(os.path.normpath(path)) or "out"
    return os.path.join(base, name)

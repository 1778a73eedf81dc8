"""A scratch directory per launched job: `TFDIST_SCRATCH_DIR` in every task's environment.

The launcher creates it (mode 0700, in the system's temporary directory) before
the first task starts, keeps it across restarts, and removes it when the job
ends. Tasks write what must not outlive the job there (`tfdist.chief_path`
puts non-chief writes under it), so even a SIGKILLed task leaves nothing
behind. If the launcher itself is SIGKILLed, the directory stays until the
next launcher of the same user starts: each job holds an exclusive lock on
`<dir>/.lock` for its lifetime, and a directory whose lock is free belongs to
a dead job and is removed.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile

# The name tfdist.chief reads (its SCRATCH_ENV): task scratch goes inside.
ENV_VAR = "TFDIST_SCRATCH_DIR"
_PREFIX = "tfdist-job-"


def _remove_stale(root: str) -> None:
    try:
        names = os.listdir(root)
    except OSError:
        return
    uid = os.geteuid()
    for name in names:
        if not name.startswith(_PREFIX):
            continue
        path = os.path.join(root, name)
        try:
            if os.lstat(path).st_uid != uid or os.path.islink(path):
                continue
            fd = os.open(os.path.join(path, ".lock"), os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # a live job holds it
        finally:
            os.close(fd)
        shutil.rmtree(path, ignore_errors=True)


class JobDir:
    """Creates the job's scratch directory and removes it on `close()`."""

    def __init__(self, root: str | None = None):
        root = root or tempfile.gettempdir()
        _remove_stale(root)
        self.path = tempfile.mkdtemp(prefix=_PREFIX, dir=root)
        self._lock_fd = os.open(os.path.join(self.path, ".lock"),
                                os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        fcntl.flock(self._lock_fd, fcntl.LOCK_EX)

    def close(self) -> None:
        if self._lock_fd >= 0:
            shutil.rmtree(self.path, ignore_errors=True)
            os.close(self._lock_fd)
            self._lock_fd = -1

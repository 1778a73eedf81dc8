"""The error parameter-server training raises when it cannot continue."""

from __future__ import annotations

import contextlib
from typing import Iterator


class ParameterServerError(RuntimeError):
    """A parameter server (or every worker) was lost: training cannot continue in this process."""


@contextlib.contextmanager
def lost_ps_is_an_error() -> Iterator[None]:
    """Turns a lost parameter server into ParameterServerError with the fix."""
    from tfdist.compat import ps_keras

    try:
        yield
    except ps_keras.ps_unavailable_errors() as e:
        raise ParameterServerError(
            "Lost a parameter server (or the whole cluster) during training: "
            f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300]}. Variables live on "
            "the ps tasks, so this process cannot continue. Restart the job and resume "
            "from the last checkpoint (keras.callbacks.BackupAndRestore or "
            "ModelCheckpoint; `tfdist launch --max_restarts=R` restarts it for you)."
        ) from e

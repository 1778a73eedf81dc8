"""The errors parameter-server training raises when it cannot continue, and what they mean."""

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


# TensorFlow's words when a graph sent to another process uses an op that process lacks.
_OP_NOT_REGISTERED = "Op type not registered"


@contextlib.contextmanager
def missing_worker_ops_explained() -> Iterator[None]:
    """Turns "Op type not registered ... in binary running on ..." into a ValueError with the fix.

    Workers and parameter servers started from TF_CONFIG run in their own
    processes and have only the ops of the libraries imported there before
    `tfdist.make_strategy(...)`, where they start serving and never return. A
    pipeline or model that uses ops of a library imported later (KerasHub's
    tokenizers use tensorflow_text's) then fails on the worker.
    """
    try:
        yield
    except Exception as e:
        text = str(e)
        if _OP_NOT_REGISTERED not in text:
            raise
        line = next(l for l in text.splitlines() if _OP_NOT_REGISTERED in l).strip()
        op = line.split(_OP_NOT_REGISTERED, 1)[1].split()[0].strip("'\"")
        raise ValueError(
            f"A worker or parameter server has no op {op!r}: the steps or the input pipeline "
            "use an op of a library that was not imported in that task's process. Workers "
            "and parameter servers import only what your script imports before "
            "`tfdist.make_strategy(...)` (there they start serving and never return). Import "
            "the library (e.g. `import keras_hub` or `import tensorflow_text`, whose ops "
            "KerasHub's tokenizers use) at the top of the script, before make_strategy. "
            f"TensorFlow said: {line[:300]}") from e

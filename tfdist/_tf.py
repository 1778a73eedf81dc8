"""Imports TensorFlow once, without its C++ start-up chatter.

A bare `import tensorflow` prints 4-6 stderr lines (oneDNN notice, CPU
feature guard, CUDA probing) before absl logging starts, so
TF_CPP_MIN_LOG_LEVEL alone cannot hide them, and TF_ENABLE_ONEDNN_OPTS=0
(the only env switch that does) changes kernels and numerics. Instead we
capture file descriptor 2 while TensorFlow imports and probes its devices,
drop the lines that are TensorFlow's start-up log, and replay anything else
(or everything, if the import fails).

Start-up logs come back when the user sets TF_CPP_MIN_LOG_LEVEL themselves
(the usual env var) or TFDIST_VERBOSE=1 (what `--verbosity>=1` sets).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import tempfile

_TF_STARTUP_LINE = re.compile(
    r"^([IWEF]\d{4} |WARNING: All log messages before absl::InitializeLog|"
    r"To enable the following instructions|"
    r"\S*\.(cc|h):\d+\] )"
)


def quiet_requested() -> bool:
    """True unless the user asked for TensorFlow's own start-up logs."""
    if os.environ.get("TFDIST_VERBOSE", "") not in ("", "0"):
        return False
    return "TF_CPP_MIN_LOG_LEVEL" not in os.environ or os.environ.get(
        "TFDIST_QUIET_SET_LOG_LEVEL"
    ) == "1"


@contextlib.contextmanager
def _stderr_filtered():
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as sink:
        os.dup2(sink.fileno(), 2)
        failed = True
        try:
            yield
            failed = False
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            text = sink.read().decode("utf-8", "replace")
            kept = [
                line
                for line in text.splitlines()
                if failed or not _TF_STARTUP_LINE.match(line)
            ]
            if kept:
                sys.stderr.write("\n".join(kept) + "\n")


def import_tensorflow():
    """Returns the `tensorflow` module, imported quietly the first time.

    Call it before `import keras` (which imports TensorFlow itself) to keep
    TensorFlow's C++ start-up lines out of your output:

        tf = tfdist.import_tensorflow()
        import keras
    """
    if "tensorflow" in sys.modules:
        tensorflow = sys.modules["tensorflow"]
        if quiet_requested():
            _quiet_python_logs(tensorflow, unless_set=True)
        return tensorflow
    if not quiet_requested():
        import tensorflow

        return tensorflow
    # Hide C++ INFO/WARNING for the life of the process (errors still show);
    # mark that we, not the user, set it, so child processes stay quiet too.
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    os.environ["TFDIST_QUIET_SET_LOG_LEVEL"] = "1"
    with _stderr_filtered():
        import tensorflow

        # Probing physical devices prints the CUDA/cuInit lines; it does not
        # initialise the runtime, so logical devices can still be configured.
        tensorflow.config.list_physical_devices()
    _quiet_python_logs(tensorflow)
    return tensorflow


def _quiet_python_logs(tensorflow, *, unless_set: bool = False) -> None:
    """TensorFlow's Python INFO lines off; warnings and errors still show.

    Under absl (`app.run`: INFO by default) TensorFlow logs "Using MirroredStrategy
    with devices ...", which tfdist's summary repeats, and "Collective all_reduce
    tensors ..." at every traced step. `unless_set`: TensorFlow was imported by
    someone else, so a level they chose for its logger stays.
    """
    get_logger = getattr(tensorflow, "get_logger", None)  # None while TensorFlow imports
    if get_logger is None:
        return
    logger = get_logger()
    if not unless_set or logger.level == logging.NOTSET:
        logger.setLevel(logging.WARNING)

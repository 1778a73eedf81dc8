"""Builds MultiWorkerMirroredStrategy the way the multi_worker_mirrored preset needs it.

What tfdist adds to `tf.distribute.MultiWorkerMirroredStrategy()`:
- TF_CONFIG is validated first (tfdist.cluster), so a bad cluster is a clear
  ValueError instead of a gRPC error or a hang; no TF_CONFIG = one worker.
- NCCL without GPUs is rejected before anything starts (TensorFlow accepts
  it and fails at the first all-reduce).
- The Keras 3 fixes for `model.fit` are applied (tfdist.compat.keras_multi_worker).
- A join timeout: TensorFlow's constructor blocks until every task has
  joined, forever. The blocking call is in C++ and cannot be interrupted from
  Python (it holds the GIL), so a small watchdog process prints a message
  naming the tasks whose servers never came up (found by connecting to each
  peer's port) and SIGKILLs the task after `join_timeout` seconds.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import time

from tfdist import cluster as cluster_lib
from tfdist import config as config_lib
from tfdist._tf import import_tensorflow

logger = logging.getLogger("tfdist")

# The first words of the join-timeout message (the launcher looks for them).
JOIN_TIMEOUT_MARKER = "gave up after waiting"


def _port_open(address: str, timeout: float = 1.0) -> bool:
    host, port = cluster_lib.split_address(address)
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def missing_tasks(config: cluster_lib.TFConfig) -> list[str]:
    """Training tasks (other than this one) whose address accepts no connection."""
    out = []
    for task_type, task_id in config.cluster.tasks():
        if task_type not in ("chief", "worker"):
            continue
        if (task_type, task_id) == (config.task_type, config.task_id):
            continue
        address = config.cluster.address(task_type, task_id)
        if not _port_open(address):
            out.append(f"{task_type}:{task_id} ({address})")
    return out


def join_timeout_message(config: cluster_lib.TFConfig, timeout: float,
                         missing: list[str]) -> str:
    me = f"{config.task_type}:{config.task_id}"
    if missing:
        what = (f"these tasks never joined: {', '.join(missing)} (nothing listens on their "
                f"ports)")
    else:
        what = ("every task's port answers, but the group did not form; check that all "
                "tasks were started with the same TF_CONFIG cluster")
    return (f"tfdist: MultiWorkerMirroredStrategy on task {me} gave up after waiting "
            f"{timeout:g} s for the cluster ({config.cluster.sizes()}): {what}. Start every "
            f"task listed in TF_CONFIG (e.g. with `tfdist launch --num_workers=N -- python "
            f"script.py`), or raise --join_timeout.")


@contextlib.contextmanager
def join_watchdog(config: cluster_lib.TFConfig | None, timeout: float):
    """Kills this process if the block inside does not finish within `timeout` s.

    TensorFlow's constructor blocks in C++ while holding the GIL, so a Python
    thread cannot watch it. The watchdog is a small separate process (no
    TensorFlow): when the block ends (or this process dies) its stdin closes
    and it exits; after `timeout` s it prints the message naming the tasks
    that never joined to our stderr and SIGKILLs this process.

    Args:
      config: this task's TF_CONFIG (None: one worker, nothing to wait for).
      timeout: seconds.
    """
    if config is None or config.cluster.num_training_tasks < 2 or config.task_type not in (
            "chief", "worker"):
        yield
        return
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, TF_CONFIG=config.to_json(),
               PYTHONPATH=package_root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    watchdog = subprocess.Popen(
        [sys.executable, "-c", "from tfdist.multi_worker import _watchdog_main; "
         "_watchdog_main()", str(os.getpid()), repr(float(timeout))],
        stdin=subprocess.PIPE, env=env, close_fds=True)
    try:
        yield
    finally:
        watchdog.stdin.close()
        try:
            watchdog.wait(timeout=10)
        except subprocess.TimeoutExpired:
            watchdog.kill()
            watchdog.wait()


def _watchdog_main() -> None:
    """The watchdog process: argv = [parent pid, timeout]; TF_CONFIG in the env."""
    parent, timeout = int(sys.argv[1]), float(sys.argv[2])
    readable, _, _ = select.select([sys.stdin], [], [], timeout)
    if readable:  # the parent finished joining, or died
        return
    config = cluster_lib.tf_config_from_env()
    message = join_timeout_message(config, timeout, missing_tasks(config))
    sys.stderr.write(message + "\n")
    sys.stderr.flush()
    try:
        os.kill(parent, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _communication_options(tf, options: config_lib.MultiWorkerMirroredOptions):
    impl = tf.distribute.experimental.CommunicationImplementation
    return tf.distribute.experimental.CommunicationOptions(
        bytes_per_pack=options.bytes_per_pack,
        timeout_seconds=options.collective_timeout,
        implementation={"auto": impl.AUTO, "ring": impl.RING,
                        "nccl": impl.NCCL}[options.communication],
    )


def build_strategy(options: config_lib.MultiWorkerMirroredOptions):
    """MultiWorkerMirroredStrategy from validated options and this process's TF_CONFIG.

    Raises:
      ValueError: invalid TF_CONFIG (TFConfigError), a cluster with parameter
        servers, a ps task, or communication='nccl' without GPUs.
    """
    config = cluster_lib.tf_config_from_env()
    if config is None and os.environ.get("TF_CONFIG") not in (None, "{}"):
        # tfdist reads a blank TF_CONFIG as "no cluster"; TensorFlow's resolver
        # would fail to parse it. Say the same thing in TensorFlow's words.
        os.environ["TF_CONFIG"] = "{}"
    if config is not None:
        cluster_lib.check_cluster_for(config, "multi_worker_mirrored")
        if config.task_type not in ("chief", "worker", "evaluator"):
            raise ValueError(
                f"multi_worker_mirrored runs on chief and worker tasks. Received: "
                f"TF_CONFIG task {config.task_type}:{config.task_id}. Fix the task type.")
    tf = import_tensorflow()
    if options.communication == "nccl" and not tf.config.list_physical_devices("GPU"):
        raise ValueError(
            "communication='nccl' needs GPUs on every worker; NCCL has no CPU kernels, so "
            "training would fail at its first all-reduce. Received: communication='nccl' "
            "on a machine with no GPU. Use communication='ring' or 'auto'.")
    from tfdist.compat import keras_multi_worker, tf_state

    if config is not None and tf_state.runtime_started():
        raise RuntimeError(
            "MultiWorkerMirroredStrategy must be created before TensorFlow's runtime starts "
            "(collective ops are configured at start-up), but this process already ran "
            "TensorFlow ops or listed logical devices. Create the strategy first thing in the "
            "script, and do not split the CPU into logical devices (MultiWorkerMirrored uses "
            "one device per worker on CPUs).")
    keras_multi_worker.install()
    start = time.monotonic()
    with join_watchdog(config, options.join_timeout):
        strategy = tf.distribute.MultiWorkerMirroredStrategy(
            communication_options=_communication_options(tf, options))
    logger.info("tfdist: %s joined the cluster in %.1f s",
                "local" if config is None else f"{config.task_type}:{config.task_id}",
                time.monotonic() - start)
    return strategy

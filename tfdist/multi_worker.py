"""Builds MultiWorkerMirroredStrategy the way the multi_worker_mirrored preset needs it.

What tfdist adds to `tf.distribute.MultiWorkerMirroredStrategy()`:
- TF_CONFIG is validated first (tfdist.cluster), so a bad cluster is a clear
  ValueError instead of a gRPC error or a hang; no TF_CONFIG = one worker.
- NCCL without GPUs is rejected before anything starts (TensorFlow accepts
  it and fails at the first all-reduce).
- The Keras 3 fixes for `model.fit` (tfdist.compat.keras_multi_worker, keras_files)
  are the preset's features, attached by `tfdist.make_strategy`.
- A join timeout: TensorFlow's constructor blocks until every task has
  joined, forever (and a one-task cluster whose own address is not this
  machine, forever too). The blocking call is in C++ and cannot be
  interrupted from Python (it holds the GIL, so SIGTERM waits too), so a small
  watchdog process prints a message naming the tasks whose servers never came
  up (found by connecting to each peer's port), or what is wrong with this
  task's own address, and SIGKILLs the task after `join_timeout` seconds.
- This task's port is checked first: taken, it is a ValueError naming the
  port instead of TensorFlow's "Could not start gRPC server".
- A second strategy in the same process (keras.io's guides make one per
  `run_training()` call) runs on the server the first one started, with
  collective keys of its own (tfdist.compat.collective_keys); TensorFlow's own
  constructor would reconfigure the running server. It must come from the
  same TF_CONFIG: TensorFlow serves one cluster per process.
"""

from __future__ import annotations

import contextlib
import errno
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


def own_address_problem(config: cluster_lib.TFConfig) -> str | None:
    """Why this task's own address cannot be this machine, if it plainly cannot.

    TensorFlow serves on the port of the task's own TF_CONFIG entry and then
    reaches itself through the host name: a host that does not resolve, or that
    names another machine, makes the constructor wait forever.
    """
    address = config.cluster.address(config.task_type, config.task_id)
    host, _ = cluster_lib.split_address(address)
    host = host.strip("[]")
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as e:
        return (f"this task's own address {address} does not resolve "
                f"({getattr(e, 'strerror', None) or e}): its entry in TF_CONFIG must name this "
                f"machine")
    for family, _, _, _, sockaddr in infos:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((sockaddr[0], 0))
                return None
            except OSError:
                continue
    ips = sorted({info[4][0] for info in infos})
    return (f"this task's own address {address} resolves to {', '.join(ips)}, which is not an "
            f"address of this machine: its entry in TF_CONFIG must name this machine")


def check_own_port(config: cluster_lib.TFConfig) -> None:
    """Raises if this task's port is taken, before TensorFlow's server tries it.

    TensorFlow binds the wildcard address on that port and, when it is taken,
    fails with "UnknownError: Could not start gRPC server" without the port.
    """
    address = config.cluster.address(config.task_type, config.task_id)
    _, port = cluster_lib.split_address(address)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        # gRPC sets SO_REUSEADDR too: connections in TIME_WAIT do not count as "taken".
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("0.0.0.0", port))
        except OSError as e:
            if e.errno != errno.EADDRINUSE:
                return
            raise ValueError(
                f"Port {port} of this task ({config.task_type}:{config.task_id}, {address}) is "
                f"already in use on this machine, so TensorFlow cannot start its server there. "
                f"Received: TF_CONFIG with {config.task_type}:{config.task_id} at {address}. "
                f"Stop the process holding the port, or give this task a free port in "
                f"TF_CONFIG (`tfdist tf-config --local` picks free ones).") from None


def join_timeout_message(config: cluster_lib.TFConfig, timeout: float,
                         missing: list[str], own_problem: str | None = None) -> str:
    me = f"{config.task_type}:{config.task_id}"
    if own_problem:
        what = own_problem
    elif missing:
        what = (f"these tasks never joined: {', '.join(missing)} (nothing listens on their "
                f"ports)")
    elif config.cluster.num_training_tasks < 2:
        what = ("this one-task cluster never formed, although nothing seems wrong with its "
                "address")
    else:
        what = ("every task's port answers, but the group did not form; check that all "
                "tasks were started with the same TF_CONFIG cluster")
    fix = ("Fix this task's entry in TF_CONFIG" if own_problem else
           "Start every task listed in TF_CONFIG (e.g. with `tfdist launch --num_workers=N -- "
           "python script.py`)")
    return (f"tfdist: MultiWorkerMirroredStrategy on task {me} gave up after waiting "
            f"{timeout:g} s for the cluster ({config.cluster.sizes()}): {what}. {fix}, or "
            f"raise --join_timeout.")


@contextlib.contextmanager
def join_watchdog(config: cluster_lib.TFConfig | None, timeout: float):
    """Kills this process if the block inside does not finish within `timeout` s.

    TensorFlow's constructor blocks in C++ while holding the GIL, so a Python
    thread cannot watch it. The watchdog is a small separate process (no
    TensorFlow): when the block ends (or this process dies) its stdin closes
    and it exits; after `timeout` s it prints the message naming the tasks
    that never joined to our stderr and SIGKILLs this process.

    It runs for every TF_CONFIG, a one-task cluster too: TensorFlow also waits
    forever there when the task's own address is not this machine. First, this
    task's port is checked (`check_own_port`).

    Args:
      config: this task's TF_CONFIG (None: one worker, nothing to wait for).
      timeout: seconds.

    Raises:
      ValueError: this task's port is already in use.
    """
    if config is None or config.task_type not in ("chief", "worker"):
        yield
        return
    check_own_port(config)
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
    message = join_timeout_message(config, timeout, missing_tasks(config),
                                   own_address_problem(config))
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

    The multi_worker_mirrored preset's factory: `tfdist.make_strategy` then
    attaches the preset's features (the Keras fixes among them).

    Raises:
      ValueError: invalid TF_CONFIG (TFConfigError), a cluster with parameter
        servers, a ps task, or communication='nccl' without GPUs.
    """
    config = cluster_lib.tf_config_from_env()
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
    from tfdist.compat import tf_state

    if config is not None and _joined_cluster is not None:
        return _another_strategy(tf, config, options)
    if config is not None and tf_state.runtime_started():
        raise RuntimeError(
            "MultiWorkerMirroredStrategy must be created before TensorFlow's runtime starts "
            "(collective ops are configured at start-up), but this process already ran "
            "TensorFlow ops or listed logical devices. Create the strategy first thing in the "
            "script, and do not split the CPU into logical devices (MultiWorkerMirrored uses "
            "one device per worker on CPUs).")
    start = time.monotonic()
    with join_watchdog(config, options.join_timeout):
        strategy = tf.distribute.MultiWorkerMirroredStrategy(
            communication_options=_communication_options(tf, options))
    logger.info("tfdist: %s joined the cluster in %.1f s",
                "local" if config is None else f"{config.task_type}:{config.task_id}",
                time.monotonic() - start)
    from tfdist import preemption

    # TensorFlow's coordination agent installed a C++ SIGTERM handler that only records
    # the signal; outside a fit with a backup, SIGTERM ends the process again.
    preemption.default_sigterm()
    if config is not None:
        _set_joined_cluster(config)
    return strategy


# The TF_CONFIG this process's first multi-worker strategy joined: its server runs until the
# process ends, and later strategies in the same process run on it.
_joined_cluster: cluster_lib.TFConfig | None = None


def _set_joined_cluster(config: cluster_lib.TFConfig) -> None:
    global _joined_cluster
    _joined_cluster = config


def _another_strategy(tf, config: cluster_lib.TFConfig,
                      options: config_lib.MultiWorkerMirroredOptions):
    """A further strategy on the cluster this process joined (same TF_CONFIG required)."""
    from tfdist.compat import collective_keys

    if config != _joined_cluster:
        raise RuntimeError(
            "This process already joined a multi-worker cluster as task "
            f"{_joined_cluster.task_type}:{_joined_cluster.task_id} "
            f"({_joined_cluster.cluster.sizes()}), and TensorFlow serves one cluster per "
            f"process. Received: TF_CONFIG with task {config.task_type}:{config.task_id} of "
            f"{config.cluster.sizes()}, different from the first. Make every strategy of a "
            "process from the same TF_CONFIG, or start a new process for the other cluster.")
    strategy = collective_keys.joined_multi_worker_strategy(_communication_options(tf, options))
    logger.info("tfdist: another strategy on the cluster %s:%s joined", config.task_type,
                config.task_id)
    return strategy

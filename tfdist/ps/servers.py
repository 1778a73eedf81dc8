"""Servers and cluster lifecycle for parameter-server training.

Two ways to get a cluster:

* in-process (`local_cluster`): every worker and ps is a `tf.distribute.Server`
  inside this process, on free ports (notebooks, tests, one machine);
* TF_CONFIG (`resolve_tf_config_cluster`): one process per task, started by
  `tfdist launch`, SLURM or Kubernetes. Worker and ps tasks serve
  (`serve_forever`); the chief waits until every task accepts connections and
  becomes the coordinator.

Security: TensorFlow's gRPC server listens on every interface of the machine,
whatever address the cluster spec gives (grpc_server_lib.cc binds
"0.0.0.0:<port>"; nothing in the ServerDef or the Python API narrows it), and
it runs whatever ops it is sent, unauthenticated. docs/parameter_server.md
says what that means and how to confine a job.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import socket
import sys
import threading
import time
import warnings
from typing import Any

from tfdist import cluster as cluster_lib
from tfdist import config as config_lib
from tfdist import state as state_lib
from tfdist._tf import import_tensorflow
from tfdist.ps.errors import ParameterServerError

logger = logging.getLogger("tfdist")

# Worker servers need enough inter-op threads to serve remote function calls
# while their own ops wait on the parameter servers; with the default on a
# 2-core machine, an in-process cluster deadlocks at the first step.
_SERVER_INTER_OP_THREADS = 8


@dataclasses.dataclass
class LocalCluster:
    """Workers and parameter servers running as servers in this process."""

    cluster: cluster_lib.Cluster
    servers: list
    resolver: Any


_LOCAL_CLUSTERS: dict[tuple[int, int], LocalCluster] = {}
_LOCAL_LOCK = threading.Lock()


def server_config(tf):
    """The session config every tfdist PS server runs with."""
    config = tf.compat.v1.ConfigProto()
    config.inter_op_parallelism_threads = _SERVER_INTER_OP_THREADS
    return config


def local_cluster(num_workers: int, num_ps: int) -> LocalCluster:
    """Starts (or reuses) an in-process cluster on free 127.0.0.1 ports.

    TensorFlow servers cannot be stopped, and a process can talk to only one
    cluster at a time, so one cluster per shape is kept for the life of the
    process: re-running a notebook cell reuses it. The cluster spec names
    127.0.0.1, but TensorFlow's servers listen on every interface (see the
    module docstring).
    """
    tf = import_tensorflow()
    key = (num_workers, num_ps)
    with _LOCAL_LOCK:
        if key in _LOCAL_CLUSTERS:
            return _LOCAL_CLUSTERS[key]
        earlier = sorted({state.preset or "?" for strategy, state in state_lib.live()
                          if state.preset != "parameter_server"})
        if earlier and not _LOCAL_CLUSTERS:
            warnings.warn(
                f"Starting an in-process parameter-server cluster renames this process's "
                f"devices (/job:localhost becomes /job:chief), so the {' and '.join(earlier)} "
                "strategy made earlier in this process stops working (its steps fail with "
                "'unknown device'), as do variables made before. Make the parameter_server "
                "strategy first, or restart the process (the notebook kernel) to go back.",
                stacklevel=3)
        if _LOCAL_CLUSTERS:
            warnings.warn(
                f"Starting a second in-process cluster ({num_workers} workers, {num_ps} ps); "
                "strategies made on the earlier one stop working. Restart the process (the "
                "notebook kernel) to free its servers.", stacklevel=3)
        spec = cluster_lib.local_cluster(num_workers=num_workers, num_ps=num_ps)
        cluster_spec = tf.train.ClusterSpec(spec.cluster_dict())
        servers = []
        for task_type, task_id in spec.tasks():
            servers.append(tf.distribute.Server(
                cluster_spec, job_name=task_type, task_index=task_id, protocol="grpc",
                config=server_config(tf), start=True))
        resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
            cluster_spec, rpc_layer="grpc")
        _LOCAL_CLUSTERS[key] = LocalCluster(spec, servers, resolver)
        logger.info("tfdist: in-process cluster %s", spec.sizes())
        return _LOCAL_CLUSTERS[key]


def reachable(address: str, *, timeout: float = 1.0) -> bool:
    """True if "host:port" accepts a TCP connection now."""
    host, port = cluster_lib.split_address(address)
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def wait_for_tasks(addresses: dict[str, str], *, timeout: float,
                   poll: float = 0.2) -> None:
    """Waits until every "host:port" accepts TCP connections.

    Args:
      addresses: task name ("ps:0") -> "host:port".
      timeout: seconds to wait in total.

    Raises:
      ParameterServerError: naming the tasks that never became reachable.
    """
    deadline = time.monotonic() + timeout
    pending = dict(addresses)
    while pending:
        for name, address in list(pending.items()):
            if reachable(address, timeout=min(poll * 5, 2.0)):
                del pending[name]
        if not pending:
            return
        if time.monotonic() >= deadline:
            listed = ", ".join(f"{n} at {a}" for n, a in sorted(pending.items()))
            raise ParameterServerError(
                f"Could not reach {listed} within {timeout:g} s. Start those tasks (every "
                "task runs the same script; worker and ps tasks serve until stopped), check "
                "the addresses in TF_CONFIG, or raise connect_timeout.")
        time.sleep(poll)


# With SIGTERM a server keeps serving while the chief runs, so the chief can finish its
# in-flight steps and save (tfdist.preemption), for at most the grace period less this.
_LINGER_MARGIN = 3.0


def _linger_seconds() -> float:
    from tfdist import preemption

    return max(0.0, preemption._grace_period() - _LINGER_MARGIN)


def serve_forever(tf_config: cluster_lib.TFConfig) -> None:
    """Runs this worker/ps task's TensorFlow server until SIGTERM/SIGINT, then exits.

    SIGINT exits 0 at once. SIGTERM (a preemption, or the launcher stopping
    the job) keeps the server up while the chief still accepts connections,
    so the chief's save on SIGTERM can read the variables and finish its
    scheduled steps, for at most the grace period less 3 s
    (`TFDIST_GRACE_PERIOD`, set by `tfdist launch`; 30 s otherwise); then it
    exits 0 if the chief is gone, else 75 (preempted).

    Raises:
      ValueError: the cluster cannot run parameter-server training (no chief,
        no ps, no worker): the task would serve a coordinator that never comes.
      ParameterServerError: the server could not start (its port is taken).
    """
    cluster_lib.check_cluster_for(tf_config, "parameter_server")
    tf = import_tensorflow()
    cluster_spec = tf.train.ClusterSpec(training_cluster(tf_config.cluster))
    try:
        server = tf.distribute.Server(
            cluster_spec, job_name=tf_config.task_type, task_index=tf_config.task_id,
            protocol=tf_config.rpc_layer or "grpc", config=server_config(tf), start=True)
    except (tf.errors.UnknownError, tf.errors.InvalidArgumentError) as e:
        raise ParameterServerError(
            f"Task {tf_config.task_type}:{tf_config.task_id} could not start its server on "
            f"{tf_config.address}: {str(e).strip().splitlines()[0][:200]}. Another process "
            "probably holds that port: free it, or give this task another address in "
            "TF_CONFIG (tfdist launch picks free ports).") from None
    print(f"tfdist: {tf_config.task_type}:{tf_config.task_id} serving at "
          f"{tf_config.address} pid={os.getpid()} (stop with SIGTERM)", file=sys.stderr, flush=True)

    received: list[int] = []

    def stop(signum, frame):
        if signum == signal.SIGINT:
            # Exit without running TensorFlow's server teardown, which can block
            # while the coordinator still holds connections.
            sys.stderr.flush()
            os._exit(0)
        received.append(signum)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    del server  # kept alive by the runtime
    while not received:
        time.sleep(0.2)
    chief = tf_config.cluster.chief[0] if tf_config.cluster.chief else None
    deadline = time.monotonic() + _linger_seconds()
    while chief and reachable(chief, timeout=0.5) and time.monotonic() < deadline:
        time.sleep(0.2)
    from tfdist.preemption import PREEMPTED_EXIT_CODE

    code = PREEMPTED_EXIT_CODE if chief and time.monotonic() >= deadline else 0
    sys.stderr.flush()
    os._exit(code)


def training_cluster(cluster: cluster_lib.Cluster) -> dict[str, list[str]]:
    """TF_CONFIG's cluster without the evaluator (which is not part of the training cluster)."""
    return {k: list(v) for k, v in cluster.cluster_dict().items() if k != "evaluator"}


def _no_cluster_error() -> ValueError:
    return ValueError(
        "The parameter_server preset needs a cluster. Received: no TF_CONFIG and "
        "no local_workers/local_ps. Pass local_workers=2, local_ps=1 for a cluster "
        "inside this process, or run under `tfdist launch --num_workers=2 "
        "--num_ps=1 --chief -- python script.py`, which sets TF_CONFIG.")


def resolve_cluster(options: config_lib.ParameterServerOptions):
    """The cluster resolver (and number of ps) for this process, as the coordinator.

    In a TF_CONFIG cluster, worker and ps tasks do not return: they serve
    until stopped and then exit 0, so one script runs on every task.

    Returns:
      (cluster resolver, number of ps tasks).

    Raises:
      ValueError: no cluster; a cluster without chief, ps or workers (checked
        before a task starts serving); a task type that cannot run here.
      ParameterServerError: a worker or ps unreachable within connect_timeout.
    """
    tf = import_tensorflow()
    if options.is_local:
        local = local_cluster(options.local_workers, options.local_ps)
        return local.resolver, options.local_ps
    tf_config = cluster_lib.tf_config_from_env()
    if tf_config is None:
        raise _no_cluster_error()
    cluster = tf_config.cluster
    # Before serving: a worker or ps of a cluster without a chief would serve a
    # coordinator that never comes, forever.
    cluster_lib.check_cluster_for(tf_config, "parameter_server")
    if tf_config.task_type in ("worker", "ps"):
        serve_forever(tf_config)  # never returns
    if tf_config.task_type != "chief":
        raise ValueError(
            f"This process is task {tf_config.task_type}:{tf_config.task_id}; under the "
            "parameter_server preset the 'chief' task runs the training script as "
            "coordinator and worker/ps tasks serve. Run an evaluator as a separate "
            "plain script that loads checkpoints.")
    wait_for_tasks(
        {f"{t}:{i}": a for t in ("ps", "worker") for i, a in enumerate(getattr(cluster, t))},
        timeout=options.connect_timeout)
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec(training_cluster(cluster)), task_type="chief",
        task_id=0, rpc_layer=tf_config.rpc_layer or "grpc")
    return resolver, cluster.num_ps

"""Run a tfdist preset inside Ray Train's `TensorflowTrainer` (`pip install tfdist[ray]`).

Ray starts the worker processes and writes each one's TF_CONFIG; tfdist
supplies the strategy. Plain Keras 3 `fit` under Ray's
MultiWorkerMirroredStrategy fails (keras-team/keras#20585,
ray-project/ray#47464); with the tfdist preset it trains:

    import ray
    from ray.train import ScalingConfig
    from ray.train.tensorflow import TensorflowTrainer
    import tfdist
    from tfdist.integrations import ray as tfdist_ray

    def train_loop_per_worker(config):
        strategy = tfdist_ray.make_strategy("multi_worker_mirrored")
        with strategy.scope():
            model = build_model()
            model.compile(optimizer="adam", loss="mse")
        # Ray writes each worker's output to a log file: one plain line per
        # epoch from worker 0, nothing from the others.
        model.fit(dataset, epochs=3, verbose=tfdist.fit_verbose())

    scaling = ScalingConfig(num_workers=2)
    tfdist_ray.check_resources(scaling)   # a clear error instead of Ray waiting forever
    TensorflowTrainer(train_loop_per_worker, scaling_config=scaling).fit()

What Ray writes, and what `make_strategy` does about it (Ray 2.60,
ray/train/tensorflow/config.py):

* TF_CONFIG lists workers only, at `ray.util.get_node_ip_address()` and a
  free port: the node's address, not 127.0.0.1, even when Ray itself was
  started on 127.0.0.1. `bind_local=True` rewrites the addresses to
  127.0.0.1 when every worker runs on this node (else it is an error).
* `TF_USE_LEGACY_KERAS=1`, which points `tf.keras` at tf_keras (Keras 2)
  whether or not tf_keras is installed. tfdist's presets are for Keras 3, so
  it is removed from the worker's environment before TensorFlow reads it.

Ray has no parameter servers (ray-project/ray#41089) and one kind of worker:
only the synchronous presets run here.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from tfdist.cluster import Cluster, TFConfig, TFConfigError, parse_tf_config, split_address

logger = logging.getLogger("tfdist")

# Presets that run on Ray's workers-only cluster.
RAY_PRESETS = ("multi_worker_mirrored", "auto")


def _local_config(config: TFConfig, node_ip: str) -> TFConfig:
    hosts = {split_address(a)[0].strip("[]") for a in config.cluster.worker}
    if hosts != {node_ip}:
        raise TFConfigError(
            f"bind_local=True needs every Ray worker on this node ({node_ip}), but Ray's "
            f"TF_CONFIG puts workers on {', '.join(sorted(hosts))}. Use bind_local=False on "
            f"a multi-node Ray cluster (the workers must then reach each other's node "
            f"addresses), or start Ray on one node.")
    worker = tuple(f"127.0.0.1:{split_address(a)[1]}" for a in config.cluster.worker)
    return TFConfig(cluster=Cluster(worker=worker), task_type=config.task_type,
                    task_id=config.task_id, rpc_layer=config.rpc_layer)


def make_strategy(preset: str = "multi_worker_mirrored", *, bind_local: bool = False,
                  **options: Any):
    """The tfdist strategy for this Ray Train worker; call it first in `train_loop_per_worker`.

    Args:
      preset: 'multi_worker_mirrored' (or 'auto', which picks it from Ray's
        TF_CONFIG). Ray has no parameter servers.
      bind_local: rewrite Ray's TF_CONFIG addresses to 127.0.0.1 (all workers
        on this node): TensorFlow's servers then talk over loopback only.
      **options: the preset's options, e.g. `join_timeout=60`.

    Returns:
      The strategy (build and compile the model under `strategy.scope()`).

    Raises:
      ValueError: not inside a TensorflowTrainer worker, a preset Ray cannot
        run, or `bind_local` with workers on several nodes.
    """
    if preset not in RAY_PRESETS:
        raise ValueError(
            f"Ray Train runs {', '.join(RAY_PRESETS)} presets only: its TensorflowTrainer "
            f"starts workers, never parameter servers (ray-project/ray#41089). Received: "
            f"preset={preset!r}. Use tfdist launch or SLURM for parameter_server.")
    text = os.environ.get("TF_CONFIG")
    if not text:
        raise ValueError(
            "TF_CONFIG is not set: tfdist.integrations.ray.make_strategy runs inside a Ray "
            "TensorflowTrainer worker (train_loop_per_worker), where Ray sets it. Outside "
            "Ray use tfdist.make_strategy.")
    config = parse_tf_config(text)
    if bind_local:
        import ray

        config = _local_config(config, ray.util.get_node_ip_address())
        os.environ["TF_CONFIG"] = config.to_json()
    if os.environ.pop("TF_USE_LEGACY_KERAS", None) is not None:
        logger.info("tfdist: removed TF_USE_LEGACY_KERAS (set by Ray) so tf.keras is Keras 3.")
    import tfdist

    logger.info("tfdist: Ray worker %s of %d", config.task_id, config.cluster.num_workers)
    return tfdist.make_strategy(preset, **options)


def check_resources(scaling_config) -> None:
    """Raises a clear error when the Ray cluster cannot hold `scaling_config`'s workers.

    Ray Train does not fail on a cluster that is too small: it waits for the
    resources forever. Connects like `TensorflowTrainer.fit()` would
    (`ray.init()`) when Ray is not initialised yet.

    Raises:
      ValueError: naming each resource, what the cluster has and what is needed.
    """
    import ray

    if not ray.is_initialized():
        ray.init()
    have = ray.cluster_resources()
    need = dict(scaling_config.total_resources)
    short = {k: v for k, v in need.items() if v > have.get(k, 0.0)}
    if short:
        details = ", ".join(f"{k}: needs {v:g}, has {have.get(k, 0.0):g}"
                            for k, v in short.items())
        raise ValueError(
            f"The Ray cluster is too small for {scaling_config.num_workers} worker(s) "
            f"({details}); Ray would wait for it forever. Add nodes or start Ray with more "
            "(e.g. ray.init(num_cpus=N) / "
            f"`ray start --num-cpus=N`), or ask for fewer workers or resources per worker.")

"""The Ray driver the Ray test runs in a subprocess: a local Ray cluster on 127.0.0.1.

    python tests/engines/run_ray_driver.py OUT TEMP_DIR

1. A 1-CPU Ray cluster: check_resources for 2 workers must refuse it.
2. A 2-CPU Ray cluster: TensorflowTrainer with 2 workers, each under
   tfdist_ray.make_strategy(bind_local=True); each writes its weights and what
   Ray had set; the driver writes the 1-process reference weights.
"""

import json
import os
import sys


def train_loop_per_worker(config):
    import numpy as np

    import ray.train
    from tests.engines.run_slurm_training import build_and_train
    from tfdist.integrations import ray as tfdist_ray

    ray_tf_config = os.environ.get("TF_CONFIG")
    legacy = os.environ.get("TF_USE_LEGACY_KERAS")
    strategy = tfdist_ray.make_strategy("multi_worker_mirrored", bind_local=True,
                                        join_timeout=120)
    weights, iterations = build_and_train(strategy)
    rank = ray.train.get_context().get_world_rank()
    np.save(os.path.join(config["out"], f"ray{rank}.npy"), weights)
    with open(os.path.join(config["out"], f"ray{rank}.json"), "w") as f:
        json.dump({"ray_tf_config": json.loads(ray_tf_config), "legacy_keras": legacy,
                   "tf_config": json.loads(os.environ["TF_CONFIG"]),
                   "replicas": strategy.num_replicas_in_sync, "iterations": iterations,
                   "legacy_after": os.environ.get("TF_USE_LEGACY_KERAS")}, f)


def main() -> int:
    out, temp_dir = sys.argv[1], sys.argv[2]
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.tensorflow import TensorflowTrainer

    from tfdist.integrations import ray as tfdist_ray

    common = dict(address="local", _node_ip_address="127.0.0.1", include_dashboard=False,
                  _temp_dir=temp_dir, log_to_driver=True, configure_logging=False)
    scaling = ScalingConfig(num_workers=2, resources_per_worker={"CPU": 1})
    ray.init(num_cpus=1, **common)
    try:
        tfdist_ray.check_resources(scaling)
        small = "accepted"
    except ValueError as e:
        small = str(e)
    finally:
        ray.shutdown()
    with open(os.path.join(out, "small.txt"), "w") as f:
        f.write(small)

    ray.init(num_cpus=2, **common)
    try:
        tfdist_ray.check_resources(scaling)
        trainer = TensorflowTrainer(
            train_loop_per_worker, train_loop_config={"out": out}, scaling_config=scaling,
            run_config=RunConfig(storage_path=os.path.join(temp_dir, "results"), name="t"))
        trainer.fit()
    finally:
        ray.shutdown()

    # The reference: the same training in one process, on one device.
    import numpy as np
    import tensorflow as tf

    from tests.engines.run_slurm_training import build_and_train

    weights, _ = build_and_train(tf.distribute.get_strategy())
    np.save(os.path.join(out, "reference.npy"), weights)
    return 0


if __name__ == "__main__":
    sys.exit(main())

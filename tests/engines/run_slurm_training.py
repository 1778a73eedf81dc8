"""The training script the SLURM tests run under `srun` (and once alone, as the reference).

    python tests/engines/run_slurm_training.py --out DIR [--preset auto] [--slurm_port P]
        [--tf_config_from_slurm --chief --num_ps N] [--backup DIR --kill_at_step N]
        [--progress FILE --step_delay S]

`--progress FILE`: rank 0 appends "step SLURM_JOB_ID" after every step (the
preemption test signals the job with scancel once it is far enough).

Each task writes DIR/rank<R>.npy (its final weights), DIR/rank<R>.json (its
TF_CONFIG and what it saw) where R is SLURM_PROCID (or 'single' outside SLURM).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

N, FEATURES, GLOBAL_BATCH, EPOCHS, STEPS = 128, 8, 16, 3, 4


def build_and_train(strategy, *, backup=None, callbacks=(), ps=False):
    import keras
    import numpy as np
    import tensorflow as tf

    rng = np.random.default_rng(0)
    x = rng.standard_normal((N, FEATURES)).astype("float32")
    y = (x @ rng.standard_normal((FEATURES, 1)) + 0.1).astype("float32")
    with strategy.scope():
        model = keras.Sequential([keras.Input((FEATURES,)),
                                  keras.layers.Dense(8, activation="relu"),
                                  keras.layers.Dense(1)])
        init = np.random.default_rng(42)
        model.set_weights([(0.3 * init.standard_normal(w.shape)).astype("float32")
                           for w in model.get_weights()])
        model.compile(keras.optimizers.SGD(0.05, momentum=0.5), "mse")
    from tfdist.checkpoint import repeat_shuffled

    ds = repeat_shuffled(tf.data.Dataset.from_tensor_slices((x, y)), buffer_size=N,
                         seed=1).batch(GLOBAL_BATCH)
    callbacks = list(callbacks)
    if backup is not None:
        ds = backup.dataset(ds)
        callbacks.append(backup)
    if ps:
        ds = ds.repeat()
    model.fit(ds, epochs=EPOCHS, steps_per_epoch=STEPS, callbacks=callbacks, verbose=0)
    weights = np.concatenate([w.ravel() for w in model.get_weights()])
    return weights, int(model.optimizer.iterations.numpy())


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--preset", default="auto")
    parser.add_argument("--slurm_port", type=int, default=8888)
    parser.add_argument("--tf_config_from_slurm", action="store_true",
                        help="set TF_CONFIG with tfdist.slurm_tf_config before the strategy")
    parser.add_argument("--chief", action="store_true")
    parser.add_argument("--num_ps", type=int, default=0)
    parser.add_argument("--backup", default=None)
    parser.add_argument("--kill_at_step", type=int, default=0,
                        help="SLURM rank 1 SIGKILLs itself after this global step, once")
    parser.add_argument("--progress", default=None)
    parser.add_argument("--step_delay", type=float, default=0.0)
    args = parser.parse_args()

    import tfdist
    from tfdist._tf import import_tensorflow

    rank = os.environ.get("SLURM_PROCID", "single")
    if args.tf_config_from_slurm:
        os.environ["TF_CONFIG"] = tfdist.slurm_tf_config(
            port=args.slurm_port, chief=args.chief, num_ps=args.num_ps).to_json()
    import_tensorflow()
    import keras
    import numpy as np

    options = {"auto": {"slurm_port": args.slurm_port},
               "multi_worker_mirrored": {"join_timeout": 120}}.get(args.preset, {})
    strategy = tfdist.make_strategy(args.preset, **options)
    report = {"rank": rank, "node": os.environ.get("SLURMD_NODENAME"),
              "tf_config": json.loads(os.environ.get("TF_CONFIG") or "{}"),
              "strategy": type(strategy).__name__,
              "replicas": strategy.num_replicas_in_sync}
    callbacks = []
    marker = os.path.join(args.out, "killed-once")
    if args.kill_at_step and rank == "1" and not os.path.exists(marker):
        class KillSelf(keras.callbacks.Callback):
            def on_train_batch_end(self, batch, logs=None):
                step = int(self.model.optimizer.iterations.numpy())
                if step >= args.kill_at_step:
                    open(marker, "w").close()
                    print(f"rank 1: SIGKILL at step {step}", flush=True)
                    os.kill(os.getpid(), signal.SIGKILL)

        callbacks.append(KillSelf())
    if args.progress:
        class Progress(keras.callbacks.Callback):
            def on_train_batch_end(self, batch, logs=None):
                if rank == "0":
                    step = int(self.model.optimizer.iterations.numpy())
                    with open(args.progress, "a") as f:
                        f.write(f"{step} {os.environ.get('SLURM_JOB_ID')}\n")
                time.sleep(args.step_delay)

        callbacks.append(Progress())
    backup = tfdist.BackupAndRestore(args.backup) if args.backup else None
    if backup is not None:
        report["initial_epoch"] = backup.initial_epoch
    weights, iterations = build_and_train(strategy, backup=backup, callbacks=callbacks,
                                          ps=args.preset == "parameter_server")
    report["iterations"] = iterations
    np.save(os.path.join(args.out, f"rank{rank}.npy"), weights)
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)
    print(f"rank {rank}: done, {iterations} steps", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The training program of the preemption, elastic and chaos tests: every task runs it.

    python tests/checkpoint/run_preemption.py --out DIR --backup_dir DIR
        [--preset multi_worker_mirrored|mirrored|parameter_server] [--backup tfdist|keras]
        [--save_freq N] [--shard optimizer] [--compression powersgd]
        [--epochs E] [--steps S] [--sigterm ATTEMPT:TASK:STEP ...]
        [--crash ATTEMPT:TASK:STEP ...] [--progress FILE] [--step_delay SECONDS]
        [--no_preemption]
    python tests/checkpoint/run_preemption.py --reference OUT.npy [--compression powersgd]

A small MLP (16 -> 16 -> 16 -> 1, SGD with momentum, so the optimizer has state,
sharded under ZeRO) on a deterministic tf.data pipeline (`repeat_shuffled`,
global batch 32), 6 epochs of 8 steps unless told otherwise. Every
synchronous preset gives the same numbers as one replica with the same global
batch, and PowerSGD's depend only on sums over the replicas, so `--reference`
(one replica, this process) is the answer for every worker count.

- `--sigterm 1:worker:1:7`: on launch attempt 1, worker:1 sends itself SIGTERM
  after global step 7 (a Kubernetes-like direct SIGTERM to one task);
- `--crash 2:worker:1:3`: ... exits with status 3 instead (a failing worker);
- `--progress FILE`: the chief appends "step monotonic-time" after every step;
- every task prints `resuming at step N` after the restore and, at the end,
  writes its weights to OUT/<task>.npy (`local.npy` without TF_CONFIG).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

N, FEATURES, GLOBAL_BATCH, EPOCHS, STEPS = 512, 16, 32, 6, 8


def data():
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.standard_normal((N, FEATURES)).astype("float32")
    y = (np.tanh(x @ rng.standard_normal((FEATURES, 1))) + 0.1).astype("float32")
    return x, y


def dataset():
    import tensorflow as tf

    from tfdist.checkpoint import repeat_shuffled

    x, y = data()
    examples = tf.data.Dataset.from_tensor_slices((x, y))
    return repeat_shuffled(examples, buffer_size=N, seed=1).batch(GLOBAL_BATCH)


def build(strategy):
    import keras
    import numpy as np

    with strategy.scope():
        model = keras.Sequential([keras.Input((FEATURES,)),
                                  keras.layers.Dense(16, activation="tanh"),
                                  keras.layers.Dense(16, activation="tanh"),
                                  keras.layers.Dense(1)])
        rng = np.random.default_rng(42)
        model.set_weights([(0.4 * rng.standard_normal(w.shape)).astype("float32")
                           for w in model.get_weights()])
        model.compile(keras.optimizers.SGD(0.05, momentum=0.5), "mse")
    return model


def flat(model):
    import numpy as np

    return np.concatenate([w.ravel() for w in model.get_weights()])


def _events(specs, attempt: str, task: str) -> set[int]:
    steps = set()
    for spec in specs:  # "ATTEMPT:TASK:STEP", TASK like "worker:1"
        when, rest = spec.split(":", 1)
        who, step = rest.rsplit(":", 1)
        if when in (attempt, "*") and who == task:
            steps.add(int(step))
    return steps


def preset_options(args) -> dict:
    options = {}
    if args.shard != "none":
        options["shard"] = args.shard
    if args.compression != "none":
        options.update(gradient_compression=args.compression, powersgd_rank=1,
                       powersgd_warmup_steps=2)
    return options


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--backup_dir", default=None)
    parser.add_argument("--reference", default=None)
    parser.add_argument("--preset", default="multi_worker_mirrored")
    parser.add_argument("--backup", default="tfdist", choices=("tfdist", "keras"))
    parser.add_argument("--save_freq", type=int, default=0)
    parser.add_argument("--shard", default="none")
    parser.add_argument("--compression", default="none")
    parser.add_argument("--epochs", type=int, default=EPOCHS)
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--sigterm", action="append", default=[])
    parser.add_argument("--crash", action="append", default=[])
    parser.add_argument("--progress", default=None)
    parser.add_argument("--step_delay", type=float, default=0.0)
    parser.add_argument("--no_preemption", action="store_true",
                        help="tfdist.BackupAndRestore(preemption=False): the negative control")
    args = parser.parse_args()

    import tfdist
    import tfdist.chief

    task = tfdist.chief.task_name()
    attempt = os.environ.get("TFDIST_LAUNCH_ATTEMPT", "1")
    sigterm_at = _events(args.sigterm, attempt, task)
    crash_at = _events(args.crash, attempt, task)
    options = preset_options(args)
    if args.reference:
        tfdist.configure_logical_devices(1)
        strategy = tfdist.make_strategy("mirrored", devices=("/cpu:0",),
                                        **{k: v for k, v in options.items() if k != "shard"})
    elif args.preset == "multi_worker_mirrored":
        strategy = tfdist.make_strategy("multi_worker_mirrored", join_timeout=120, **options)
    elif args.preset == "mirrored":
        tfdist.configure_logical_devices(2)
        strategy = tfdist.make_strategy("mirrored", num_devices=2, **options)
    else:
        strategy = tfdist.make_strategy("parameter_server")
    if task.startswith("ps:") or (args.preset == "parameter_server" and task.startswith(
            "worker:")):
        return 0  # parameter_server: make_strategy serves and never returns there
    tfdist.import_tensorflow()
    import keras
    import numpy as np

    model = build(strategy)
    chief = tfdist.chief.is_chief()

    class Events(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            print(f"resuming at step {int(self.model.optimizer.iterations.numpy())}",
                  flush=True)

        def on_train_batch_end(self, batch, logs=None):
            step = int(self.model.optimizer.iterations.numpy())
            if chief and args.progress:
                with open(args.progress, "a") as f:
                    f.write(f"{step} {time.monotonic():.3f}\n")
            if step in sigterm_at:
                print(f"sending myself SIGTERM after step {step}", flush=True)
                os.kill(os.getpid(), signal.SIGTERM)
            if step in crash_at:
                print(f"crashing after step {step}", flush=True)
                sys.stdout.flush()
                os._exit(3)
            if args.step_delay:
                time.sleep(args.step_delay)

    train = dataset()
    callbacks = []
    if args.reference:
        pass
    elif args.backup == "tfdist":
        kwargs = {"save_freq": args.save_freq} if args.save_freq else {}
        backup = tfdist.BackupAndRestore(args.backup_dir, preemption=not args.no_preemption,
                                         **kwargs)
        train = backup.dataset(train)
        callbacks.append(backup)
    else:
        callbacks.append(keras.callbacks.BackupAndRestore(
            args.backup_dir, save_freq=args.save_freq or "epoch"))
    callbacks.append(Events())
    model.fit(train, epochs=args.epochs, steps_per_epoch=args.steps, callbacks=callbacks,
              verbose=0)
    if args.reference:
        np.save(args.reference, flat(model))
    else:
        name = task.replace(':', '')
        np.save(os.path.join(args.out, f"{name}.npy"), flat(model))
        # Which launch attempt wrote it: a task of an earlier attempt can finish and save,
        # then lose its attempt (another task killed), and the next attempt may run fewer
        # workers (--min_workers), leaving that file behind.
        with open(os.path.join(args.out, f"{name}.attempt"), "w") as f:
            f.write(os.environ.get("TFDIST_LAUNCH_ATTEMPT", "0"))
    print("done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

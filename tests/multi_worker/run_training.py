"""A tiny training script for the multi-worker tests, run by `tfdist launch`.

    python tests/multi_worker/run_training.py --out DIR [--inputs tfdata,numpy]
        [--backup DIR --kill_at_step N] [--hang_task worker:1]

Also imported by the tests for the single-process reference run (`train`).
Each task writes its final weights to DIR/<input>_<task>.npy.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

N, FEATURES, GLOBAL_BATCH, EPOCHS, STEPS = 256, 16, 32, 3, 8


def data():
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.standard_normal((N, FEATURES)).astype("float32")
    y = (x @ rng.standard_normal((FEATURES, 1)) + 0.1).astype("float32")
    return x, y


def initial_weights(model):
    import numpy as np

    rng = np.random.default_rng(42)
    return [(0.3 * rng.standard_normal(w.shape)).astype("float32") for w in model.get_weights()]


def initial_flat():
    """The initial weights `train` starts from, as one flat vector."""
    import numpy as np

    model = _model()
    return np.concatenate([w.ravel() for w in initial_weights(model)])


def _model():
    import keras

    return keras.Sequential([keras.Input((FEATURES,)),
                             keras.layers.Dense(16, activation="relu"),
                             keras.layers.Dense(1)])


def dataset(x, y):
    import tensorflow as tf

    from tfdist.checkpoint import repeat_shuffled

    examples = tf.data.Dataset.from_tensor_slices((x, y))
    return repeat_shuffled(examples, buffer_size=N, seed=1).batch(GLOBAL_BATCH)


def train(strategy, inputs: str, *, callbacks=(), backup=None):
    """Trains the test model; returns the final weights as one flat vector."""
    import keras
    import numpy as np

    x, y = data()
    with strategy.scope():
        model = _model()
        model.set_weights(initial_weights(model))
        model.compile(keras.optimizers.SGD(0.05, momentum=0.5), "mse")
    callbacks = list(callbacks)
    if inputs == "tfdata":
        ds = dataset(x, y)
        if backup is not None:
            ds = backup.dataset(ds)
            callbacks.append(backup)
        model.fit(ds, epochs=EPOCHS, steps_per_epoch=STEPS, callbacks=callbacks, verbose=0,
                  shuffle=False)
    elif inputs == "numpy":
        model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=EPOCHS, callbacks=callbacks, verbose=0,
                  shuffle=False)
    else:
        raise ValueError(f"inputs must be tfdata or numpy. Received: {inputs!r}")
    return np.concatenate([w.ravel() for w in model.get_weights()])


def _kill_during_save(epoch: int) -> None:
    """Makes this process SIGKILL itself with half of epoch `epoch`'s backup written."""
    import io

    from tfdist import checkpoint

    original = checkpoint._atomic_write_bytes
    target = checkpoint.backup_file_name(epoch * STEPS)

    def write_half_then_die(path, write):
        if not path.endswith(target):
            return original(path, write)

        def half(f):
            buffer = io.BytesIO()
            write(buffer)
            f.write(buffer.getvalue()[:len(buffer.getvalue()) // 2])
            f.flush()
            os.fsync(f.fileno())
            print(f"killing myself while saving {target}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

        return original(path, half)

    checkpoint._atomic_write_bytes = write_half_then_die


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--inputs", default="tfdata")
    parser.add_argument("--backup", default=None)
    parser.add_argument("--kill_at_step", type=int, default=0,
                        help="worker:1 SIGKILLs itself after this global step (1st attempt)")
    parser.add_argument("--kill_chief_in_save", type=int, default=0,
                        help="worker:0 SIGKILLs itself half-way through writing the backup "
                             "of this epoch (2nd attempt)")
    parser.add_argument("--hang_task", default=None, help="this task sleeps instead of joining")
    parser.add_argument("--join_timeout", type=float, default=60)
    args = parser.parse_args()

    import tfdist
    import tfdist.chief

    task = tfdist.chief.task_name()
    if task == args.hang_task:
        time.sleep(3600)
    from tfdist._tf import import_tensorflow

    import_tensorflow()  # quietly, before keras imports it
    import keras
    import numpy as np

    strategy = tfdist.make_strategy("multi_worker_mirrored", join_timeout=args.join_timeout)
    print(f"joined: {strategy.num_replicas_in_sync} replicas", flush=True)
    attempt = int(os.environ.get("TFDIST_LAUNCH_ATTEMPT", "1"))
    for inputs in args.inputs.split(","):
        callbacks = []
        if args.kill_at_step and task == "worker:1" and attempt == 1:
            class KillSelf(keras.callbacks.Callback):
                def on_train_batch_end(self, batch, logs=None):
                    step = int(self.model.optimizer.iterations.numpy())
                    if step >= args.kill_at_step:
                        print(f"killing myself at step {step}", flush=True)
                        os.kill(os.getpid(), signal.SIGKILL)

            callbacks.append(KillSelf())
        if args.kill_chief_in_save and task == "worker:0" and attempt == 2:
            _kill_during_save(args.kill_chief_in_save)
        backup = (tfdist.BackupAndRestore(args.backup) if args.backup else None)
        if backup is not None:
            print(f"resuming at epoch {backup.initial_epoch}", flush=True)
        weights = train(strategy, inputs, callbacks=callbacks, backup=backup)
        np.save(os.path.join(args.out, f"{inputs}_{task.replace(':', '')}.npy"), weights)
        print(f"done {inputs}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

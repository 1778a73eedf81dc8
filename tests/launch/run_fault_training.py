"""Training script for the launcher's fault tests (tests/launch/test_faults.py,
tests/launch/test_namespaces.py); every task runs it under `tfdist launch`.

    python tests/launch/run_fault_training.py --out DIR --backup DIR
        [--kill ATTEMPT:TASK:STEP ...] [--pause_at STEP --pause_file PATH]
        [--collective_timeout S]

The model, data and training are tests/multi_worker/run_training.py's (3 epochs of
8 steps, a deterministic tf.data pipeline, tfdist.BackupAndRestore), so the
final weights can be compared with the same 1-replica reference.

- `--kill 1:worker:0:12`: on launch attempt 1, task worker:0 SIGKILLs itself
  right after global step 12 (several may be given; tasks killed at the same
  step fail together).
- `--pause_at 12 --pause_file P`: after step 12 every task writes
  P.<task>.reached and waits (at most 120 s) for P to exist; the test cuts
  the network meanwhile, so the next all-reduce meets a partition.
Each task writes its final weights to DIR/<task>.npy.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--backup", required=True)
    parser.add_argument("--kill", action="append", default=[])
    parser.add_argument("--pause_at", type=int, default=0)
    parser.add_argument("--pause_file", default=None)
    parser.add_argument("--collective_timeout", type=float, default=None)
    args = parser.parse_args()

    import tfdist
    import tfdist.chief

    task = tfdist.chief.task_name()
    attempt = os.environ.get("TFDIST_LAUNCH_ATTEMPT", "1")
    kill_at = []
    for kill in args.kill:  # "ATTEMPT:TASK:STEP", TASK like "worker:0"
        kill_attempt, rest = kill.split(":", 1)
        kill_task, step = rest.rsplit(":", 1)
        if (kill_attempt, kill_task) == (attempt, task):
            kill_at.append(int(step))
    tfdist.import_tensorflow()
    import keras
    import numpy as np

    from tests.multi_worker import run_training as script

    strategy = tfdist.make_strategy("multi_worker_mirrored", join_timeout=120,
                                    collective_timeout=args.collective_timeout)
    print(f"joined: {strategy.num_replicas_in_sync} replicas", flush=True)

    class Faults(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            step = int(self.model.optimizer.iterations.numpy())
            if step in kill_at:
                print(f"killing myself at step {step}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            if args.pause_at and step == args.pause_at and attempt == "1":
                open(f"{args.pause_file}.{task.replace(':', '')}.reached", "w").close()
                deadline = time.monotonic() + 120
                while not os.path.exists(args.pause_file) and time.monotonic() < deadline:
                    time.sleep(0.1)

    backup = tfdist.BackupAndRestore(args.backup)
    print(f"resuming at epoch {backup.initial_epoch}", flush=True)
    weights = script.train(strategy, "tfdata", callbacks=[Faults()], backup=backup)
    np.save(os.path.join(args.out, f"{task.replace(':', '')}.npy"), weights)
    print("done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

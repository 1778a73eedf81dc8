"""Training script for tests/test_ps_failures.py (every task runs it).

Worker and ps tasks (TF_CONFIG) serve inside `make_strategy` and never return.
The chief trains with plain `model.fit` and prints JSON lines:

  {"event": "epoch", "epoch": e, "iterations": n}   after every epoch
  {"event": "done", "iterations": n, "scheduled": s, "resumed_from": k}

Modes (argv[1]):
  worker_kill: after epoch 0 it waits for the test to kill and restart
    worker:1 (file <dir>/restarted), then keeps training epochs until the
    restarted worker's log (<dir>/worker1.log) shows it ran steps, or 60 s.
  resume: trains 6 epochs with keras.callbacks.BackupAndRestore(<dir>/backup),
    so a restarted job (after losing a ps) resumes from the last epoch.
"""

import json
import os
import sys
import time

import tfdist

STARTED = time.monotonic()
MARKER = "tfdist-test-step-ran"


def main(mode: str, workdir: str) -> None:
    strategy = tfdist.make_strategy("parameter_server", connect_timeout=60)
    from tfdist._tf import import_tensorflow

    tf = import_tensorflow()
    import keras
    import numpy as np

    print(json.dumps({"event": "strategy_ready", "t": round(time.monotonic() - STARTED, 2)}),
          flush=True)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((512, 8)).astype("float32")
    y = x.sum(axis=1, keepdims=True)

    def dataset_fn(input_context):
        return tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(16)

    class Marked(keras.Sequential):
        def train_step(self, data):
            tf.print(MARKER, output_stream=sys.stderr)  # runs (and prints) on the worker
            return super().train_step(data)

    with strategy.scope():
        model = Marked([keras.Input((8,)), keras.layers.Dense(32), keras.layers.Dense(1)])
        model.compile(keras.optimizers.Adam(0.01), "mse")

    steps = 50
    born = STARTED
    emit = lambda **kw: print(json.dumps({**kw, "t": round(time.monotonic() - born, 2)}),  # noqa: E731
                              flush=True)
    if mode == "worker_kill":
        scheduled = 0
        model.fit(dataset_fn, epochs=1, steps_per_epoch=steps, verbose=0)
        scheduled += steps
        emit(event="epoch", epoch=0, iterations=int(model.optimizer.iterations.numpy()))
        restarted = os.path.join(workdir, "restarted")
        deadline = time.monotonic() + 60
        while not os.path.exists(restarted) and time.monotonic() < deadline:
            # Keep training while worker:1 is down: the survivors take the steps.
            model.fit(dataset_fn, epochs=1, steps_per_epoch=steps, verbose=0)
            scheduled += steps
        log = os.path.join(workdir, "worker1.log")
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            model.fit(dataset_fn, epochs=1, steps_per_epoch=steps, verbose=0)
            scheduled += steps
            with open(log) as f:
                if MARKER in f.read():
                    break
        emit(event="done", iterations=int(model.optimizer.iterations.numpy()),
             scheduled=scheduled, resumed_from=None)
        # Then the test kills the ps: the next fit must fail with a clear error.
        ps_killed = os.path.join(workdir, "ps_killed")
        deadline = time.monotonic() + 60
        while not os.path.exists(ps_killed) and time.monotonic() < deadline:
            time.sleep(0.1)
        started = time.monotonic()
        try:
            model.fit(dataset_fn, epochs=1, steps_per_epoch=steps, verbose=0)
            emit(event="ps_error", error=None, seconds=time.monotonic() - started)
        except tfdist.ParameterServerError as e:
            emit(event="ps_error", error=str(e), seconds=time.monotonic() - started)
        sys.stdout.flush()
        os._exit(0)  # skip TensorFlow's teardown against a dead ps

    class Report(keras.callbacks.Callback):
        """Runs after BackupAndRestore: its backup is written when we print."""

        def on_train_begin(self, logs=None):
            self.resumed_from = getattr(model, "_initial_epoch", None) or 0

        def on_epoch_end(self, epoch, logs=None):
            emit(event="epoch", epoch=epoch,
                 iterations=int(model.optimizer.iterations.numpy()))
            time.sleep(0.5)  # gives the test time to kill the ps mid-job

    report = Report()
    # Keras's own BackupAndRestore: model + optimizer state and the epoch.
    backup = keras.callbacks.BackupAndRestore(os.path.join(workdir, "backup"))
    epochs = 6
    model.fit(dataset_fn, epochs=epochs, steps_per_epoch=steps, verbose=0,
              callbacks=[backup, report])
    emit(event="done", iterations=int(model.optimizer.iterations.numpy()),
         scheduled=epochs * steps, resumed_from=report.resumed_from)


if __name__ == "__main__":
    if sys.argv[1] == "serve":  # a worker/ps task: make_strategy serves until killed
        tfdist.make_strategy("parameter_server")
    else:
        main(sys.argv[1], sys.argv[2])

"""Training script for tests/ps/test_failures.py (every task runs it).

Worker and ps tasks (TF_CONFIG) serve inside `make_strategy` and never return.
The chief trains with plain `model.fit` and prints one JSON line per event;
the test drives the faults and tells the chief to move on by creating files
in <dir>.

Modes (argv[1]):
  faults: the coordinator side of worker and ps failures, in order:
    1. epoch 0 on both workers ({"event": "epoch"});
    2. an exactly-once evaluation ("eval_start"; the test kills worker:1
       during it) -> "eval_done" with the sharded and the exact loss;
    3. epochs until <dir>/phase_c exists (the test restarts and kills
       workers meanwhile: overlapping failures);
    4. "accounted": iterations vs scheduled steps and the steps reported as
       re-run after writing;
    5. waits for <dir>/all_lost (both workers killed): the next fit fails
       ("all_lost_error"); waits for <dir>/worker_back: one more epoch
       ("resumed");
    6. waits for <dir>/ps_killed: the next fit fails ("ps_error").
  resume: trains 6 epochs with keras.callbacks.BackupAndRestore(<dir>/backup),
    so a restarted job (after losing a ps) resumes from the last epoch.
"""

import json
import os
import sys
import time

import tfdist
from tests.ps.marked_model import marked_regression  # the test sets PYTHONPATH to the repository

STARTED = time.monotonic()
STEPS = 50


def emit(**event):
    print(json.dumps({**event, "t": round(time.monotonic() - STARTED, 2)}), flush=True)


def wait_for(workdir, name, timeout=240):
    deadline = time.monotonic() + timeout
    while not os.path.exists(os.path.join(workdir, name)):
        if time.monotonic() > deadline:
            emit(event="gave_up", waiting_for=name)
            sys.stdout.flush()
            os._exit(3)
        time.sleep(0.05)


def faults(workdir, strategy, tf, keras, np, model, dataset_fn):
    from tensorflow.python.data.experimental.ops import testing as data_testing

    from tfdist.ps import CoordinatorTrainer

    scheduled = rerun_after_write = 0

    def epoch(tag=None):
        nonlocal scheduled, rerun_after_write
        model.fit(dataset_fn, epochs=1, steps_per_epoch=STEPS, verbose=0)
        scheduled += STEPS
        rerun_after_write += CoordinatorTrainer.for_model(model).last_report.rerun_after_write
        emit(event="epoch", tag=tag, iterations=int(model.optimizer.iterations.numpy()))

    epoch("first")

    # 2. Exactly-once evaluation while worker:1 is killed: 64 batches of a
    # dataset that sleeps 50 ms per batch, in 8 shards over the 2 workers.
    rng = np.random.default_rng(1)
    ex = rng.standard_normal((1024, 8)).astype("float32")
    ey = ex.sum(axis=1, keepdims=True)

    def eval_fn(input_context):
        ds = tf.data.Dataset.from_tensor_slices((ex, ey)).batch(16)
        return ds.apply(data_testing.sleep(50_000))

    with strategy.scope():
        model.compile(model.optimizer, "mse", pss_evaluation_shards=8)
    from tfdist.compat import ps_recovery

    coordinator = CoordinatorTrainer.for_model(model).coordinator
    reruns = ps_recovery.rerun_count(coordinator)
    model.evaluate(eval_fn, verbose=0)  # traces the shard step, makes the worker datasets
    emit(event="eval_start")
    loss = model.evaluate(eval_fn, verbose=0)
    exact = float(np.mean((model.predict(ex, verbose=0) - ey) ** 2))
    emit(event="eval_done", loss=float(loss), exact=exact,
         reruns=ps_recovery.rerun_count(coordinator) - reruns)

    # 3. Overlapping worker failures: the coordinator must keep training.
    while not os.path.exists(os.path.join(workdir, "phase_c")):
        epoch()
    epoch("after")
    emit(event="accounted", iterations=int(model.optimizer.iterations.numpy()),
         scheduled=scheduled, rerun_after_write=rerun_after_write,
         reruns=ps_recovery.rerun_count(coordinator))

    # 5. Every worker lost: a clear error in bounded time, then training goes on.
    wait_for(workdir, "all_lost")
    started = time.monotonic()
    try:
        model.fit(dataset_fn, epochs=1, steps_per_epoch=STEPS, verbose=0)
        emit(event="all_lost_error", error=None)
    except tfdist.ParameterServerError as e:
        emit(event="all_lost_error", error=str(e), seconds=time.monotonic() - started)
    wait_for(workdir, "worker_back")
    before = int(model.optimizer.iterations.numpy())
    model.fit(dataset_fn, epochs=1, steps_per_epoch=STEPS, verbose=0)
    emit(event="resumed", applied=int(model.optimizer.iterations.numpy()) - before,
         rerun_after_write=CoordinatorTrainer.for_model(model).last_report.rerun_after_write)

    # 6. Losing the ps is fatal for this process: a clear error, in bounded time.
    wait_for(workdir, "ps_killed")
    started = time.monotonic()
    try:
        model.fit(dataset_fn, epochs=1, steps_per_epoch=STEPS, verbose=0)
        emit(event="ps_error", error=None, seconds=time.monotonic() - started)
    except tfdist.ParameterServerError as e:
        emit(event="ps_error", error=str(e), seconds=time.monotonic() - started)
    sys.stdout.flush()
    os._exit(0)  # skip TensorFlow's teardown against a dead ps


def main(mode: str, workdir: str) -> None:
    # faults: the test starts the chief once every server listens, and the
    # timeout also bounds how long every worker may be lost (step 5).
    strategy = tfdist.make_strategy("parameter_server",
                                    connect_timeout=20 if mode == "faults" else 90,
                                    skip_completed_reruns=mode == "faults")
    from tfdist._tf import import_tensorflow

    tf = import_tensorflow()
    import keras
    import numpy as np

    emit(event="strategy_ready")
    model, dataset_fn = marked_regression(strategy, hidden=32)

    if mode == "faults":
        faults(workdir, strategy, tf, keras, np, model, dataset_fn)

    class Report(keras.callbacks.Callback):
        """Runs after BackupAndRestore: its backup is written when we print."""

        def on_train_begin(self, logs=None):
            self.resumed_from = getattr(model, "_initial_epoch", None) or 0

        def on_epoch_end(self, epoch, logs=None):
            emit(event="epoch", epoch=epoch, iterations=int(model.optimizer.iterations.numpy()))
            time.sleep(0.5)  # gives the test time to kill the ps mid-job

    report = Report()
    # Keras's own BackupAndRestore: model + optimizer state and the epoch.
    backup = keras.callbacks.BackupAndRestore(os.path.join(workdir, "backup"))
    epochs = 6
    model.fit(dataset_fn, epochs=epochs, steps_per_epoch=STEPS, verbose=0,
              callbacks=[backup, report])
    emit(event="done", iterations=int(model.optimizer.iterations.numpy()),
         scheduled=epochs * STEPS, resumed_from=report.resumed_from)


if __name__ == "__main__":
    if sys.argv[1] == "serve":  # a worker/ps task: make_strategy serves until killed
        tfdist.make_strategy("parameter_server")
    else:
        main(sys.argv[1], sys.argv[2])

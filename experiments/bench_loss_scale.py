"""mixed_float16 on several workers: the loss scale's finite check of summed gradients.

    python -m experiments.bench_loss_scale [--workers=2,4] [--rounds=3] [--model=tiny|conv]
        [--steps=50] [--out=FILE]

N workers (`tfdist launch` on 127.0.0.1, task k pinned to core k mod cores, 1 intra-op
and 1 inter-op thread each) train bench_multiworker's scaling model under the
multi_worker_mirrored preset and Keras's mixed_float16 policy (a LossScaleOptimizer),
in two ways, interleaved round by round, each run a fresh launch:

- "sums first" (tfdist as shipped): the gradients are summed before the finite
  check (tfdist.compat.loss_scale's `tf_apply`), so every worker checks the same
  sums and the check runs no collective of its own;
- "Keras's order": that fix taken out in the workers; the sums run inside the update
  the check may skip, and the check all-reduces an overflow count
  (`loss_scale.check_finite`) so that every worker decides alike.

With the tiny model (Dense(10) on 8 features, 8 examples per worker) the step is all
overhead, as in bench_multiworker's scaling curve, so one collective more or less
shows in the step. Worker 0 reports the median step of the timed epochs (the first
epoch traces and is not timed) and, from a profile of a few more steps, how many
collectives a step runs.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

from absl import app, flags

from experiments.args import int_list
from experiments.rows import print_rows, row, write_rows
from experiments.workers import launch_workers

FLAGS = flags.FLAGS
WAYS = ("sums_first", "keras_order")
EPOCHS = 4  # the first traces and is not timed
TIMEOUT = 900


def _define_flags() -> None:
    flags.DEFINE_list("workers", ["2", "4"], "Worker counts (each >= 2).")
    flags.DEFINE_integer("rounds", 3, "Interleaved rounds (>= 1); the step is their median.")
    flags.DEFINE_enum("model", "tiny", ["tiny", "conv"], "bench_multiworker's scaling model.")
    flags.DEFINE_integer("steps", 50, "Steps per timed epoch (>= 5).")
    flags.DEFINE_string("out", "results/bench_loss_scale.json", "Where to write the JSON.")
    flags.DEFINE_string("role", None, "Internal: run as a launched worker.")
    flags.DEFINE_string("worker_out", None, "Internal: the worker's result file.")
    flags.DEFINE_string("config", "{}", "Internal: the worker's JSON configuration.")


def check_arguments(workers, rounds: int, steps: int) -> list[int]:
    """The worker counts as integers.

    Raises:
      ValueError: a value out of range, naming what was received.
    """
    counts = int_list("--workers", workers, 2, example="2,4",
                      why="the check only runs a collective with several workers")
    if rounds < 1:
        raise ValueError(f"--rounds must be >= 1. Received: {rounds}")
    if steps < 5:
        raise ValueError(f"--steps must be >= 5. Received: {steps}")
    return counts


def _worker(config: dict, out: str) -> None:
    import tfdist
    from experiments import bench_multiworker as multiworker
    from experiments.bench_comm import _pin

    task = int(json.loads(os.environ["TF_CONFIG"])["task"]["index"])
    _pin(task)
    tfdist.configure_threads(intra_op=1, inter_op=1)
    tf = tfdist.import_tensorflow()
    import keras

    strategy = tfdist.make_strategy("multi_worker_mirrored")
    if config["way"] == "keras_order":
        from tfdist.compat import _patch, loss_scale

        _patch.uninstall([loss_scale.APPLY_FIX.name])
    workers = strategy.num_replicas_in_sync
    keras.mixed_precision.set_global_policy("mixed_float16")
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = multiworker._scaling_model(keras, config["model"])
        model.compile(keras.optimizers.SGD(0.01),
                      keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
    ds = multiworker.scaling_dataset(tf, config["model"], workers, task, "global")
    durations: list[float] = []

    class Timer(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.epoch, self.last = epoch, time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            now = time.perf_counter()
            if self.epoch:  # epoch 0 traces
                durations.append(now - self.last)
            self.last = now

    model.fit(ds, epochs=EPOCHS, steps_per_epoch=config["steps"], callbacks=[Timer()],
              verbose=0)
    profile_dir = out + ".profile"

    class Profile(keras.callbacks.Callback):
        # Whole steps only; worker 0 alone (TensorFlow 2.21's profiler can crash in stop()
        # when several processes profile at once). Every worker runs the steps.
        def on_train_batch_begin(self, batch, logs=None):
            if task == 0 and batch == 1:
                tf.profiler.experimental.start(profile_dir)

        def on_train_batch_end(self, batch, logs=None):
            if task == 0 and batch == multiworker.PROFILE_STEPS:
                multiworker._stop_profile(tf)

    model.fit(ds, epochs=1, steps_per_epoch=multiworker.PROFILE_STEPS + 1, verbose=0,
              callbacks=[Profile()])
    if task == 0:
        result = {"step_ms": statistics.median(durations) * 1e3,
                  "finite": bool(all(tf.reduce_all(tf.math.is_finite(w)).numpy()
                                     for w in model.weights)),
                  "scale": float(model.optimizer.dynamic_scale.numpy())}
        result.update(multiworker._collectives(profile_dir, multiworker.PROFILE_STEPS))
        with open(out, "w") as f:
            json.dump(result, f)


def run(workers: list[int], rounds: int, model: str, steps: int) -> dict:
    """{workers: {way: [worker 0's result per round]}}, ways interleaved in each round."""
    results: dict = {n: {way: [] for way in WAYS} for n in workers}
    for _ in range(rounds):
        for n in workers:
            for way in WAYS:
                config = json.dumps({"way": way, "model": model, "steps": steps})
                results[n][way].append(launch_workers(
                    "experiments.bench_loss_scale", "worker", num_workers=n, timeout=TIMEOUT,
                    extra_args=(f"--config={config}",), what=f"{way} x{n}"))
    return results


def rows(results: dict, model: str) -> list[dict]:
    """Per worker count: each way's median step and collectives per step, and the ratio."""
    out = []
    for n, ways in results.items():
        steps = {way: statistics.median(r["step_ms"] for r in runs) for way, runs in ways.items()}
        for way, runs in ways.items():
            collectives = statistics.median(r["collectives_per_step"] for r in runs)
            out.append(row(f"loss_scale/{model}/{n}w/{way}/step", steps[way], "ms",
                           f"mixed_float16, {n} workers on 127.0.0.1, 1+1 threads each, "
                           f"{collectives:g} collectives per step; rounds: "
                           + ", ".join(f"{r['step_ms']:.2f}" for r in runs)))
        out.append(row(f"loss_scale/{model}/{n}w/speedup", steps["keras_order"]
                       / steps["sums_first"], "x", "Keras's order / sums first, same run"))
    return out


def main(argv):
    del argv
    if FLAGS.role:
        return _worker(json.loads(FLAGS.config), FLAGS.worker_out)
    workers = check_arguments(FLAGS.workers, FLAGS.rounds, FLAGS.steps)
    results = run(workers, FLAGS.rounds, FLAGS.model, FLAGS.steps)
    table = rows(results, FLAGS.model)
    print(f"load average {os.getloadavg()[0]:.1f}, {os.cpu_count()} cores")
    print_rows(table)
    write_rows(FLAGS.out, table, results={str(n): r for n, r in results.items()})


if __name__ == "__main__":
    _define_flags()
    try:
        app.run(main)
    except ValueError as e:  # bad flags: the message, not a traceback
        sys.exit(f"bench_loss_scale: {e}")

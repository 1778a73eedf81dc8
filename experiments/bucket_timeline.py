"""When each gradient bucket's all-reduce starts, against the backward pass that feeds it.

    python -m experiments.bucket_timeline [--bucket_bytes=16384] [--inter_op=1,2] [--steps=3]

Two workers (`tfdist launch`, loopback, each pinned to its own core with 1
intra-op thread) train bench_cluster's conv model under the
multi_worker_mirrored preset with `bucket_bytes`; worker 0 profiles `--steps`
whole steps. From the trace, per step: when the backward pass (the ops under
`gradient_tape/`) ends, when each of the optimizer's collectives starts, and
how many of them start before the backward pass ends. A bucket can only hide
its exchange behind the rest of the backward pass if its collective starts
before that pass ends; this reads whether it does, with no link shaping.

The inter-op thread count is the knob that decides it: TensorFlow's executor
runs a step's ready ops on its inter-op threads, and with one thread the long
chain of backward convolutions runs before the small ops that complete a
bucket (a bias gradient, the bucket's concatenation) and before the bucket's
collective (docs/performance.md has the figures).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

from absl import app, flags

from experiments.workers import launch_workers

FLAGS = flags.FLAGS
WARMUP_STEPS = 3


def _define_flags() -> None:
    flags.DEFINE_integer("bucket_bytes", 16384, "bucket_bytes of the preset (> 0).")
    flags.DEFINE_list("inter_op", ["1", "2"], "Inter-op thread counts per worker to compare.")
    flags.DEFINE_integer("steps", 3, "Profiled steps per configuration (>= 1).")
    flags.DEFINE_string("out", None, "Also write the summaries as JSON here.")
    flags.DEFINE_string("role", None, "Internal: run as a launched worker.")
    flags.DEFINE_string("worker_out", None, "Internal: the worker's result file.")
    flags.DEFINE_string("config", "{}", "Internal: the worker's JSON configuration.")


def check_arguments(bucket_bytes: int, inter_op, steps: int) -> list[int]:
    """The inter-op thread counts as integers.

    Raises:
      ValueError: a value out of range, naming what was received.
    """
    if bucket_bytes < 1:
        raise ValueError(f"--bucket_bytes must be >= 1. Received: {bucket_bytes}")
    if steps < 1:
        raise ValueError(f"--steps must be >= 1. Received: {steps}")
    try:
        counts = [int(n) for n in inter_op]
    except ValueError:
        counts = []
    if not counts or any(n < 1 for n in counts):
        raise ValueError(f"--inter_op must be positive integers, e.g. 1,2. "
                         f"Received: {','.join(map(str, inter_op))!r}")
    return counts


def step_summaries(events: list[tuple[str, float, float]], steps: int) -> list[dict]:
    """Per profiled step, from (name, start s, duration s) op events of `steps` whole steps.

    The optimizer's collectives are the `CollectiveReduceV2` ops under a name
    scope (the optimizer's, e.g. `StatefulPartitionedCall/sgd/CollectiveReduceV2_1`;
    the packed logs' collective sits at the function's top level): every step runs
    the same number, so the k-th group of them in start order is step k's. A
    step's backward pass is its ops under `gradient_tape/` that start after the
    previous step's last collective and before its own last one. Times in ms from
    the step's first backward op.

    Raises:
      ValueError: the collectives do not divide into `steps` equal groups.
    """
    def optimizer_collective(name):
        op = name.split(":", 1)[0].split("/")
        return name.endswith(":CollectiveReduceV2") and "gradient_tape" not in op and len(op) > 2

    collectives = sorted(start for name, start, _ in events if optimizer_collective(name))
    if not collectives or len(collectives) % steps:
        raise ValueError(f"{len(collectives)} optimizer collectives do not divide into "
                         f"{steps} steps")
    per_step = len(collectives) // steps
    backward = [(start, start + duration) for name, start, duration in events
                if "/gradient_tape/" in name]
    out, previous_end = [], float("-inf")
    for k in range(steps):
        group = collectives[k * per_step:(k + 1) * per_step]
        ops = [(a, b) for a, b in backward if previous_end < a < group[-1]]
        previous_end = group[-1]
        if not ops:
            continue
        t0 = min(a for a, _ in ops)
        end = (max(b for _, b in ops) - t0) * 1e3
        starts = [(c - t0) * 1e3 for c in group]
        out.append({"backward_ms": end, "collective_starts_ms": starts,
                    "started_during_backward": sum(1 for c in starts if c < end)})
    return out


def _worker(config: dict, out: str) -> None:
    import numpy as np

    import tfdist
    from experiments import bench_cluster
    from experiments.bench_comm import _pin
    from tfdist._tf import import_tensorflow
    from tfdist.compat import profiler_trace

    task = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    _pin(task)
    tfdist.configure_threads(intra_op=1, inter_op=config["inter_op"])
    tf = import_tensorflow()
    import keras

    strategy = tfdist.make_strategy("multi_worker_mirrored",
                                    bucket_bytes=config["bucket_bytes"])
    with strategy.scope():
        model, ds, _, compile_kwargs = bench_cluster._model_and_data("conv", 2, keras, np, tf)
        model.compile(**compile_kwargs)
    trace_dir = out + ".trace"
    last = WARMUP_STEPS + config["steps"] - 1

    class Profile(keras.callbacks.Callback):
        # Whole steps only, after tracing; worker 0 alone (TensorFlow 2.21's
        # profiler can crash in stop() when several processes profile at once).
        def on_train_batch_begin(self, batch, logs=None):
            if task == 0 and batch == WARMUP_STEPS:
                tf.profiler.experimental.start(trace_dir)

        def on_train_batch_end(self, batch, logs=None):
            if task == 0 and batch == last:
                time.sleep(1.0)  # the step's last collective is recorded after it returns
                tf.profiler.experimental.stop()

    model.fit(ds, steps_per_epoch=last + 1, epochs=1, verbose=0, callbacks=[Profile()])
    if task == 0:
        events = profiler_trace.timed_events(trace_dir, contains=":")
        with open(out, "w") as f:
            json.dump({"steps": step_summaries(events, config["steps"])}, f)


def run(bucket_bytes: int, inter_op: list[int], steps: int) -> dict:
    """{inter-op threads: [per-step summary]} from one 2-worker run per count."""
    results = {}
    for n in inter_op:
        config = json.dumps({"bucket_bytes": bucket_bytes, "inter_op": n, "steps": steps})
        result = launch_workers("experiments.bucket_timeline", "worker", num_workers=2,
                                timeout=600, extra_args=(f"--config={config}",),
                                what=f"bucket timeline inter_op={n}")
        results[n] = result["steps"]
    return results


def report(results: dict, bucket_bytes: int) -> str:
    lines = [f"conv model, 2 workers on loopback, bucket_bytes={bucket_bytes}, 1 intra-op "
             f"thread, load average {os.getloadavg()[0]:.1f}", "",
             "| inter-op threads | backward pass (median) | optimizer collectives per step | "
             "started before the backward pass ended | first collective starts |",
             "|---|---|---|---|---|"]
    for n, steps in results.items():
        if not steps:
            lines.append(f"| {n} | - | 0 | - | - |")
            continue
        lines.append(
            f"| {n} | {statistics.median(s['backward_ms'] for s in steps):.1f} ms | "
            f"{len(steps[0]['collective_starts_ms'])} | "
            + ", ".join(f"{s['started_during_backward']}" for s in steps) + " (per step) | "
            + ", ".join(f"{s['collective_starts_ms'][0]:.1f}" for s in steps) + " ms |")
    return "\n".join(lines)


def main(argv):
    del argv
    if FLAGS.role:
        return _worker(json.loads(FLAGS.config), FLAGS.worker_out)
    inter_op = check_arguments(FLAGS.bucket_bytes, FLAGS.inter_op, FLAGS.steps)
    results = run(FLAGS.bucket_bytes, inter_op, FLAGS.steps)
    print(report(results, FLAGS.bucket_bytes))
    if FLAGS.out:
        with open(FLAGS.out, "w") as f:
            json.dump({str(k): v for k, v in results.items()}, f, indent=2)


if __name__ == "__main__":
    _define_flags()
    try:
        app.run(main)
    except ValueError as e:  # bad flags: the message, not a traceback
        sys.exit(f"bucket_timeline: {e}")

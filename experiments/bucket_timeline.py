"""When each gradient bucket's all-reduce starts, against the backward pass that feeds it.

    python -m experiments.bucket_timeline [--bucket_bytes=16384] [--inter_op=1,2] [--steps=3]
        [--rate=GBIT_EQ] [--model=conv|mlp] [--communication=auto|ring] [--timed_steps=8]
        [--nice_compute=0] [--nobucket_priority] [--mixed_precision=mixed_float16]
        [--nosums_before_loss_scale] [--trace_dir=DIR] [--out=FILE]

Two workers (each pinned to its own core with 1 intra-op thread) train
bench_cluster's conv (or mlp) model under the multi_worker_mirrored preset with
`bucket_bytes` (0: no buckets, the gradients' one collective); worker 0
profiles `--steps` whole steps. From the trace, per step: when the backward
pass (the ops under `gradient_tape/`) ends, when each of the optimizer's
collectives starts and ends, how many start before the backward pass ends, and
how much of the collectives' busy time (the union of their intervals) lies
before that end. A bucket can only hide its exchange behind the rest of the
backward pass if its collective starts before that pass ends.

Without `--rate` the workers run on loopback (`tfdist launch`). With it they
run in experiments/netlab.py's namespaces, both directions of the link shaped
to `--rate` Gbit/s-equivalent (bench_cluster's RATE_SCALE), and worker 0 also
measures bench_cluster's three figures on the same processes: the step
(median of `--timed_steps`, not profiled), the compute-only step and the
exchange alone, so hidden = (compute + exchange - step) / exchange is printed
beside what the trace shows. Needs root, `ip`, `tc`, `nsenter`.
`--nobucket_priority` leaves the backward pass in TensorFlow's own order (the
preset's `bucket_priority=False`; tfdist.compat.backward_priority).
`--mixed_precision=mixed_float16` trains under Keras's mixed_float16 policy
(a LossScaleOptimizer), where tfdist sums the buckets before the loss scale's
finite check (tfdist.compat.loss_scale); `--nosums_before_loss_scale` takes
that fix out in the workers, so the sums run inside the update as in Keras.
`--nice_compute` lowers the priority of the workers' inter-op threads (TensorFlow
names them `tf_Compute`) after start-up: a probe of whether the collectives lose
the core to the backward pass.

What the traces show (docs/performance.md has the figures): the collectives of a
step run one after another (each one's launch waits for the previous one's end:
their shared ordering token), the next one's launch is queued on the inter-op
pool from the previous one's completion callback (so with as many inter-op
threads as running backward kernels it waits for a kernel to end), and those
running during the backward pass share the worker's one core with it.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass

from absl import app, flags

from experiments.args import int_list
from experiments.bench_cluster import RATE_SCALE
from experiments.workers import launch_workers

FLAGS = flags.FLAGS
WARMUP_STEPS = 3
MODELS = ("conv", "mlp")
WORKER_TIMEOUT = 600


def _define_flags() -> None:
    flags.DEFINE_integer("bucket_bytes", 16384,
                         "bucket_bytes of the preset (>= 0; 0: no buckets).")
    flags.DEFINE_list("inter_op", ["1", "2"], "Inter-op thread counts per worker to compare.")
    flags.DEFINE_integer("steps", 3, "Profiled steps per configuration (>= 1).")
    flags.DEFINE_float("rate", None, "Shape the link to this many Gbit/s-equivalent "
                       "(network namespaces); default: loopback, unshaped.")
    flags.DEFINE_enum("model", "conv", list(MODELS), "bench_cluster's model.")
    flags.DEFINE_enum("communication", "auto", ["auto", "ring"],
                      "multi_worker_mirrored's communication implementation.")
    flags.DEFINE_bool("bucket_priority", True, "The preset's bucket_priority: each "
                      "bucket's gradients before the backward pass moves on (with buckets).")
    flags.DEFINE_enum("mixed_precision", "float32", ["float32", "mixed_float16"],
                      "Keras dtype policy of the model (mixed_float16: a LossScaleOptimizer).")
    flags.DEFINE_bool("sums_before_loss_scale", True, "Under mixed_float16: the buckets "
                      "are summed before the loss scale's finite check (tfdist.compat."
                      "loss_scale); false: the fix taken out, Keras's order.")
    flags.DEFINE_integer("nice_compute", 0, "Nice value (0-19) given to the workers' "
                         "inter-op threads (`tf_Compute`) after start-up, so the collectives' "
                         "and gRPC's threads win the worker's one core from the backward pass.")
    flags.DEFINE_integer("timed_steps", 8, "With --rate: unprofiled steps timed (>= 2).")
    flags.DEFINE_string("out", None, "Also write the summaries as JSON here.")
    flags.DEFINE_string("trace_dir", None, "Keep worker 0's profiler traces here (one "
                        "folder per inter-op count, for TensorBoard).")
    flags.DEFINE_string("role", None, "Internal: run as a launched worker.")
    flags.DEFINE_string("worker_out", None, "Internal: the worker's result file.")
    flags.DEFINE_string("config", "{}", "Internal: the worker's JSON configuration.")


def check_arguments(bucket_bytes: int, inter_op, steps: int, rate: float | None = None,
                    timed_steps: int = 8, nice_compute: int = 0) -> list[int]:
    """The inter-op thread counts as integers.

    Raises:
      ValueError: a value out of range, naming what was received.
    """
    if bucket_bytes < 0:
        raise ValueError(f"--bucket_bytes must be >= 0 (0: no buckets). Received: {bucket_bytes}")
    if steps < 1:
        raise ValueError(f"--steps must be >= 1. Received: {steps}")
    if rate is not None and not rate > 0:
        raise ValueError(f"--rate must be > 0 Gbit/s-equivalent (leave it out for loopback). "
                         f"Received: {rate}")
    if not 0 <= nice_compute <= 19:
        raise ValueError(f"--nice_compute must be in 0..19. Received: {nice_compute}")
    if timed_steps < 2:
        raise ValueError(f"--timed_steps must be >= 2. Received: {timed_steps}")
    return int_list("--inter_op", inter_op, 1, example="1,2")


def _union_ms(intervals: list[tuple[float, float]], until: float = float("inf")) -> float:
    """Length of the union of [start, end) intervals, cut at `until`."""
    total, reached = 0.0, float("-inf")
    for a, b in sorted(intervals):
        a, b = max(a, reached), min(b, until)
        if b > a:
            total += b - a
        reached = max(reached, b)
    return total


def step_summaries(events: list[tuple[str, float, float]], steps: int) -> list[dict]:
    """Per profiled step, from (name, start s, duration s) op events of `steps` whole steps.

    The optimizer's collectives are the `CollectiveReduceV2` ops under a name
    scope (the optimizer's, e.g. `StatefulPartitionedCall/sgd/CollectiveReduceV2_1`;
    the packed logs' collective sits at the function's top level): every step runs
    the same number, so the k-th group of them in start order is step k's. A
    step's backward pass is its ops under `gradient_tape/` that start after the
    previous step's last collective and before its own last one. Times in ms from
    the step's first backward op; `exchange_ms` is the union of the collectives'
    intervals, `exchange_during_backward_ms` its part before the backward pass ends.

    Raises:
      ValueError: the collectives do not divide into `steps` equal groups.
    """
    def optimizer_collective(name):
        op = name.split(":", 1)[0].split("/")
        return name.endswith(":CollectiveReduceV2") and "gradient_tape" not in op and len(op) > 2

    collectives = sorted((start, start + duration) for name, start, duration in events
                         if optimizer_collective(name))
    if not collectives or len(collectives) % steps:
        raise ValueError(f"{len(collectives)} optimizer collectives do not divide into "
                         f"{steps} steps")
    per_step = len(collectives) // steps
    backward = [(start, start + duration) for name, start, duration in events
                if "/gradient_tape/" in name]
    out, previous_end = [], float("-inf")
    for k in range(steps):
        group = collectives[k * per_step:(k + 1) * per_step]
        ops = [(a, b) for a, b in backward if previous_end < a < group[-1][0]]
        previous_end = group[-1][0]
        if not ops:
            continue
        t0 = min(a for a, _ in ops)
        end = (max(b for _, b in ops) - t0) * 1e3
        spans = [((a - t0) * 1e3, (b - t0) * 1e3) for a, b in group]
        out.append({"backward_ms": end, "collective_starts_ms": [a for a, _ in spans],
                    "collective_ends_ms": [b for _, b in spans],
                    "started_during_backward": sum(1 for a, _ in spans if a < end),
                    "exchange_ms": _union_ms(spans),
                    "exchange_during_backward_ms": _union_ms(spans, until=end)})
    return out


def renice_threads(name: str, nice: int) -> int:
    """Gives this process's threads called `name` the nice value `nice`; how many."""
    count = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().strip() != name:
                    continue
            os.setpriority(os.PRIO_PROCESS, int(tid), nice)
            count += 1
        except (FileNotFoundError, ProcessLookupError):  # the thread ended meanwhile
            continue
    return count


def _worker(config: dict, out: str) -> None:
    import numpy as np

    import tfdist
    from experiments import bench_cluster
    from experiments.bench_comm import _pin, compute_and_exchange_seconds, step_timer
    from tfdist._tf import import_tensorflow
    from tfdist.compat import profiler_trace

    task = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    _pin(task)
    tfdist.configure_threads(intra_op=1, inter_op=config["inter_op"])
    tf = import_tensorflow()
    import keras

    options = {"communication": config.get("communication", "auto")}
    if config["bucket_bytes"]:
        options["bucket_bytes"] = config["bucket_bytes"]
        options["bucket_priority"] = config.get("bucket_priority", True)
    strategy = tfdist.make_strategy("multi_worker_mirrored", join_timeout=300, **options)
    if not config.get("sums_before_loss_scale", True):
        from tfdist.compat import _patch, loss_scale

        _patch.uninstall([loss_scale.APPLY_FIX.name])
    keras.mixed_precision.set_global_policy(config.get("mixed_precision", "float32"))
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model, ds, _, compile_kwargs = bench_cluster._model_and_data(
            config.get("model", "conv"), 2, keras, np, tf)
        model.compile(**compile_kwargs)
    trace_dir = config.get("trace_dir") or out + ".trace"
    model.fit(ds, steps_per_epoch=1, epochs=1, verbose=0)  # start-up: every pool thread exists
    reniced = (renice_threads("tf_Compute", config["nice_compute"])
               if config.get("nice_compute") else 0)
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
    result = {"reniced_threads": reniced}
    if config.get("timed_steps"):  # the shaped run: bench_cluster's figures, same processes
        time_steps = step_timer(keras, model, ds)
        n = config["timed_steps"]
        result["step_ms"] = time_steps(n) * 1e3
        compute, exchange = compute_and_exchange_seconds(
            tf, strategy, model, ds, time_steps, steps=n, exchange_repeats=max(3, n // 2))
        result.update(compute_ms=compute * 1e3, exchange_alone_ms=exchange * 1e3)
    if task == 0:
        events = profiler_trace.timed_events(trace_dir, contains=":")
        result["steps"] = step_summaries(events, config["steps"])
        result["profiled_step_ms"] = [
            duration * 1e3 for name, _, duration in profiler_trace.timed_events(
                trace_dir, contains="multi_step_on_iterator")
            if name == "multi_step_on_iterator"]
        result["top_events"] = [[name, seconds * 1e3, count] for name, seconds, count
                                in profiler_trace.host_events(trace_dir, top=30)]
        with open(out, "w") as f:
            json.dump(result, f)


def _run_shaped(lab, config: dict, port: int) -> dict:
    """Worker 0's result from 2 workers on the lab's nodes (fresh processes, ended here)."""
    from experiments.netlab import run_workers

    return run_workers(lab, ["-m", "experiments.bucket_timeline", "--role=worker",
                             f"--config={json.dumps(config)}"],
                       nodes=2, port=port, timeout=WORKER_TIMEOUT,
                       label=f"bucket timeline inter_op={config['inter_op']}")


@dataclass(frozen=True)
class Setup:
    """What one timeline run measures, as the flags give it (their defaults are the flags'
    own, in _define_flags)."""

    bucket_bytes: int
    steps: int
    model: str
    communication: str
    nice_compute: int
    bucket_priority: bool
    mixed_precision: str
    sums_before_loss_scale: bool
    rate: float | None  # Gbit/s-equivalent; None: loopback
    timed_steps: int  # with a rate: unprofiled steps timed

    @classmethod
    def from_flags(cls, values) -> Setup:
        return cls(**{name: getattr(values, name) for name in cls.__dataclass_fields__})

    def worker_config(self) -> dict:
        """The workers' part (the link and its timed steps stay with the parent)."""
        config = asdict(self)
        del config["rate"], config["timed_steps"]
        return config


def run(setup: Setup, inter_op: list[int], trace_dir: str | None = None) -> dict:
    """{inter-op threads: worker 0's result} from one 2-worker run per count.

    A result holds "steps" (the per-step summaries) and, with `setup.rate`, "step_ms",
    "compute_ms" and "exchange_alone_ms".
    """
    base, rate = setup.worker_config(), setup.rate
    results = {}

    def traced(n):
        if not trace_dir:
            return {}
        return {"trace_dir": os.path.join(os.path.abspath(trace_dir), f"inter_op_{n}")}

    if rate is None:
        for n in inter_op:
            config = json.dumps(dict(base, inter_op=n, **traced(n)))
            results[n] = launch_workers("experiments.bucket_timeline", "worker", num_workers=2,
                                        timeout=WORKER_TIMEOUT, extra_args=(f"--config={config}",),
                                        what=f"bucket timeline inter_op={n}")
        return results
    from experiments.netlab import NetLab

    with NetLab(2, rate * 1e9 * RATE_SCALE) as lab:
        for port, n in enumerate(inter_op, start=47600):
            results[n] = _run_shaped(lab, dict(base, inter_op=n,
                                               timed_steps=setup.timed_steps, **traced(n)),
                                     port)
    return results


def _hidden(result: dict) -> float | None:
    """bench_cluster's (compute + exchange - step) / exchange, clipped to [0, 1]."""
    if "step_ms" not in result or result["exchange_alone_ms"] <= 0:
        return None
    share = (result["compute_ms"] + result["exchange_alone_ms"] - result["step_ms"]) \
        / result["exchange_alone_ms"]
    return max(0.0, min(1.0, share))


def report(results: dict, setup: Setup) -> str:
    rate = setup.rate
    link = (f"link shaped to {rate:g} Gbit/s-eq ({rate * RATE_SCALE * 1e3:g} Mbit/s each way)"
            if rate else "loopback")
    priority = ("" if setup.bucket_priority or not setup.bucket_bytes
                else " (bucket_priority=False)")
    if setup.mixed_precision != "float32":
        priority += f", {setup.mixed_precision}" + (
            "" if setup.sums_before_loss_scale else " (sums inside the loss scale's update)")
    lines = [f"{setup.model} model, 2 workers, {link}, bucket_bytes={setup.bucket_bytes}"
             f"{priority}, communication {setup.communication}, 1 intra-op thread, inter-op "
             f"threads at nice {setup.nice_compute}, load average {os.getloadavg()[0]:.1f}", "",
             "| inter-op threads | backward pass (median) | optimizer collectives per step | "
             "started before the backward pass ended | first collective starts | "
             "last collective ends | exchange busy (during backward) | "
             "step / compute-only / exchange alone | hidden |",
             "|---|---|---|---|---|---|---|---|---|"]
    for n, result in results.items():
        steps = result["steps"]
        if not steps:
            lines.append(f"| {n} | - | 0 | - | - | - | - | - | - |")
            continue
        hidden = _hidden(result)
        timed = (f"{result['step_ms']:.1f} / {result['compute_ms']:.1f} / "
                 f"{result['exchange_alone_ms']:.1f} ms" if "step_ms" in result else "-")
        lines.append(
            f"| {n} | {statistics.median(s['backward_ms'] for s in steps):.1f} ms | "
            f"{len(steps[0]['collective_starts_ms'])} | "
            + ", ".join(f"{s['started_during_backward']}" for s in steps) + " (per step) | "
            + ", ".join(f"{s['collective_starts_ms'][0]:.1f}" for s in steps) + " ms | "
            + ", ".join(f"{max(s['collective_ends_ms']):.1f}" for s in steps) + " ms | "
            + ", ".join(f"{s['exchange_ms']:.1f} ({s['exchange_during_backward_ms']:.1f})"
                        for s in steps) + " ms | "
            + timed + " | " + ("-" if hidden is None else f"{hidden:.2f}") + " |")
    return "\n".join(lines)


def main(argv):
    del argv
    if FLAGS.role:
        return _worker(json.loads(FLAGS.config), FLAGS.worker_out)
    inter_op = check_arguments(FLAGS.bucket_bytes, FLAGS.inter_op, FLAGS.steps, FLAGS.rate,
                               FLAGS.timed_steps, FLAGS.nice_compute)
    setup = Setup.from_flags(FLAGS)
    results = run(setup, inter_op, FLAGS.trace_dir)
    print(report(results, setup))
    if FLAGS.out:
        with open(FLAGS.out, "w") as f:
            json.dump({str(k): v for k, v in results.items()}, f, indent=2)


if __name__ == "__main__":
    _define_flags()
    try:
        app.run(main)
    except ValueError as e:  # bad flags: the message, not a traceback
        sys.exit(f"bucket_timeline: {e}")

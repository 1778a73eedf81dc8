"""Multi-worker numbers: all-reduce over loopback, and scaling with the worker count.

    python -m experiments.bench_multiworker [--quick] [--out results/bench_multiworker.json]
    python -m experiments.bench_multiworker --scaling_only --models=tiny \
        --workers=1,2,4,8,16 [--rounds=3] [--input=global|per_worker]

1. All-reduce between 2 local worker processes (MultiWorkerMirroredStrategy,
   ring) for message sizes 1 KB ... 64 MB: median seconds per all-reduce,
   bus bandwidth 2(N-1)/N*K/t, next to raw loopback TCP throughput measured
   in the same run, and the alpha-beta fit T = alpha + K*beta. The raw
   (bytes, seconds) points are saved for the cost model's calibration.
2. Scaling of a compute-bound convolutional model: 2 workers x 1 intra-op
   thread vs 1 worker x 1 thread, same per-worker batch (target >= 1.7x
   throughput).
3. The scaling curve (`--scaling_only`, and the tiny model at 1, 2, 4 workers
   in a full run): at each worker count N, the step time of
   - tfdist: the multi_worker_mirrored preset, model.fit;
   - tfdist_unpacked: the same with keras_log_reduction taken out (one
     collective per log value);
   - stock: tf.distribute.MultiWorkerMirroredStrategy with a custom training
     loop of the same model (strategy.run, optimizer.apply_gradients,
     strategy.reduce of the loss);
   - control: N independent 1-worker processes at once, pinned as the
     workers are (task k on core k mod cores), so they share the cores as
     the N workers do, with no links between them;
   - control_idle: the same, each process idling `--control_idle_ms` after
     every step, as a linked worker waits for its peers: does idling itself
     make the next step's compute dearer on this machine?
   Efficiency = the control's step time / the variant's. Every process
   also records its CPU per step by thread (experiments/thread_cpu.py), so a
   worker's extra CPU can be placed. Worker 0 alone
   profiles a few more steps and counts its collectives per step, in order:
   TensorFlow 2.21's profiler can crash in tf.profiler.experimental.stop()
   when several processes profile at once, so no other process profiles (of
   the control's processes, only the first). Every process also times its
   input pipeline alone (the same dataset, distributed the same way, with no
   step): with `--input=global` (the default; arrays on every worker, as
   `fit` on numpy or `from_tensor_slices` gives) TensorFlow's DATA auto-shard
   makes each worker's pipeline build every worker's batch and keep its own,
   so that cost grows with N; `--input=per_worker` gives each worker its own
   examples (auto-shard off), as `distribute_datasets_from_function` or
   sharded files do.

Workers are started with tfdist's launcher; each runs this file with
--role=allreduce|scaling and worker 0 writes its measurements to a file
(the scaling role's other workers write theirs next to it).
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from experiments import thread_cpu
from experiments.args import int_list
from experiments.rows import print_rows, row as _row, write_rows
from experiments.workers import ROOT, launch_workers
from absl import app, flags


def _define_flags() -> None:
    """Flags of this module as a program (not at import: experiments.benchmark and
    other bench modules import it, and define flags of the same names)."""
    flags.DEFINE_bool("quick", False, "Fewer sizes, steps and repeats (a smoke run).")
    flags.DEFINE_string("out", "results/bench_multiworker.json", "Where to write the JSON.")
    flags.DEFINE_enum("role", None, ["allreduce", "scaling"], "Internal: run as a launched worker.")
    flags.DEFINE_string("worker_out", None, "Internal: the worker's result file.")
    flags.DEFINE_string("config", "{}", "Internal: the scaling worker's JSON configuration.")
    flags.DEFINE_bool("scaling_only", False, "Only the scaling curve (no all-reduce sizes, "
                      "no conv 2-worker rows unless --models names conv).")
    flags.DEFINE_list("workers", None, "Worker counts of the scaling curve, e.g. 1,2,4,8,16 "
                      "(default 1,2,4,8; with --quick 1,2).")
    flags.DEFINE_list("models", ["tiny"], "Models of the scaling curve: tiny (Dense(10) on 8 "
                      "features, 8 examples per worker: a step of nil compute, all overhead) "
                      "and/or conv (the compute-bound model of the 2-worker rows).")
    flags.DEFINE_integer("rounds", None, "Interleaved rounds of the scaling curve; each "
                         "figure is the median (default 3, 1 with --quick).")
    flags.DEFINE_list("variants", list(DEFAULT_VARIANTS),
                      "Variants of the scaling curve: tfdist and any of "
                      + ", ".join(SCALING_VARIANTS[1:]) + " (efficiency is against control).")
    flags.DEFINE_integer("control_idle_ms", CONTROL_IDLE_MS, "control_idle's pause after "
                         "every step, in ms (about what a linked worker waits for its peers).")
    flags.DEFINE_enum("input", "global", list(INPUTS),
                      "The scaling curve's input: " + "; ".join(
                          f"{k}: {v}" for k, v in INPUTS.items()) + ".")


FLAGS = flags.FLAGS

KB, MB = 1024, 1024 * 1024
SIZES = [KB, 4 * KB, 16 * KB, 64 * KB, 256 * KB, MB, 4 * MB, 16 * MB, 64 * MB]
QUICK_SIZES = [KB, 16 * KB, 256 * KB, 4 * MB]
SCALING_TARGET = 1.7
# Scaling model: convolutions do much arithmetic on few weights (~32k parameters,
# 128 KB of gradients, ~200 MFLOP per training example), so the step is compute-bound
# and the all-reduce small, as in the compute-heavy regime data parallelism is for.
PER_WORKER_BATCH = 64
IMAGE = (32, 32, 16)
FILTERS = 32

# --- worker side (runs under `tfdist launch`) ----------------------------------------


def _fetch(strategy, value) -> None:
    for local in strategy.experimental_local_results(value):
        local.numpy()


def _allreduce_worker(quick: bool, out: str) -> None:
    import tfdist

    tfdist.configure_threads(intra_op=1)
    tf = tfdist._tf.import_tensorflow()
    strategy = tfdist.make_strategy("multi_worker_mirrored", communication="ring")
    points = []
    for size in (QUICK_SIZES if quick else SIZES):
        value = strategy.experimental_distribute_values_from_function(
            lambda _, n=size // 4: tf.ones([n], tf.float32))

        device = strategy.extended.worker_devices[0]

        def replica_fn(x):
            # in a tf.function the tensor has no device yet; run in this iteration only
            with tf.device(device):  # noqa: B023
                x = tf.identity(x)
            return tf.distribute.get_replica_context().all_reduce("SUM", x)

        @tf.function
        def allreduce(v):
            return strategy.run(replica_fn, args=(v,))

        repeats = 5 if quick else (20 if size <= 4 * MB else 8)
        for _ in range(3):
            _fetch(strategy, allreduce(value))
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            _fetch(strategy, allreduce(value))
            times.append(time.perf_counter() - start)
        points.append({"bytes": size, "seconds": statistics.median(times),
                       "all_seconds": times})
    if tfdist.is_chief():
        with open(out, "w") as f:
            json.dump({"points": points, "num_workers": strategy.num_replicas_in_sync}, f)



# How each worker of the scaling curve gets its examples.
INPUTS = {
    "global": "every worker holds the whole arrays and batches the global batch; "
              "TensorFlow's DATA auto-shard gives it 1/N of each (so each worker's "
              "pipeline reads N x its own examples per step)",
    "per_worker": "each worker holds its own examples (auto-shard off), as "
                  "distribute_datasets_from_function or sharded files give; its pipeline "
                  "reads only its own",
}
INPUT_STEPS = (5, 20)  # batches timed by the input-only measurement (quick, full)
SCALING_VARIANTS = ("tfdist", "tfdist_unpacked", "stock", "control", "control_idle")
CONTROLS = ("control", "control_idle")  # unlinked processes: baselines, no efficiency
DEFAULT_VARIANTS = SCALING_VARIANTS[:4]  # control_idle is a diagnosis, asked for by name
CONTROL_IDLE_MS = 60  # control_idle's default pause after every step
VARIANT_NOTES = {
    "tfdist": "tfdist multi_worker_mirrored preset, model.fit",
    "tfdist_unpacked": "the same with keras_log_reduction taken out (one collective per "
                       "log value)",
    "stock": "stock tf.distribute.MultiWorkerMirroredStrategy, custom training loop "
             "(strategy.run + optimizer.apply_gradients + strategy.reduce of the loss)",
    "control": "N independent 1-worker processes at once (no links), pinned as the workers are",
    "control_idle": "the control's processes, each idling after every step as a linked "
                    "worker waits for its peers",
}
# Per model: examples per worker, steps per timed epoch (quick, full), the input shape.
SCALING_MODELS = {
    # The compute-bound model of the 2-worker rows (~200 MFLOP per example, 128 KB of
    # gradients).
    "conv": {"per_worker_batch": PER_WORKER_BATCH, "steps": (5, 10), "input": IMAGE,
             "describe": f"4x Conv2D({FILTERS}) on {IMAGE}"},
    # All overhead: the step's compute is nil, so what a worker count adds is what the
    # step costs beyond compute (collectives, their threads, the input pipeline).
    "tiny": {"per_worker_batch": 8, "steps": (20, 50), "input": (8,),
             "describe": "Dense(10) on 8 features"},
}
PROFILE_STEPS = 5
SCALING_TIMEOUT = 1800  # seconds per launch (16 workers on 2 loaded cores start slowly)


def _scaling_model(keras, name: str):
    shape = SCALING_MODELS[name]["input"]
    if name == "conv":
        return keras.Sequential([keras.Input(shape)] + [
            keras.layers.Conv2D(FILTERS, 3, padding="same", activation="relu")
            for _ in range(4)] + [
            keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(10)])
    return keras.Sequential([keras.Input(shape), keras.layers.Dense(10)])


def _collectives(trace_dir: str, steps: int) -> dict:
    """Collectives per step on this worker and one step's of them in order, from a
    profiler trace of `steps` whole steps."""
    from tfdist.compat import profiler_trace

    events = profiler_trace.timed_events(trace_dir, contains=":Collective")
    per_step = len(events) / steps
    one_step = events[:round(per_step)]
    return {"collectives_per_step": per_step,
            "collective_order": [_short_op_name(name) for name, _, _ in one_step],
            "collective_names": [name for name, _, _ in one_step],
            "collective_ms": [duration * 1e3 for _, _, duration in one_step]}


def _short_op_name(name: str) -> str:
    """'StatefulPartitionedCall/sgd/CollectiveReduceV2:CollectiveReduceV2' ->
    'sgd/CollectiveReduceV2': the op's name scope (the optimizer's, 'sgd...', is the
    gradients' all-reduce; a bare one the loss's or the logs')."""
    op = name.split(":", 1)[0]
    return op[len("StatefulPartitionedCall/"):] if op.startswith("StatefulPartitionedCall/") \
        else op


def _stop_profile(tf) -> None:
    # The last step's result is back before its collective's trace event is recorded
    # (the op is asynchronous): stopping at once lost that event in 1 of 2 stock runs
    # (0 of 4 with the wait).
    time.sleep(1.0)
    tf.profiler.experimental.stop()


def _scaling_worker(config: dict, out: str) -> None:
    import numpy as np

    import tfdist
    from experiments.bench_comm import _pin

    variant, name, quick = config["variant"], config["model"], config["quick"]
    idle = config.get("idle_ms", 0) / 1e3 if variant == "control_idle" else 0.0
    if variant in CONTROLS:  # a 1-worker process of its own (no TF_CONFIG)
        task_id = int(os.environ["BENCH_CONTROL_INDEX"])
    else:
        tf_config = json.loads(os.environ.get("TF_CONFIG") or "{}")
        task_id = int(tf_config.get("task", {}).get("index", 0))
    pinned = _pin(task_id)  # one core per worker, as the 1-worker baseline has one
    tfdist.configure_threads(intra_op=1, inter_op=1)
    tf = tfdist._tf.import_tensorflow()
    import keras

    if variant == "stock":
        strategy = tf.distribute.MultiWorkerMirroredStrategy()
    else:
        strategy = tfdist.make_strategy("multi_worker_mirrored")
    if variant == "tfdist_unpacked":
        from tfdist.compat import keras_log_reduction

        tfdist.compat.uninstall([keras_log_reduction.NAME])
    workers = strategy.num_replicas_in_sync
    spec = SCALING_MODELS[name]
    global_batch = spec["per_worker_batch"] * workers
    ds = scaling_dataset(tf, name, workers, task_id, config.get("input", "global"))
    steps = spec["steps"][0 if quick else 1]
    epochs = 3 if quick else 5  # the first traces and is not timed
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = _scaling_model(keras, name)
        optimizer = keras.optimizers.SGD(0.01)
    seconds, cpu = [], []
    threads = {}  # the timed steps' CPU (ms) and preemptions per step by thread (thread_cpu.since)
    step_durations = []  # per timed epoch, each step's seconds (fit only)
    profile_dir = os.path.join(os.path.dirname(out), f"profile-{variant}-{workers}")
    # One process profiles (worker 0; of the control's processes the first): with
    # several profiling at once TensorFlow 2.21's profiler can crash in stop().
    profiles = task_id == 0

    if variant == "stock":
        loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")
        iterator = iter(strategy.experimental_distribute_dataset(ds))

        def replica_step(xb, yb):
            with tf.GradientTape() as tape:
                per_example = loss_fn(yb, model(xb, training=True))
                loss = tf.nn.compute_average_loss(per_example, global_batch_size=global_batch)
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return loss

        @tf.function
        def train_step(it):
            per_replica = strategy.run(replica_step, args=next(it))
            return strategy.reduce("SUM", per_replica, axis=None)

        def run_steps(n):
            for _ in range(n):
                loss = train_step(iterator)
            return float(loss)

        run_steps(steps)  # traces, warms up
        before = thread_cpu.snapshot()
        for _ in range(epochs - 1):
            start, start_cpu = time.perf_counter(), time.process_time()
            run_steps(steps)
            seconds.append(time.perf_counter() - start)
            cpu.append(time.process_time() - start_cpu)
        threads = thread_cpu.since(before, steps * (epochs - 1))
        if profiles:
            tf.profiler.experimental.start(profile_dir)
        run_steps(PROFILE_STEPS)
        if profiles:
            _stop_profile(tf)
    else:
        with strategy.scope():
            model.compile(optimizer,
                          keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                          metrics=["accuracy"])

        class Timer(keras.callbacks.Callback):
            def on_epoch_begin(self, epoch, logs=None):
                if epoch == 1:  # epoch 0 traces
                    self.threads = thread_cpu.snapshot()
                self.start, self.start_cpu = time.perf_counter(), time.process_time()
                self.last, self.durations = self.start, []

            def on_train_batch_end(self, batch, logs=None):
                if idle:  # control_idle: a linked worker's wait, as a pause
                    time.sleep(idle)
                now = time.perf_counter()
                self.durations.append(now - self.last)
                self.last = now

            def on_epoch_end(self, epoch, logs=None):
                if epoch:  # epoch 0 traces
                    seconds.append(time.perf_counter() - self.start)
                    cpu.append(time.process_time() - self.start_cpu)
                    step_durations.append(self.durations)
                if epoch == epochs - 1:
                    threads.update(thread_cpu.since(self.threads, steps * (epochs - 1)))

        class Profile(keras.callbacks.Callback):
            # Whole steps only (the second to the last): no tracing, no epoch end.
            def on_train_batch_begin(self, batch, logs=None):
                if profiles and batch == 1:
                    tf.profiler.experimental.start(profile_dir)

            def on_train_batch_end(self, batch, logs=None):
                if profiles and batch == PROFILE_STEPS:
                    _stop_profile(tf)

        model.fit(ds, epochs=epochs, steps_per_epoch=steps, callbacks=[Timer()], verbose=0)
        # Every worker runs these steps (their collectives pair up); worker 0 profiles them.
        model.fit(ds, epochs=1, steps_per_epoch=PROFILE_STEPS + 1, verbose=0,
                  callbacks=[Profile()])
    step_seconds = statistics.median(seconds) / steps
    # The input pipeline alone, as the step sees it: the same dataset distributed the
    # same way (no collective: each worker pulls its own batches).
    input_iterator = iter(strategy.experimental_distribute_dataset(ds))
    for _ in range(3):
        next(input_iterator)
    input_steps = INPUT_STEPS[0 if quick else 1]
    start = time.perf_counter()
    for _ in range(input_steps):
        next(input_iterator)
    input_seconds = (time.perf_counter() - start) / input_steps
    result = {"workers": workers, "variant": variant, "model": name, "task": task_id,
              "pinned": pinned, "steps": steps, "timed_epochs": len(seconds),
              "step_seconds": step_seconds, "samples_per_sec": global_batch / step_seconds,
              "input_seconds_per_step": input_seconds, "input": config.get("input", "global"),
              "cpu_seconds_per_step": statistics.median(cpu) / steps,
              "threads": len(os.listdir("/proc/self/task")), **threads,
              "idle_ms": idle * 1e3,
              "step_durations": step_durations,
              "gradient_bytes": 4 * sum(int(np.prod(w.shape))
                                        for w in model.trainable_weights)}
    if profiles:
        result.update(_collectives(profile_dir, PROFILE_STEPS))
        with open(out, "w") as f:
            json.dump(result, f)
    else:
        with open(f"{out}.task{task_id}", "w") as f:
            json.dump(result, f)


def scaling_dataset(tf, model: str, workers: int, task_id: int, input_mode: str):
    """The scaling curve's dataset on one worker: batches of the global batch (N x the
    per-worker batch), which the strategy splits so that each worker steps on its own
    per-worker batch.

    "global": the same arrays on every worker (seed 0), 4 global batches of them, and
    TensorFlow's default auto-shard (DATA for in-memory data: each worker builds every
    global batch and keeps its 1/N). "per_worker": 4 global batches of this worker's own
    examples (seed = its task index) with auto-shard off, so each worker's pipeline only
    reads what it steps on.
    """
    import numpy as np

    spec = SCALING_MODELS[model]
    global_batch = spec["per_worker_batch"] * workers
    rng = np.random.default_rng(0 if input_mode == "global" else task_id)
    x = rng.standard_normal((global_batch * 4, *spec["input"])).astype("float32")
    y = rng.integers(0, 10, size=(global_batch * 4,)).astype("int32")
    ds = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(global_batch)
    if input_mode == "per_worker":
        options = tf.data.Options()
        options.experimental_distribute.auto_shard_policy = (
            tf.data.experimental.AutoShardPolicy.OFF)
        ds = ds.with_options(options)
    return ds


# --- parent side -----------------------------------------------------------------------


def _launch_role(role: str, num_workers: int, quick: bool) -> dict:
    return launch_workers("experiments.bench_multiworker", role, num_workers=num_workers,
                          timeout=900, extra_args=("--quick",) if quick else (), what=role,
                          tail_lines=30)


def _launch_scaling(model: str, variant: str, num_workers: int, quick: bool,
                    input_mode: str = "global", idle_ms: int = 0) -> dict:
    """One point of the scaling curve: worker 0's result ({"step_seconds", ...}, with its
    collectives), every task's under "tasks" (task order), "step_seconds" the tasks'
    mean step and "cpu_ms_by_thread" their mean CPU per step by thread name."""
    config = json.dumps({"model": model, "variant": variant, "quick": quick,
                         "input": input_mode, "idle_ms": idle_ms})
    if variant not in CONTROLS:
        first = launch_workers("experiments.bench_multiworker", "scaling",
                               num_workers=num_workers, timeout=SCALING_TIMEOUT,
                               what=f"scaling {model} {variant} x{num_workers}",
                               extra_args=(f"--config={config}",), tail_lines=30,
                               every_task=True)
        results = [first] + first.pop("tasks")
    else:
        results = _run_control(config, num_workers)
    first = dict(results[0])
    if len(results) != num_workers:
        raise RuntimeError(f"scaling {model} {variant} x{num_workers}: {len(results)} of "
                           f"{num_workers} tasks wrote a result")
    # Synchronous workers step together; the control's processes do not, so their mean.
    first["worker0_step_seconds"] = first["step_seconds"]
    first["step_seconds"] = statistics.mean(r["step_seconds"] for r in results)
    first["cpu_seconds_per_step"] = statistics.mean(r["cpu_seconds_per_step"] for r in results)
    for key in ("cpu_ms_by_thread", "preempted_by_thread"):
        first[key] = thread_cpu.mean_by_name([r.get(key) or {} for r in results])
    first["input_seconds_per_step"] = statistics.mean(r["input_seconds_per_step"]
                                                      for r in results)
    first["samples_per_sec"] = sum(SCALING_MODELS[model]["per_worker_batch"] / r["step_seconds"]
                                   for r in results)
    bound = synchronous_bound([r.get("step_durations") or [] for r in results])
    if bound is not None:
        first["synchronous_bound_seconds"] = bound
    first["tasks"] = results
    return first


def synchronous_bound(durations: list[list[list[float]]]) -> float | None:
    """The step N processes would take if they had to step together, from each process's
    own step times: durations[p][e][i] is process p's step i of timed epoch e.

    A synchronous step ends when the slowest worker is done with it, so each step
    index takes the maximum over the processes; an epoch is the sum of those
    maxima, and the figure the median epoch over the steps per epoch (as
    step_seconds is). For the control (N independent processes) it is the step a
    synchronous job would take with free links: what the workers' variation
    costs, apart from communication. None when any process timed no steps.
    """
    if not durations or any(not d for d in durations):
        return None
    epochs = min(len(d) for d in durations)
    steps = min(len(epoch) for d in durations for epoch in d[:epochs])
    if not steps:
        return None
    per_epoch = [sum(max(d[e][i] for d in durations) for i in range(steps))
                 for e in range(epochs)]
    return statistics.median(per_epoch) / steps


def _run_control(config: str, num_workers: int) -> list[dict]:
    """N unrelated 1-worker processes at once (no TF_CONFIG), pinned as the workers are, so
    they share the cores as the N workers do -> their results, in index order."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
        env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
        procs, logs = [], []
        try:
            for k in range(num_workers):
                logs.append(open(os.path.join(tmp, f"control{k}.log"), "w+"))
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", "experiments.bench_multiworker", "--role=scaling",
                     f"--worker_out={out}", f"--config={config}"],
                    env=dict(env, BENCH_CONTROL_INDEX=str(k)), cwd=ROOT,
                    stdout=logs[-1], stderr=subprocess.STDOUT))
            deadline = time.monotonic() + SCALING_TIMEOUT
            for p in procs:
                try:
                    p.wait(timeout=max(1.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    break
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        results = []
        for k, (p, log) in enumerate(zip(procs, logs)):
            path = out if k == 0 else f"{out}.task{k}"
            if p.returncode != 0 or not os.path.exists(path):
                log.seek(0)
                tail = "\n".join(log.read().strip().splitlines()[-20:])
                for f in logs:
                    f.close()
                raise RuntimeError(f"scaling control process {k} of {num_workers} failed "
                                   f"(exit {p.returncode}):\n{tail}")
            with open(path) as f:
                results.append(json.load(f))
        for f in logs:
            f.close()
    return results


def scaling_curve(models: list[str], workers: list[int], *, rounds: int, quick: bool,
                  variants: tuple[str, ...] = DEFAULT_VARIANTS, input_mode: str = "global",
                  idle_ms: int = 0, log=print, progress=None) -> dict:
    """{model: {variant: {N: [result per round]}}}, every configuration once per round
    (control_idle's processes idle `idle_ms` after every step).

    `progress(curve)` runs after each configuration, with the curve so far (e.g. to
    save it, so a run cut short keeps what it measured).

    At N = 1 only tfdist and stock run (the control is the 1-worker tfdist run; with
    one worker keras_log_reduction passes through). The order of the variants rotates
    from round to round, so no variant always runs first.
    """
    curve = {m: {v: {n: [] for n in workers} for v in variants} for m in models}
    for r in range(rounds):
        for model in models:
            for n in workers:
                chosen = [v for v in variants if n > 1 or v in ("tfdist", "stock")]
                k = r % len(chosen)
                for variant in chosen[k:] + chosen[:k]:
                    result = _launch_scaling(model, variant, n, quick, input_mode, idle_ms)
                    curve[model][variant][n].append(result)
                    log(f"scaling round {r + 1}/{rounds} {model} N={n} {variant}: "
                        f"{result['step_seconds'] * 1e3:.1f} ms/step, input "
                        f"{result['input_seconds_per_step'] * 1e3:.2f} ms/step, "
                        f"{result.get('collectives_per_step', float('nan')):.1f} "
                        "collectives/step on worker 0", flush=True)
                    if progress is not None:
                        progress(curve)
    return curve


def _median_result(results: list[dict]) -> dict:
    ordered = sorted(results, key=lambda d: d["step_seconds"])
    return ordered[(len(ordered) - 1) // 2]


def scaling_table(curve: dict) -> dict:
    """{model: {N: {"step_ms": {variant: ms}, "efficiency": {variant: x},
    "collectives": {variant: (per step, [names in order])}, ...}}} from the medians.

    Efficiency at N workers = the control's step time / the variant's step time,
    the control being N independent 1-worker processes run at once on the same
    cores, pinned the same way (at N = 1: the 1-worker tfdist run). The `vs_1`
    figure is the variant's own 1-worker step / its step at N (tfdist_unpacked's
    1-worker step is tfdist's).
    """
    table = {}
    for model, variants in curve.items():
        # The worker counts measured so far (all of them once the curve is done).
        counts = sorted(n for n, results in variants["tfdist"].items() if results)
        if not counts or counts[0] != 1:
            continue
        one = statistics.median(r["step_seconds"] for r in variants["tfdist"][counts[0]])
        # Each variant's own 1-worker step (tfdist_unpacked is tfdist with one worker).
        ones = {v: statistics.median(r["step_seconds"] for r in variants[v][counts[0]])
                for v in variants if variants[v][counts[0]]}
        ones.setdefault("tfdist_unpacked", one)
        table[model] = {}
        for n in counts:
            med = {v: _median_result(variants[v][n]) for v in variants if variants[v][n]}
            linked = {v: r for v, r in med.items() if v not in CONTROLS}
            control = med["control"]["step_seconds"] if "control" in med else one
            bound = med["control"].get("synchronous_bound_seconds") if "control" in med else None
            table[model][n] = {
                "step_ms": {v: r["step_seconds"] * 1e3 for v, r in med.items()},
                "control_ms": control * 1e3,
                "efficiency": {v: control / r["step_seconds"] for v, r in linked.items()},
                # The control's steps taken in lockstep (the slowest process's each step):
                # what synchronous training costs with free links.
                "synchronous_bound_ms": None if bound is None else bound * 1e3,
                "efficiency_vs_bound": {} if bound is None else {
                    v: bound / r["step_seconds"] for v, r in linked.items()},
                "vs_1": {v: ones[v] / r["step_seconds"] for v, r in linked.items()},
                "cpu_ms": {v: r["cpu_seconds_per_step"] * 1e3 for v, r in med.items()},
                # The processes' mean CPU per step by thread name (experiments/thread_cpu).
                "cpu_ms_by_thread": {v: r.get("cpu_ms_by_thread") or {}
                                     for v, r in med.items()},
                # ... and how often each thread was switched out while runnable, per step.
                "preempted_by_thread": {v: r.get("preempted_by_thread") or {}
                                        for v, r in med.items()},
                "idle_ms": med["control_idle"].get("idle_ms", 0.0)
                if "control_idle" in med else 0.0,
                "input_ms": {v: r["input_seconds_per_step"] * 1e3 for v, r in med.items()},
                "input": med["tfdist"].get("input", "global"),
                "collectives": {v: (r["collectives_per_step"], r["collective_order"],
                                    r["collective_ms"])
                                for v, r in med.items() if "collectives_per_step" in r},
                "threads": {v: r["threads"] for v, r in med.items()},
                "rounds": {v: [x["step_seconds"] * 1e3 for x in variants[v][n]]
                           for v in med}}
    return table


def _baseline_note(model: str, n: int) -> str:
    cores = os.cpu_count()
    spec = SCALING_MODELS[model]
    control = ("the 1-worker tfdist run (1 process)" if n == 1 else
               f"{n} independent 1-worker processes at once, no links")
    return (f"{spec['describe']}, {spec['per_worker_batch']} examples per worker, SGD; CPU "
            f"only, {cores} cores shared, load average {os.getloadavg()[0]:.1f}; every process "
            f"1 intra-op/1 inter-op thread, pinned to core k mod {cores}; workers linked by "
            f"gRPC over loopback (127.0.0.1); baseline (control): {control}, same threads "
            "and pinning")


def scaling_rows(table: dict) -> list[dict]:
    """One row per model, worker count and variant of a scaling_table: its efficiency
    against the control."""
    rows = []
    for model, by_n in table.items():
        for n, t in by_n.items():
            for variant, eff in t["efficiency"].items():
                count, order, ms = t["collectives"].get(variant, (float("nan"), [], []))
                order_text = ", ".join(f"{op} {d:.2f} ms" for op, d in zip(order, ms))
                rows.append(_row(
                    f"scaling_{model}_{n}workers_{variant}_efficiency", eff, "x",
                    f"{VARIANT_NOTES[variant]}: step {t['step_ms'][variant]:.2f} ms vs control "
                    f"{t['control_ms']:.2f} ms (median of {len(t['rounds'][variant])} "
                    "interleaved rounds: "
                    + ", ".join(f"{x:.2f}" for x in t["rounds"][variant])
                    + " ms); " + _bound_note(t, variant)
                    + f"vs its own 1-worker step {t['vs_1'][variant]:.2f}; worker 0 "
                    f"{count:.1f} collectives per step [{order_text}], "
                    f"{t['threads'][variant]} threads; input pipeline alone "
                    f"{t['input_ms'][variant]:.2f} ms per step per worker (control "
                    f"{t['input_ms'].get('control', t['input_ms'][variant]):.2f}; input "
                    f"{t['input']}: {INPUTS[t['input']]}); " + _cpu_note(t, variant)
                    + _baseline_note(model, n)))
            if "control_idle" in t["cpu_ms"] and "control" in t["cpu_ms"]:
                rows.append(_row(
                    f"scaling_{model}_{n}workers_control_idle_cpu",
                    t["cpu_ms"]["control_idle"] / t["cpu_ms"]["control"], "x",
                    f"{VARIANT_NOTES['control_idle']} ({t['idle_ms']:.0f} ms after every "
                    f"step): CPU per step {t['cpu_ms']['control_idle']:.2f} ms vs the "
                    f"control's {t['cpu_ms']['control']:.2f} ms (above 1: idling makes the "
                    "next step's compute dearer on this machine, and a linked worker that "
                    "waits pays it too); " + _cpu_note(t, "control_idle")
                    + _baseline_note(model, n)))
    return rows


def _cpu_note(t: dict, variant: str) -> str:
    """CPU per step by thread of a variant and of the control, for a row's note."""
    by_thread = t.get("cpu_ms_by_thread", {})
    if not by_thread.get(variant):
        return ""
    note = (f"CPU per step {t['cpu_ms'][variant]:.2f} ms by thread (mean of the processes): "
            + thread_cpu.describe(by_thread[variant]))
    if variant != "control" and by_thread.get("control"):
        note += f"; the control's {thread_cpu.describe(by_thread['control'])}"
    preempted = t.get("preempted_by_thread", {})
    if preempted.get(variant):
        note += ("; switched out while runnable, per step: "
                 + thread_cpu.describe(preempted[variant], unit=""))
    return note + "; "


def _bound_note(t: dict, variant: str) -> str:
    if variant not in t.get("efficiency_vs_bound", {}):
        return ""
    return (f"{t['efficiency_vs_bound'][variant]:.2f} of the control's steps in lockstep "
            f"({t['synchronous_bound_ms']:.2f} ms: each step the slowest process's); ")


def _scaling_part(quick: bool, *, models=("tiny",), workers=None, rounds=None,
                  variants: tuple[str, ...] = DEFAULT_VARIANTS,
                  input_mode: str = "global", idle_ms: int = CONTROL_IDLE_MS,
                  progress=None) -> tuple[list[dict], dict, dict]:
    """The scaling curve's rows, the curve, and its table (see scaling_table)."""
    workers = check_worker_counts(workers or ((1, 2) if quick else (1, 2, 4, 8)))
    rounds = (1 if quick else 3) if rounds is None else rounds
    unknown = [m for m in models if m not in SCALING_MODELS]
    if unknown or not models:
        raise ValueError(f"--models must name one or more of {', '.join(SCALING_MODELS)}. "
                         f"Received: {','.join(models)!r}")
    if rounds < 1:
        raise ValueError(f"--rounds must be at least 1. Received: {rounds}")
    if input_mode not in INPUTS:
        raise ValueError(f"--input must be one of {', '.join(INPUTS)}. Received: {input_mode!r}")
    if "tfdist" not in variants or set(variants) - set(SCALING_VARIANTS):
        raise ValueError("--variants must name tfdist and any of "
                         f"{', '.join(SCALING_VARIANTS[1:])}. Received: {','.join(variants)!r}")
    if "control_idle" in variants and "control" not in variants:
        raise ValueError("--variants: control_idle is measured against control; name both "
                         f"(e.g. tfdist,control,control_idle). Received: {','.join(variants)!r}")
    if "control_idle" in variants and idle_ms < 1:
        raise ValueError("--control_idle_ms must be at least 1 with control_idle. "
                         f"Received: {idle_ms}")
    curve = scaling_curve(list(models), workers, rounds=rounds, quick=quick, variants=variants,
                          input_mode=input_mode, idle_ms=idle_ms, progress=progress)
    table = scaling_table(curve)
    return scaling_rows(table), curve, table


def check_worker_counts(workers) -> list[int]:
    """Sorted distinct worker counts, including 1 (the curve's 1-worker point).

    Raises:
      ValueError: a count that is not a positive integer, with what was received.
    """
    counts = sorted(set(int_list("--workers", workers, 1, example="--workers=1,2,4,8")))
    return counts if counts[0] == 1 else [1] + counts


def two_vs_one_rows(curve: dict, fit: tuple[float, float] | None = None) -> list[dict]:
    """The conv model's 2-worker rows (against the 1.7x target) from the curve's tfdist
    runs at 1 and 2 workers, round by round."""
    ones, twos = curve["conv"]["tfdist"][1], curve["conv"]["tfdist"][2]
    speedups = [b["samples_per_sec"] / a["samples_per_sec"] for a, b in zip(ones, twos)]
    speedup = statistics.median(speedups)
    mid = sorted(range(len(speedups)), key=speedups.__getitem__)[(len(speedups) - 1) // 2]
    one, two = ones[mid], twos[mid]
    rows = [
        _row("scaling_1worker_samples_per_sec", one["samples_per_sec"], "samples/s",
             f"1 worker x 1 thread (intra 1, inter 1, pinned to one core), batch "
             f"{PER_WORKER_BATCH}, 4x Conv2D({FILTERS}) on {IMAGE}; CPU only"),
        _row("scaling_2workers_samples_per_sec", two["samples_per_sec"], "samples/s",
             f"2 workers x 1 thread (intra 1, inter 1), each pinned to its own core, "
             f"{PER_WORKER_BATCH} per worker; gRPC over loopback (127.0.0.1)")]
    comm = (f"; all-reduce of {two['gradient_bytes'] / MB:.1f} MB gradients predicted "
            f"{(fit[0] + two['gradient_bytes'] * fit[1]) * 1e3:.1f} ms by the fit"
            if fit else "")
    collectives = ", ".join(f"{op} {d:.1f} ms" for op, d in
                            zip(two.get("collective_order", []), two.get("collective_ms", [])))
    rows.append(_row(
        "scaling_2workers_vs_1", speedup, "x",
        f"median of {len(speedups)} interleaved rounds "
        f"({', '.join(f'{x:.2f}' for x in sorted(speedups))}); baseline 1 worker x 1 thread "
        f"on one core (CPU); load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} "
        f"cores; step {one['step_seconds'] * 1e3:.1f} ms -> {two['step_seconds'] * 1e3:.1f} "
        f"ms; worker 0's collectives per step [{collectives}]" + comm,
        target=SCALING_TARGET))
    return rows


def loopback_tcp_bytes_per_sec(total_bytes: int = 256 * MB, chunk: int = MB) -> float:
    """Raw throughput of one TCP stream over 127.0.0.1 (sendall -> recv_into)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    received = [0]

    def sink():
        conn, _ = server.accept()
        buf = bytearray(chunk)
        view = memoryview(buf)
        with conn:
            while True:
                n = conn.recv_into(view)
                if not n:
                    break
                received[0] += n

    thread = threading.Thread(target=sink)
    thread.start()
    payload = b"\0" * chunk
    with socket.create_connection(server.getsockname()) as client:
        start = time.perf_counter()
        for _ in range(total_bytes // chunk):
            client.sendall(payload)
        client.shutdown(socket.SHUT_WR)
        thread.join()
        seconds = time.perf_counter() - start
    server.close()
    return received[0] / seconds


def alpha_beta_fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Fits T = alpha + K*beta over (K bytes, T seconds); returns (alpha, beta).

    Least squares on the relative error (each equation divided by T): sizes
    span 1 KB..64 MB, and plain least squares would let the largest messages
    decide alpha (it can even come out negative).
    """
    import numpy as np

    k = np.array([p[0] for p in points], dtype=float)
    t = np.array([p[1] for p in points], dtype=float)
    a = np.stack([np.ones_like(k), k], axis=1) / t[:, None]
    (alpha, beta), *_ = np.linalg.lstsq(a, np.ones_like(t), rcond=None)
    return float(alpha), float(beta)


def run(quick: bool) -> list[dict]:
    """Benchmark rows (see the module docstring); the raw points are in row notes/JSON."""
    rows = []
    tcp = statistics.median(loopback_tcp_bytes_per_sec(64 * MB if quick else 256 * MB)
                            for _ in range(3))
    rows.append(_row("loopback_tcp_throughput", tcp / 1e9, "GB/s",
                     "one TCP stream over 127.0.0.1, same run"))
    allreduce = _launch_role("allreduce", 2, quick)
    n = allreduce["num_workers"]
    points = [(p["bytes"], p["seconds"]) for p in allreduce["points"]]
    for size, seconds in points:
        bus = 2 * (n - 1) / n * size / seconds
        rows.append(_row(f"allreduce_{size // KB}KB_time", seconds * 1e6, "us",
                         f"{n} workers, ring over loopback; bus bandwidth "
                         f"{bus / 1e9:.3f} GB/s ({bus / tcp:.2f} of raw TCP)"))
        rows.append(_row(f"allreduce_{size // KB}KB_busbw", bus / 1e9, "GB/s",
                         "2(N-1)/N*K/t"))
    alpha, beta = alpha_beta_fit(points)
    rows.append(_row("allreduce_alpha", alpha * 1e6, "us", "fit T = alpha + K*beta"))
    rows.append(_row("allreduce_1_over_beta", 1 / beta / 1e9 if beta > 0 else float("nan"),
                     "GB/s", f"fit T = alpha + K*beta; raw TCP {tcp / 1e9:.2f} GB/s"))
    # Interleaved rounds (1 worker, 2 workers, ...) and medians: one pair of
    # short runs swings by +-30% on a shared 2-core machine.
    _, conv, _ = _scaling_part(quick, models=("conv",), workers=(1, 2), variants=("tfdist",))
    rows += two_vs_one_rows(conv, (alpha, beta))
    if not quick:  # the overhead curve: the tiny model at 1, 2 and 4 workers, every variant
        rows += _scaling_part(quick, models=("tiny",), workers=(1, 2, 4))[0]
    rows.append({"name": "allreduce_points", "value": float(len(points)), "unit": "points",
                 "target": None, "ratio": None, "note": "raw (bytes, seconds) in 'points'",
                 "points": [{"bytes": k, "seconds": t} for k, t in points]})
    return rows


def _scaling_only(quick: bool, models: list[str], workers, rounds,
                  input_mode: str = "global", variants=DEFAULT_VARIANTS,
                  idle_ms: int = CONTROL_IDLE_MS,
                  progress=None) -> tuple[list[dict], dict]:
    rows, curve, table = _scaling_part(quick, models=models, workers=workers, rounds=rounds,
                                       input_mode=input_mode, variants=tuple(variants),
                                       idle_ms=idle_ms, progress=progress)
    if "conv" in curve and 2 in curve["conv"]["tfdist"]:
        rows += two_vs_one_rows(curve)
    return rows, table


def format_table(table: dict) -> str:
    """The scaling curve as a markdown table (step ms per variant, efficiency, collectives)."""
    lines = []
    for model, by_n in table.items():
        lines += [f"{model}:", "",
                  "| N | tfdist ms | tfdist_unpacked ms | stock ms | control ms | efficiency "
                  "tfdist | tfdist_unpacked | stock | control in lockstep ms | efficiency "
                  "vs lockstep tfdist, stock | collectives/step tfdist, unpacked, "
                  "stock | input alone ms, tfdist / control |", "|---" * 12 + "|"]
        for n, t in by_n.items():
            def ms(v, t=t):
                return f"{t['step_ms'][v]:.2f}" if v in t["step_ms"] else "-"

            def eff(v, t=t):
                return f"{t['efficiency'][v]:.2f}" if v in t["efficiency"] else "-"

            bound = t.get("synchronous_bound_ms")
            vs_bound = ", ".join(f"{t['efficiency_vs_bound'][v]:.2f}"
                                 if v in t.get("efficiency_vs_bound", {}) else "-"
                                 for v in ("tfdist", "stock"))
            counts = ", ".join(f"{t['collectives'][v][0]:.1f}" if v in t["collectives"]
                               else "-" for v in ("tfdist", "tfdist_unpacked", "stock"))
            lines.append(f"| {n} | {ms('tfdist')} | {ms('tfdist_unpacked')} | {ms('stock')} | "
                         f"{t['control_ms']:.2f} | {eff('tfdist')} | {eff('tfdist_unpacked')} "
                         f"| {eff('stock')} | {'-' if bound is None else f'{bound:.2f}'} "
                         f"| {vs_bound} | {counts} | {t['input_ms']['tfdist']:.2f} / "
                         f"{t['input_ms'].get('control', t['input_ms']['tfdist']):.2f} |")
        lines.append("")
        for n, t in by_n.items():
            for v, (count, order, _) in t["collectives"].items():
                lines.append(f"N={n} {v}: worker 0, {count:.1f} collectives/step: "
                             + (", ".join(order) or "none"))
        lines.append("")
        for n, t in by_n.items():
            for v, by_thread in t.get("cpu_ms_by_thread", {}).items():
                if by_thread:
                    idle = f" (idling {t['idle_ms']:.0f} ms a step)" if v == "control_idle" \
                        else ""
                    preempted = t.get("preempted_by_thread", {}).get(v)
                    lines.append(f"N={n} {v}{idle}: CPU {t['cpu_ms'][v]:.2f} ms per step: "
                                 + thread_cpu.describe(by_thread)
                                 + ("; switched out while runnable per step: "
                                    + thread_cpu.describe(preempted, unit="")
                                    if preempted else ""))
        lines.append("")
    return "\n".join(lines)


def main(argv):
    del argv
    if FLAGS.role == "allreduce":
        return _allreduce_worker(FLAGS.quick, FLAGS.worker_out)
    if FLAGS.role == "scaling":
        return _scaling_worker(json.loads(FLAGS.config), FLAGS.worker_out)
    details = {}
    command = " ".join(["python -m experiments.bench_multiworker", *sys.argv[1:]])
    if FLAGS.scaling_only:
        saved = []

        def save_so_far(curve):
            if FLAGS.out:
                saved.append(FLAGS.out)
                table = scaling_table(curve)
                write_rows(FLAGS.out, scaling_rows(table), quick=FLAGS.quick,
                           load_average=os.getloadavg(), command=command, partial=True,
                           scaling=table)

        try:
            rows, table = _scaling_only(FLAGS.quick, FLAGS.models, FLAGS.workers, FLAGS.rounds,
                                        FLAGS.input, FLAGS.variants, FLAGS.control_idle_ms,
                                        progress=save_so_far)
        except RuntimeError as e:  # a launch failed or was stopped (SIGTERM, a timeout)
            where = (f"The configurations measured before it are in {FLAGS.out} "
                     '("partial": true).' if saved else "No configuration had finished.")
            sys.exit(f"bench_multiworker: the scaling curve stopped: {e}\n{where}")
        details["scaling"] = table
    else:
        rows = run(FLAGS.quick)
    print_rows(rows)
    if "scaling" in details:
        print()
        print(format_table(details["scaling"]))
    if FLAGS.out:
        write_rows(FLAGS.out, rows, quick=FLAGS.quick, load_average=os.getloadavg(),
                   command=command, **details)


if __name__ == "__main__":
    _define_flags()
    try:
        app.run(main)
    except ValueError as e:  # bad flags: the message, not a traceback
        sys.exit(f"bench_multiworker: {e}")

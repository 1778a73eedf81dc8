"""Gradient compression, buckets and overlap on 2 local workers: `python -m experiments.bench_comm`.

    python -m experiments.bench_comm [--quick] [--out results/bench_comm.json]

An MLP with ~9 MB of float32 gradients (784-1024-1024-512-10, 2.4 M
parameters), global batch = 64 per worker, Adam:

1. Scaling, 2 workers x 1 thread vs 1 worker x 1 thread (same per-worker
   batch), for gradient_compression none, fp16, bf16, powersgd (rank 4, no
   warm-up), and none and fp16 with buckets (bucket_bytes 1 MB): samples/s ratio per
   round, median over interleaved rounds (every configuration once per round,
   rotated). Targets: powersgd >= 1.6x, fp16 >= 1.3x (with and without buckets).
2. Bytes on the wire per step, measured on worker 0's TCP sockets (`ss -ti`
   bytes_sent over the timed steps), next to the alpha-beta prediction
   (`tfdist.cost.compressed_gradient_bytes`; a 2-worker ring sends K per
   rank) and the alpha-beta time with the link calibrated in the same run.
3. Overlap: for each configuration the same workers also time the step with
   communication removed (a GradientSync that keeps each worker's gradients)
   and the gradient exchange alone; hidden = (compute + comm - step) / comm.

The parent process never imports TensorFlow: every worker is a process
started by tfdist's launcher, pinned to one core (sched_setaffinity) with
one intra-op and one inter-op thread; the load average is recorded around
every round.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import time

from absl import app, flags

from experiments.rows import print_rows, row as _row, write_rows
from experiments.workers import launch_workers


def _define_flags() -> None:
    """Flags of this module as a program (not at import: experiments.benchmark and
    other bench modules import it, and define flags of the same names)."""
    flags.DEFINE_bool("quick", False, "One short round (a smoke run).")
    flags.DEFINE_string("out", "results/bench_comm.json", "Where to write the JSON.")
    flags.DEFINE_string("role", None, "Internal: run as a launched worker with this JSON config.")
    flags.DEFINE_string("worker_out", None, "Internal: the worker's result file.")


FLAGS = flags.FLAGS

WIDTHS = (784, 1024, 1024, 512, 10)
PER_WORKER_BATCH = 64
# 1 MB pieces: over gRPC they move several times faster than one large tensor
# (experiments/bench_allreduce.py), and a bucket can start before the backward pass ends.
BUCKET_BYTES = 1024 * 1024
POWERSGD_RANK = 4
CONFIGS = {  # name -> preset options of the 2-worker run
    "none": {},
    "none+buckets": {"bucket_bytes": BUCKET_BYTES},
    "fp16": {"gradient_compression": "fp16"},
    "fp16+buckets": {"gradient_compression": "fp16", "bucket_bytes": BUCKET_BYTES},
    "bf16": {"gradient_compression": "bf16"},
    "powersgd": {"gradient_compression": "powersgd", "powersgd_rank": POWERSGD_RANK,
                 "powersgd_warmup_steps": 0},
}
TARGETS = {"powersgd": 1.6, "fp16": 1.3, "fp16+buckets": 1.3}


def shapes() -> list[tuple[int, ...]]:
    """The MLP's trainable variable shapes (kernels and biases)."""
    out = []
    for a, b in zip(WIDTHS[:-1], WIDTHS[1:]):
        out += [(a, b), (b,)]
    return out


# --- worker side ------------------------------------------------------------------------


def _pin(task_id: int) -> str:
    """Pins this process to one core (task k on core k mod cores); returns which."""
    cores = sorted(os.sched_getaffinity(0))
    core = cores[task_id % len(cores)]
    os.sched_setaffinity(0, {core})
    return f"core {core}"


def tcp_bytes_by_socket(pid: int | None) -> dict[tuple[str, str], int] | None:
    """Bytes each TCP socket has sent (`ss -ti`: bytes_sent), keyed by (local, peer).

    `pid`: that process's sockets (`ss -p`); None: every socket of this network namespace
    (a simulated node's namespace holds its one worker, and no process table is searched).

    When its netlink query fails, `ss` falls back to /proc/net/tcp without a word (exit 0):
    every socket is listed, none with its tcp_info, so none with bytes_sent. Such a reading
    (an established socket without tcp_info) is taken again; None when `ss` fails or reads
    so three times: the bytes on the wire are then unknown, never 0.
    """
    args = ["ss", "-tinH"] + (["-p"] if pid is not None else [])
    problem = ""
    for attempt in range(3):
        if attempt:
            time.sleep(0.2)
        try:
            done = subprocess.run(args, capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired) as e:
            problem = str(e)
            continue
        if done.returncode:
            problem = f"exit {done.returncode}: {done.stderr.strip()[-200:]}"
            continue
        sockets = _parse_ss(done.stdout, pid)
        if sockets is not None:
            return sockets
        problem = "no tcp_info: ss read /proc/net/tcp instead of netlink"
    print(f"{' '.join(args)} failed 3 times ({problem}): bytes on the wire unknown",
          file=sys.stderr, flush=True)
    return None


def _parse_ss(text: str, pid: int | None) -> dict[tuple[str, str], int] | None:
    """`ss -tinH` output as {(local, peer): bytes_sent}; None if an established socket has no
    tcp_info line (its `mss:`), as in `ss`'s /proc fallback."""
    sockets: dict[tuple[str, str], int] = {}
    key, waiting = None, False
    for line in text.splitlines():
        if not line.startswith((" ", "\t")):
            if waiting:
                return None
            fields = line.split()
            mine = pid is None or f"pid={pid}," in line
            key = (fields[3], fields[4]) if mine and len(fields) > 4 else None
            waiting = bool(fields) and fields[0] == "ESTAB"
            continue
        waiting = waiting and "mss:" not in line
        found = re.search(r"bytes_sent:(\d+)", line)
        if key is not None and found:
            sockets[key] = sockets.get(key, 0) + int(found.group(1))
    return None if waiting else sockets


def tcp_bytes_sent_since(before: dict[tuple[str, str], int] | None, pid: int | None) -> float:
    """Bytes sent over TCP since the snapshot `before` (`tcp_bytes_by_socket(pid)`),
    counted per socket: a connection opened since counts whole, and one closed since drops
    out instead of taking the total below zero. NaN when either snapshot failed."""
    after = tcp_bytes_by_socket(pid)
    if before is None or after is None:
        return float("nan")
    sent = 0
    for key, now in after.items():
        was = before.get(key, 0)
        sent += now - was if now >= was else now  # fewer: a new connection on the same ports
    return float(sent)


def step_timer(keras, model, ds):
    """`time_steps(steps)`: the median time between the ends of `steps` consecutive steps
    of `model.fit(ds)` (one more step runs first, so every interval is a whole step), each
    step's end read where its loss is (bench_cluster's and bucket_timeline's clock)."""

    class Clock(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            self.ends = []

        def on_train_batch_end(self, batch_index, logs=None):
            float(logs["loss"])  # the step's result is here
            self.ends.append(time.perf_counter())

    def time_steps(steps: int) -> float:
        clock = Clock()
        model.fit(ds, epochs=1, steps_per_epoch=steps + 1, verbose=0, callbacks=[clock])
        return statistics.median(b - a for a, b in zip(clock.ends, clock.ends[1:]))

    return time_steps


def compute_and_exchange_seconds(tf, strategy, model, ds, time_steps, *, steps: int,
                                 exchange_repeats: int,
                                 sparse_rows: dict[int, int] | None = None
                                 ) -> tuple[float, float]:
    """(compute-only step, exchange alone) on a worker of a tfdist multi-worker strategy.

    Compute only: `time_steps(steps)` with the strategy's GradientSync swapped for one that
    keeps each worker's own gradients (no communication; tfdist's sync is put back after).
    Exchange alone: the sync's reduction of gradient-shaped tensors, outside any step, the
    median of `exchange_repeats` runs. `sparse_rows` maps the index of a trainable variable
    whose gradient is an IndexedSlices (an embedding's) to its number of rows in one step's
    gradient: that gradient is exchanged as an IndexedSlices of so many rows, the others
    dense. Shared by bench_comm and bench_cluster (their hidden share is
    (compute + exchange - step) / exchange).
    """
    from tfdist import sync as sync_lib

    sync = sync_lib.gradient_sync(strategy)

    class KeepLocal(sync_lib.GradientSync):
        """No communication: each worker applies its own gradients (timing only)."""

        def reduce(self, optimizer, grads_and_vars, keras_all_reduce):
            return list(grads_and_vars)

    sync_lib.set_gradient_sync(strategy, KeepLocal())
    model.make_train_function(force=True)
    model.fit(ds, epochs=1, steps_per_epoch=2, verbose=0)
    compute_seconds = time_steps(steps)
    sync_lib.set_gradient_sync(strategy, sync)
    variables = [v.value for v in model.trainable_variables]
    sparse_rows = dict(sparse_rows or {})

    def gradient_like(index, v):
        if index not in sparse_rows:
            return tf.ones_like(v) * 1e-3
        rows = sparse_rows[index]
        return tf.IndexedSlices(tf.ones([rows, *v.shape[1:]], v.dtype) * 1e-3,
                                tf.range(rows) % v.shape[0], tf.shape(v))

    def keras_all_reduce(grads_and_vars):
        # What Keras's optimizer does (one all-reduce of every gradient), in public API.
        grads = [g for g, _ in grads_and_vars]
        summed = tf.distribute.get_replica_context().all_reduce("SUM", grads)
        return list(zip(summed, [v for _, v in grads_and_vars]))

    @tf.function
    def exchange():
        def replica_fn():
            pairs = [(gradient_like(i, v), v) for i, v in enumerate(variables)]
            reduced = sync.reduce(model.optimizer, pairs, keras_all_reduce)
            return tf.add_n([tf.reduce_sum(g.values if isinstance(g, tf.IndexedSlices) else g)
                             for g, _ in reduced])

        return strategy.run(replica_fn)

    exchange()  # trace
    times = []
    for _ in range(exchange_repeats):
        start = time.perf_counter()
        strategy.experimental_local_results(exchange())[0].numpy()
        times.append(time.perf_counter() - start)
    return compute_seconds, statistics.median(times)


def _worker(config: dict, out: str) -> None:
    import numpy as np

    import tfdist
    from tfdist._tf import import_tensorflow

    task_id = json.loads(os.environ.get("TF_CONFIG", "{}")).get("task", {}).get("index", 0)
    pinned = _pin(task_id)
    tfdist.configure_threads(intra_op=1, inter_op=1)
    tf = import_tensorflow()
    import keras

    strategy = tfdist.make_strategy("multi_worker_mirrored", **config["options"])
    workers = strategy.num_replicas_in_sync
    batch = PER_WORKER_BATCH * workers
    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch * 4, WIDTHS[0])).astype("float32")
    y = rng.integers(0, WIDTHS[-1], size=batch * 4).astype("int32")
    ds = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(batch)
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((WIDTHS[0],))] + [
            keras.layers.Dense(w, activation="relu") for w in WIDTHS[1:-1]] + [
            keras.layers.Dense(WIDTHS[-1])])
        model.compile(keras.optimizers.Adam(1e-4),
                      keras.losses.SparseCategoricalCrossentropy(from_logits=True))

    time_steps = step_timer(keras, model, ds)
    steps = config["steps"]
    model.fit(ds, epochs=1, steps_per_epoch=3, verbose=0)  # trace, warm up
    sent_before = tcp_bytes_by_socket(os.getpid())
    step = time_steps(steps)
    sent = tcp_bytes_sent_since(sent_before, os.getpid()) / (steps + 1)
    result = {"workers": workers, "step_seconds": step, "samples_per_sec": batch / step,
              "wire_bytes_per_step": sent, "pinned": pinned,
              "gradient_bytes": 4 * model.count_params()}
    if workers > 1 and config.get("overlap"):
        result["compute_seconds"], result["comm_seconds"] = compute_and_exchange_seconds(
            tf, strategy, model, ds, time_steps, steps=steps, exchange_repeats=steps)
    if tfdist.is_chief():
        with open(out, "w") as f:
            json.dump(result, f)


# --- parent side (no TensorFlow) ---------------------------------------------------------


def _launch(num_workers: int, options: dict, steps: int, overlap: bool) -> dict:
    config = json.dumps({"options": options, "steps": steps, "overlap": overlap})
    return launch_workers("experiments.bench_comm", config, num_workers=num_workers,
                          timeout=900, what="bench_comm")





def _link_from_report() -> "object | None":
    """The alpha-beta link of the last all-reduce calibration, if one was written."""
    from tfdist import planning as cost  # the cost model

    for path in ("results/bench_multiworker.json", "results/benchmark.json"):
        try:
            with open(path) as f:
                data = json.load(f)
        except (OSError, ValueError):
            continue
        for row in data.get("rows", []):
            if row.get("name") == "allreduce_points" and row.get("points"):
                points = [(p["bytes"], p["seconds"]) for p in row["points"]]
                return cost.fit_alpha_beta(points, 2)
    return None


def run(quick: bool) -> list[dict]:
    """The rows (see the module docstring)."""
    from tfdist import planning as cost  # the cost model

    steps = 4 if quick else 12
    rounds = 1 if quick else 3
    names = list(CONFIGS)
    samples: dict[str, list[float]] = {"1 worker": []}
    ratios: dict[str, list[float]] = {name: [] for name in names}
    results: dict[str, list[dict]] = {name: [] for name in names}
    loads = [os.getloadavg()[0]]
    for r in range(rounds):
        one = _launch(1, {}, steps, overlap=False)
        samples["1 worker"].append(one["samples_per_sec"])
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            two = _launch(2, CONFIGS[name], steps, overlap=True)
            results[name].append(two)
            ratios[name].append(two["samples_per_sec"] / one["samples_per_sec"])
        loads.append(os.getloadavg()[0])
    load = (f"load average {min(loads):.1f}-{max(loads):.1f} on {os.cpu_count()} cores "
            f"(others' jobs included)")
    base = (f"baseline 1 worker x 1 thread (intra 1, inter 1, pinned to one core), batch "
            f"{PER_WORKER_BATCH}, median {statistics.median(samples['1 worker']):,.0f} "
            "samples/s")
    rows = []
    link = _link_from_report()
    for name in names:
        ratio = statistics.median(ratios[name])
        mid = sorted(results[name], key=lambda d: d["samples_per_sec"])[len(results[name]) // 2]
        rows.append(_row(
            f"comm: 2 workers x 1 thread vs 1 worker, MLP 9 MB gradients, {name}", ratio, "x",
            f"median of {rounds} interleaved rounds "
            f"({', '.join(f'{x:.2f}' for x in ratios[name])}); "
            f"2 workers x 1 thread, each pinned to its own core, {PER_WORKER_BATCH} per worker; "
            f"{base}; {load}", target=TARGETS.get(name)))
        options = CONFIGS[name]
        method = options.get("gradient_compression", "none")
        predicted = cost.compressed_gradient_bytes(shapes(), compression=method,
                                                   rank=POWERSGD_RANK)
        time_note = ""
        if link is not None:
            t = cost.compressed_allreduce_time(shapes(), 2, link, compression=method,
                                               rank=POWERSGD_RANK)
            time_note = (f"; alpha-beta time {cost.format_seconds(t)} (link from the last "
                         f"all-reduce calibration: {link.bandwidth / 1e9:.2f} GB/s)")
        rows.append(_row(
            f"comm: bytes on the wire per step, worker 0, {name}",
            statistics.median(d["wire_bytes_per_step"] for d in results[name]) / 1e6, "MB",
            f"measured: TCP bytes_sent of worker 0 (ss -ti) over the timed steps, heartbeats "
            f"included; alpha-beta prediction {predicted / 1e6:.2f} MB (2-worker ring: K per "
            f"rank); measured exchange alone "
            f"{statistics.median(d['comm_seconds'] for d in results[name]) * 1e3:.1f} ms"
            f"{time_note}"))
        step = mid["step_seconds"]
        compute, comm = mid["compute_seconds"], mid["comm_seconds"]
        hidden = max(0.0, min(1.0, (compute + comm - step) / comm)) if comm > 0 else 0.0
        rows.append(_row(
            f"comm: share of the exchange hidden behind compute, {name}", hidden, "fraction",
            f"(compute + comm - step) / comm with step {step * 1e3:.1f} ms, compute-only "
            f"{compute * 1e3:.1f} ms (no exchange), exchange alone {comm * 1e3:.1f} ms; "
            f"2 workers x 1 thread; median round"))
    return rows


def main(argv):
    del argv
    if FLAGS.role:
        return _worker(json.loads(FLAGS.role), FLAGS.worker_out)
    rows = run(FLAGS.quick)
    print_rows(rows)
    if FLAGS.out:
        write_rows(FLAGS.out, rows, quick=FLAGS.quick,
                   command="python -m experiments.bench_comm" + (" --quick" if FLAGS.quick else ""))


if __name__ == "__main__":
    _define_flags()
    app.run(main)

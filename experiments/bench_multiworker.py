"""Multi-worker numbers: all-reduce over loopback, and 2-worker scaling.

    python -m experiments.bench_multiworker [--quick] [--out results/bench_multiworker.json]

1. All-reduce between 2 local worker processes (MultiWorkerMirroredStrategy,
   ring) for message sizes 1 KB ... 64 MB: median seconds per all-reduce,
   bus bandwidth 2(N-1)/N*K/t, next to raw loopback TCP throughput measured
   in the same run, and the alpha-beta fit T = alpha + K*beta. The raw
   (bytes, seconds) points are saved for the cost model's calibration.
2. Scaling of a compute-heavy MLP: 2 workers x 1 intra-op thread vs 1 worker
   x 1 thread, same per-worker batch (target >= 1.7x throughput).

Workers are started with tfdist's launcher; each runs this file with
--role=allreduce|scaling and worker 0 writes its measurements to a file.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import threading
import time

from experiments.rows import print_rows, row as _row, write_rows
from experiments.workers import launch_workers
from absl import app, flags


def _define_flags() -> None:
    """Flags of this module as a program (not at import: experiments.benchmark and
    other bench modules import it, and define flags of the same names)."""
    flags.DEFINE_bool("quick", False, "Fewer sizes and repeats (a smoke run).")
    flags.DEFINE_string("out", "results/bench_multiworker.json", "Where to write the JSON.")
    flags.DEFINE_enum("role", None, ["allreduce", "scaling"], "Internal: run as a launched worker.")
    flags.DEFINE_string("worker_out", None, "Internal: the worker's result file.")


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


def _scaling_worker(quick: bool, out: str) -> None:
    import numpy as np

    import tfdist
    from experiments.bench_comm import _pin

    task_id = json.loads(os.environ.get("TF_CONFIG", "{}")).get("task", {}).get("index", 0)
    _pin(task_id)  # one core per worker, as the 1-worker baseline has one
    tfdist.configure_threads(intra_op=1, inter_op=1)
    tf = tfdist._tf.import_tensorflow()
    import keras

    strategy = tfdist.make_strategy("multi_worker_mirrored")
    workers = strategy.num_replicas_in_sync
    global_batch = PER_WORKER_BATCH * workers
    rng = np.random.default_rng(0)
    x = rng.standard_normal((global_batch * 4, *IMAGE)).astype("float32")
    y = rng.integers(0, 10, size=(global_batch * 4,))
    ds = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(global_batch)
    with strategy.scope():
        model = keras.Sequential([keras.Input(IMAGE)] + [
            keras.layers.Conv2D(FILTERS, 3, padding="same", activation="relu")
            for _ in range(4)] + [
            keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(10)])
        model.compile(keras.optimizers.SGD(0.01),
                      keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    steps = 5 if quick else 10
    epochs = 3 if quick else 6

    class Timer(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            self.seconds = []

        def on_epoch_begin(self, epoch, logs=None):
            self.start = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            self.seconds.append(time.perf_counter() - self.start)

    timer = Timer()
    model.fit(ds, epochs=epochs, steps_per_epoch=steps, callbacks=[timer], verbose=0,
              shuffle=False)
    step_seconds = statistics.median(timer.seconds[1:]) / steps  # epoch 0 traces
    params = sum(int(np.prod(w.shape)) for w in model.trainable_weights)
    if tfdist.is_chief():
        with open(out, "w") as f:
            json.dump({"workers": workers, "step_seconds": step_seconds,
                       "samples_per_sec": global_batch / step_seconds,
                       "gradient_bytes": 4 * params}, f)


# --- parent side -----------------------------------------------------------------------


def _launch_role(role: str, num_workers: int, quick: bool) -> dict:
    return launch_workers("experiments.bench_multiworker", role, num_workers=num_workers,
                          timeout=900, extra_args=("--quick",) if quick else (), what=role,
                          tail_lines=30)


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
    rounds = [(_launch_role("scaling", 1, quick), _launch_role("scaling", 2, quick))
              for _ in range(1 if quick else 3)]
    speedups = sorted(two["samples_per_sec"] / one["samples_per_sec"] for one, two in rounds)
    speedup = statistics.median(speedups)
    one, two = rounds[[two["samples_per_sec"] / one["samples_per_sec"]
                       for one, two in rounds].index(speedups[len(speedups) // 2])]
    rows.append(_row("scaling_1worker_samples_per_sec", one["samples_per_sec"], "samples/s",
                     f"1 worker x 1 thread (intra 1, inter 1, pinned to one core), batch "
                     f"{PER_WORKER_BATCH}, 4x Conv2D({FILTERS}) on {IMAGE}"))
    rows.append(_row("scaling_2workers_samples_per_sec", two["samples_per_sec"], "samples/s",
                     f"2 workers x 1 thread (intra 1, inter 1), each pinned to its own core, "
                     f"{PER_WORKER_BATCH} per worker"))
    comm = alpha + two["gradient_bytes"] * beta
    load = os.getloadavg()[0]
    rows.append(_row("scaling_2workers_vs_1", speedup, "x",
                     f"median of {len(rounds)} interleaved rounds "
                     f"({', '.join(f'{x:.2f}' for x in speedups)}); "
                     f"load average {load:.1f} on {os.cpu_count()} cores; "
                     f"step {one['step_seconds'] * 1e3:.1f} ms -> {two['step_seconds'] * 1e3:.1f}"
                     f" ms; all-reduce of {two['gradient_bytes'] / MB:.1f} MB gradients "
                     f"predicted {comm * 1e3:.1f} ms by the fit", target=SCALING_TARGET))
    rows.append({"name": "allreduce_points", "value": float(len(points)), "unit": "points",
                 "target": None, "ratio": None, "note": "raw (bytes, seconds) in 'points'",
                 "points": [{"bytes": k, "seconds": t} for k, t in points]})
    return rows


def main(argv):
    del argv
    if FLAGS.role == "allreduce":
        return _allreduce_worker(FLAGS.quick, FLAGS.worker_out)
    if FLAGS.role == "scaling":
        return _scaling_worker(FLAGS.quick, FLAGS.worker_out)
    rows = run(FLAGS.quick)
    print_rows(rows)
    if FLAGS.out:
        write_rows(FLAGS.out, rows, quick=FLAGS.quick,
                   command="python -m experiments.bench_multiworker"
                           + (" --quick" if FLAGS.quick else ""))


if __name__ == "__main__":
    _define_flags()
    app.run(main)

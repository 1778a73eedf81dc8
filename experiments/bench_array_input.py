"""What one worker's input costs per step when `fit` reads NumPy arrays, by worker count.

    python -m experiments.bench_array_input [--workers=1,2,4,8,16] [--rounds=5] [--out=F.json]

Under MultiWorkerMirroredStrategy, Keras's array path builds every global
batch on every worker and keeps the worker's share (TensorFlow's DATA
auto-shard), so a worker's input work grows with the number of workers.
tfdist's `multi_worker_mirrored` preset (`tfdist.compat.keras_array_input`)
has each worker gather only its own rows. This times worker 0's pipeline both
ways in ONE process pinned to one core with 1 intra-op and 1 inter-op thread
(what each worker of the issue's scaling benchmark has), for N workers of 64
examples of 32x32x16 float32 each (the scaling benchmark's conv input; 4 MB
per worker batch), `shuffle=True`: the median over `--rounds` interleaved
rounds of 20 batches pulled after 5 untimed. No link is involved: each
worker's pipeline runs on its own, so one process measures it exactly. A
check row confirms that, unshuffled, both pipelines give worker 0 the same
rows.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

from absl import app, flags

from experiments.args import int_list
from experiments.rows import print_rows, row, write_rows

FLAGS = flags.FLAGS
PER_WORKER, SHAPE = 64, (32, 32, 16)
WARMUP, BATCHES = 5, 20


def _define_flags() -> None:
    flags.DEFINE_list("workers", ["1", "2", "4", "8", "16"], "Worker counts N to time.")
    flags.DEFINE_integer("rounds", 5, "Interleaved rounds; each figure is the median.")
    flags.DEFINE_string("out", None, "Also write the rows as JSON here.")


def check_arguments(workers, rounds: int) -> list[int]:
    """The worker counts as integers.

    Raises:
      ValueError: a value out of range, naming what was received.
    """
    counts = int_list("--workers", workers, 1, example="1,2,4")
    if rounds < 1:
        raise ValueError(f"--rounds must be at least 1. Received: {rounds}")
    return counts


def _per_batch_ms(dataset) -> float:
    iterator = iter(dataset.repeat())
    for _ in range(WARMUP):
        next(iterator)
    start = time.perf_counter()
    for _ in range(BATCHES):
        next(iterator)
    return (time.perf_counter() - start) / BATCHES * 1e3


def measure(counts: list[int], rounds: int, log=print) -> dict:
    """{N: {"keras": [ms per round], "tfdist": [...]}, "same_rows": {N: bool}}."""
    import numpy as np

    from tfdist.compat import keras_array_input

    rng = np.random.default_rng(0)
    times, same = {}, {}
    for n in counts:
        x = rng.standard_normal((PER_WORKER * n * 4, *SHAPE)).astype("float32")
        y = rng.integers(0, 10, size=(len(x),)).astype("int32")
        ordered = keras_array_input.worker_datasets(x, y, batch_size=PER_WORKER * n,
                                                    shuffle=False, workers=n)
        first = {way: next(iter(ds)) for way, ds in ordered.items()}
        same[n] = all(np.array_equal(a, b) for a, b in zip(first["keras"], first["tfdist"]))
        datasets = keras_array_input.worker_datasets(x, y, batch_size=PER_WORKER * n,
                                                     shuffle=True, workers=n)
        times[n] = {"keras": [], "tfdist": []}
        for r in range(rounds):
            ways = ("keras", "tfdist") if r % 2 == 0 else ("tfdist", "keras")
            for way in ways:
                times[n][way].append(_per_batch_ms(datasets[way]))
        log(f"N={n}: keras {statistics.median(times[n]['keras']):.2f} ms, tfdist "
            f"{statistics.median(times[n]['tfdist']):.2f} ms per batch on worker 0; same rows "
            f"unshuffled: {same[n]}", flush=True)
    return {"times": times, "same_rows": same}


def rows(result: dict, rounds: int) -> list[dict]:
    """Per N: Keras's and tfdist's ms per step on worker 0, and their ratio."""
    note = (f"worker 0's input pipeline alone for fit on NumPy arrays under N workers of "
            f"{PER_WORKER} examples of {'x'.join(map(str, SHAPE))} float32, shuffle=True; one "
            "process pinned to one core, 1 intra-op/1 inter-op thread, CPU only, no links; "
            f"median of {rounds} interleaved rounds of {BATCHES} batches; load average "
            f"{os.getloadavg()[0]:.1f}")
    out = []
    for n, t in result["times"].items():
        keras_ms, tfdist_ms = statistics.median(t["keras"]), statistics.median(t["tfdist"])
        out.append(row(f"array_input_{n}workers_keras", keras_ms, "ms",
                       f"Keras's path (each worker gathers the global batch): {note}"))
        out.append(row(f"array_input_{n}workers_tfdist", tfdist_ms, "ms",
                       f"tfdist's keras_array_input (each worker gathers its rows); same rows "
                       f"as Keras's unshuffled: {result['same_rows'][n]}; {note}"))
        out.append(row(f"array_input_{n}workers_speedup", keras_ms / tfdist_ms, "x",
                       f"Keras's / tfdist's ms per step; {note}"))
    return out


def main(argv):
    del argv
    counts = check_arguments(FLAGS.workers, FLAGS.rounds)
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    import tfdist

    tf = tfdist.import_tensorflow()
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    result = measure(counts, FLAGS.rounds)
    table = rows(result, FLAGS.rounds)
    print_rows(table)
    if FLAGS.out:
        write_rows(FLAGS.out, table, raw={str(n): t for n, t in result["times"].items()})
    if not all(result["same_rows"].values()):
        sys.exit("bench_array_input: tfdist's pipeline gave worker 0 other rows than Keras's")


if __name__ == "__main__":
    _define_flags()
    try:
        app.run(main)
    except ValueError as e:  # bad flags: the message, not a traceback
        sys.exit(f"bench_array_input: {e}")

"""What an epoch boundary costs on a shaped link, with and without tfdist's iterator release.

    python -m experiments.bench_epoch_boundary [--rate=1] [--epochs=5] [--rounds=2]
        [--patterns=fit,fit_per_epoch] [--out=FILE]

Two workers on simulated nodes (`experiments.netlab`, each link shaped to
`--rate` Gbit/s-equivalent: the rate / 16, bench_cluster's scaling) train
bench_cluster's digits MLP (64-1024-1024-512-10, Adam, global batch 128, 12
steps per epoch) under `multi_worker_mirrored` over a finite shuffled
`tf.data` dataset with autotuning on, in two patterns:

- `fit`: one `model.fit(ds, epochs=E)`;
- `fit_per_epoch`: `model.fit(ds, initial_epoch=e, epochs=e + 1)` for each
  epoch, as many scripts do.

and two variants, in interleaved rounds: `fixed` (the preset as shipped) and
`unfixed` (tfdist's `keras_epoch_iterator` fixes taken out: Keras as
released). Worker 0 reports, per boundary, its first step's time beyond the
run's median step (the wait for the previous epoch's data iterator to be
deleted: TensorFlow's lost wakeup, docs/performance.md), each `fit` call's
time, the whole loop's time and how long it waited at the end for tfdist's
release threads. Rows: per pattern and variant the largest wait and how many
waits exceeded 1 s, over every round.

Needs root, `ip`, `tc` and `nsenter` (`NetLab.available()` says why not).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

from absl import app, flags

from experiments.rows import print_rows, row, write_rows

PATTERNS = ("fit", "fit_per_epoch")
VARIANTS = ("fixed", "unfixed")
STALL_SECONDS = 1.0  # a wait above this counts as a stall (a step here is ~1.3 s at 1 Gbit/s)
PORT = 47960
FLAGS = flags.FLAGS


def _define_flags() -> None:
    flags.DEFINE_float("rate", 1.0, "Link rate in Gbit/s-equivalent (the link gets rate / 16).")
    flags.DEFINE_integer("epochs", 5, "Epochs per run (at least 2: the first has no boundary).")
    flags.DEFINE_integer("rounds", 2, "Interleaved rounds; every pattern and variant once each.")
    flags.DEFINE_list("patterns", list(PATTERNS), "Any of: " + ", ".join(PATTERNS))
    flags.DEFINE_string("out", None, "Write the rows and every run's figures as JSON here.")
    flags.DEFINE_string("role", None, "Internal: run as a worker.")
    flags.DEFINE_string("config", None, "Internal: the worker's configuration (JSON).")
    flags.DEFINE_string("worker_out", None, "Internal: where worker 0 writes its result.")


def check_arguments(rate: float, epochs: int, rounds: int, patterns: list[str]) -> list[str]:
    """The patterns, or ValueError naming the flag, what it received and what it takes."""
    if not rate > 0:
        raise ValueError(f"--rate must be positive (Gbit/s-equivalent). Received: {rate}")
    if epochs < 2:
        raise ValueError(f"--epochs must be at least 2 (the first epoch has no boundary). "
                         f"Received: {epochs}")
    if rounds < 1:
        raise ValueError(f"--rounds must be at least 1. Received: {rounds}")
    unknown = [p for p in patterns if p not in PATTERNS]
    if unknown or not patterns:
        raise ValueError(f"--patterns must name one or more of {', '.join(PATTERNS)}. "
                         f"Received: {','.join(patterns)}")
    return list(patterns)


# --- worker side ------------------------------------------------------------------------


def _worker(config: dict, out: str) -> None:
    import threading

    import tfdist

    tfdist.configure_threads(intra_op=1, inter_op=1)
    tf = tfdist.import_tensorflow()
    import keras

    from experiments.bench_cluster import _mlp
    from models.datasets import load_dataset

    strategy = tfdist.make_strategy("multi_worker_mirrored", join_timeout=300)
    if config["variant"] == "unfixed":
        from tfdist.compat import _patch, keras_epoch_iterator

        _patch.uninstall(keras_epoch_iterator.NAMES)
    data = load_dataset("digits")
    x = data.x_train.reshape(len(data.x_train), -1)
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = _mlp(keras, (64,), 10)
        model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    ds = tf.data.Dataset.from_tensor_slices((x, data.y_train)).shuffle(len(x), seed=0).batch(128)
    epochs = []  # per epoch: its begin time, then each step's end

    class Clock(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            epochs.append([time.perf_counter()])

        def on_train_batch_end(self, batch, logs=None):
            float(logs["loss"])  # the step's result is here
            epochs[-1].append(time.perf_counter())

    calls = []
    start = time.perf_counter()
    if config["pattern"] == "fit":
        model.fit(ds, epochs=config["epochs"], verbose=0, callbacks=[Clock()])
    else:
        for epoch in range(config["epochs"]):
            call = time.perf_counter()
            model.fit(ds, initial_epoch=epoch, epochs=epoch + 1, verbose=0, callbacks=[Clock()])
            calls.append(time.perf_counter() - call)
    loop = time.perf_counter() - start
    steps = [b - a for e in epochs[1:] for a, b in zip(e[1:], e[2:])]
    median = statistics.median(steps)
    waits = [e[1] - e[0] - median for e in epochs[1:]]  # each boundary's first step, beyond
    start = time.perf_counter()
    for thread in threading.enumerate():
        if thread.name == "tfdist-release-data-iterator":
            thread.join()
    result = {"median_step_seconds": median, "boundary_wait_seconds": waits,
              "fit_call_seconds": calls, "loop_seconds": loop,
              "exit_wait_seconds": time.perf_counter() - start}
    if json.loads(os.environ["TF_CONFIG"])["task"]["index"] == 0:
        with open(out, "w") as f:
            json.dump(result, f)


# --- driver -----------------------------------------------------------------------------


def _waits(result: dict) -> list[float]:
    """Every wait a run shows: each boundary's, and each fit call's beyond the epoch's steps
    (a per-epoch `fit` pays its last iterator's deletion when it returns)."""
    waits = list(result["boundary_wait_seconds"])
    calls = result["fit_call_seconds"]
    if calls:
        typical = statistics.median(calls[1:]) if len(calls) > 1 else calls[0]
        waits += [c - typical for c in calls[1:]]
    return waits


def measure(rate: float, epochs: int, rounds: int, patterns: list[str],
            log=print) -> dict[str, list[dict]]:
    """{"<pattern> <variant>": [worker 0's result per round]}, in interleaved rounds."""
    from experiments.netlab import NetLab, run_workers

    results: dict[str, list[dict]] = {}
    configs = [(p, v) for p in patterns for v in VARIANTS]
    with NetLab(2) as lab:
        lab.set_rate(rate * 1e9 / 16)
        for r in range(rounds):
            for k, (pattern, variant) in enumerate(configs[r % len(configs):]
                                                   + configs[:r % len(configs)]):
                config = {"pattern": pattern, "variant": variant, "epochs": epochs}
                result = run_workers(
                    lab, ["-m", "experiments.bench_epoch_boundary", "--role=worker",
                          f"--config={json.dumps(config)}"],
                    nodes=2, port=PORT + 2 * (r * len(configs) + k) % 200, timeout=1800,
                    label=f"epoch boundary {pattern} {variant}")
                result["load_average"] = os.getloadavg()[0]
                results.setdefault(f"{pattern} {variant}", []).append(result)
                log(f"  round {r + 1}/{rounds} {pattern} {variant}: waits "
                    + ", ".join(f"{w:+.2f}" for w in _waits(result)) + " s; loop "
                    f"{result['loop_seconds']:.1f} s; exit wait "
                    f"{result['exit_wait_seconds']:.3f} s", flush=True)
    return results


def rows(results: dict[str, list[dict]], rate: float, epochs: int) -> list[dict]:
    out = []
    for key, runs in results.items():
        pattern, variant = key.split()
        waits = [w for r in runs for w in _waits(r)]
        loads = [r["load_average"] for r in runs]
        note = (f"{len(runs)} runs x {epochs} epochs; loops "
                + ", ".join(f"{r['loop_seconds']:.1f}" for r in runs) + " s; median step "
                + ", ".join(f"{r['median_step_seconds'] * 1e3:.0f}" for r in runs)
                + f" ms; exit wait up to {max(r['exit_wait_seconds'] for r in runs):.3f} s; "
                f"2 nodes, 1 worker each (1 intra + 1 inter-op thread), link "
                f"{rate * 1e3 / 16:g} Mbit/s each way ({rate:g} Gbit/s-eq); load average "
                f"{min(loads):.1f}-{max(loads):.1f} on {os.cpu_count()} cores")
        name = f"epoch boundary/{rate:g} Gbit/s-eq/{pattern}/{variant}"
        out.append(row(f"{name}: largest wait", max(waits), "s", note))
        out.append(row(f"{name}: waits over {STALL_SECONDS:g} s",
                       sum(w > STALL_SECONDS for w in waits), "count",
                       f"of {len(waits)} (epoch boundaries and fit returns)"))
    return out


def main(argv) -> int:
    del argv
    if FLAGS.role == "worker":
        _worker(json.loads(FLAGS.config), FLAGS.worker_out)
        return 0
    patterns = check_arguments(FLAGS.rate, FLAGS.epochs, FLAGS.rounds, FLAGS.patterns)
    from experiments.netlab import NetLab

    problem = NetLab.available()
    if problem:
        sys.exit(f"bench_epoch_boundary: cannot build simulated nodes here: {problem}")
    results = measure(FLAGS.rate, FLAGS.epochs, FLAGS.rounds, patterns)
    table = rows(results, FLAGS.rate, FLAGS.epochs)
    print_rows(table)
    if FLAGS.out:
        write_rows(FLAGS.out, table, runs=results)
    return 0


if __name__ == "__main__":
    _define_flags()
    try:
        app.run(main)
    except ValueError as e:  # bad flags: the message, not a traceback
        sys.exit(f"bench_epoch_boundary: {e}")

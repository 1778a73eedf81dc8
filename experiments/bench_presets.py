"""Preset overhead, scaling, FLOP utilisation and the all-reduce cost model, side by side.

    python -m experiments.bench_presets [--quick] [--out results/bench_presets.json]

Rows (medians over interleaved rounds, all in one process on 4 logical CPUs):
- wrapper overhead: tfdist `mirrored` x2 vs `tf.distribute.MirroredStrategy`
  written by hand on the same 2 devices and global batch (target >= 0.98);
- `mirrored` over 1, 2, 4 logical CPUs vs plain `model.fit` (no strategy);
- model FLOP utilisation: a wide MLP's achieved FLOP/s (FLOPs from
  `tfdist.planning.model_stats`) under the better of the planner's pick and
  `mirrored` x2, over this machine's fp32 matmul peak measured in the same
  run (target >= 60%);
- the alpha-beta all-reduce model: calibrated on half the message sizes of a
  2-process (2 local workers) ring all-reduce, predicting the other half
  (target: within +-30%).

Logical devices must exist before TensorFlow starts, so `configure()` runs
first (benchmark.py calls it once for the whole suite).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from experiments.rows import print_rows, write_rows
from absl import app, flags

NUM_LOGICAL_DEVICES = 4
GLOBAL_BATCH = 256
MFU_BATCH = 512
MFU_TARGET = 0.60
WRAPPER_TARGET = 0.98
ALLREDUCE_TOLERANCE = 0.30
SPE = 8  # steps_per_execution of the "plain fit, steps_per_execution" row


def configure() -> None:
    """4 logical CPUs, before any TensorFlow op (a no-op if already so)."""
    import tfdist

    tfdist.configure_logical_devices(NUM_LOGICAL_DEVICES)


def _row(name, value, unit, target=None, note="", *, lower_is_better=False):
    ratio = None
    if target:
        ratio = value / target
    return {"name": name, "value": value, "unit": unit, "target": target, "ratio": ratio,
            "note": note + (" (lower is better: ratio <= 1 passes)" if lower_is_better else "")}


# --- throughput ---------------------------------------------------------------------


def _mlp(keras, inputs, hidden, outputs):
    layers = [keras.Input((inputs,))]
    layers += [keras.layers.Dense(h, activation="relu") for h in hidden]
    layers.append(keras.layers.Dense(outputs))
    return keras.Sequential(layers)


class _StepClock:
    """Batch-end timestamps inside one fit call (so fit()'s set-up is not timed)."""

    def __new__(cls):
        import keras

        class Clock(keras.callbacks.Callback):
            def on_train_begin(self, logs=None):
                self.ends = []

            def on_train_batch_end(self, batch, logs=None):
                self.ends.append(time.perf_counter())

        return Clock()


class _Config:
    """A built, compiled model under one strategy, timed in rounds of `steps` steps.

    A round is one `fit` call; its throughput counts the steady-state steps
    between the end of the first step and the end of the last one.
    """

    def __init__(self, name, strategy, build, dataset, steps, steps_per_execution=1):
        import keras

        self.name = name
        self.steps = steps
        # Keras calls batch-end callbacks once per execution of `spe` steps.
        self.spe = steps_per_execution
        self.dataset = dataset
        scope = strategy.scope() if strategy is not None else _nullcontext()
        with scope:
            keras.utils.set_random_seed(0)
            self.model = build()
        self.samples_per_sec: list[float] = []
        self._clock = _StepClock()

    def warm_up(self):
        self.model.fit(self.dataset, steps_per_epoch=2 * self.spe, epochs=1, verbose=0,
                       shuffle=False)

    def time_round(self, batch):
        calls = max(2, self.steps // self.spe + 1)
        self.model.fit(self.dataset, steps_per_epoch=calls * self.spe, epochs=1, verbose=0,
                       shuffle=False, callbacks=[self._clock])
        ends = self._clock.ends
        self.samples_per_sec.append((len(ends) - 1) * self.spe * batch / (ends[-1] - ends[0]))

    @property
    def median(self):
        return statistics.median(self.samples_per_sec)


class _nullcontext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _paired_ratio(a, b):
    """Median over rounds of a's throughput / b's in the same round (load drifts cancel)."""
    return statistics.median(x / y for x, y in zip(a.samples_per_sec, b.samples_per_sec))


def _ratio_range(a, b):
    ratios = [x / y for x, y in zip(a.samples_per_sec, b.samples_per_sec)]
    return f"{min(ratios):.2f}-{max(ratios):.2f}"


def _interleave(configs, rounds, batch):
    for config in configs:
        config.warm_up()
    for r in range(rounds):
        for config in _round_order(configs, r):
            config.time_round(batch)


def _round_order(configs, r):
    """Rotated so no configuration always runs first, reversed on odd rounds so
    neighbours (tfdist's and the hand-written strategy) take turns going first."""
    order = configs[r % len(configs):] + configs[:r % len(configs)]
    return order[::-1] if r % 2 else order


def _dataset(tf, inputs, outputs, batch, *, classes=True):
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.normal(size=(batch * 8, inputs)).astype("float32")
    if classes:
        y = rng.integers(0, outputs, size=batch * 8).astype("int32")
    else:
        y = rng.normal(size=(batch * 8, outputs)).astype("float32")
    return tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(
        batch, drop_remainder=True).prefetch(2)


def _throughput(quick):
    from tfdist._tf import import_tensorflow

    tf = import_tensorflow()  # before keras: no TensorFlow start-up lines
    import keras

    import tfdist
    data = _dataset(tf, 784, 10, GLOBAL_BATCH)

    def build(steps_per_execution=1):
        model = _mlp(keras, 784, (512, 512), 10)
        model.compile(keras.optimizers.Adam(1e-3),
                      keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      steps_per_execution=steps_per_execution)
        return model

    steps = 6 if quick else 15
    configs = [_Config("plain fit", None, build, data, steps),
               _Config(f"plain fit, steps_per_execution {SPE}", None,
                       lambda: build(SPE), data, 2 * SPE, steps_per_execution=SPE)]
    for n in (1, 2, 4):
        configs.append(_Config(f"tfdist mirrored x{n}",
                               tfdist.make_strategy("mirrored", num_devices=n), build, data, steps))
        if n == 2:
            # The same strategy written by hand, timed right after tfdist's so each
            # pair of rounds sees the same machine load: MirroredStrategy over the
            # same devices with TensorFlow's default cross-device ops. It is the only
            # stock MirroredStrategy here, so its collective keys (TensorFlow's default
            # base) collide with none of tfdist's (tfdist.compat.collective_keys).
            by_hand = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
            configs.append(_Config("hand-written MirroredStrategy x2", by_hand, build, data,
                                   steps))
    configs.append(_Config(f"tfdist mirrored x2, steps_per_execution {SPE}",
                           tfdist.make_strategy("mirrored", num_devices=2), lambda: build(SPE),
                           data, 2 * SPE, steps_per_execution=SPE))
    _interleave(configs, 3 if quick else 15, GLOBAL_BATCH)
    by_name = {c.name: c for c in configs}
    plain = by_name["plain fit"]
    ours, theirs = by_name["tfdist mirrored x2"], by_name["hand-written MirroredStrategy x2"]
    rows = [_row(
        "wrapper overhead: tfdist mirrored x2 / hand-written MirroredStrategy x2",
        _paired_ratio(ours, theirs), "x", WRAPPER_TARGET,
        f"median of per-round ratios (range {_ratio_range(ours, theirs)}); medians "
        f"{ours.median:,.0f} vs {theirs.median:,.0f} "
        f"samples/s; MLP 784-512-512-10, Adam, global batch {GLOBAL_BATCH}; both on "
        f"/cpu:0 and /cpu:1 (logical CPUs), TensorFlow's default threads")]
    rows.append(_row("plain model.fit (no strategy)", plain.median, "samples/s", None,
                     f"MLP 784-512-512-10, Adam, batch {GLOBAL_BATCH}; absolute: this machine"))
    for n in (1, 2, 4):
        c = by_name[f"tfdist mirrored x{n}"]
        rows.append(_row(
            f"mirrored x{n} logical CPUs / plain fit", _paired_ratio(c, plain), "x", None,
            f"{c.median:,.0f} samples/s; baseline plain fit on 1 device, both with TF's default "
            f"threads (all cores), steps_per_execution 1; logical CPUs share the physical cores, "
            "so no "
            "speed-up is expected here (a correctness and test tool on CPU)"))
    plain_spe = by_name[f"plain fit, steps_per_execution {SPE}"]
    two_spe = by_name[f"tfdist mirrored x2, steps_per_execution {SPE}"]
    rows.append(_row(
        f"mirrored x2 / plain fit, both with steps_per_execution {SPE}",
        _paired_ratio(two_spe, plain_spe), "x", None,
        f"{two_spe.median:,.0f} vs {plain_spe.median:,.0f} samples/s; mirrored x2 on 2 logical "
        f"CPUs vs plain fit on 1 device, both TF's default threads (all cores); "
        f"steps_per_execution gains {_paired_ratio(two_spe, by_name['tfdist mirrored x2']):.2f}x "
        f"for mirrored x2 and {_paired_ratio(plain_spe, plain):.2f}x for plain fit (Keras's "
        "multi-step loop fails with several replicas, keras-team/keras#19246: tfdist's "
        "compat.keras_multi_step runs it)"))
    details = {name: c.samples_per_sec for name, c in by_name.items()}
    return rows, details


# --- FLOP utilisation ------------------------------------------------------------------


def _matmul_peak(tf, n, chain):
    """A callable measuring the FLOP/s of `chain` dependent n x n fp32 matmuls
    in one tf.function (TensorFlow's intra-op pool: all cores)."""
    a = tf.random.normal([n, n], seed=1) / n ** 0.5

    @tf.function
    def run(x):
        for _ in range(chain):
            x = tf.linalg.matmul(x, a)
        return x[0, 0]

    run(a).numpy()  # trace

    def measure():
        start = time.perf_counter()
        run(a).numpy()
        return 2.0 * n ** 3 * chain / (time.perf_counter() - start)

    return measure


def _mfu(quick):
    from tfdist._tf import import_tensorflow

    tf = import_tensorflow()  # before keras: no TensorFlow start-up lines
    import keras

    import tfdist
    from tfdist import planning as cost  # the cost model
    widths = (1024, (2048, 2048, 2048), 1024)
    data = _dataset(tf, widths[0], widths[2], MFU_BATCH, classes=False)

    def build():
        model = _mlp(keras, *widths)
        model.compile(keras.optimizers.SGD(1e-3), "mse")
        return model

    stats = cost.model_stats(build())
    plan = tfdist.plan(stats=stats, global_batch_size=MFU_BATCH, optimizer="sgd")
    presets = [plan.recommended or "default", "mirrored"]
    steps = 2 if quick else 5
    configs = []
    for preset in dict.fromkeys(presets):
        options = {"num_devices": 2} if preset == "mirrored" else {}
        strategy = tfdist.make_strategy(preset, **options)
        label = preset + (" x2" if preset == "mirrored" else "")
        configs.append(_Config(label, strategy, build, data, steps))
    for config in configs:
        config.warm_up()
    peak_of = _matmul_peak(tf, 2048, 2)
    peaks = []
    for r in range(3 if quick else 9):
        # The peak is measured in every round, around the training rounds, as the
        # best of three short matmul chains (a peak is the best the machine does
        # under the current load); utilisation is the median of per-round ratios.
        before = [peak_of(), peak_of()]
        for config in _round_order(configs, r):
            config.time_round(MFU_BATCH)
        peaks.append(max(before + [peak_of()]))
    best = max(configs, key=lambda c: c.median)
    flops = stats.train_flops_per_example
    per_round = [s * flops / p for s, p in zip(best.samples_per_sec, peaks)]
    utilisation = statistics.median(per_round)
    peak = statistics.median(peaks)
    achieved = best.median * flops
    rows = [
        _row(f"model FLOP utilisation ({best.name})", utilisation, "fraction of peak",
             MFU_TARGET,
             f"median of per-round achieved/peak (range {min(per_round):.2f}-"
             f"{max(per_round):.2f}); medians {achieved / 1e9:.0f} GFLOP/s achieved "
             f"(MLP 1024-2048x3-1024, SGD, batch {MFU_BATCH}, {flops / 1e6:.1f} "
             f"MFLOP/example = 3x forward matmuls) vs {peak / 1e9:.0f} GFLOP/s fp32 matmul peak; "
             "planner "
             f"recommended {plan.recommended}"),
        _row("fp32 matmul peak, all cores", peak / 1e9, "GFLOP/s", None,
             "2048x2048 matmul chain in one tf.function; absolute: this machine"),
    ]
    details = {"peak_flops": peaks, "train_flops_per_example": stats.train_flops_per_example,
               "planner": plan.recommended,
               **{c.name: [s * stats.train_flops_per_example for s in c.samples_per_sec]
                  for c in configs}}
    return rows, details


# --- all-reduce: alpha-beta model vs 2 local workers ------------------------------------

QUICK_SIZES = [2**10, 2**14, 2**17, 2**20, 2**22, 2**23]
FULL_SIZES = [2**k for k in range(10, 27, 2)]  # 1 KiB ... 64 MiB


def measure_allreduce(sizes, repeats, timeout=180.0):
    """Median seconds of a 2-worker ring all-reduce per size: [(bytes, seconds), ...].

    Raises:
      RuntimeError: a worker failed, or the pair did not finish in `timeout` seconds
        (both workers are then killed); the message has each worker's last line.
    """
    from tfdist import cluster as cluster_lib

    cluster = cluster_lib.local_cluster(num_workers=2)
    procs = []
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = err = ""
    timed_out = False
    # Worker 1's output goes to a file, not a pipe: nobody reads it while worker 0 runs, and
    # a full pipe would block worker 1, and worker 0's collectives with it.
    with tempfile.TemporaryFile("w+") as other:
        try:
            for i in range(2):
                env = {**os.environ, "CUDA_VISIBLE_DEVICES": "",
                       "TF_CONFIG": cluster_lib.tf_config_for(cluster, "worker", i)}
                pipes = ({"stdout": subprocess.PIPE, "stderr": subprocess.PIPE} if i == 0
                         else {"stdout": other, "stderr": subprocess.STDOUT})
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", "experiments.allreduce_worker",
                     f"--sizes={','.join(map(str, sizes))}", f"--repeats={repeats}"],
                    cwd=root, env=env, text=True, **pipes))
            try:
                out, err = procs[0].communicate(timeout=timeout)
                procs[1].wait(timeout=30)
            except subprocess.TimeoutExpired:
                timed_out = True
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
            if timed_out and procs[0].stdout is not None:
                out, err = procs[0].communicate()  # what it wrote before it was killed
        other.seek(0)
        other_tail = other.read().strip().splitlines()[-1:]
    last = (err or out or "").strip().splitlines()[-1:]
    if timed_out:
        raise RuntimeError(
            f"the 2-worker all-reduce of {len(sizes)} sizes x {repeats} repeats did not "
            f"finish (worker 0 in {timeout:.0f} s, worker 1 within 30 s after it), and both "
            "workers were killed. Worker 0's last line: "
            f"{last}; worker 1's: {other_tail}. A loaded machine slows it: rerun when it is "
            "quieter, or with --quick.")
    if procs[0].returncode != 0:
        raise RuntimeError(f"all-reduce worker failed (rc {procs[0].returncode}): "
                           f"{last}; worker 1 (rc {procs[1].returncode}): {other_tail}")
    return [tuple(p) for p in json.loads(out.strip().splitlines()[-1])["points"]]


def validate_allreduce(points):
    """Calibrates alpha, beta on every other size and predicts the rest."""
    from tfdist import planning as cost  # the cost model

    points = sorted(points)
    calibrate, held_out = points[0::2], points[1::2]
    link = cost.fit_alpha_beta(calibrate, 2)
    predictions = [(k, t, cost.ring_allreduce_time(k, 2, link)) for k, t in held_out]
    errors = [abs(pred - t) / t for k, t, pred in predictions]
    return link, calibrate, predictions, errors


def _allreduce(quick):
    from tfdist import planning as cost  # the cost model

    sizes = QUICK_SIZES if quick else FULL_SIZES
    points = measure_allreduce(sizes, 5 if quick else 25)
    link, calibrate, predictions, errors = validate_allreduce(points)
    within = sum(e <= ALLREDUCE_TOLERANCE for e in errors)
    rows = [
        _row("all-reduce model error, 2 local workers (held-out sizes, max)", max(errors),
             "relative error", ALLREDUCE_TOLERANCE,
             f"{within}/{len(errors)} held-out sizes within +-30%; calibrated on "
             f"{[cost.format_bytes(k) for k, _ in calibrate]}: alpha "
             f"{cost.format_seconds(link.latency)}, bandwidth {link.bandwidth / 1e9:.2f} GB/s",
             lower_is_better=True),
        _row("all-reduce model error, 2 local workers (held-out sizes, median)",
             statistics.median(errors), "relative error", ALLREDUCE_TOLERANCE,
             "same fit", lower_is_better=True),
    ]
    details = {"points": points, "alpha": link.latency, "bandwidth": link.bandwidth,
               "calibration_sizes": [k for k, _ in calibrate],
               "predictions": predictions}
    return rows, details


# --- entry points ------------------------------------------------------------------------


def measure(quick: bool):
    """(rows, details for plots). Call `configure()` before TensorFlow starts."""
    configure()
    rows, details = [], {}
    for key, part in (("throughput", _throughput), ("mfu", _mfu), ("allreduce", _allreduce)):
        part_rows, details[key] = part(quick)
        rows += part_rows
    return rows, details


def run(quick: bool) -> list[dict]:
    """The rows, for experiments.benchmark."""
    return measure(quick)[0]


def main(argv):
    del argv
    try:
        rows, details = measure(flags.FLAGS.quick)
    except RuntimeError as error:  # a measurement's workers failed or timed out: said, no trace
        sys.exit(f"bench_presets: {error}")
    write_rows(flags.FLAGS.out, rows, details=details)
    print_rows(rows)


if __name__ == "__main__":
    # Flags only when run as a program: experiments.benchmark imports this module
    # and has flags of the same names.
    flags.DEFINE_bool("quick", False, "Fewer, shorter rounds (CI smoke run).")
    flags.DEFINE_string("out", "results/bench_presets.json", "Where to write the rows.")
    app.run(main)

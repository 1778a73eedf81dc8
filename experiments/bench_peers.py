"""tfdist next to what a Keras user would pick instead: `python -m experiments.bench_peers`.

    python -m experiments.bench_peers [--rounds=3] [--steps=60] [--configs=...]
        [--jax_python=PATH] [--out results/bench_peers.json]

One model, one data set, one global batch, the same cores: an MLP
784-512-512-10 with Adam(1e-3), sparse categorical cross-entropy and an
accuracy metric, `fit` on synthetic MNIST-shaped numpy arrays (as a user
passes them), global batch 256. Every measurement is its own process (its
own device layout and threads); the rounds are interleaved (every
configuration once per round, the order rotated) and each row is the median
over rounds. Samples/s are timed over the epochs after the first (the first
traces), epoch boundaries included, as a user's `fit` sees them.

Configurations (`--configs`):

- `tf_plain`: TensorFlow `model.fit`, no strategy, TensorFlow's default threads
  (the baseline every TensorFlow row's ratio is taken to);
- `tfdist_mirrored`: `tfdist.make_strategy("mirrored", num_devices=2)` over 2
  logical CPUs, as the preset sets it up;
- `tf_mirrored`: `tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])`
  written by hand over the same 2 logical CPUs, TensorFlow's default threads;
- `jax_plain`, `jax_data_parallel`: Keras 3 on JAX (a separate virtual
  environment with jax and the same Keras: `--jax_python`), plain and with
  `keras.distribution.DataParallel` over 2 host devices
  (`XLA_FLAGS=--xla_force_host_platform_device_count=2`). "not available"
  with the reason when that environment is missing or fails.

Any TensorFlow configuration takes knobs after a `+`, to try what a preset
could set, e.g. `tfdist_mirrored+cdo=reduction_to_one_device`:
`intra=N` / `inter=N` (set the thread pools by hand before start-up),
`spe=N` (steps_per_execution), `cdo=NAME` (mirrored preset's
cross_device_ops, or a stock MirroredStrategy's: ring or
reduction_to_one_device), `tiny` (a Dense(10) on 8 features instead of the
MLP: a step that is all overhead), `unfixed` (mirrored preset: its
`keras_epoch_iterator` fix taken out, as before it existed).

Each row also gives the steady step (median time between two steps inside an
epoch) and the epoch overhead (an epoch's median time beyond its steps at
that pace: iterator set-up, the first step's wait, Keras's epoch end).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from absl import app, flags

from experiments.rows import print_rows, row as _row, write_rows

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WIDTHS = (784, 512, 512, 10)
TINY_WIDTHS = (8, 10)
GLOBAL_BATCH = 256
EPOCHS = 3  # the first traces and is not timed
# A Python with jax and keras installed (e.g. `python -m venv jaxenv && jaxenv/bin/pip install
# jax keras`): --jax_python, or TFDIST_JAX_PYTHON.
DEFAULT_JAX_PYTHON = os.environ.get("TFDIST_JAX_PYTHON", "")
CONFIGS = ("tf_plain", "tfdist_mirrored", "tf_mirrored", "jax_plain", "jax_data_parallel")
BASES = ("tf_plain", "tfdist_mirrored", "tf_mirrored", "jax_plain", "jax_data_parallel")
KNOBS = ("unfixed", "intra", "inter", "spe", "cdo", "tiny")
TARGET = 0.6  # tfdist_mirrored / tf_plain
DESCRIPTIONS = {
    "tf_plain": "TensorFlow fit, 1 device, no strategy",
    "tfdist_mirrored": "tfdist make_strategy('mirrored', num_devices=2) over 2 logical CPUs",
    "tf_mirrored": "tf.distribute.MirroredStrategy(['/cpu:0', '/cpu:1']) by hand, "
                   "same 2 logical CPUs",
    "jax_plain": "Keras on JAX, 1 host device",
    "jax_data_parallel": "Keras on JAX, keras.distribution.DataParallel over 2 host devices",
}


def _define_flags() -> None:
    flags.DEFINE_integer("rounds", 3, "Interleaved rounds; each row is the median.")
    flags.DEFINE_integer("steps", 100, "Steps per epoch (epochs: 3, the first untimed).")
    flags.DEFINE_list("configs", list(CONFIGS), "Configurations (knobs after '+').")
    flags.DEFINE_string("jax_python", DEFAULT_JAX_PYTHON,
                        "Python of a virtual environment with jax and Keras 3.")
    flags.DEFINE_string("out", "results/bench_peers.json", "Where to write the JSON ('' = no).")
    flags.DEFINE_float("timeout", 600, "Seconds one measurement may take.")
    flags.DEFINE_string("role", None, "Internal: run one configuration (its name).")
    flags.DEFINE_string("worker_out", None, "Internal: the configuration's result file.")


FLAGS = flags.FLAGS


def parse_config(name: str) -> tuple[str, dict[str, str]]:
    """'tfdist_mirrored+spe=10+tiny' -> ('tfdist_mirrored', {'spe': '10', 'tiny': ''})."""
    base, *parts = name.split("+")
    if base not in BASES:
        raise ValueError(f"Unknown configuration {base!r} in {name!r}. Expected one of "
                         f"{', '.join(BASES)}, each optionally with +knob=value.")
    knobs = {}
    for part in parts:
        key, _, value = part.partition("=")
        if key not in KNOBS:
            raise ValueError(f"Unknown knob {key!r} in {name!r}. Expected one of "
                             f"{', '.join(KNOBS)}.")
        if base.startswith("jax") and key != "tiny":
            raise ValueError(f"Knob {key!r} in {name!r} is for TensorFlow configurations; "
                             "JAX configurations take only 'tiny'.")
        knobs[key] = value
    return base, knobs


# --- one configuration (its own process) -------------------------------------------------


def _data(widths, examples: int):
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.standard_normal((examples, widths[0])).astype("float32")
    y = rng.integers(0, widths[-1], size=examples).astype("int32")
    return x, y


def _build(keras, widths, steps_per_execution: int = 1):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((widths[0],))] + [
        keras.layers.Dense(w, activation="relu") for w in widths[1:-1]] + [
        keras.layers.Dense(widths[-1])])
    model.compile(keras.optimizers.Adam(1e-3),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"], steps_per_execution=steps_per_execution)
    return model


def _fit_and_time(keras, model, x, y, steps_per_execution: int = 1) -> dict:
    seconds, gaps = [], []

    class Timer(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.start = self.last = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            now = time.perf_counter()
            if epoch_index[0] > 0 and batch > 0:
                gaps.append(now - self.last)
            self.last = now

        def on_epoch_end(self, epoch, logs=None):
            seconds.append(time.perf_counter() - self.start)
            epoch_index[0] += 1

    epoch_index = [0]
    history = model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=EPOCHS, verbose=0,
                        callbacks=[Timer()])
    timed = seconds[1:]
    steps = len(x) // GLOBAL_BATCH
    # One batch callback per execution: a gap spans steps_per_execution steps.
    step = statistics.median(gaps) / steps_per_execution if gaps else float("nan")
    # The steady step (median gap between steps inside an epoch) and what an
    # epoch costs beyond its steps (iterator set-up, the first step's wait, the end).
    return {"samples_per_sec": len(x) * len(timed) / sum(timed), "epoch_seconds": seconds,
            "step_ms": 1e3 * step,
            "epoch_overhead_ms": 1e3 * (statistics.median(timed) - steps * step),
            "final_loss": float(history.history["loss"][-1])}


def _tensorflow_config(base: str, knobs: dict, steps: int) -> dict:
    import contextlib

    import tensorflow as tf

    if "intra" in knobs:
        tf.config.threading.set_intra_op_parallelism_threads(int(knobs["intra"]))
    if "inter" in knobs:
        tf.config.threading.set_inter_op_parallelism_threads(int(knobs["inter"]))
    strategy = None
    if base != "tf_plain":
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    if base == "tfdist_mirrored":
        import tfdist

        options = {}
        if "cdo" in knobs:
            options["cross_device_ops"] = knobs["cdo"]
        strategy = tfdist.make_strategy("mirrored", num_devices=2, **options)
        if "unfixed" in knobs:
            from tfdist.compat import keras_epoch_iterator

            tfdist.compat.uninstall(keras_epoch_iterator.NAMES)
    elif base == "tf_mirrored":
        ops = {"reduction_to_one_device": tf.distribute.ReductionToOneDevice(),
               "ring": None, None: None}[knobs.get("cdo")]
        strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"], cross_device_ops=ops)
    import keras

    widths = TINY_WIDTHS if "tiny" in knobs else WIDTHS
    x, y = _data(widths, steps * GLOBAL_BATCH)
    with (strategy.scope() if strategy is not None else contextlib.nullcontext()):
        model = _build(keras, widths, int(knobs.get("spe", 1)))
    result = _fit_and_time(keras, model, x, y, int(knobs.get("spe", 1)))
    result.update(replicas=strategy.num_replicas_in_sync if strategy is not None else 1,
                  intra_op=tf.config.threading.get_intra_op_parallelism_threads(),
                  inter_op=tf.config.threading.get_inter_op_parallelism_threads(),
                  devices=[d.name for d in tf.config.list_logical_devices("CPU")])
    return result


def _jax_config(base: str, knobs: dict, steps: int) -> dict:
    import jax
    import keras

    if base == "jax_data_parallel":
        keras.distribution.set_distribution(keras.distribution.DataParallel())
    widths = TINY_WIDTHS if "tiny" in knobs else WIDTHS
    x, y = _data(widths, steps * GLOBAL_BATCH)
    model = _build(keras, widths)
    result = _fit_and_time(keras, model, x, y)
    result.update(replicas=len(jax.devices()) if base == "jax_data_parallel" else 1,
                  devices=[str(d) for d in jax.devices()])
    return result


def _run_config(name: str, steps: int, out: str) -> None:
    base, knobs = parse_config(name)
    if base.startswith("jax"):
        result = _jax_config(base, knobs, steps)
    else:
        result = _tensorflow_config(base, knobs, steps)
    with open(out, "w") as f:
        json.dump(dict(result, config=name), f)


# --- parent side (no TensorFlow) ------------------------------------------------------------


def jax_available(jax_python: str) -> str | None:
    """None when `jax_python` imports jax and Keras on JAX, else the reason it does not."""
    if not jax_python:
        return ("no JAX environment given: --jax_python=PATH (or TFDIST_JAX_PYTHON), a Python "
                "with jax and keras installed")
    if not os.path.exists(jax_python):
        return f"no JAX environment at {jax_python} (--jax_python)"
    probe = subprocess.run(
        [jax_python, "-c", "import jax, keras; assert keras.backend.backend() == 'jax'"],
        env=dict(os.environ, KERAS_BACKEND="jax", JAX_PLATFORMS="cpu"),
        capture_output=True, text=True, timeout=300)
    if probe.returncode != 0:
        lines = probe.stderr.strip().splitlines() or ["no output"]
        return f"{jax_python} cannot import jax with Keras on JAX: {lines[-1][:200]}"
    return None


def measure(name: str, *, steps: int, jax_python: str, timeout: float) -> dict:
    """One configuration in its own process: {"samples_per_sec", ...} or {"error"}."""
    base, _ = parse_config(name)
    python = sys.executable
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("TF_CONFIG", None)
    if base.startswith("jax"):
        python = jax_python
        env.update(KERAS_BACKEND="jax", JAX_PLATFORMS="cpu")
        if base == "jax_data_parallel":
            env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        command = [python, "-m", "experiments.bench_peers", f"--role={name}",
                   f"--steps={steps}", f"--worker_out={out}"]
        try:
            done = subprocess.run(command, cwd=ROOT, env=env, text=True, timeout=timeout,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {timeout:.0f} s"}
        if done.returncode != 0 or not os.path.exists(out):
            lines = [line for line in done.stderr.strip().splitlines() if line.strip()]
            errors = [line for line in lines if "Error" in line] or lines[-1:] or ["no result"]
            return {"error": errors[-1][:300]}
        with open(out) as f:
            return json.load(f)


def _ratio_note(values: list[float], bases: list[float]) -> tuple[float, str]:
    ratios = [v / b for v, b in zip(values, bases)]
    return statistics.median(ratios), ", ".join(f"{r:.3f}" for r in ratios)


def run(*, rounds: int, steps: int, configs: tuple[str, ...], jax_python: str,
        timeout: float) -> list[dict]:
    for name in configs:
        parse_config(name)  # bad names fail before anything runs
    jax_missing = (jax_available(jax_python)
                   if any(parse_config(n)[0].startswith("jax") for n in configs) else None)
    results: dict[str, list[dict]] = {name: [] for name in configs}
    loads = [os.getloadavg()[0]]
    for r in range(rounds):
        k = r % len(configs)
        for name in list(configs[k:]) + list(configs[:k]):
            if name.startswith("jax") and jax_missing:
                found = {"error": jax_missing}
            else:
                found = measure(name, steps=steps, jax_python=jax_python, timeout=timeout)
            results[name].append(found)
            print(f"bench_peers round {r}: {name}: "
                  f"{found.get('samples_per_sec', found.get('error'))}", flush=True)
        loads.append(os.getloadavg()[0])
    what = (f"median of {rounds} interleaved rounds, one process per measurement, "
            f"{steps} steps/epoch x {EPOCHS - 1} timed epochs, global batch {GLOBAL_BATCH}; "
            f"load average {min(loads):.1f}-{max(loads):.1f} on {os.cpu_count()} cores")
    rates = {name: [d.get("samples_per_sec") for d in found] for name, found in results.items()}
    rows = []
    for name in configs:
        base_name, knobs = parse_config(name)
        good = [v for v in rates[name] if v is not None]
        if not good:
            errors = [d["error"] for d in results[name] if "error" in d]
            rows.append(_row(f"peers/{name}", float("nan"), "samples/s",
                             f"not available: {errors[0] if errors else 'no result'}"))
            continue
        sample = next(d for d in results[name] if "samples_per_sec" in d)
        threads = ("" if base_name.startswith("jax") else
                   f"; intra-op {sample['intra_op'] or 'default'}, inter-op "
                   f"{sample['inter_op'] or 'default'} threads")
        steps_ms = [d["step_ms"] for d in results[name] if "step_ms" in d]
        overheads = [d["epoch_overhead_ms"] for d in results[name] if "epoch_overhead_ms" in d]
        note = (f"{DESCRIPTIONS[base_name]}{' +' + '+'.join(name.split('+')[1:]) if knobs else ''}"
                f"; {sample['replicas']} replica(s) on {len(sample['devices'])} device(s)"
                f"{threads}; rounds {', '.join(f'{v:,.0f}' for v in good)}; steady step "
                f"{statistics.median(steps_ms):.1f} ms, epoch overhead "
                f"{statistics.median(overheads):.0f} ms")
        for baseline in ("tf_plain+tiny" if "tiny" in knobs else "tf_plain",
                         "jax_plain+tiny" if "tiny" in knobs else "jax_plain"):
            pairs = [(v, b) for v, b in zip(rates[name], rates.get(baseline, []))
                     if v is not None and b is not None]
            if pairs and baseline != name:
                ratio, each = _ratio_note(*zip(*pairs))
                note += f"; {ratio:.3f}x of {baseline} (per round {each})"
        rows.append(_row(f"peers/{name}", statistics.median(good), "samples/s",
                         f"{note}; {what}"))
    pairs = [(v, b) for v, b in zip(rates.get("tfdist_mirrored", []), rates.get("tf_plain", []))
             if v is not None and b is not None]
    if pairs:
        ratio, each = _ratio_note(*zip(*pairs))
        rows.append(_row("peers/tfdist mirrored x2 / plain TF fit", ratio, "x",
                         f"per-round ratios {each}; both on the same cores; {what}",
                         target=TARGET))
    return rows


def main(argv):
    del argv
    if FLAGS.role:
        return _run_config(FLAGS.role, FLAGS.steps, FLAGS.worker_out)
    if FLAGS.rounds < 1 or FLAGS.steps < 1:
        raise app.UsageError(f"--rounds and --steps must be >= 1. Received: "
                             f"--rounds={FLAGS.rounds} --steps={FLAGS.steps}")
    print(f"bench_peers: {os.cpu_count()} cores (schedulable: {len(os.sched_getaffinity(0))}), "
          f"baseline tf_plain (TensorFlow fit, no strategy, default threads); "
          f"model MLP {'-'.join(map(str, WIDTHS))}, Adam, global batch {GLOBAL_BATCH}", flush=True)
    rows = run(rounds=FLAGS.rounds, steps=FLAGS.steps, configs=tuple(FLAGS.configs),
               jax_python=FLAGS.jax_python, timeout=FLAGS.timeout)
    print_rows(rows)
    if FLAGS.out:
        write_rows(FLAGS.out, rows, command="python -m experiments.bench_peers " +
                   " ".join(sys.argv[1:]))


if __name__ == "__main__":
    _define_flags()
    app.run(main)

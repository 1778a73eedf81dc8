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
  with the reason when that environment is missing or fails;
- `tfdist_2workers`: 2 worker processes started by `tfdist.launch` on fresh
  127.0.0.1 ports (in a loopback-only network namespace where the OS allows
  it), each `tfdist.make_strategy("multi_worker_mirrored")` from the TF_CONFIG
  the launcher gives it; every worker passes the same full arrays to `fit`
  with the global batch size, and the strategy's dataset auto-shard (DATA, as
  for any numpy input) gives each its 128 of every 256;
- `tf_2workers`: the same 2 processes and input with a stock
  `tf.distribute.MultiWorkerMirroredStrategy()` written by hand;
- `jax_2processes`: 2 Keras-on-JAX processes under the same launcher (used
  only to pick the port, bound the run and clean up): each calls
  `keras.distribution.initialize("127.0.0.1:PORT", 2, i)` (it calls
  `jax.distributed.initialize`; CPU collectives: gloo, JAX's default), then
  `DataParallel(auto_shard_dataset=False)` over
  `keras.distribution.list_devices()` (one CPU device per process), and
  passes `fit` its half of the arrays (every other example) with batch 128:
  Keras on JAX accepts numpy input across processes only when the user shards
  it (with auto-sharding it asks for a `tf.data.Dataset`).

The 2-process rows time worker 0 (the workers step together) and count the
global batch; their processes are not pinned unless `+pin` (process i on
core i), and use each library's default threads unless `+intra=`/`+inter=`.

Any TensorFlow configuration takes knobs after a `+`, to try what a preset
could set, e.g. `tfdist_mirrored+cdo=reduction_to_one_device`:
`intra=N` / `inter=N` (set the thread pools by hand before start-up),
`spe=N` (steps_per_execution), `cdo=NAME` (mirrored preset's
cross_device_ops, or a stock MirroredStrategy's: ring or
reduction_to_one_device), `tiny` (a Dense(10) on 8 features instead of the
MLP: a step that is all overhead), `unfixed` (mirrored and 2-worker presets:
their `keras_epoch_iterator` fix taken out, as before it existed;
`unfixed=log`, 2-worker preset: its `keras_log_reduction` fix taken out),
`pin` (2-process rows: process i on core i), `loop` (`tf_2workers`: a
custom training loop instead of `fit`, the way a stock
MultiWorkerMirroredStrategy trains under Keras 3, whose `fit` fails there
with "Attempt to convert a value (PerReplica...)", keras-team/keras#20585;
the same model, Adam, loss and accuracy metric, batches in order, no
shuffle), `exchange` (`tfdist_2workers`, `jax_2processes`: after the timed
`fit`, the gradients' exchange alone, an all-reduce of gradient-shaped
tensors between the 2 processes, median of 30; tfdist's row also its step
without communication: experiments.bench_comm.compute_and_exchange_seconds).
JAX configurations take `tiny`, and `pin` and `exchange` for `jax_2processes`.

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
CONFIGS = ("tf_plain", "tfdist_mirrored", "tf_mirrored", "jax_plain", "jax_data_parallel",
           "tfdist_2workers", "tf_2workers", "jax_2processes")
BASES = CONFIGS
# One process per worker, started together by tfdist.launch.
TWO_PROCESSES = ("tfdist_2workers", "tf_2workers", "jax_2processes")
KNOBS = ("unfixed", "intra", "inter", "spe", "cdo", "tiny", "pin", "loop", "exchange")
JAX_KNOBS = ("tiny", "pin", "exchange")
EXCHANGE_REPEATS = 30
TARGET = 0.6  # tfdist_mirrored / tf_plain
DESCRIPTIONS = {
    "tf_plain": "TensorFlow fit, 1 device, no strategy",
    "tfdist_mirrored": "tfdist make_strategy('mirrored', num_devices=2) over 2 logical CPUs",
    "tf_mirrored": "tf.distribute.MirroredStrategy(['/cpu:0', '/cpu:1']) by hand, "
                   "same 2 logical CPUs",
    "tf_2workers+loop": "tf.distribute.MultiWorkerMirroredStrategy() by hand, a custom "
                        "training loop (its fit fails), the same 2 processes and input",
    "jax_plain": "Keras on JAX, 1 host device",
    "jax_data_parallel": "Keras on JAX, keras.distribution.DataParallel over 2 host devices",
    "tfdist_2workers": "tfdist make_strategy('multi_worker_mirrored'), 2 worker processes "
                       "(tfdist.launch, 127.0.0.1), each fit on the full arrays with the global "
                       "batch, auto-sharded (DATA: 128 of every 256 each)",
    "tf_2workers": "tf.distribute.MultiWorkerMirroredStrategy() by hand with fit, the same 2 "
                   "processes and input",
    "jax_2processes": "Keras on JAX, 2 processes (keras.distribution.initialize, gloo CPU "
                      "collectives), DataParallel(auto_shard_dataset=False) over their 2 "
                      "devices, each fit on its half of the arrays with batch 128",
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
        if base.startswith("jax") and key not in JAX_KNOBS:
            raise ValueError(f"Knob {key!r} in {name!r} is for TensorFlow configurations; "
                             "JAX configurations take only 'tiny' (and 'pin' for "
                             "jax_2processes).")
        if key == "exchange" and base not in ("tfdist_2workers", "jax_2processes"):
            raise ValueError(f"Knob 'exchange' in {name!r} is for tfdist_2workers and "
                             "jax_2processes.")
        if key == "loop" and base != "tf_2workers":
            raise ValueError(f"Knob 'loop' in {name!r} is for tf_2workers.")
        if key == "unfixed" and value not in ("", "log" if base == "tfdist_2workers" else ""):
            raise ValueError(f"Knob 'unfixed={value}' in {name!r}: expected 'unfixed' (the "
                             "epoch-iterator fix out) or, for tfdist_2workers, 'unfixed=log'.")
        if key == "pin" and base not in TWO_PROCESSES:
            raise ValueError(f"Knob 'pin' in {name!r} is for the 2-process configurations "
                             f"({', '.join(TWO_PROCESSES)}).")
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


def _fit_and_time(keras, model, x, y, steps_per_execution: int = 1, *,
                  batch_size: int = GLOBAL_BATCH, processes: int = 1) -> dict:
    """`fit` on (x, y), batch `batch_size` (this process's), timed; the samples/s count
    every process's examples (`processes` processes passing as many each)."""
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
    history = model.fit(x, y, batch_size=batch_size, epochs=EPOCHS, verbose=0,
                        callbacks=[Timer()])
    timed = seconds[1:]
    steps = len(x) // batch_size
    # One batch callback per execution: a gap spans steps_per_execution steps.
    step = statistics.median(gaps) / steps_per_execution if gaps else float("nan")
    # The steady step (median gap between steps inside an epoch) and what an
    # epoch costs beyond its steps (iterator set-up, the first step's wait, the end).
    return {"samples_per_sec": processes * len(x) * len(timed) / sum(timed),
            "epoch_seconds": seconds, "step_ms": 1e3 * step,
            "epoch_overhead_ms": 1e3 * (statistics.median(timed) - steps * step),
            "final_loss": float(history.history["loss"][-1]),
            # Every worker's copy must agree: the sum of |w| over all weights.
            "weights_abs_sum": float(sum(abs(keras.ops.convert_to_numpy(w)).sum(dtype="float64")
                                         for w in model.weights))}


def _loop_and_time(tf, keras, strategy, model, x, y) -> dict:
    """What `_fit_and_time` measures, for a custom training loop under `strategy`."""
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")
    with strategy.scope():
        accuracy = keras.metrics.SparseCategoricalAccuracy()
        model.optimizer.build(model.trainable_variables)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH)

    def replica_step(xb, yb):
        with tf.GradientTape() as tape:
            logits = model(xb, training=True)
            loss = tf.nn.compute_average_loss(loss_fn(yb, logits),
                                              global_batch_size=GLOBAL_BATCH)
        grads = tape.gradient(loss, model.trainable_variables)
        model.optimizer.apply_gradients(zip(grads, model.trainable_variables))
        accuracy.update_state(yb, logits)
        return loss

    @tf.function
    def train_step(batch):
        return strategy.reduce("SUM", strategy.run(replica_step, args=batch), axis=None)

    seconds, gaps, loss = [], [], None
    for epoch in range(EPOCHS):
        start = last = time.perf_counter()
        for i, batch in enumerate(strategy.experimental_distribute_dataset(dataset)):
            loss = train_step(batch)
            now = time.perf_counter()
            if epoch > 0 and i > 0:
                gaps.append(now - last)
            last = now
        float(loss), float(accuracy.result())  # what fit's logs fetch at an epoch's end
        accuracy.reset_state()
        seconds.append(time.perf_counter() - start)
    timed, step = seconds[1:], statistics.median(gaps)
    return {"samples_per_sec": len(x) * len(timed) / sum(timed), "epoch_seconds": seconds,
            "step_ms": 1e3 * step,
            "epoch_overhead_ms": 1e3 * (statistics.median(timed) - len(x) // GLOBAL_BATCH * step),
            "final_loss": float(loss),
            "weights_abs_sum": float(sum(abs(w.numpy()).sum(dtype="float64")
                                         for w in model.weights))}


def _tfdist_exchange(tf, keras, strategy, model, x, y) -> dict:
    """tfdist's step without communication and its gradient exchange alone, in ms."""
    from experiments.bench_comm import compute_and_exchange_seconds, step_timer

    dataset = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(GLOBAL_BATCH)
    steps = len(x) // GLOBAL_BATCH
    compute, exchange = compute_and_exchange_seconds(
        tf, strategy, model, dataset, step_timer(keras, model, dataset), steps=steps,
        exchange_repeats=EXCHANGE_REPEATS)
    return {"compute_ms": 1e3 * compute, "exchange_ms": 1e3 * exchange}


def _jax_exchange(jax, model) -> dict:
    """The all-reduce DataParallel's step runs on the gradients, alone: gradient-shaped
    arrays, one row per process, summed over the processes in one jitted call; in ms."""
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    mesh = Mesh(np.array(jax.devices()), ("batch",))
    arrays = [jax.make_array_from_process_local_data(
        NamedSharding(mesh, PartitionSpec("batch")),
        np.full((1, *w.shape), 1e-3, dtype="float32")) for w in model.trainable_weights]
    summed = jax.jit(lambda xs: [a.sum(0) for a in xs],
                     out_shardings=NamedSharding(mesh, PartitionSpec()))
    jax.block_until_ready(summed(arrays))  # compiles
    times = []
    for _ in range(EXCHANGE_REPEATS):
        start = time.perf_counter()
        jax.block_until_ready(summed(arrays))
        times.append(time.perf_counter() - start)
    return {"exchange_ms": 1e3 * statistics.median(times)}


def _task(knobs: dict) -> tuple[int, list[str], str]:
    """A 2-process configuration's task index, the workers' addresses (from the TF_CONFIG
    tfdist.launch gives each task) and where it runs (pinned with `+pin`)."""
    tf_config = json.loads(os.environ.get("TF_CONFIG") or "{}")
    task = int(tf_config.get("task", {}).get("index", 0))
    workers = tf_config.get("cluster", {}).get("worker", [])
    if "pin" in knobs:
        from experiments.bench_comm import _pin

        _pin(task)
        return task, workers, "pinned, process i on core i"
    return task, workers, "not pinned"


def _tensorflow_config(base: str, knobs: dict, steps: int) -> dict:
    import contextlib

    import tensorflow as tf

    if "intra" in knobs:
        tf.config.threading.set_intra_op_parallelism_threads(int(knobs["intra"]))
    if "inter" in knobs:
        tf.config.threading.set_inter_op_parallelism_threads(int(knobs["inter"]))
    strategy = None
    placement = None
    if base in TWO_PROCESSES:
        _, _, placement = _task(knobs)
    elif base != "tf_plain":
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
    elif base == "tfdist_2workers":
        import tfdist

        strategy = tfdist.make_strategy("multi_worker_mirrored")
        if knobs.get("unfixed") == "log":
            from tfdist.compat import keras_log_reduction

            tfdist.compat.uninstall([keras_log_reduction.NAME])
        elif "unfixed" in knobs:
            from tfdist.compat import keras_epoch_iterator

            tfdist.compat.uninstall(keras_epoch_iterator.NAMES)
    elif base == "tf_2workers":
        strategy = tf.distribute.MultiWorkerMirroredStrategy()
    import keras

    widths = TINY_WIDTHS if "tiny" in knobs else WIDTHS
    x, y = _data(widths, steps * GLOBAL_BATCH)
    with (strategy.scope() if strategy is not None else contextlib.nullcontext()):
        model = _build(keras, widths, int(knobs.get("spe", 1)))
    if "loop" in knobs:
        result = _loop_and_time(tf, keras, strategy, model, x, y)
    else:
        result = _fit_and_time(keras, model, x, y, int(knobs.get("spe", 1)))
    if "exchange" in knobs:
        result.update(_tfdist_exchange(tf, keras, strategy, model, x, y))
    result.update(replicas=strategy.num_replicas_in_sync if strategy is not None else 1,
                  intra_op=tf.config.threading.get_intra_op_parallelism_threads(),
                  inter_op=tf.config.threading.get_inter_op_parallelism_threads(),
                  devices=[d.name for d in tf.config.list_logical_devices("CPU")],
                  processes=2 if base in TWO_PROCESSES else 1, placement=placement)
    return result


def _jax_config(base: str, knobs: dict, steps: int) -> dict:
    import jax
    import keras

    processes, placement = 1, None
    widths = TINY_WIDTHS if "tiny" in knobs else WIDTHS
    x, y = _data(widths, steps * GLOBAL_BATCH)
    if base == "jax_data_parallel":
        keras.distribution.set_distribution(keras.distribution.DataParallel())
    elif base == "jax_2processes":
        task, workers, placement = _task(knobs)
        port = workers[0].rsplit(":", 1)[1]
        # The coordinator listens on loopback only (JAX's default: every interface).
        os.environ["JAX_COORDINATOR_BIND_ADDRESS"] = f"127.0.0.1:{port}"
        keras.distribution.initialize(f"127.0.0.1:{port}", num_processes=len(workers),
                                      process_id=task)
        keras.distribution.set_distribution(keras.distribution.DataParallel(
            devices=keras.distribution.list_devices(), auto_shard_dataset=False))
        processes = len(workers)
        x, y = x[task::processes], y[task::processes]
    model = _build(keras, widths)
    result = _fit_and_time(keras, model, x, y, batch_size=GLOBAL_BATCH // processes,
                           processes=processes)
    if "exchange" in knobs:
        result.update(_jax_exchange(jax, model))
    result.update(replicas=1 if base == "jax_plain" else len(jax.devices()),
                  devices=[str(d) for d in jax.devices()], processes=processes,
                  placement=placement,
                  collectives=jax.config.jax_cpu_collectives_implementation)
    return result


def _run_config(name: str, steps: int, out: str) -> None:
    base, knobs = parse_config(name)
    if base.startswith("jax"):
        result = _jax_config(base, knobs, steps)
    else:
        result = _tensorflow_config(base, knobs, steps)
    task = _task({})[0] if base in TWO_PROCESSES else 0
    # Worker 0's file is the result; another task's comes back under "tasks".
    with open(out if task == 0 else f"{out}.task{task}", "w") as f:
        json.dump(dict(result, config=name, task=task), f)


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


def last_error(log: str) -> str:
    """A failed run's last error line from its log (a value printed over several lines, e.g.
    a PerReplica's tensors, shortened to its first and last line), else its last line."""
    lines = [line for line in log.strip().splitlines() if line.strip()]
    found = [i for i, line in enumerate(lines) if "Error" in line]
    if not found:
        return (lines[-1] if lines else "no result")[:300]
    text = lines[found[-1]]
    if text.rstrip().endswith("{"):  # the value's own lines, up to the one that closes it
        close = next((line for line in lines[found[-1] + 1:] if "})" in line), None)
        if close is not None:
            text += " ... " + close[close.index("})"):]
    return text[:300]


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
    if base in TWO_PROCESSES:
        from experiments.workers import launch_workers

        try:
            first = launch_workers("experiments.bench_peers", name, num_workers=2,
                                   timeout=timeout, extra_args=(f"--steps={steps}",),
                                   env=env, what=name, every_task=True, python=python)
        except RuntimeError as e:
            return {"error": last_error(str(e))}
        tasks = first.pop("tasks")
        if len(tasks) != 1:
            return {"error": f"{len(tasks) + 1} of 2 workers wrote a result"}
        first["tasks"] = [dict(first), *tasks]
        return first
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
            return {"error": last_error(done.stderr)}
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
            error = errors[0] if errors else "no result"
            if base_name == "tf_2workers" and "PerReplica" in error:
                error += (" (Keras 3's fit under a stock MultiWorkerMirroredStrategy: "
                          "keras-team/keras#20585; tf_2workers+loop trains without fit)")
            rows.append(_row(f"peers/{name}", float("nan"), "samples/s",
                             f"not available: {error}"))
            continue
        sample = next(d for d in results[name] if "samples_per_sec" in d)
        per = " per process" if base_name in TWO_PROCESSES else ""
        threads = (f"; XLA's default threads{per}" if base_name.startswith("jax") else
                   f"; intra-op {sample['intra_op'] or 'default'}, inter-op "
                   f"{sample['inter_op'] or 'default'} threads{per}")
        if base_name in TWO_PROCESSES:
            # Every round: both workers end with the same weights.
            agree = all(len({t["weights_abs_sum"] for t in found["tasks"]}) == 1
                        for found in results[name] if "tasks" in found)
            threads += (f"; 2 processes, {sample['placement']}; the workers' final weights "
                        f"{'identical' if agree else 'DIFFER'} in every round")
            if "collectives" in sample:
                threads += f"; CPU collectives {sample['collectives']}"
            for key, what_key in (("compute_ms", "step without communication"),
                                  ("exchange_ms", "gradient exchange alone")):
                found = [d[key] for d in results[name] if key in d]
                if found:
                    threads += f"; {what_key} {statistics.median(found):.1f} ms"
        steps_ms = [d["step_ms"] for d in results[name] if "step_ms" in d]
        overheads = [d["epoch_overhead_ms"] for d in results[name] if "epoch_overhead_ms" in d]
        described = "tf_2workers+loop" if base_name == "tf_2workers" and "loop" in knobs \
            else base_name
        note = (f"{DESCRIPTIONS[described]}{' +' + '+'.join(name.split('+')[1:]) if knobs else ''}"
                f"; {sample['replicas']} replica(s) on {len(sample['devices'])} device(s)"
                f"{threads}; rounds {', '.join(f'{v:,.0f}' for v in good)}; steady step "
                f"{statistics.median(steps_ms):.1f} ms, epoch overhead "
                f"{statistics.median(overheads):.0f} ms")
        suffix = "+tiny" if "tiny" in knobs else ""
        for baseline in (f"tf_plain{suffix}", f"jax_plain{suffix}") + (
                (f"jax_2processes{suffix}", f"tf_2workers{suffix}", f"tf_2workers+loop{suffix}")
                if base_name == "tfdist_2workers" else ()):
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
    for other, what_other in (("jax_2processes", "Keras-JAX 2 processes"),
                              ("tf_2workers", "stock MultiWorkerMirroredStrategy 2 workers"),
                              ("tf_2workers+loop",
                               "stock MultiWorkerMirroredStrategy 2 workers, custom loop")):
        pairs = [(v, b) for v, b in zip(rates.get("tfdist_2workers", []), rates.get(other, []))
                 if v is not None and b is not None]
        if pairs:
            ratio, each = _ratio_note(*zip(*pairs))
            rows.append(_row(f"peers/tfdist 2 workers / {what_other}", ratio, "x",
                             f"per-round ratios {each}; both on the same cores; {what}"))
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

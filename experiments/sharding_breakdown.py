"""Where ZeRO stage 3's step time goes: `python -m experiments.sharding_breakdown`.

    python -m experiments.sharding_breakdown [--rounds=5] [--steps=10] [--width=1024]

bench_sharding's model and setup (MLP 4 x Dense(1024) + Dense(16), Adam,
global batch 256, `mirrored` on logical CPUs /cpu:1 and /cpu:2, intra-op 1 and
inter-op 2 threads per process), one process per configuration, all alive
at once and measured in interleaved rounds:

- `none`; `parameters` (each sharded layer under keras.remat);
  `parameters_noremat` (`shard_remat=False`); `none_remat` (no sharding, each
  Dense under `keras.remat`: the recomputed forward pass alone); `gradients`
  and `optimizer` (ZeRO-2 and ZeRO-1, for their memory);
- in the `none` process, the collectives alone, one `tf.function` running both
  replicas: 8 all-gathers of 2 MB blocks (stage 3's forward and backward
  gathers of the four 4 MB kernels), the same bytes in 2 all-gathers, 4
  reduce-scatters of 4 MB (tfdist's all-to-all + sum) and one all-reduce of
  the model's 16.9 MB of gradients.

Prints each median (ms), each step's ratio to `none`, the allocator peak of
one step (whole process, TF_CPU_ALLOCATOR_USE_BFC=1), the peak over what was
allocated when the step began (the step's own gradients, exchange buffers,
gathered weights and activations, both replicas together; what
`tfdist.planning`'s memory model adds to the state at rest) and the load
average.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from absl import app, flags

VARIANTS = ("none", "parameters", "parameters_noremat", "none_remat", "gradients", "optimizer")
WIDTH, LAYERS, BATCH = 1024, 4, 256

_FLAGS = flags.FLAGS
flags.DEFINE_integer("rounds", 5, "Interleaved rounds.")
flags.DEFINE_integer("steps", 10, "Timed calls per configuration per round.")
flags.DEFINE_integer("width", WIDTH, "The Dense layers' width (the report's model: 1024).")
flags.DEFINE_string("worker", None, "Internal: run one variant.")


def check_arguments(rounds: int, steps: int, width: int) -> None:
    """Raises ValueError naming the flag, what it received and what it takes."""
    for name, value in (("rounds", rounds), ("steps", steps), ("width", width)):
        if value < 1:
            raise ValueError(f"--{name} must be at least 1. Received: {value}")
    if width % 2:
        raise ValueError(f"--width must be even (each kernel is gathered in 2 halves). "
                         f"Received: {width}")


def _worker(variant: str, width: int = WIDTH) -> None:
    import tfdist

    tfdist.configure_logical_devices(3)
    tfdist.configure_threads(intra_op=1, inter_op=2)
    tf = tfdist.import_tensorflow()
    import keras
    import numpy as np

    from tfdist.compat import sharding_collectives as collectives

    options = {"shard": variant} if variant in ("optimizer", "gradients") else {}
    if variant.startswith("parameters"):
        options = {"shard": "parameters", "shard_remat": variant == "parameters"}
    strategy = tfdist.make_strategy("mirrored", devices=("/cpu:1", "/cpu:2"), **options)
    dense = keras.layers.Dense
    if variant == "none_remat":
        class RematDense(keras.layers.Dense):
            def call(self, x):
                return keras.remat(super().call)(x)
        dense = RematDense
    with strategy.scope():
        keras.utils.set_random_seed(0)
        inputs = keras.Input((width,))
        x = inputs
        for _ in range(LAYERS):
            x = dense(width, activation="relu")(x)
        model = keras.Model(inputs, keras.layers.Dense(16)(x))
        model.compile(keras.optimizers.Adam(1e-4), "mse")
    rng = np.random.default_rng(0)
    data = tf.data.Dataset.from_tensors(
        (rng.standard_normal((BATCH, width)).astype("float32"),
         rng.standard_normal((BATCH, 16)).astype("float32"))).repeat()
    iterator = iter(strategy.experimental_distribute_dataset(data))
    model.fit(data, steps_per_epoch=2, epochs=1, verbose=0)  # trace, warm up
    step = model.make_train_function()
    tf.config.experimental.reset_memory_stats("CPU:0")
    resident = tf.config.experimental.get_memory_info("CPU:0")["current"]
    step(iterator)
    peak = tf.config.experimental.get_memory_info("CPU:0")["peak"]
    timed = {"step": lambda: float(step(iterator)["loss"])}
    if variant == "none":
        kernel = width * width
        params = sum(int(v.shape.num_elements()) for v in model.trainable_variables)

        def gathers(count, block):
            return lambda: tf.add_n([tf.reduce_sum(collectives.all_gather(
                strategy, tf.fill([block], float(i)))) for i in range(count)])

        def scatters():
            return tf.add_n([tf.reduce_sum(collectives.reduce_scatter(
                strategy, tf.fill([kernel], float(i)))) for i in range(LAYERS)])

        def all_reduce():
            context = tf.distribute.get_replica_context()
            return tf.reduce_sum(context.all_reduce("sum", tf.ones([params])))

        for name, fn in (("8_gathers_2MB", gathers(2 * LAYERS, kernel // 2)),
                         ("2_gathers_8MB", gathers(2, LAYERS * kernel // 2)),
                         ("4_reduce_scatters_4MB", scatters),
                         ("all_reduce_16.9MB", all_reduce)):
            function = tf.function(lambda fn=fn: strategy.run(fn))
            function()
            timed[name] = lambda function=function: [
                t.numpy() for t in strategy.experimental_local_results(function())]
    print("ready " + json.dumps({"peak": peak, "resident": resident}), flush=True)
    for line in sys.stdin:
        if line.split()[:1] != ["run"]:
            break
        out = {}
        for name, fn in timed.items():
            times = []
            for _ in range(int(line.split()[1])):
                start = time.perf_counter()
                fn()
                times.append(time.perf_counter() - start)
            out[name] = times
        print(json.dumps(out), flush=True)


def _read(proc, prefix: str) -> str:
    while True:
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"breakdown worker exited (code {proc.wait()})")
        if line.startswith(prefix):
            return line


def measure(rounds: int, steps: int, width: int = WIDTH) -> dict:
    """Runs every variant in its own process, interleaved -> {"times": {variant: {name:
    [seconds, ...]}}, "peaks": {variant: {"peak", "resident"}}}; no process outlives it."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, KERAS_BACKEND="tensorflow", TF_CPU_ALLOCATOR_USE_BFC="1",
               TF_CPP_MIN_LOG_LEVEL="2")
    procs, peaks, times = {}, {}, {v: {} for v in VARIANTS}
    try:
        for variant in VARIANTS:  # one after another: tracing four models at once thrashes
            procs[variant] = subprocess.Popen(
                [sys.executable, "-m", "experiments.sharding_breakdown", f"--worker={variant}",
                 f"--width={width}"],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=root)
            peaks[variant] = json.loads(_read(procs[variant], "ready ")[6:])
        for _ in range(rounds):
            for variant, proc in procs.items():
                proc.stdin.write(f"run {steps}\n")
                proc.stdin.flush()
                for name, values in json.loads(_read(proc, "{")).items():
                    times[variant].setdefault(name, []).extend(values)
        for proc in procs.values():
            proc.stdin.write("quit\n")
            proc.stdin.flush()
            proc.wait(timeout=600)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return {"times": times, "peaks": peaks}


def report(result: dict) -> list[str]:
    """The printed lines: each median (ms) with the step's ratio to `none`, and the peaks."""
    import numpy as np

    times, peaks = result["times"], result["peaks"]
    base = float(np.median(times["none"]["step"]))
    lines = []
    for variant in VARIANTS:
        for name, values in times[variant].items():
            median = float(np.median(values))
            ratio = f"  {median / base:.3f} x none" if name == "step" else ""
            lines.append(f"{variant:20s} {name:22s} {median * 1e3:8.2f} ms{ratio}")
        peak, resident = peaks[variant]["peak"], peaks[variant]["resident"]
        lines.append(f"{variant:20s} {'allocator peak':22s} {peak / 2**20:8.1f} MB")
        lines.append(f"{variant:20s} {'peak over resident':22s} "
                     f"{(peak - resident) / 2**20:8.1f} MB")
    return lines


def main(argv) -> int:
    del argv
    if _FLAGS.worker:
        _worker(_FLAGS.worker, _FLAGS.width)
        return 0
    try:
        check_arguments(_FLAGS.rounds, _FLAGS.steps, _FLAGS.width)
    except ValueError as error:
        print(f"sharding_breakdown: {error}", file=sys.stderr)
        return 2
    for line in report(measure(_FLAGS.rounds, _FLAGS.steps, _FLAGS.width)):
        print(line)
    print(f"load average {os.getloadavg()[0]:.2f} at the end")
    return 0


if __name__ == "__main__":
    app.run(main)

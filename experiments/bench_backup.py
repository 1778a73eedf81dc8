"""What a `tfdist.BackupAndRestore` save costs per step, for a model of a few hundred MB.

    python -m experiments.bench_backup [--width=4096] [--layers=4] [--steps=60]
        [--out results/bench_backup.json]

An MLP of `layers` Dense(width) layers (4 x 4096^2: 67 M parameters, 268 MB of
float32 weights, as much again of SGD momentum: a 537 MB backup) trains one
process for `steps` steps, side by side in one run:

- no backup (the baseline step time);
- a backup every step written on the training thread (`async_write=False`);
- a backup every step written off it (`async_write=True`, the default): the
  training thread only copies the values into host memory;
- a backup every 10 steps, written off the training thread.

Per-save cost = (step time with saves - baseline) x steps per save. Also
measured alone: the host copy (snapshot) and the write (`np.savez` + fsync +
rename) of one backup, and its size. Pick `save_freq` from the cost: a save
every N steps adds cost/N per step.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time

from absl import app, flags

from experiments.rows import print_rows, row, write_rows

flags.DEFINE_integer("width", 4096, "Units per Dense layer.")
flags.DEFINE_integer("layers", 4, "Dense layers.")
flags.DEFINE_integer("batch", 16, "Batch size.")
flags.DEFINE_integer("steps", 60, "Timed steps per configuration.")
flags.DEFINE_string("out", "results/bench_backup.json", "Where to write the JSON.")
FLAGS = flags.FLAGS


def _model(keras, width: int, layers: int):
    model = keras.Sequential([keras.Input((width,))]
                             + [keras.layers.Dense(width, activation="tanh")
                                for _ in range(layers - 1)] + [keras.layers.Dense(width)])
    model.compile(keras.optimizers.SGD(1e-4, momentum=0.9), "mse")
    return model


def _step_times(model, data, callbacks, steps: int) -> list[float]:
    import keras

    times: list[float] = []

    class Clock(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            self.start = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            times.append(time.perf_counter() - self.start)

    # The clock runs last: it times the step and every backup callback's work after it.
    model.fit(data, epochs=1, steps_per_epoch=steps + 5, callbacks=[*callbacks, Clock()],
              verbose=0)
    return times[5:]  # the first steps trace and warm up


def main(argv) -> int:
    del argv
    import tfdist

    tf = tfdist.import_tensorflow()
    import keras
    import numpy as np

    from tfdist import checkpoint

    width, layers, steps = FLAGS.width, FLAGS.layers, FLAGS.steps
    model = _model(keras, width, layers)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((FLAGS.batch * 4, width)).astype("float32")
    data = tf.data.Dataset.from_tensor_slices((x, x)).repeat().batch(FLAGS.batch)
    model.fit(data, epochs=1, steps_per_epoch=2, verbose=0)  # builds the optimizer's state
    variables = checkpoint.tracked_variables(model)
    state_bytes = sum(int(np.prod(v.shape)) * 4 for v in variables.values())

    work = tempfile.mkdtemp(prefix="tfdist-bench-backup-")
    rows, details = [], {}
    try:
        start = time.perf_counter()
        values = {f"v{i}": checkpoint._value(v) for i, v in enumerate(variables.values())}
        snapshot = time.perf_counter() - start
        path = os.path.join(work, "one.npz")
        start = time.perf_counter()
        checkpoint._atomic_write_bytes(path, lambda f, arrays=values: np.savez(f, **arrays))
        write = time.perf_counter() - start
        size = os.path.getsize(path)
        values.clear()

        configs = [("no backup", None), ("every step, on the training thread", (1, False)),
                   ("every step, written off the training thread", (1, True)),
                   ("every 10 steps, written off the training thread", (10, True))]
        medians = {}
        for name, config in configs:
            callbacks = []
            if config is not None:
                backup_dir = os.path.join(work, name.replace(" ", "_").replace(",", ""))
                callbacks.append(tfdist.BackupAndRestore(
                    backup_dir, save_freq=config[0], async_write=config[1],
                    preemption=False))
            times = _step_times(model, data, callbacks, steps)
            medians[name] = statistics.mean(times)
            details[name] = times
        base = medians["no backup"]
        rows.append(row("backup size", size / 2**20, "MiB",
                        f"{state_bytes / 2**20:.0f} MiB of variables ({layers} x Dense({width}) "
                        f"+ SGD momentum)"))
        rows.append(row("host copy of the state (snapshot)", snapshot, "s", "training thread"))
        rows.append(row("write of one backup (savez + fsync + rename)", write, "s",
                        f"{size / write / 2**20:.0f} MiB/s"))
        rows.append(row("step time, no backup", base, "s", f"mean of {steps} steps"))
        for name, config in configs[1:]:
            per_save = (medians[name] - base) * config[0]
            rows.append(row(f"step time, backup {name}", medians[name], "s",
                            f"{medians[name] / base:.2f}x; cost per save {per_save:.2f} s"))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print_rows(rows)
    write_rows(FLAGS.out, rows, step_times=details,
               config={"width": width, "layers": layers, "batch": FLAGS.batch, "steps": steps})
    print(f"wrote {FLAGS.out}")
    return 0


if __name__ == "__main__":
    app.run(main)

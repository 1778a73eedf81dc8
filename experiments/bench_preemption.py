"""Steps lost when a cluster preempts a 2-worker job: SIGTERM to `tfdist launch` mid-epoch.

    python -m experiments.bench_preemption [--backup=tfdist|keras] [--save_freq=0]
        [--sigterm_at=560] [--grace_period=30] [--out results/bench_preemption.json]

What a cluster does on preemption (Kubernetes eviction, SLURM preemption, a
spot VM reclaimed): SIGTERM, a grace period, SIGKILL. This runs it as a user
would: `tfdist launch --num_workers=2 --grace_period=30` around a
multi_worker_mirrored `fit` (400-step epochs, 3 epochs, an MLP of ~4.7 M
parameters, ~0.1 s per step on 2 shared cores) with `tfdist.BackupAndRestore`
(or Keras's own `keras.callbacks.BackupAndRestore`), sends SIGTERM to the
launcher once the chief has trained `--sigterm_at` steps, and measures:

- the step the chief had reached at the SIGTERM, and the last step it trained;
- seconds from the SIGTERM to the launcher's exit, and its exit status;
- the step the relaunch (the same command) resumes at;
- steps lost = last step trained - step resumed at (work done and thrown away).

The relaunch only reads where it would resume (every task prints
`optimizer.iterations` after the restore and exits).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time

from absl import app, flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FEATURES, WIDTH, GLOBAL_BATCH, STEPS_PER_EPOCH, EPOCHS = 256, 2048, 64, 400, 3


def _define_flags() -> None:
    flags.DEFINE_enum("backup", "tfdist", ["tfdist", "keras"], "Which backup callback.")
    flags.DEFINE_integer("save_freq", 0, "Also back up every N steps (0: at epoch ends only).")
    flags.DEFINE_integer("sigterm_at", 560, "SIGTERM the launcher once the chief trained this "
                         "many steps.")
    flags.DEFINE_float("grace_period", 30.0, "The launcher's --grace_period.")
    flags.DEFINE_string("out", "results/bench_preemption.json", "Where to write the JSON.")
    flags.DEFINE_enum("role", None, ["train"], "Internal: run as a launched task.")
    flags.DEFINE_string("backup_dir", None, "Internal: the backup folder.")
    flags.DEFINE_string("progress", None, "Internal: the chief appends 'step time' here.")
    flags.DEFINE_bool("probe_resume", False, "Internal: print the restored step and exit.")


FLAGS = flags.FLAGS


# --- task side (runs under `tfdist launch`) -----------------------------------------


def _train() -> None:
    import tfdist
    import tfdist.chief
    from tfdist import checkpoint

    tf = tfdist.import_tensorflow()
    import keras
    import numpy as np

    strategy = tfdist.make_strategy("multi_worker_mirrored")
    chief = tfdist.chief.is_chief()
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4096, FEATURES)).astype("float32")
    y = (x[:, :1] * 0.5).astype("float32")
    examples = tf.data.Dataset.from_tensor_slices((x, y))
    data = checkpoint.repeat_shuffled(examples, buffer_size=4096, seed=1)
    data = data.batch(GLOBAL_BATCH)
    with strategy.scope():
        model = keras.Sequential([keras.Input((FEATURES,))]
                                 + [keras.layers.Dense(WIDTH, activation="relu")
                                    for _ in range(2)] + [keras.layers.Dense(1)])
        model.compile(keras.optimizers.SGD(0.001), "mse")
    save_freq = FLAGS.save_freq or "epoch"
    if FLAGS.backup == "tfdist":
        kwargs = {"save_freq": FLAGS.save_freq} if FLAGS.save_freq else {}
        backup = tfdist.BackupAndRestore(FLAGS.backup_dir, **kwargs)
        data = backup.dataset(data)
    else:
        backup = keras.callbacks.BackupAndRestore(FLAGS.backup_dir, save_freq=save_freq)

    class Progress(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            step = int(self.model.optimizer.iterations.numpy())
            print(f"resuming at step {step}", flush=True)
            if FLAGS.probe_resume:
                sys.stdout.flush()
                os._exit(0)

        def on_train_batch_end(self, batch, logs=None):
            if chief:
                step = int(self.model.optimizer.iterations.numpy())
                with open(FLAGS.progress, "a") as f:
                    f.write(f"{step} {time.time():.3f}\n")

    model.fit(data, epochs=EPOCHS, steps_per_epoch=STEPS_PER_EPOCH,
              callbacks=[backup, Progress()], verbose=0)
    print("finished", flush=True)


# --- driver ------------------------------------------------------------------------


def _launch_cmd(backup_dir: str, progress: str, *, probe: bool) -> list[str]:
    return [sys.executable, "-m", "tfdist.cli", "launch", "--num_workers=2",
            f"--grace_period={FLAGS.grace_period:g}", "--",
            sys.executable, "-m", "experiments.bench_preemption", "--role=train",
            f"--backup={FLAGS.backup}", f"--save_freq={FLAGS.save_freq}",
            f"--backup_dir={backup_dir}", f"--progress={progress}",
            f"--probe_resume={probe}"]


def _last_step(progress: str) -> tuple[int, float]:
    try:
        with open(progress) as f:
            lines = f.read().split("\n")
    except FileNotFoundError:
        return 0, 0.0
    for line in reversed(lines):
        parts = line.split()
        if len(parts) == 2:
            return int(parts[0]), float(parts[1])
    return 0, 0.0


def measure() -> dict:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    with tempfile.TemporaryDirectory() as tmp:
        backup_dir, progress = os.path.join(tmp, "backup"), os.path.join(tmp, "progress")
        log_path = os.path.join(tmp, "run.log")
        with open(log_path, "w") as log:
            launcher = subprocess.Popen(_launch_cmd(backup_dir, progress, probe=False),
                                        cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
            deadline = time.monotonic() + 900
            while _last_step(progress)[0] < FLAGS.sigterm_at:
                if launcher.poll() is not None or time.monotonic() > deadline:
                    launcher.kill()
                    raise RuntimeError(f"the run ended before step {FLAGS.sigterm_at}:\n"
                                       + open(log_path).read()[-3000:])
                time.sleep(0.02)
            at_sigterm, _ = _last_step(progress)
            sent = time.monotonic()
            launcher.send_signal(signal.SIGTERM)
            code = launcher.wait(timeout=FLAGS.grace_period + 60)
            exit_seconds = time.monotonic() - sent
        last, _ = _last_step(progress)
        first_log = open(log_path).read()
        with open(log_path, "w") as log:
            probe = subprocess.run(_launch_cmd(backup_dir, progress, probe=True), cwd=ROOT,
                                   env=env, stdout=log, stderr=subprocess.STDOUT, timeout=300)
        resumed = [int(line.rsplit(" ", 1)[1]) for line in open(log_path).read().splitlines()
                   if "] resuming at step " in line]
        if not resumed:
            raise RuntimeError(f"the relaunch did not say where it resumes (exit "
                               f"{probe.returncode}):\n" + open(log_path).read()[-3000:])
    launcher_lines = [line for line in first_log.splitlines() if "[tfdist launch]" in line]
    # A backup taken at the step boundary after the chief's last progress line holds one more
    # step than the file shows: the steps trained are at least the steps resumed from.
    last = max(last, resumed[0])
    return {"backup": FLAGS.backup, "save_freq": FLAGS.save_freq,
            "grace_period": FLAGS.grace_period, "step_at_sigterm": at_sigterm,
            "last_step_trained": last, "launcher_exit_status": code,
            "seconds_sigterm_to_exit": round(exit_seconds, 2), "resumed_at_step": resumed[0],
            "steps_lost": last - resumed[0], "launcher_said": launcher_lines[-2:]}


def main(argv) -> int:
    del argv
    if FLAGS.role == "train":
        _train()
        return 0
    result = measure()
    print(json.dumps(result, indent=2))
    os.makedirs(os.path.dirname(os.path.abspath(FLAGS.out)), exist_ok=True)
    with open(FLAGS.out, "w") as f:
        json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    _define_flags()
    app.run(main)

"""Train an example model with a tfdist preset: `python -m experiments.train`.

With no flags: MirroredStrategy over 2 logical CPUs on the scikit-learn digits.
    python -m experiments.train --strategy=mirrored --logical_devices=4 --model=cnn
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import tempfile
import time

from absl import app, flags

import tfdist.flags as tfdist_flags
from models import MODELS
from models.datasets import DATASETS

tfdist_flags.define_flags()
tfdist_flags.define_training_flags()
tfdist_flags.define_split_flags()
tfdist_flags.define_step_flags()
flags.DEFINE_enum("model", "mlp", list(MODELS), "Example model from models/.")
flags.DEFINE_enum("dataset", "digits", list(DATASETS),
                  "digits (ships with scikit-learn), synthetic, or mnist (needs network once).")
flags.FLAGS.set_default("logical_devices", 2)
FLAGS = flags.FLAGS

# Each logical device is one more replica that TensorFlow builds and runs in
# turn on the same cores: 16 already take minutes to start on 2 cores.
MAX_LOGICAL_DEVICES = 64


def _check_writable_dir(flag: str, value: str, path: str) -> None:
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        what = "" if value == path else "'s folder"
        raise ValueError(
            f"--{flag}{what} must be a directory this process can write to; {path!r} is not "
            f"({e.strerror or e}). Received: --{flag}={value}. Pick a writable place, e.g. "
            f"under /tmp.") from None


def check_inputs(*, learning_rate: float, logical_devices: int | None, model_dir: str | None,
                 metrics_out: str | None) -> None:
    """Rejects flag values that would train nothing, hang or fail late.

    Raises:
      ValueError: what was received, what is expected, the fix.
    """
    if not math.isfinite(learning_rate) or learning_rate <= 0:
        raise ValueError(
            f"--learning_rate must be a finite number > 0. Received: "
            f"--learning_rate={learning_rate!r}. Use e.g. --learning_rate=1e-3.")
    if logical_devices is not None and logical_devices > MAX_LOGICAL_DEVICES:
        raise ValueError(
            f"--logical_devices must be at most {MAX_LOGICAL_DEVICES}: each one is a replica "
            f"TensorFlow builds and runs on the same {os.cpu_count()} cores (16 already take "
            f"minutes to start on 2 cores). Received: --logical_devices={logical_devices}. "
            f"Use a few per core, e.g. --logical_devices=4.")
    if model_dir:
        from tfdist.chief import chief_path

        _check_writable_dir("model_dir", model_dir, chief_path(model_dir))
    if metrics_out:
        if os.path.isdir(metrics_out):
            raise ValueError(f"--metrics_out names a file to write; {metrics_out!r} is a "
                             f"directory. Received: --metrics_out={metrics_out}. Give a file "
                             f"name, e.g. {os.path.join(metrics_out, 'metrics.json')}.")
        _check_writable_dir("metrics_out", metrics_out,
                            os.path.dirname(os.path.abspath(metrics_out)))


def _split_strategy(strategy_options, split_options):
    """(strategy, Parallelism or None): one pipeline, or the mirrored preset's replicas of it.

    --strategy=default: one replica (TensorFlow's default strategy). --strategy=mirrored:
    its devices (--devices / --num_devices, default all) hold R = devices / split size
    replicas, each running the split: the strategy `tfdist.make_strategy` makes from the
    `tfdist.Parallelism` the flags describe.
    """
    import tfdist
    from tfdist import devices as devices_lib

    preset = strategy_options.preset
    if preset == "default":
        return tfdist.make_strategy(strategy_options), None
    if preset != "mirrored":
        raise ValueError(
            f"--split and --sequence_parallel run in this process: one pipeline "
            f"(--strategy=default) or replicas of it over this process's devices "
            f"(--strategy=mirrored); a split across workers is not supported. Received: "
            f"--strategy={preset}. Use --strategy=default or --strategy=mirrored.")
    if split_options.split == "auto" and split_options.stages is None:
        raise ValueError(
            "--strategy=mirrored with --split=auto runs replicas x stages over its devices, so "
            "it needs the stage count. Received: --split=auto without --stages. Pass e.g. "
            "--stages=2 (4 devices: 2 replicas of 2 stages), or --strategy=default for one "
            "pipeline over all devices.")
    pool = devices_lib.resolve_devices(strategy_options.devices, strategy_options.num_devices)
    per_replica = split_options.parallelism(pool).devices_per_replica
    replicas = max(1, len(pool) // per_replica)
    dims = split_options.parallelism(pool, replicas=replicas)
    # Other mirrored options (cross_device_ops, sync_batch_norm, shard, ...) given by flag:
    # make_strategy says a split runs its replicas with the preset's defaults.
    given = {f.name: getattr(strategy_options, f.name)
             for f in dataclasses.fields(strategy_options)
             if f.name not in ("devices", "num_devices")
             and getattr(strategy_options, f.name) != f.default}
    return tfdist.make_strategy(dims, **given), dims


def run(*, strategy_options, model_name: str, dataset_name: str, global_batch_size: int,
        epochs: int, steps_per_epoch: int | None, learning_rate: float, seed: int,
        model_dir: str | None = None, verbose: int | str | None = "auto",
        split_options=None, step_options=None) -> dict:
    """Trains and evaluates one configuration; returns the metrics summary.

    `verbose` is Keras's `fit` verbosity; with 0 the summary lines are not
    printed either. None: `tfdist.fit_verbose()` once the strategy is made (the
    `auto` preset may set TF_CONFIG from SLURM), so a multi-worker job prints
    them once, from the chief.
    """
    from tfdist._tf import import_tensorflow

    tf = import_tensorflow()  # before keras: no TensorFlow start-up or INFO lines
    import keras
    import numpy as np

    import tfdist
    from tfdist import step_options as step_lib
    from tfdist.strategies import strategy_name
    from models import build_model
    from models.datasets import load_dataset

    def say(text: str) -> None:
        if verbose != 0:
            print(text, flush=True)

    start = time.perf_counter()
    data = load_dataset(dataset_name, seed=seed)
    if global_batch_size > len(data.x_train):
        raise ValueError(
            f"global_batch_size must be at most the training set's size ({len(data.x_train)} "
            f"examples of {dataset_name}): a bigger batch repeats examples within one step. "
            f"Received: global_batch_size={global_batch_size}. Use e.g. --global_batch_size=64.")
    splitting = split_options is not None and split_options.enabled
    if splitting:
        strategy, split_dims = _split_strategy(strategy_options, split_options)
    else:
        strategy, split_dims = tfdist.make_strategy(strategy_options), None
    if verbose is None:
        verbose = tfdist.fit_verbose()
    step_options = step_options or tfdist.StepOptions()
    step_lib.check(step_options, strategy)
    replicas = strategy.num_replicas_in_sync
    per_replica = tfdist.per_replica_batch_size(global_batch_size, replicas)
    steps = steps_per_epoch or max(1, len(data.x_train) // global_batch_size)
    say(f"tfdist: {tfdist.describe(strategy, global_batch_size)}")
    say(f"tfdist: {model_name} on {dataset_name}: {len(data.x_train)} train / "
        f"{len(data.x_test)} held-out examples, {steps} steps/epoch")

    train = (tf.data.Dataset.from_tensor_slices((data.x_train, data.y_train))
             .shuffle(len(data.x_train), seed=seed).repeat()
             .batch(global_batch_size, drop_remainder=True).prefetch(2))
    test = tf.data.Dataset.from_tensor_slices((data.x_test, data.y_test)).batch(global_batch_size)
    # A split's replicas (split_dims.replicas > 1) are the split model's own: it is built
    # as on one device and split_model runs it under the strategy.
    scope = strategy.scope() if split_dims is None else contextlib.nullcontext()
    with scope, step_lib.dtype_policy(step_options):
        keras.utils.set_random_seed(seed)
        model = build_model(model_name, data.input_shape, data.num_classes)
        if splitting:
            from tfdist.split import split_from_options

            if split_dims is None or split_dims.replicas == 1:
                model = split_from_options(
                    model, split_options,
                    devices=None if split_dims is None else split_dims.devices)
            else:
                model = split_from_options(model, split_options, strategy=strategy)
            say(tfdist.placement_report(model, batch_size=global_batch_size))
        # The optimizer is made under the strategy's scope (its slots are mirrored variables).
        with strategy.scope() if split_dims is not None else contextlib.nullcontext():
            model.compile(
                step_lib.optimizer(keras.optimizers.Adam(learning_rate), step_options),
                keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                metrics=["accuracy"], **step_lib.compile_arguments(step_options))
    # samples/s, step time and device memory per epoch, into the history and TensorBoard.
    callbacks = [tfdist.ThroughputMonitor(global_batch_size=global_batch_size)]
    if model_dir:
        # Multi-worker: only the chief writes into model_dir (tfdist.chief_path).
        callbacks.append(keras.callbacks.TensorBoard(
            tfdist.chief_path(os.path.join(model_dir, "logs"))))
    history = model.fit(train, epochs=epochs, steps_per_epoch=steps, callbacks=callbacks,
                        verbose=verbose, shuffle=False)  # the dataset is already shuffled
    test_loss, test_accuracy = model.evaluate(test, verbose=0)
    if model_dir and not splitting:
        model.save(tfdist.chief_path(os.path.join(model_dir, "model.keras")))
    throughput = history.history["samples_per_sec"]
    steady = throughput[1:] or throughput  # the first epoch includes tracing
    return {
        "preset": strategy_options.preset,
        "strategy": strategy_name(strategy),
        "num_replicas": replicas,
        "devices": list(tfdist.replica_devices(strategy)),
        "global_batch_size": global_batch_size,
        "per_replica_batch_size": per_replica,
        "model": model_name,
        "dataset": dataset_name,
        "epochs": epochs,
        "steps_per_epoch": steps,
        "history": {k: [float(v) for v in vs] for k, vs in history.history.items()},
        "test_loss": float(test_loss),
        "test_accuracy": float(test_accuracy),
        "samples_per_sec": float(np.median(steady)),
        "wall_time_s": time.perf_counter() - start,
        "step_options": dataclasses.asdict(step_options),
        "gradient_compression": getattr(strategy_options, "gradient_compression", "none"),
        "split": None if not splitting else tfdist.split.describe(model),
    }


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {' '.join(argv[1:])}")
    tfdist_flags.apply_verbosity()
    import tfdist

    try:
        check_inputs(learning_rate=FLAGS.learning_rate, logical_devices=FLAGS.logical_devices,
                     model_dir=FLAGS.model_dir, metrics_out=FLAGS.metrics_out)
        if FLAGS.strategy != "multi_worker_mirrored":
            # MWMS must start the runtime itself (one device per worker on CPUs).
            tfdist_flags.apply_device_flags()
        metrics = run(
            strategy_options=tfdist_flags.strategy_options_from_flags(),
            model_name=FLAGS.model, dataset_name=FLAGS.dataset,
            global_batch_size=FLAGS.global_batch_size, epochs=FLAGS.epochs,
            steps_per_epoch=FLAGS.steps_per_epoch, learning_rate=FLAGS.learning_rate,
            # Progress and summaries from the chief only (worker 0 without one): a
            # bar on a terminal or under `tfdist launch`, one line per epoch into a file.
            seed=FLAGS.seed, model_dir=FLAGS.model_dir, verbose=None,
            split_options=tfdist_flags.split_options_from_flags(),
            step_options=tfdist_flags.step_options_from_flags())
    except (ValueError, RuntimeError, flags.ValidationError) as e:
        # Bad input: the message says what was received and how to fix it.
        raise SystemExit(f"error: {e}") from None
    if tfdist.fit_verbose() != 0:
        print(f"tfdist: held-out accuracy {metrics['test_accuracy']:.4f}, "
              f"{metrics['samples_per_sec']:.0f} samples/s, {metrics['wall_time_s']:.1f} s wall")
    if FLAGS.metrics_out:
        from tfdist.chief import chief_path

        os.makedirs(os.path.dirname(os.path.abspath(FLAGS.metrics_out)), exist_ok=True)
        with open(chief_path(FLAGS.metrics_out), "w") as f:
            json.dump(metrics, f, indent=2)


if __name__ == "__main__":
    app.run(main)

"""Keras's own file writers, one path on every worker: run by `tfdist launch` in the tests.

    python tests/checkpoint/run_keras_files.py --out DIR --mode tfdist|user

--mode tfdist (the preset): 3 rounds, each a 1-epoch `fit` with
ModelCheckpoint (.weights.h5, .keras, .h5), TensorBoard and CSVLogger, then
`save_weights`, `save` (.keras, .h5) and `export` to one path on every
worker; then Keras's BackupAndRestore interrupted at epoch 2 and resumed in a
fresh model; then the ordered-write probe (below) with tfdist's fixes and,
as a negative control, again after `keras_files.uninstall()`; and "save,
then load_model" on every worker with a chief slow to write, with and
without the barrier after the chief's write.

--mode user (a user's own tf.distribute.MultiWorkerMirroredStrategy, tfdist's
fixes installed but not applying to it): the ordered-write probe and
TensorBoard/CSVLogger driven by hand; then, on the chief, a model with no
strategy saved with the fixes installed (stock Keras behaviour), and a fix
whose target changed shape (refused, nothing left installed).

The ordered-write probe makes collisions deterministic: every worker gives
its model different weights (its task index), the chief writes, all wait,
then worker 1 writes to the same paths. If the file afterwards holds worker
1's weights, a non-chief write reached the user's path.

Each task writes DIR/report_<task>.json and DIR/preds_<task>.npy.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tests.checkpoint import keras_files_model as mdl  # noqa: E402

ROUNDS = 3


def _dataset(tf, x, y, batch):
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(batch)


def _compile(keras, model):
    model.compile(keras.optimizers.Adam(0.01), "mse", metrics=["mae"])


def _ordered_writes(tf, keras, strategy, barrier, task_index, out):
    """Chief writes, then worker 1: returns {file: task index whose weights it holds}."""
    with strategy.scope():
        model = mdl.build(seed=0, on_read=False)
        _compile(keras, model)
    model.set_weights([w * 0 + task_index for w in model.get_weights()])
    os.makedirs(out, exist_ok=True)
    writers = {
        "ordered.weights.h5": lambda p: model.save_weights(p),
        "ordered.keras": lambda p: model.save(p),
        "ordered.h5": lambda p: model.save(p),
        "ordered_export": lambda p: model.export(p, verbose=False),
    }
    for turn in (0, 1):
        if task_index == turn:
            for name, write in writers.items():
                write(os.path.join(out, name))
        barrier()
    holder = {}
    if task_index == 0:
        for name in writers:
            path = os.path.join(out, name)
            if name.endswith("export"):
                loaded = tf.saved_model.load(path)
                value = float(loaded.serve(tf.zeros((1, mdl.FEATURES))).numpy().ravel()[0])
                # Dense(16, relu) -> Dense(1) with every weight = i: i*(16*relu(i)) + i.
                holder[name] = 0 if value == 0 else 1
            else:
                fresh = mdl.build(seed=5, on_read=False)
                if name.endswith(".weights.h5"):
                    fresh.load_weights(path)
                else:
                    fresh = keras.saving.load_model(path, compile=False)
                holder[name] = int(round(float(fresh.get_weights()[0].ravel()[0])))
    barrier()
    return holder


def _save_then_load(keras, strategy, barrier, out):
    """keras.io's "save, then load_model" on every worker, with a chief slow to write.

    Returns {"fixed": outcome, "unfixed": outcome} on this worker: "loaded" or the
    error's type. "unfixed" takes out the barrier that makes every worker wait for the
    chief's file (a negative control: the load then races the chief's write).
    """
    import time

    from tfdist.compat import keras_files

    with strategy.scope():
        model = mdl.build(seed=0, on_read=False)
        _compile(keras, model)
    os.makedirs(out, exist_ok=True)
    stock_write_as, stock_barrier = keras_files.write_as, keras_files.barrier

    def slow_write_as(who, *args, **kwargs):
        if who == "chief":
            time.sleep(1.0)
        return stock_write_as(who, *args, **kwargs)

    outcomes = {}
    keras_files.write_as = slow_write_as
    try:
        for name in ("fixed", "unfixed"):
            if name == "unfixed":
                keras_files.barrier = lambda strategy: None
            path = os.path.join(out, f"{name}.keras")
            model.save(path)
            try:
                keras.saving.load_model(path, compile=False)
                outcomes[name] = "loaded"
            except Exception as e:  # noqa: BLE001 (the outcome is what the test reads)
                outcomes[name] = type(e).__name__
            keras_files.barrier = stock_barrier
            barrier()
    finally:
        keras_files.write_as, keras_files.barrier = stock_write_as, stock_barrier
    return outcomes


def _drive_callbacks_by_hand(keras, strategy, task_index, out):
    """TensorBoard and CSVLogger as fit drives them (fit itself is the preset's fix)."""
    with strategy.scope():
        model = mdl.build(seed=0, on_read=False)
        _compile(keras, model)
    for callback in (keras.callbacks.TensorBoard(os.path.join(out, "tb")),
                     keras.callbacks.CSVLogger(os.path.join(out, "log.csv"))):
        callback.set_model(model)
        callback.on_train_begin()
        callback.on_epoch_begin(0)
        callback.on_epoch_end(0, {"loss": float(task_index), "task": float(task_index)})
        callback.on_train_end()


def run_tfdist(args, tf, keras, np, strategy, barrier, task, task_index):
    from tfdist.compat import keras_files

    report = {"task": task}
    x, y = mdl.data()
    train = _dataset(tf, x, y, mdl.GLOBAL_BATCH)
    val = _dataset(tf, x[:32], y[:32], mdl.GLOBAL_BATCH)
    out = args.out
    with strategy.scope():
        model = mdl.build(seed=0)
        _compile(keras, model)
    os.makedirs(os.path.join(out, "sharded"), exist_ok=True)  # Keras does not create it
    for round_ in range(ROUNDS):
        callbacks = [
            keras.callbacks.ModelCheckpoint(os.path.join(out, "ckpt.weights.h5"),
                                            save_weights_only=True),
            keras.callbacks.ModelCheckpoint(os.path.join(out, "ckpt.keras")),
            keras.callbacks.ModelCheckpoint(os.path.join(out, "ckpt.h5")),
            keras.callbacks.TensorBoard(os.path.join(out, "tb")),
            keras.callbacks.CSVLogger(os.path.join(out, "log.csv"), append=True),
        ]
        model.fit(train, validation_data=val, epochs=1, callbacks=callbacks, verbose=0,
                  shuffle=False)
        model.save_weights(os.path.join(out, "direct.weights.h5"))
        model.save_weights(os.path.join(out, "sharded", "sharded.weights.json"),
                           max_shard_size=0.000002)
        keras.saving.save_model(model, os.path.join(out, "function.keras"))
        model.save(os.path.join(out, "direct.keras"))
        model.save(os.path.join(out, "direct.h5"))
        model.export(os.path.join(out, "export"), verbose=False)
        barrier()
        # Every worker reads (the on-read variable's value is an all-reduce).
        expected = model.get_weights()
        if task_index == 0:  # every round's files load and hold this round's weights
            for name in ("ckpt.weights.h5", "direct.weights.h5"):
                fresh = mdl.build(seed=9)
                fresh.load_weights(os.path.join(out, name))
                report[f"round{round_}:{name}"] = max(
                    float(np.abs(a - b).max()) for a, b in zip(fresh.get_weights(), expected))
            for name in ("ckpt.keras", "ckpt.h5", "direct.keras", "function.keras",
                         "direct.h5"):
                fresh = keras.saving.load_model(os.path.join(out, name), compile=False)
                report[f"round{round_}:{name}"] = max(
                    float(np.abs(a - b).max()) for a, b in zip(fresh.get_weights(), expected))
        barrier()
    np.save(os.path.join(out, f"preds_{task.replace(':', '')}.npy"),
            model.predict(mdl.probe(), verbose=0))
    report["weights"] = [w.tolist() for w in model.get_weights()]

    # Keras's BackupAndRestore (double_checkpoint: the previous backup is kept as .bkp):
    # interrupted at the start of epoch 2, resumed in fresh models, once from the backup
    # and once from a copy whose latest file the chief damaged (Keras then falls back to
    # the .bkp of epoch 1). No shuffling, so the epochs are exact.
    class Interrupt(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            if epoch == 2:
                raise RuntimeError("interrupted")

    backup_dir, damaged_dir = os.path.join(out, "bar"), os.path.join(out, "bar_damaged")
    with strategy.scope():
        reference = mdl.build(seed=3)
        interrupted = mdl.build(seed=3)
        resumed = mdl.build(seed=4)
        from_bkp = mdl.build(seed=5)
        for m in (reference, interrupted, resumed, from_bkp):
            _compile(keras, m)
    reference.fit(train, epochs=3, verbose=0, shuffle=False)
    try:
        interrupted.fit(train, epochs=3, verbose=0, shuffle=False, callbacks=[
            keras.callbacks.BackupAndRestore(backup_dir, double_checkpoint=True), Interrupt()])
    except RuntimeError as e:
        report["interrupted"] = str(e)
    barrier()
    report["backup_files"] = sorted(os.listdir(backup_dir))
    if task_index == 0:
        import shutil

        shutil.copytree(backup_dir, damaged_dir)
        with open(os.path.join(damaged_dir, "latest.weights.h5"), "wb") as f:
            f.write(b"damaged")
    barrier()
    for name, model_, folder in (("resumed", resumed, backup_dir),
                                 ("from_bkp", from_bkp, damaged_dir)):
        history = model_.fit(train, epochs=3, verbose=0, shuffle=False,
                             callbacks=[keras.callbacks.BackupAndRestore(folder)])
        report[f"{name}_epochs"] = history.epoch
        report[f"{name}_vs_uninterrupted"] = max(
            float(np.abs(a - b).max())
            for a, b in zip(model_.get_weights(), reference.get_weights()))
        report[f"{name}_backup_left"] = os.path.exists(folder)

    report["ordered"] = _ordered_writes(tf, keras, strategy, barrier, task_index,
                                        os.path.join(out, "ordered"))
    report["save_then_load"] = _save_then_load(keras, strategy, barrier,
                                               os.path.join(out, "save_load"))
    report["uninstalled"] = list(keras_files.uninstall())
    report["ordered_unpatched"] = _ordered_writes(tf, keras, strategy, barrier, task_index,
                                                  os.path.join(out, "unpatched"))
    return report


def _plain_keras_and_changed_code(keras, np, out):
    """A model with no strategy saves as stock Keras; a changed target is refused."""
    from keras.src.callbacks import backup_and_restore

    from tfdist.compat import _patch, keras_files

    report = {}
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile("sgd", "mse")
    plain = os.path.join(out, "plain")
    os.makedirs(plain)
    model.save(os.path.join(plain, "m.keras"))
    model.save_weights(os.path.join(plain, "m.weights.h5"))
    model.fit(np.ones((4, 3)), np.ones((4, 2)), epochs=1, verbose=0,
              callbacks=[keras.callbacks.TensorBoard(os.path.join(plain, "tb"))])
    report["plain_files"] = sorted(os.listdir(plain))
    report["plain_role"] = keras_files.role(model.distribute_strategy)
    report["uninstalled"] = len(keras_files.uninstall())

    def on_train_end(self, logs=None, extra=None):  # an upstream change, late in the list
        pass

    original = backup_and_restore.BackupAndRestore.on_train_end
    backup_and_restore.BackupAndRestore.on_train_end = on_train_end
    try:
        keras_files.install()
    except _patch.CompatError as e:
        report["refused"] = str(e)
    finally:
        backup_and_restore.BackupAndRestore.on_train_end = original
    report["installed_after_refusal"] = list(_patch.installed())
    return report


def run_user(args, tf, keras, np, strategy, barrier, task, task_index):
    report = {"task": task}
    report["ordered"] = _ordered_writes(tf, keras, strategy, barrier, task_index, args.out)
    _drive_callbacks_by_hand(keras, strategy, task_index, args.out)
    if task_index == 0:
        report.update(_plain_keras_and_changed_code(keras, np, args.out))
    return report


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--mode", choices=("tfdist", "user"), required=True)
    args = parser.parse_args()

    import tfdist
    import tfdist.chief

    task = tfdist.chief.task_name()
    tf = tfdist.import_tensorflow()
    if args.mode == "tfdist":
        strategy = tfdist.make_strategy("multi_worker_mirrored", join_timeout=60)
    else:
        from tfdist.compat import keras_files

        keras_files.install()  # installed, but a user's own strategy is not tfdist's
        strategy = tf.distribute.MultiWorkerMirroredStrategy()
    import keras
    import numpy as np

    from tfdist.compat.keras_files import barrier as strategy_barrier

    task_index = int(strategy.cluster_resolver.task_id)
    run = run_tfdist if args.mode == "tfdist" else run_user
    report = run(args, tf, keras, np, strategy, lambda: strategy_barrier(strategy), task,
                 task_index)
    with open(os.path.join(args.out, f"report_{task.replace(':', '')}.json"), "w") as f:
        json.dump(report, f)
    print("done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Step-granular backups: mid-epoch resume, asynchronous writes, Keras's own callback.

In this process, one replica: each resumed run is compared with the same run
uninterrupted (same data, same initial weights), which it must equal exactly.
"""

from __future__ import annotations

import io
import json
import os

import numpy as np
import pytest

STEPS, EPOCHS = 4, 3


def _data():
    from tfdist._tf import import_tensorflow

    tf = import_tensorflow()
    from tfdist.checkpoint import repeat_shuffled

    x = np.arange(96, dtype="float32").reshape(32, 3) / 96
    return repeat_shuffled(tf.data.Dataset.from_tensor_slices((x, x[:, :1] * 2)),
                           buffer_size=32, seed=0).batch(4)


def _model(strategy=None):
    import contextlib

    import keras

    with strategy.scope() if strategy is not None else contextlib.nullcontext():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4),
                                  keras.layers.Dense(1)])
        rng = np.random.default_rng(0)
        model.set_weights([rng.standard_normal(w.shape).astype("float32")
                           for w in model.get_weights()])
        model.compile(keras.optimizers.SGD(0.05, momentum=0.9), "mse")
    return model


def _stop_after(step):
    import keras

    class Stop(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if int(self.model.optimizer.iterations.numpy()) == step:
                raise KeyboardInterrupt(f"stopped after step {step}")

    return Stop()


def _batches_seen():
    import keras

    class Seen(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.batches = []

        def on_train_batch_begin(self, batch, logs=None):
            self.batches.append(batch)

    return Seen()


def _uninterrupted(strategy=None):
    model = _model(strategy)
    model.fit(_data(), epochs=EPOCHS, steps_per_epoch=STEPS, verbose=0)
    return model.get_weights()


def _max_diff(a, b):
    return max(float(np.abs(x - y).max()) for x, y in zip(a, b))


def test_save_freq_resumes_in_the_middle_of_an_epoch_exactly(tmp_path):
    import tfdist

    want = _uninterrupted()
    folder = str(tmp_path / "backup")
    model = _model()
    # Written before training goes on: the interrupted fit leaves no write in flight here.
    backup = tfdist.BackupAndRestore(folder, save_freq=3, async_write=False)
    with pytest.raises(KeyboardInterrupt):
        model.fit(backup.dataset(_data()), epochs=EPOCHS, steps_per_epoch=STEPS,
                  callbacks=[backup, _stop_after(7)], verbose=0)
    state = json.loads((tmp_path / "backup" / "tfdist_backup.json").read_text())
    assert (state["step"], state["file"]) == (6, "backup-step000000000006.npz")

    again = tfdist.BackupAndRestore(folder, save_freq=3)
    assert (again.initial_epoch, again.initial_step) == (1, 6)
    resumed, seen = _model(), _batches_seen()
    resumed.fit(again.dataset(_data()), epochs=EPOCHS, steps_per_epoch=STEPS,
                callbacks=[again, seen], verbose=0)
    # Epoch 2 runs its last 2 batches (indices 2, 3), then epoch 3 in full.
    assert seen.batches == [2, 3, 0, 1, 2, 3]
    assert int(resumed.optimizer.iterations.numpy()) == EPOCHS * STEPS
    assert _max_diff(resumed.get_weights(), want) == 0.0
    assert not os.path.exists(folder)


def test_an_asynchronous_write_holds_the_values_of_its_step(tmp_path, monkeypatch):
    """The training thread goes on while the file is written: the file must still hold the
    values the variables had at the save, not later ones."""
    import threading

    import keras

    import tfdist
    from tfdist import checkpoint

    gate, written = threading.Event(), {}
    original = checkpoint._atomic_write_bytes

    def slow(path, write):
        if path.endswith(".npz"):
            gate.wait(30)  # until training has moved on by 2 steps
            buffer = io.BytesIO()
            write(buffer)
            written[os.path.basename(path)] = buffer.getvalue()
        return original(path, write)

    monkeypatch.setattr(checkpoint, "_atomic_write_bytes", slow)
    at_save = {}

    class Record(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            step = int(self.model.optimizer.iterations.numpy())
            if step == 3:
                at_save["weights"] = self.model.get_weights()
            if step == 5:
                gate.set()

    model = _model()
    backup = tfdist.BackupAndRestore(str(tmp_path), save_freq=3, delete_on_finish=False)
    model.fit(backup.dataset(_data()), epochs=2, steps_per_epoch=STEPS,
              callbacks=[backup, Record()], verbose=0)
    with np.load(io.BytesIO(written["backup-step000000000003.npz"])) as data:
        manifest = json.loads(str(data["manifest"][()]))
        saved = {key: data[f"v{i:05d}"] for i, key in enumerate(manifest["keys"])}
    kernels = [saved[k] for k in sorted(saved) if k.startswith("model/") and "kernel" in k]
    assert len(kernels) == 2
    want = [w for w in at_save["weights"] if w.ndim == 2]
    assert any(np.array_equal(kernels[0], w) for w in want)
    assert all(any(np.array_equal(k, w) for w in want) for k in kernels)
    assert not any(np.array_equal(k, w) for k in kernels for w in model.get_weights()
                   if w.ndim == 2)  # training moved on: the final kernels differ


def test_keras_backup_and_restore_resumes_mid_epoch_under_a_tfdist_strategy(tmp_path):
    """keras.callbacks.BackupAndRestore(save_freq=3) under a tfdist strategy resumes at the
    saved batch and data position; with the fix taken out (stock Keras) it restarts the epoch
    on weights that already learned from its first steps (the negative control)."""
    import keras

    import tfdist
    from tfdist.compat import keras_backup

    def run(folder, *, fixed: bool):
        strategy = tfdist.make_strategy("one_device", device="/cpu:0")  # installs the fixes
        if not fixed:
            keras_backup.uninstall()
        model = _model(strategy)
        callback = keras.callbacks.BackupAndRestore(folder, save_freq=3)
        with pytest.raises(KeyboardInterrupt):
            model.fit(_data(), epochs=EPOCHS, steps_per_epoch=STEPS,
                      callbacks=[callback, _stop_after(7)], verbose=0)
        resumed = _model(strategy)
        resumed.fit(_data(), epochs=EPOCHS, steps_per_epoch=STEPS,
                    callbacks=[keras.callbacks.BackupAndRestore(folder, save_freq=3)],
                    verbose=0)
        return resumed.get_weights()

    with tfdist.compat.uninstall_after():
        want = _uninterrupted(tfdist.make_strategy("one_device", device="/cpu:0"))
        assert _max_diff(run(str(tmp_path / "fixed"), fixed=True), want) == 0.0
        assert _max_diff(run(str(tmp_path / "stock"), fixed=False), want) > 1e-3


def test_bad_arguments_and_a_changed_steps_per_execution_are_clear_errors(tmp_path):
    import tfdist
    from tfdist.compat import keras_resume

    with pytest.raises(ValueError, match=r"save_freq must be 'epoch' or a number of steps >= "
                                         r"1. Received: save_freq=0"):
        tfdist.BackupAndRestore(str(tmp_path), save_freq=0)
    with pytest.raises(ValueError, match=r"save_freq must be .* Received: save_freq='steps'"):
        tfdist.BackupAndRestore(str(tmp_path), save_freq="steps")
    with pytest.raises(ValueError, match=r"the backup was taken after 3 steps of an epoch, "
                                         r"which is not a multiple of steps_per_execution=2"):
        keras_resume.start_next_epoch_at(3, steps_per_execution=2)
    keras_resume.clear()

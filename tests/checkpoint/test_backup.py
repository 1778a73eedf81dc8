"""tfdist.BackupAndRestore in one process: keys by object path, damaged backups, warnings.

The multi-process kill-and-restart runs are in tests/multi_worker/test_end_to_end.py;
tests/checkpoint/backup_corpus.py holds the damaged-backup corpus (also runnable on
its own to count outcomes for any tfdist version).
"""

import json
import os
import warnings

import numpy as np
import pytest

from tests.checkpoint import backup_corpus as corpus
from tests.support import run_python


def _data(n=16, features=3, seed=0):
    import tensorflow as tf

    from tfdist.checkpoint import repeat_shuffled

    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, features)).astype("float32")
    y = x.sum(axis=1, keepdims=True)
    return repeat_shuffled(tf.data.Dataset.from_tensor_slices((x, y)), buffer_size=n,
                           seed=1).batch(4)


def _two_branch(order: str):
    """Two same-shape Dense layers created in `order`; call() always adds a(x) + b(x)."""
    import keras

    class TwoBranch(keras.Model):
        def __init__(self):
            super().__init__()
            for name in order:
                layer = keras.layers.Dense(4)
                layer.build((None, 3))
                setattr(self, name, layer)
            self.head = keras.layers.Dense(1)
            self.head.build((None, 4))

        def call(self, x):
            return self.head(self.a(x) + self.b(x))

    model = TwoBranch()
    model(np.zeros((1, 3), "float32"))
    rng = np.random.default_rng(0)
    for layer in (model.a, model.b, model.head):  # the same values whatever the order
        layer.set_weights([rng.standard_normal(w.shape).astype("float32")
                           for w in layer.get_weights()])
    model.compile(keras.optimizers.SGD(0.05, momentum=0.9), "mse")
    return model


def _by_layer(model):
    return {name: [w.copy() for w in getattr(model, name).get_weights()]
            for name in ("a", "b", "head")}


def test_reordered_same_shape_variables_restore_to_the_right_place(tmp_path):
    """Saved by position (the old format), a and b (and their momentum) swap silently."""
    import tfdist

    reference = _two_branch("ab")
    reference.fit(_data(), epochs=2, steps_per_epoch=2, verbose=0, shuffle=False)

    first = _two_branch("ab")
    backup = tfdist.BackupAndRestore(str(tmp_path), delete_on_finish=False)
    first.fit(backup.dataset(_data()), epochs=1, steps_per_epoch=2, callbacks=[backup],
              verbose=0, shuffle=False)

    resumed = _two_branch("ba")  # variables (and optimizer slots) created in the other order
    assert [v.shape for v in resumed.trainable_variables] == [
        v.shape for v in first.trainable_variables]
    assert resumed.trainable_variables[0] is resumed.b.kernel  # the other order
    again = tfdist.BackupAndRestore(str(tmp_path), delete_on_finish=False)
    resumed.fit(again.dataset(_data()), epochs=2, steps_per_epoch=2, callbacks=[again],
                verbose=0, shuffle=False)

    # The momentum restored to the right slot too: epoch 2 from the backup equals epoch 2
    # of the uninterrupted run (same data, same order of operations).
    expected, got = _by_layer(reference), _by_layer(resumed)
    for name in ("a", "b", "head"):
        for e, g in zip(expected[name], got[name]):
            np.testing.assert_allclose(g, e, rtol=0, atol=1e-6, err_msg=name)


def test_keys_are_object_paths_and_include_state_on_the_optimizer():
    import keras

    from tfdist.checkpoint import tracked_variables

    model = _two_branch("ab")
    model.optimizer.build(model.trainable_variables)
    # How another component's state joins the backup: a variable held as an attribute.
    model.optimizer.tfdist_residuals = [keras.Variable(np.zeros((3, 4), "float32"),
                                                       trainable=False, name="residual")]
    keys = list(tracked_variables(model))
    assert "model/a/_kernel" in keys and "model/b/bias" in keys
    assert "optimizer/slots/model/a/_kernel/momentum" in keys
    assert "optimizer/_iterations" in keys
    assert "optimizer/tfdist_residuals/0" in keys
    assert len(keys) == len(set(keys)) == 6 + 6 + 2 + 1


def test_backup_warns_once_when_the_dataset_cannot_resume_exactly(tmp_path):
    import tensorflow as tf

    import tfdist
    from tfdist import checkpoint

    checkpoint._warned.clear()
    # The case is a shuffle with no seed at all: an earlier test in this process may have set
    # TensorFlow's global seed (keras.utils.set_random_seed), which seeds every later shuffle.
    tf.random.set_seed(None)
    examples = tf.data.Dataset.from_tensor_slices(np.zeros((8, 3), "float32"))
    backup = tfdist.BackupAndRestore(str(tmp_path))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        backup.dataset(examples.shuffle(60000).repeat().batch(4))
        backup.dataset(examples.shuffle(60000).repeat().batch(4))
        backup.dataset(checkpoint.repeat_shuffled(examples, buffer_size=8, seed=1).batch(4))
        backup.dataset(examples.shuffle(8, seed=1, reshuffle_each_iteration=False).repeat())
    messages = [str(w.message) for w in caught if "tfdist.BackupAndRestore" in str(w.message)]
    assert len(messages) == 1, messages
    assert "reshuffle_each_iteration=True" in messages[0]
    assert "a shuffle without a seed" in messages[0]
    assert "tfdist.checkpoint.repeat_shuffled" in messages[0]


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    return corpus.prepare(str(tmp_path_factory.mktemp("corpus")))


@pytest.mark.parametrize("name", list(corpus.CASES))
def test_damaged_backup_fails_loudly(name, template, tmp_path):
    if name.startswith("pointer unreadable") and os.geteuid() == 0:
        pytest.skip("root reads a file whatever its mode")
    outcome, detail = corpus.run_case(name, template, str(tmp_path))
    assert outcome == corpus.CASES[name][1], detail
    if outcome == "clean":
        assert "\n" not in detail and str(tmp_path) in detail, detail


def test_an_undamaged_backup_resumes_exactly(template, tmp_path):
    import shutil

    folder = os.path.join(str(tmp_path), "backup")
    shutil.copytree(template, folder)
    saved = [np.asarray(w, "float32")
             for w in json.load(open(os.path.join(template, "..", "saved.json")))]
    assert corpus.resume(folder, saved) == ("ok", "resumed exactly")


def test_an_old_positional_backup_is_refused(tmp_path):
    import tfdist
    from tfdist.checkpoint import BackupError

    (tmp_path / "backup-epoch000001.npz").write_bytes(b"")
    (tmp_path / "tfdist_backup.json").write_text(json.dumps(
        {"format": 1, "epoch": 1, "steps_per_epoch": 2, "file": "backup-epoch000001.npz",
         "num_variables": 4}))
    with pytest.raises(BackupError, match="older tfdist that saved variables by position"):
        tfdist.BackupAndRestore(str(tmp_path))


def test_a_diverged_epoch_is_not_backed_up(tmp_path):
    import keras

    import tfdist

    model = _two_branch("ab")

    class Diverge(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            if epoch == 1:
                self.model.a.kernel.assign(np.full((3, 4), np.nan, "float32"))

    backup = tfdist.BackupAndRestore(str(tmp_path), delete_on_finish=False)
    with pytest.warns(RuntimeWarning, match=r"not backing up step 4 \(end of epoch 2\): variable "
                                            r"model/a/_kernel holds NaN or Inf .*the backup of "
                                            r"step 2 \(end of epoch 1\) is kept"):
        model.fit(backup.dataset(_data()), epochs=2, steps_per_epoch=2,
                  callbacks=[Diverge(), backup], verbose=0, shuffle=False)
    assert json.loads((tmp_path / "tfdist_backup.json").read_text())["step"] == 2
    assert sorted(os.listdir(tmp_path)) == ["backup-step000000000002.npz", "tfdist_backup.json"]


def test_an_unwritable_backup_dir_is_a_clear_error(tmp_path):
    import tfdist
    from tfdist.checkpoint import BackupError

    (tmp_path / "file").write_text("x")
    model = _two_branch("ab")
    backup = tfdist.BackupAndRestore(str(tmp_path / "file" / "backup"))
    with pytest.raises(BackupError, match=r"cannot write the backup of step 2 \(end of epoch "
                                          r"1\) to .*file/backup"):
        model.fit(backup.dataset(_data()), epochs=1, steps_per_epoch=2, callbacks=[backup],
                  verbose=0, shuffle=False)


def test_finishing_removes_only_the_backups_own_files(tmp_path):
    import tfdist

    (tmp_path / "notes.txt").write_text("the user's")
    (tmp_path / ".tmp-left-by-a-killed-save").write_bytes(b"partial")
    model = _two_branch("ab")
    backup = tfdist.BackupAndRestore(str(tmp_path))
    model.fit(backup.dataset(_data()), epochs=2, steps_per_epoch=2, callbacks=[backup],
              verbose=0, shuffle=False)
    assert os.listdir(tmp_path) == ["notes.txt"]


def test_a_save_that_dies_half_way_keeps_the_previous_backup(tmp_path, monkeypatch):
    import tfdist
    from tfdist import checkpoint

    original = checkpoint._atomic_write_bytes

    class Killed(BaseException):
        pass

    def dies_in_epoch_2(path, write):
        if path.endswith("backup-step000000000004.npz"):
            def half(f):
                f.write(b"PK\x03\x04 half")
                raise Killed()
            return original(path, half)
        return original(path, write)

    monkeypatch.setattr(checkpoint, "_atomic_write_bytes", dies_in_epoch_2)
    model = _two_branch("ab")
    backup = tfdist.BackupAndRestore(str(tmp_path), delete_on_finish=False)
    with pytest.raises(Killed):
        model.fit(backup.dataset(_data()), epochs=3, steps_per_epoch=2, callbacks=[backup],
                  verbose=0, shuffle=False)
    assert sorted(os.listdir(tmp_path)) == ["backup-step000000000002.npz", "tfdist_backup.json"]
    assert tfdist.BackupAndRestore(str(tmp_path)).initial_epoch == 1


def test_keys_cover_what_keras_lists_dropout_state_and_a_wrapped_optimizer():
    import keras

    from tfdist.checkpoint import tracked_variables

    inputs = keras.Input((3,))
    hidden = keras.layers.Dropout(0.5)(keras.layers.Dense(4, name="hid")(inputs))
    model = keras.Model(inputs, keras.layers.Dense(1, name="out")(hidden))
    model.compile(keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(momentum=0.5)),
                  "mse")
    model.optimizer.build(model.trainable_variables)
    keys = tracked_variables(model)
    wanted = {id(v) for v in model.variables + model.optimizer.variables}
    assert wanted <= {id(v) for v in keys.values()}
    assert any(k.startswith("model/keras_path/seed_generator") for k in keys)
    assert sum(k.startswith("optimizer/slots/model/") for k in keys) == 4


def test_repeat_shuffled_works_under_a_global_seed_of_zero():
    # keras.utils.set_random_seed(0) is in many users' scripts. TensorFlow's
    # random_seed.get_seed compares (global seed, op seed) with (0, 0) in Python, so a
    # per-pass tensor seed fails to trace under global seed 0 (upstream behaviour: the
    # plain pattern below); repeat_shuffled must not, and its order depends on `seed` only.
    result = run_python("-c", """
import tfdist
tf = tfdist.import_tensorflow()
from tfdist.checkpoint import repeat_shuffled

def order(global_seed):
    tf.random.set_seed(global_seed)
    ds = repeat_shuffled(tf.data.Dataset.range(6), buffer_size=6, seed=3)
    return [int(v) for v in ds.take(12)]

orders = [order(None), order(0), order(5)]
print("equal", orders[0] == orders[1] == orders[2], "passes differ", orders[0][:6] != orders[0][6:])
tf.random.set_seed(0)
base = tf.data.Dataset.range(6)
try:
    tf.data.Dataset.range(2).flat_map(
        lambda e: base.shuffle(6, seed=3 + e, reshuffle_each_iteration=False))
    print("plain pattern traced")
except Exception as e:
    print("plain pattern failed:", type(e).__name__)
""", timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert "equal True passes differ True" in result.stdout, result.stdout
    # Upstream canary: when TensorFlow stops failing here, the workaround can go.
    assert "plain pattern failed: OperatorNotAllowedInGraphError" in result.stdout, result.stdout

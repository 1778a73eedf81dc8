"""Keras's own file writers under multi_worker_mirrored: one intact file, the chief's.

Two launches of tests/checkpoint/run_keras_files.py with 2 workers: the preset (3
rounds of every writer, Keras's BackupAndRestore interrupted and resumed, the
ordered-write probe with the fixes and, as a negative control, without them)
and a user's own MultiWorkerMirroredStrategy (the fixes must not apply: the
collision is still there; a model with no strategy saves as stock Keras; a
changed Keras is refused). Every saved file is
loaded in a plain process (Keras only, no tfdist) and must predict what the
trained model predicts.
"""

import io
import json
import os
import sys

import numpy as np
import pytest

from tfdist import launch as launch_lib
from tests.support import REPO, alive, run_python

SCRIPT = os.path.join(REPO, "tests", "checkpoint", "run_keras_files.py")

_LOADER = r"""
import json, os, sys
import numpy as np
import keras, tensorflow as tf
from tests.checkpoint import keras_files_model as mdl

out = sys.argv[1]
x = mdl.probe()
preds = {}
for name in ("ckpt.weights.h5", "direct.weights.h5"):
    model = mdl.build(seed=9)
    model.load_weights(os.path.join(out, name))
    preds[name] = model.predict(x, verbose=0).tolist()
model = mdl.build(seed=9)
model.load_weights(os.path.join(out, "sharded", "sharded.weights.json"))
preds["sharded.weights.json"] = model.predict(x, verbose=0).tolist()
for name in ("ckpt.keras", "ckpt.h5", "direct.keras", "function.keras", "direct.h5"):
    model = keras.saving.load_model(os.path.join(out, name), compile=False)
    preds[name] = model.predict(x, verbose=0).tolist()
exported = tf.saved_model.load(os.path.join(out, "export"))
preds["export"] = exported.serve(x).numpy().tolist()
print(json.dumps(preds))
"""


def _launch(out, scratch, mode):
    stdout, stderr = io.StringIO(), io.StringIO()
    env = dict(os.environ, PYTHONPATH=REPO, TFDIST_SCRATCH_DIR=str(scratch))
    result = launch_lib.launch([sys.executable, SCRIPT, "--out", str(out), "--mode", mode],
                               num_workers=2, timeout=240, grace_period=3.0, env=env,
                               stdout=stdout, stderr=stderr)
    assert all(not alive(t.pid) for t in result.tasks)
    text = stdout.getvalue() + stderr.getvalue()
    assert result.returncode == 0, text[-4000:]
    return [json.loads((out / f"report_worker{i}.json").read_text()) for i in (0, 1)]


def _event_files(folder):
    return [n for n in os.listdir(folder) if n.startswith("events.out.tfevents")]


@pytest.mark.timeout(300)
def test_every_keras_writer_leaves_one_intact_file_the_chiefs(tmp_path):
    out, scratch = tmp_path / "out", tmp_path / "scratch"
    out.mkdir()
    scratch.mkdir()
    chief, other = _launch(out, scratch, "tfdist")

    # Both workers trained the same model; each round's files held that round's weights.
    np.testing.assert_array_equal(np.load(out / "preds_worker0.npy"),
                                  np.load(out / "preds_worker1.npy"))
    rounds = {k: v for k, v in chief.items() if k.startswith("round")}
    assert len(rounds) == 3 * 7 and max(rounds.values()) == 0.0, rounds

    # Every final file loads in a plain process and predicts what the trained model does.
    loaded = run_python("-c", _LOADER, str(out), timeout=120)
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    expected = np.load(out / "preds_worker0.npy")
    for name, preds in json.loads(loaded.stdout.strip().splitlines()[-1]).items():
        np.testing.assert_allclose(np.asarray(preds), expected, rtol=0, atol=1e-5,
                                   err_msg=name)

    # One event file per fit and per run (train, validation); one CSV row per epoch.
    for run in ("train", "validation"):
        assert len(_event_files(out / "tb" / run)) == 3, os.listdir(out / "tb" / run)
    rows = (out / "log.csv").read_text().splitlines()
    assert rows[0].startswith("epoch,") and len(rows) == 1 + 3, rows

    # Keras's BackupAndRestore: the chief's backup, restored on every worker, exact; from
    # the previous backup (.bkp) when the latest is damaged.
    for report in (chief, other):
        assert report["interrupted"] == "interrupted"
        assert report["backup_files"] == [
            "latest.weights.h5", "latest.weights.h5.bkp", "training_metadata.json",
            "training_metadata.json.bkp"]
        assert report["resumed_epochs"] == [2] and report["from_bkp_epochs"] == [1, 2]
        for name in ("resumed", "from_bkp"):
            assert report[f"{name}_vs_uninterrupted"] <= 1e-6, report
            assert not report[f"{name}_backup_left"]
    assert chief["weights"] == other["weights"]

    # Ordered probe: worker 1 wrote last, yet the files hold the chief's weights...
    assert set(chief["ordered"].values()) == {0}, chief["ordered"]
    # ...and without the fixes (negative control) worker 1's write reaches the path.
    assert len(chief["uninstalled"]) == 10
    assert set(chief["ordered_unpatched"].values()) == {1}, chief["ordered_unpatched"]

    # Saving then loading on every worker (keras.io's pattern) reads the chief's file even
    # when the chief is slow to write; without the barrier after its write (negative
    # control) worker 1's load comes first and fails.
    assert chief["save_then_load"] == {"fixed": "loaded", "unfixed": "loaded"}, chief
    assert other["save_then_load"]["fixed"] == "loaded", other
    assert other["save_then_load"]["unfixed"] != "loaded", other

    # Nothing else was written: no partial siblings, no scratch left behind.
    expected_files = {
        "ckpt.weights.h5", "ckpt.keras", "ckpt.h5", "tb", "log.csv", "direct.weights.h5",
        "sharded", "function.keras", "direct.keras", "direct.h5", "export", "ordered",
        "unpatched", "save_load", "preds_worker0.npy",
        "preds_worker1.npy", "report_worker0.json", "report_worker1.json"}
    assert set(os.listdir(out)) == expected_files
    assert sorted(os.listdir(out / "ordered")) == [
        "ordered.h5", "ordered.keras", "ordered.weights.h5", "ordered_export"]
    assert sorted(os.listdir(out / "tb")) == ["train", "validation"]
    assert os.listdir(scratch) == [], os.listdir(scratch)


@pytest.mark.timeout(300)
def test_a_users_own_strategy_is_untouched_and_plain_keras_passes_through(tmp_path):
    out, scratch = tmp_path / "out", tmp_path / "scratch"
    out.mkdir()
    scratch.mkdir()
    chief, _ = _launch(out, scratch, "user")
    # The collision Keras 3 has, unchanged: worker 1's writes land on the chief's paths,
    # and each worker adds its own TensorBoard event file and rewrites the CSV.
    assert set(chief["ordered"].values()) == {1}, chief["ordered"]
    assert len(_event_files(out / "tb" / "train")) == 2
    assert os.listdir(scratch) == []
    # With the fixes installed, a model without a strategy saves as stock Keras does...
    assert chief["plain_files"] == ["m.keras", "m.weights.h5", "tb"]
    assert chief["plain_role"] is None and chief["uninstalled"] == 10
    # ...and a Keras whose code changed under a fix is refused, all or nothing.
    assert "on_train_end takes (logs, extra); the tfdist fix was written for (logs)" in \
        chief["refused"], chief["refused"]
    assert chief["installed_after_refusal"] == []


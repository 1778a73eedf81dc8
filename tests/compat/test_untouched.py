"""tfdist changes nothing in a process that it was not asked to change.

- After making the presets in a process, plain Keras code there (fit /
  evaluate / predict, a custom GradientTape loop, a mixed_float16 model (Keras's
  LossScaleOptimizer), saving and loading every public way:
  `save`/`load_model` (.keras, .h5), `save_weights`/`load_weights`,
  `export`, ModelCheckpoint/CSVLogger/BackupAndRestore, `steps_per_execution`;
  a user's own MirroredStrategy made afterwards, SavedModels of both from
  `model.export` and `tf.saved_model.save`, served) gives results
  bit-identical to a process that never imported tfdist. Negative controls:
  opting the plain optimizers in to tfdist's sparse-gradient fix changes every
  result, and a pass-through `compile` on Keras's TensorFlowTrainer (where the
  parameter-server fix once sat) makes `load_model` return uncompiled models,
  so the comparison sees a fix that applies where it should not.
- `tfdist.compat.uninstall()` puts back every TensorFlow/Keras function,
  method and class attribute that making the presets replaced.

Every process is a subprocess (tests/compat/run_untouched.py), two at a time.
"""

from __future__ import annotations

import concurrent.futures
import os

import numpy as np
import pytest

from tests.support import REPO, run_python
from tfdist.compat import keras_array_input

RUN = os.path.join(REPO, "tests", "compat", "run_untouched.py")

# One process per entry, each making these presets in turn before the plain Keras code runs.
# multi_worker_mirrored: one worker (no TF_CONFIG); parameter_server: an in-process cluster.
# The synchronous presets share a process, which then holds every fix any of them installs
# (measured: default, and auto, which picks default with no GPU or cluster, install none;
# one_device's are a subset of mirrored's, and mirrored's of multi_worker_mirrored's). A fix
# that changed plain Keras shows there whatever else is installed beside it. The parameter
# server's fixes get a process of their own: its in-process cluster changes the devices.
PRESETS = {"synchronous": "multi_worker_mirrored,mirrored,one_device,default,auto",
           "parameter_server": "parameter_server"}

# After an in-process parameter-server cluster starts, this process is task chief:0 of a
# cluster, and TensorFlow's collectives no longer find the local devices a MirroredStrategy
# names ("Failed to find device /job:chief/replica:0/task:0/device:CPU:1"): stock
# TensorFlow does the same with the PS tutorial's own in-process cluster, so that part of
# the workload is not run there.
NO_USER_MIRRORED = ("parameter_server",)

# The parameter_server preset's `ps_fit.compile` replaces `TensorFlowTrainer.compile`, and
# Keras's `compile_from_config` skips compiling a loaded model whose class overrides `compile`
# (`self.__class__.compile != Trainer.compile`): after that preset, `keras.saving.load_model`
# returns plain models uncompiled (measured: the loaded model's `jit_compile` and `predict`
# differ). Those keys are left out for that preset until the fix stops replacing `compile`.
LOADED_UNCOMPILED = {"parameter_server": ("xla/loaded_jit_compile", "xla/loaded_predict")}


def _run(name: str, args: list[str], tmp_path) -> tuple[str, dict[str, np.ndarray], str]:
    out = tmp_path / f"{name}.npz"
    result = run_python(RUN, *args, "--out", str(out), timeout=300)
    assert result.returncode == 0, f"{name}:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}"
    with np.load(out) as data:
        return name, {k: data[k] for k in data.files}, result.stdout


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_plain_keras_is_bit_identical_after_every_preset(tmp_path):
    runs = {"reference": ["--preset", "none"]}
    for preset, names in PRESETS.items():
        runs[preset] = ["--preset", names] + (
            ["--no_user_mirrored"] if preset in NO_USER_MIRRORED else [])
    runs["negative_control"] = ["--preset", "mirrored", "--opt_in"]
    runs["shadow_compile"] = ["--preset", "none", "--shadow_compile"]
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        results = {name: (arrays, stdout) for name, arrays, stdout in
                   pool.map(lambda item: _run(*item, tmp_path), runs.items())}

    reference, _ = results.pop("reference")
    assert not reference.pop("tfdist_imported"), "the reference process imported tfdist"
    assert reference["user_mirrored/class_key_base"] == 0
    assert reference["user_mirrored/key_base"] == 0
    control, _ = results.pop("negative_control")
    changed = [k for k in reference if not np.array_equal(reference[k], control[k])]
    assert "fit/weight0" in changed and "loop/weight0" in changed, (
        "negative control: the opted-in sparse-gradient fix should change the embedding "
        f"weights; changed: {changed}")
    shadowed, _ = results.pop("shadow_compile")
    shadowed.pop("tfdist_imported")
    changed = {k for k in reference if not np.array_equal(reference[k], shadowed[k])}
    assert {"files/keras/evaluate", "files/checkpoint/evaluate"} <= changed, (
        "negative control: a compile installed on TensorFlowTrainer should leave loaded "
        f"models uncompiled; changed: {sorted(changed)}")
    assert "No loss to compute" in str(shadowed["files/keras/evaluate"])

    for preset, (arrays, stdout) in results.items():
        assert arrays.pop("tfdist_imported")
        assert "made " in stdout, stdout
        expected = {k for k in reference
                    if preset not in NO_USER_MIRRORED or not k.startswith("user_mirrored/")}
        assert set(arrays) == expected, preset
        different = [k for k in sorted(expected)
                     if k not in LOADED_UNCOMPILED.get(preset, ())
                     and (arrays[k].dtype != reference[k].dtype
                          or not np.array_equal(arrays[k], reference[k]))]
        assert not different, (
            f"after making {PRESETS[preset]}, plain Keras differs from a process "
            f"without tfdist in: {different}\n{stdout}")


_SNAPSHOT = r'''
import sys, types

def snapshot():
    """Every function of every loaded TensorFlow/Keras module, and every class attribute."""
    out = {}
    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith(("keras", "tensorflow", "tf_keras")):
            continue
        for key, value in list(vars(module).items()):
            if isinstance(value, types.FunctionType):
                out[(name, key)] = value
            elif isinstance(value, type) and value.__module__ == name:
                for attribute, member in list(vars(value).items()):
                    # ABC caches and lazily created __annotations__ change by themselves.
                    if not attribute.startswith("_abc") and attribute != "__annotations__":
                        out[(name, key, attribute)] = member
    return out


def differences(before, after):
    """Keys whose value is not the same object any more (or is gone), and added class members."""
    changed = sorted(".".join(k) for k in before if after.get(k, before) is not before[k]
                     or k not in after)
    classes = {k[:2] for k in before if len(k) == 3}
    added = sorted(".".join(k) for k in after if k not in before and k[:2] in classes)
    return changed, added
'''


_UNINSTALL = _SNAPSHOT + r'''
import os, sys
os.environ.pop("TF_CONFIG", None)
import tfdist
tfdist.configure_logical_devices(2)
import tensorflow as tf, keras
from tfdist.compat import placed_training

before = snapshot()
with tfdist.compat.uninstall_after():
    tfdist.make_strategy("mirrored", num_devices=2)
    placed_training.colocate_optimizer_slots(keras.optimizers.Adam())
    block = tfdist.compat.installed()
print("inside the block:", ",".join(block))
print("after the block: %s | %s" % tuple(",".join(d) for d in differences(before, snapshot())))

for preset in sys.argv[1:]:
    options = {"mirrored": {"num_devices": 2},
               "parameter_server": {"local_workers": 1, "local_ps": 2, "shard_count": 2}}
    tfdist.make_strategy(preset, **options.get(preset, {}))
placed_training.colocate_optimizer_slots(keras.optimizers.Adam())
print("installed:", ",".join(tfdist.compat.installed()))
print("replaced:", ",".join(differences(before, snapshot())[0]))
print("uninstalled:", ",".join(tfdist.compat.uninstall()))
changed, added = differences(before, snapshot())
print("changed:", ",".join(changed))
print("added:", ",".join(added))
'''


def _uninstall_run(*presets: str) -> dict[str, str]:
    result = run_python("-c", _UNINSTALL, *presets, timeout=240)
    out = result.stdout
    assert result.returncode == 0, out[-3000:] + result.stderr[-3000:]
    lines = dict(line.split(": ", 1) for line in out.splitlines() if ": " in line)
    assert set(lines["inside the block"].split(",")) >= {
        "optimizer_update.backend_update_step", "placed_training.optimizer_slots"}, out
    assert lines["after the block"] == " | ", out  # uninstall_after() restored everything
    assert lines["replaced"], "making the presets replaced nothing?\n" + out
    assert set(lines["uninstalled"].split(",")) == set(lines["installed"].split(","))
    assert lines["changed"] == "" and lines["added"] == "", (
        "after tfdist.compat.uninstall(), TensorFlow/Keras still differ from before tfdist "
        f"made its presets (a replacement made outside tfdist.compat._patch?):\n{out}")
    return lines


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_uninstall_restores_every_original():
    lines = _uninstall_run("mirrored", "multi_worker_mirrored", "one_device", "auto")
    assert {"keras_build.symbolic_build", "keras_multi_worker.reduce_per_replica",
            "keras_log_reduction.reduce_per_replica", "optimizer_update.backend_update_step",
            "placed_training.optimizer_slots", *keras_array_input.NAMES} <= set(
        lines["installed"].split(","))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_uninstall_restores_the_parameter_server_fixes():
    # Needs the parameter-server fixes (tfdist/compat/ps_*.py) to go through _patch.
    _uninstall_run("parameter_server")

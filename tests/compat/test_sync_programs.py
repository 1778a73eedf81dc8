"""Users' program patterns under the synchronous presets train as on one device.

The patterns (shrunk, offline versions of keras.io and KerasHub programs) run in
fresh processes, tests/compat/run_sync_programs.py: one on 2 logical CPUs under
`mirrored` and its ZeRO-1/ZeRO-2 variants. Every equality is against the same
pattern, seed, initial weights and global batch on ONE device (plain Keras);
every replica's copy must be identical. Negative controls run the same pattern
under a stock `tf.distribute.MirroredStrategy` (Keras as released: the upstream
bug still there) and under tfdist's strategy with the fix taken out.
"""

from __future__ import annotations

import json
import os
import re

import pytest

from tests.support import REPO, run_python

RUN = os.path.join(REPO, "tests", "compat", "run_sync_programs.py")
TFDIST_PRESETS = ("mirrored", "zero1", "zero2")
# Float32 weights after 3 SGD steps: different summation orders, nothing more.
TOLERANCE = 1e-6

pytestmark = pytest.mark.timeout(900)


def _results(proc) -> dict:
    match = re.search(r"^RESULTS (.*)$", proc.stdout, re.MULTILINE)
    assert proc.returncode == 0 and match, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(match.group(1))


@pytest.fixture(scope="module")
def mirrored():
    return _results(run_python(RUN, "mirrored", timeout=840))


def _assert_equals_one_device(results, pattern, preset):
    key = f"{pattern}.{preset}"
    assert f"{key}.error" not in results, results[f"{key}.error"]
    for what in ("vs_one_device", "loss_vs_one_device", "evaluate_vs_one_device",
                 "predict_vs_one_device"):
        assert results[f"{key}.{what}"] <= TOLERANCE, (key, what, results[f"{key}.{what}"])
    assert results[f"{key}.spread"] == 0.0, (key, results[f"{key}.spread"])


@pytest.mark.parametrize("preset", TFDIST_PRESETS)
@pytest.mark.parametrize("pattern", ["string", "bool"])
def test_string_and_bool_inputs_train_evaluate_and_predict_as_on_one_device(mirrored, pattern,
                                                                            preset):
    # TextVectorization inside the model fed raw strings (keras.io's end-to-end text
    # classifier), and a KerasHub-style dict with a bool padding mask.
    _assert_equals_one_device(mirrored, pattern, preset)


@pytest.mark.parametrize("pattern,dtype", [("string", "string"), ("bool", "bool")])
def test_string_and_bool_negative_controls_fail_in_the_symbolic_build(mirrored, pattern, dtype):
    # Stock Keras under TensorFlow's MirroredStrategy (tensorflow/tensorflow#80951), and
    # tfdist's strategy without keras_build's fix: the first batch's MEAN reduce has no
    # string/bool kernel.
    for preset in ("stock", "unfixed"):
        error = mirrored[f"{pattern}.{preset}.error"]
        assert f"Value for attr 'T' of {dtype} is not in the list of allowed values" in error, (
            preset, error)

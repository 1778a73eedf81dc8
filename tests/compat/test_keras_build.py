"""keras_build.symbolic_build reads nothing from the data: a generator, a shuffled PyDataset
and a shuffled tf.data pipeline train under `mirrored` exactly as on one device.

Keras's own `_maybe_symbolic_build` pulls a first batch through an iterator it then drops
(tests/compat/run_build_reads_nothing.py). Negative controls: a stock MirroredStrategy (Keras as
released; a canary: if it stops failing, Keras fixed it) and tfdist's strategy with the fix
taken out.
"""

from __future__ import annotations

import json
import re

import pytest

from tests.support import run_python

TOLERANCE = 1e-6
BATCHES = 16


@pytest.fixture(scope="module")
def results() -> dict:
    proc = run_python("tests/compat/run_build_reads_nothing.py", timeout=600)
    match = re.search(r"^RESULTS (.*)$", proc.stdout, re.MULTILINE)
    assert proc.returncode == 0 and match, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(match.group(1))


@pytest.mark.timeout(660)
@pytest.mark.parametrize("name", ["generator", "py_dataset", "tf_data"])
def test_the_fixed_build_trains_as_one_device(results, name):
    one, fixed = results[f"{name}.one_device"], results[f"{name}.tfdist"]
    assert fixed["steps"] == one["steps"] == BATCHES
    assert fixed["served"] == one["served"]  # the same batches, in the same order
    assert fixed["vs_one_device"] <= TOLERANCE, fixed


@pytest.mark.timeout(660)
@pytest.mark.parametrize("way", ["stock", "unfixed"])
def test_without_the_fix_the_build_reads_data_the_epoch_then_lacks(results, way):
    # A one-pass generator: the build's iterator takes batches that the epoch never sees.
    generator = results[f"generator.{way}"]
    assert generator["steps"] < BATCHES, (
        f"{way}: the generator trained all {BATCHES} steps: Keras no longer reads the first "
        "batch in _maybe_symbolic_build; keras_build's fix may only need its other parts")
    assert generator["vs_one_device"] > 1e-3
    # A shuffled PyDataset: the build draws an order, the epoch another one.
    py_dataset = results[f"py_dataset.{way}"]
    assert py_dataset["served"] != results["py_dataset.one_device"]["served"]
    assert py_dataset["vs_one_device"] > 1e-3
    # A shuffled tf.data pipeline: the build's pass takes the first order.
    assert results[f"tf_data.{way}"]["vs_one_device"] > 1e-3

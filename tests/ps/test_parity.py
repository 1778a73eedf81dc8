"""Users' programs under the parameter_server preset equal one device when there is one worker.

tests/ps/run_parity_launch.py runs every program of tests/ps/parity_programs.py
under `tfdist launch --num_workers=1 --num_ps=1 --chief` (worker and ps in
processes of their own) and, in the chief's process, with no strategy. With
one worker the steps run one after another, so every logged loss must equal
one device's to 4 decimals, the step counts exactly, and the final weights
within 1e-5. The same programs run asynchronously on two workers in
tests/ps/run_parity_cases.py (through tests/ps/test_fit.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tests.support import REPO
from tests.ps import parity_programs

LOSS_DECIMALS = 4
WEIGHT_TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    out = tmp_path_factory.mktemp("parity")
    cmd = [sys.executable, "-m", "tfdist.launch", "--num_workers=1", "--num_ps=1", "--chief",
           "--timeout=420", "--grace_period=3", "--", sys.executable,
           os.path.join(REPO, "tests", "ps", "run_parity_launch.py"), str(out)]
    proc = subprocess.run(cmd, cwd=REPO, env=dict(os.environ, PYTHONPATH=REPO),
                          capture_output=True, text=True, timeout=480)
    lines = {}
    for line in proc.stdout.splitlines():
        if "PARITY " in line:
            entry = json.loads(line.split("PARITY ", 1)[1])
            lines[entry["program"]] = entry
    assert proc.returncode == 0 and lines, proc.stdout[-6000:] + proc.stderr[-3000:]
    return lines


@pytest.mark.slow
@pytest.mark.timeout(540)
@pytest.mark.parametrize("name", list(parity_programs.PROGRAMS))
def test_one_worker_equals_one_device(name, launched):
    if name.startswith("gpt2"):
        pytest.importorskip("keras_hub", reason="KerasHub is an optional test dependency")
    entry = launched.get(name)
    assert entry is not None, f"{name} printed no result"
    assert "error" not in entry, entry.get("traceback", entry.get("error"))
    one, ps = entry["one_device"], entry["parameter_server"]
    assert ps["steps"] == one["steps"], (ps["steps"], one["steps"])
    expected_steps = parity_programs.PROGRAMS[name][1]
    assert expected_steps is None or one["steps"] == expected_steps
    assert len(ps["losses"]) == len(one["losses"])
    assert [round(v, LOSS_DECIMALS) for v in ps["losses"]] == [
        round(v, LOSS_DECIMALS) for v in one["losses"]], (ps["losses"], one["losses"])
    assert entry["weights"] <= WEIGHT_TOLERANCE, entry["weights"]
    # What else a program logged: epochs run, learning rates, files written, predictions.
    for key in ("epochs", "tensorboard", "loaded_compiled"):
        assert ps.get(key) == one.get(key), key
    for key, tolerance in (("learning_rates", 1e-9), ("predictions", 1e-5)):
        if key in one:
            np.testing.assert_allclose(ps[key], one[key], rtol=0, atol=tolerance, err_msg=key)
    # A mid-epoch checkpoint under parameter-server training holds the variables as they
    # stand when the coordinator reaches that batch (steps scheduled before it may still be
    # running), so only its existence and loading are compared.
    if "checkpoints" in one:
        assert ps["checkpoints"] and len(ps["loaded_losses"]) == len(one["loaded_losses"])


def test_an_op_missing_on_a_worker_is_explained():
    from tfdist.ps.errors import missing_worker_ops_explained

    raw = ("Graph execution error:\n\nDetected at node ParallelMapDatasetV2/_45\n"
           "Op type not registered 'RegexSplitWithOffsets' in binary running on vm. Make sure "
           "the Op and Kernel are registered in the binary running in this process.")
    with pytest.raises(ValueError, match=r"no op 'RegexSplitWithOffsets'.*before make_strategy"):
        with missing_worker_ops_explained():
            raise RuntimeError(raw)
    with pytest.raises(KeyError):  # anything else passes through unchanged
        with missing_worker_ops_explained():
            raise KeyError("loss")

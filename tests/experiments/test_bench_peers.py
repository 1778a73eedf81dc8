"""experiments/bench_peers.py's 2-process rows: tfdist's 2 workers, a stock
MultiWorkerMirroredStrategy's (its `fit` fails under Keras 3; a custom loop trains) and 2
Keras-on-JAX processes, each run end to end at a tiny size through the module's command
line. No timing is asserted: the rows exist, their rates are finite and positive, and both
workers end with the same weights."""

import json
import math
import os

import pytest

from experiments import bench_peers as bench
from tests.support import run_in_own_session

JAX_PYTHON = os.environ.get("TFDIST_JAX_PYTHON", "")


def _run(tmp_path, configs: str, *extra: str, timeout: float = 300) -> tuple[dict, str]:
    """The benchmark's command line in its own session -> (rows by name, its log). On a
    timeout every process of the run goes with it, and none may be left once it ends."""
    out = tmp_path / "rows.json"
    code, log, left = run_in_own_session(
        "-m", "experiments.bench_peers", "--rounds=1", "--steps=3", f"--configs={configs}",
        f"--out={out}", "--timeout=240", *extra, timeout=timeout)
    assert code == 0, log[-4000:]
    assert not left, "processes of the run outlived it"
    return {r["name"]: r for r in json.loads(out.read_text())["rows"]}, log


def _assert_trained(row: dict) -> None:
    assert math.isfinite(row["value"]) and row["value"] > 0, row
    assert row["unit"] == "samples/s"
    for words in ("2 replica(s) on 2 device(s)", "2 processes, not pinned",
                  "the workers' final weights identical in every round", "steady step"):
        assert words in row["note"], (words, row["note"])


@pytest.mark.slow
@pytest.mark.timeout(360)
def test_tensorflow_two_worker_rows(tmp_path):
    rows, log = _run(tmp_path, "tfdist_2workers,tf_2workers,tf_2workers+loop")
    _assert_trained(rows["peers/tfdist_2workers"])
    _assert_trained(rows["peers/tf_2workers+loop"])
    assert "multi_worker_mirrored" in rows["peers/tfdist_2workers"]["note"]
    assert "custom training loop" in rows["peers/tf_2workers+loop"]["note"]
    # Keras 3's fit under a stock MultiWorkerMirroredStrategy fails (what tfdist's
    # keras_build / keras_multi_worker fixes address): the row says so, with the error.
    stock = rows["peers/tf_2workers"]
    assert math.isnan(stock["value"])
    assert "not available" in stock["note"] and "PerReplica" in stock["note"], stock["note"]
    assert "keras-team/keras#20585" in stock["note"]
    ratio = rows["peers/tfdist 2 workers / stock MultiWorkerMirroredStrategy 2 workers, "
                 "custom loop"]
    assert math.isfinite(ratio["value"]) and ratio["value"] > 0
    assert "bench_peers round 0: tfdist_2workers:" in log


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.skipif(not JAX_PYTHON, reason="no JAX environment: TFDIST_JAX_PYTHON unset (a "
                    "Python with jax and keras, e.g. /work/venvs/perf-jax/bin/python)")
def test_jax_two_process_row(tmp_path):
    missing = bench.jax_available(JAX_PYTHON)
    assert missing is None, missing
    rows, _ = _run(tmp_path, "jax_2processes", f"--jax_python={JAX_PYTHON}", timeout=240)
    row = rows["peers/jax_2processes"]
    _assert_trained(row)
    assert "CPU collectives gloo" in row["note"], row["note"]


def test_bad_configurations_are_refused_before_anything_runs():
    for name, words in (("tf_plain+pin", "for the 2-process configurations"),
                        ("tfdist_2workers+loop", "is for tf_2workers"),
                        ("jax_2processes+spe=2", "JAX configurations take only")):
        with pytest.raises(ValueError, match=words):
            bench.parse_config(name)
    assert bench.parse_config("jax_2processes+pin+tiny") == (
        "jax_2processes", {"pin": "", "tiny": ""})


def test_last_error_shortens_a_value_printed_over_lines():
    log = ("Traceback (most recent call last):\n  File 'x.py', line 1\n"
           "[worker:1] ValueError: Attempt to convert a value (PerReplica:{\n"
           "[worker:1]   0: <tf.Tensor: shape=(2,), numpy=\n[worker:1] array([1., 2.])>\n"
           "[worker:1] }) with an unsupported type (PerReplica) to a Tensor.\n"
           "[tfdist launch] worker:1 exited with code 1; stopped the other tasks.\n")
    assert bench.last_error(log) == (
        "[worker:1] ValueError: Attempt to convert a value (PerReplica:{ ... }) with an "
        "unsupported type (PerReplica) to a Tensor.")
    assert bench.last_error("just a line\nthe last\n") == "the last"
    assert bench.last_error("") == "no result"

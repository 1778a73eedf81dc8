"""Users' program patterns under the synchronous presets train as on one device.

The patterns (shrunk, offline versions of keras.io and KerasHub programs) run in
fresh processes, tests/compat/run_sync_programs.py: one on 2 logical CPUs under
`mirrored` and its ZeRO-1/ZeRO-2 variants, and one `tfdist launch` of 2 workers
under `multi_worker_mirrored` and its ZeRO variants (strategies made one after the
other in each worker process). Every equality is against the same pattern, seed,
initial weights and global batch on ONE device (plain Keras); every replica's and
worker's copy must be identical. Negative controls run the same pattern under a
stock `tf.distribute.MirroredStrategy` (Keras as released: the upstream bug still
there) and under tfdist's strategy with the fix taken out.
"""

from __future__ import annotations

import io
import json
import os
import re
import sys

import numpy as np
import pytest

from tests.compat import run_sync_programs as programs
from tests.support import REPO, alive, run_python

RUN = os.path.join(REPO, "tests", "compat", "run_sync_programs.py")
# Float32 weights after 3 steps, and logged values relative to their size: summation order only.
TOLERANCE = 1e-6
# pattern -> the tfdist presets it runs under, on 2 logical CPUs and on 2 workers.
MIRRORED = {name: tuple(p for p in pattern.presets if p != "stock")
            for name, pattern in programs.PATTERNS.items()}
WORKERS = {name: pattern.worker_presets for name, pattern in programs.PATTERNS.items()
           if pattern.worker_presets}


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
    assert results[f"{key}.vs_one_device"] <= TOLERANCE, (key, results[f"{key}.vs_one_device"])
    compared = [k for k in results if k.startswith(f"{key}.") and k.endswith("_vs_one_device")]
    assert compared, key
    for k in compared:
        assert results[k] <= TOLERANCE, (k, results[k])
    assert results[f"{key}.spread"] == 0.0, (key, results[f"{key}.spread"])
    # Every optimizer stepped as often as on one device (no replica stepped a counter twice).
    assert results[f"{key}.iterations"] == results[f"{pattern}.one_device.iterations"], key


@pytest.mark.timeout(900)
@pytest.mark.parametrize("pattern,preset", [(p, s) for p, presets in MIRRORED.items()
                                            for s in presets])
def test_patterns_under_mirrored_equal_one_device(mirrored, pattern, preset):
    # Weights, every logged value, evaluate and predict; the replicas' copies identical.
    _assert_equals_one_device(mirrored, pattern, preset)


@pytest.mark.timeout(900)
def test_string_and_bool_negative_controls_fail_in_the_symbolic_build(mirrored):
    # Stock Keras under TensorFlow's MirroredStrategy (tensorflow/tensorflow#80951), and
    # tfdist's strategy without keras_build's fix: the first batch's MEAN reduce has no
    # string/bool kernel.
    for key, dtype in (("string.stock", "string"), ("bool.stock", "bool"),
                       ("string.unfixed_build", "string")):
        assert (f"Value for attr 'T' of {dtype} is not in the list of allowed values"
                in mirrored[f"{key}.error"]), (key, mirrored[f"{key}.error"])


@pytest.mark.timeout(900)
def test_train_step_without_call_negative_controls(mirrored):
    # Stock: Keras cannot build a model without `call` symbolically.
    for key in ("vae.stock", "gan.stock", "vae.unfixed_build"):
        assert "Unable to automatically build the model" in mirrored[f"{key}.error"], key
    # Built lazily in the traced step without keras_build's optimizer fix, Adam's slots are
    # created inside the step's function (keras-team/keras#23085).
    assert ("You must feed a value for placeholder tensor"
            in mirrored["vae.unfixed_optimizer.error"]), mirrored["vae.unfixed_optimizer.error"]


@pytest.mark.timeout(900)
def test_losses_negative_controls_differ_from_one_device(mirrored):
    # Without keras_losses, Keras's per-replica loss scaling: the VAE's hand-written means
    # get the sum of 2 replicas' gradients (Adam, so the weights move only slightly
    # differently), the GAN logs half of its losses, and add_loss of a Loss object is scaled
    # twice, stock Keras and tfdist's strategy alike.
    assert mirrored["vae.unfixed_losses.vs_one_device"] > 1e-5
    assert mirrored["gan.unfixed_losses.d_loss_vs_one_device"] > 0.1
    for key in ("add_loss.stock", "add_loss.unfixed_losses"):
        assert mirrored[f"{key}.vs_one_device"] > 1e-3, key
        logged = mirrored[f"{key}.logs.loss"][0]
        one_device = mirrored["add_loss.one_device.logs.loss"][0]
        assert abs(logged - one_device / 2) <= 1e-3 * one_device, (key, logged, one_device)


@pytest.mark.timeout(900)
def test_partial_batch_negative_controls_differ_from_one_device(mirrored):
    # The last batch, 3 + 2 examples: averaging the two replicas' means (stock TensorFlow, and
    # tfdist with the example weighting switched off) gives the 2 examples the weight of 3.
    for key in ("partial_batch.stock", "partial_batch.unweighted"):
        assert mirrored[f"{key}.vs_one_device"] > 1e-3, (key, mirrored[f"{key}.vs_one_device"])
    # One epoch: the partial batch is the last step, so the weights it updates show in
    # evaluate (the logged loss was computed before that update).
    assert mirrored["partial_batch.unweighted.evaluate_vs_one_device"] > TOLERANCE


@pytest.mark.timeout(900)
def test_optimizer_made_outside_the_scope_negative_controls_fail(mirrored):
    # Keras's optimizer keeps the strategy it was created under (keras-team/keras#17187):
    # stock Keras, and tfdist's strategy without keras_build's adopt_optimizer, fail in fit.
    for key in ("optimizer_outside_scope.stock", "optimizer_outside_scope.unfixed_adopt"):
        assert "Mixing different tf.distribute.Strategy objects" in mirrored[f"{key}.error"], (
            key, mirrored[f"{key}.error"])
    assert mirrored["optimizer_outside_scope.one_device.iterations"] == [programs.STEPS]


@pytest.mark.timeout(900)
def test_xla_is_off_with_one_warning_where_it_cannot_compile(mirrored):
    # Left to Keras ("auto"), XLA is off on a CPU-only machine and under any strategy.
    assert mirrored["xla_auto.one_device.jit_compile"] is False
    assert mirrored["xla_auto.mirrored.jit_compile"] is False
    assert mirrored["xla_auto.mirrored.xla_warnings"] == 0
    # jit_compile=True: XLA on one device; off under 2 CPU replicas, with one warning per model.
    assert mirrored["xla_true.one_device.jit_compile"] is True
    assert MIRRORED["xla_true"]
    for preset in MIRRORED["xla_true"]:
        assert mirrored[f"xla_true.{preset}.jit_compile"] is False, preset
        assert mirrored[f"xla_true.{preset}.xla_warnings"] == 1, preset
    # Negative controls: with XLA, 2 CPU replicas fail at the first step.
    for key in ("xla_true.stock", "xla_true.unfixed_xla"):
        assert "Trying to access resource" in mirrored[f"{key}.error"], mirrored[f"{key}.error"]


@pytest.mark.timeout(900)
def test_sparse_duplicates_mirrored_equals_summed_one_device_or_plain_tf_when_kept(mirrored):
    # docs/numerics.md: an embedding row looked up 3 times, Adam. The plain single-device
    # TensorFlow run and the summed one differ (0.22 on that row); mirrored equals the summed
    # one, and with keep_duplicate_sparse_slices the plain one.
    assert mirrored["sparse.plain_vs_summed"] > 0.1
    assert mirrored["sparse.mirrored_vs_summed"] <= TOLERANCE
    assert mirrored["sparse.mirrored_vs_plain"] > 0.1
    assert mirrored["sparse.kept_vs_plain"] <= TOLERANCE


# --- multi_worker_mirrored: 2 workers through tfdist launch ------------------------------


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    from tfdist import launch as launch_lib

    out_dir = tmp_path_factory.mktemp("sync_programs_workers")
    out, err = io.StringIO(), io.StringIO()
    result = launch_lib.launch(
        [sys.executable, RUN, "worker", "--out", str(out_dir)], num_workers=2, timeout=780,
        stdout=out, stderr=err, env=dict(os.environ, PYTHONPATH=REPO), grace_period=3.0)
    assert all(not alive(t.pid) for t in result.tasks)
    assert result.returncode == 0, out.getvalue()[-3000:] + err.getvalue()[-5000:]
    return out_dir, [json.loads((out_dir / f"results_{i}.json").read_text()) for i in (0, 1)]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_patterns_under_two_workers_equal_one_device(workers):
    out_dir, results = workers
    for r in results:
        # Three strategies in each worker process (the later two on the first one's server).
        assert r["replicas"] == {"mwms": 2, "zero1": 2, "zero2": 2}, r["replicas"]
        for pattern, presets in WORKERS.items():
            for preset in presets:
                _assert_equals_one_device(r, pattern, preset)
        assert r["xla_true.mwms.jit_compile"] is False
        assert r["xla_true.mwms.xla_warnings"] == 1
    # Both workers hold the same weights, bit for bit.
    for pattern, presets in {**WORKERS, "run_training_twice": ("mwms",)}.items():
        for preset in presets:
            w0, w1 = (np.load(out_dir / f"{pattern}.{preset}_{i}.npz") for i in (0, 1))
            assert len(w0.files) == len(w1.files) > 0
            for name in w0.files:
                np.testing.assert_array_equal(w0[name], w1[name], err_msg=f"{pattern}.{preset}")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_run_training_twice_makes_a_second_strategy_and_resumes_as_one_device(workers):
    # keras.io's distributed-training guide: each run_training() makes a strategy; the
    # second restores the first's checkpoint and trains on: two epochs of one device.
    _, results = workers
    for r in results:
        assert r["run_training_twice.distinct_strategies"] is True
        assert r["run_training_twice.vs_one_device"] <= TOLERANCE, r
        assert r["run_training_twice.spread"] == 0.0


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_variables_of_any_dtype_start_from_worker_0s_value(workers):
    # keras.io's Gemma LoRA guide under a bfloat16 policy: TensorFlow's broadcast of initial
    # values has no bfloat16 (nor int8, uint8) kernel; initial_values widens it exactly.
    _, results = workers
    for r in results:
        for dtype in ("bfloat16", "int8", "uint8", "float32"):
            assert r[f"dtype.{dtype}"] == [1.0, 3.0], (dtype, r[f"dtype.{dtype}"])
            assert r[f"dtype.{dtype}.dtype"] == dtype
        # The canary: without the fix stock TensorFlow refuses the dtype on every worker.
        assert "bfloat16 is not in the list" in (r["dtype.unfixed.error"] or ""), r


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_stock_reductions_of_a_metric_variable_still_fail_on_two_workers(workers):
    # The canary of keras_multi_worker.reduce_per_replica's pass-through for variables
    # (keras.io's CategoricalTruePositives returns its own): Keras's multi-worker reduction
    # and TensorFlow's strategy.reduce both fail on it.
    _, results = workers
    for r in results:
        assert "Invalid reduction dimension 0" in (r["metric.keras_reduce.error"] or ""), r
        assert "Cannot convert `input_tensor` to a `PerReplica` object" in (
            r["metric.strategy_reduce.error"] or ""), r["metric.strategy_reduce.error"]


def test_a_second_strategy_from_another_cluster_is_refused(monkeypatch):
    from tfdist import cluster as cluster_lib
    from tfdist import config as config_lib
    from tfdist import multi_worker

    def tf_config(port):
        return {"cluster": {"worker": [f"127.0.0.1:{port}", f"127.0.0.1:{port + 1}"]},
                "task": {"type": "worker", "index": 0}}

    monkeypatch.setenv("TF_CONFIG", json.dumps(tf_config(20000)))
    joined = cluster_lib.tf_config_from_env()
    monkeypatch.setattr(multi_worker, "_joined_cluster", joined)
    monkeypatch.setenv("TF_CONFIG", json.dumps(tf_config(21000)))
    with pytest.raises(RuntimeError, match=r"already joined a multi-worker cluster as task "
                                           r"worker:0 \(worker=2\).*Received: TF_CONFIG with "
                                           r"task worker:0 of worker=2, different from the "
                                           r"first"):
        multi_worker.build_strategy(config_lib.MultiWorkerMirroredOptions())

"""Gradient compression and buckets (tfdist.comm), and the per-step knobs (tfdist.step_options).

Pure option checks run here; training runs in fresh processes:
- mirrored x2 against a NumPy computation of the same steps (tests/comm/run_reference.py),
- 2 workers under `tfdist launch`: bit-identical weights (tests/comm/run_worker.py),
- the digits default run with every method (tests/comm/run_digits.py).
"""

import io
import json
import os
import sys

import numpy as np
import pytest
from absl import flags

import tfdist
from tests.support import REPO, run_python
from tfdist import config as config_lib


# --- options -------------------------------------------------------------------------


@pytest.mark.parametrize("preset", ["mirrored", "multi_worker_mirrored"])
def test_compression_options_and_errors(preset):
    options = tfdist.make_options(preset, gradient_compression="powersgd")
    assert config_lib.powersgd_rank_of(options) == config_lib.DEFAULT_POWERSGD_RANK
    assert config_lib.powersgd_warmup_of(options) == config_lib.DEFAULT_POWERSGD_WARMUP_STEPS
    assert tfdist.make_options(preset, gradient_compression="powersgd",
                               powersgd_warmup_steps=0).powersgd_warmup_steps == 0
    cases = [
        ({"gradient_compression": "zip"},
         "gradient_compression must be one of none, fp16, bf16, powersgd. Received: "
         "gradient_compression='zip'"),
        ({"gradient_compression": "powersgd", "powersgd_rank": 0},
         "powersgd_rank must be an integer >= 1. Received: powersgd_rank=0"),
        ({"gradient_compression": "powersgd", "powersgd_warmup_steps": -1},
         "powersgd_warmup_steps must be an integer >= 0"),
        ({"gradient_compression": "fp16", "powersgd_rank": 2},
         "powersgd_rank only applies with gradient_compression='powersgd'"),
        ({"powersgd_warmup_steps": 5}, "Add gradient_compression='powersgd'"),
        ({"bucket_bytes": -1}, "bucket_bytes must be an integer >= 0"),
        ({"bucket_bytes": 1024, "bucket_priority": "yes"},
         "bucket_priority must be True or False. Received: bucket_priority='yes'"),
        ({"bucket_priority": False},
         "bucket_priority=False only applies with bucket_bytes > 0"),
    ]
    reducer = ({"cross_device_ops": "reduction_to_one_device"} if preset == "mirrored"
               else {"communication": "nccl"})
    cases.append(({"gradient_compression": "fp16", **reducer},
                  "runs on TensorFlow's collective all-reduce"))
    if preset == "multi_worker_mirrored":
        cases.append(({"bucket_bytes": 1024, "bytes_per_pack": 1024}, "not both"))
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=None) as info:
            tfdist.make_options(preset, **kwargs)
        assert message in str(info.value), (kwargs, str(info.value))
    if "shard" in config_lib.MirroredOptions.option_names():  # tfdist.sharding is installed
        with pytest.raises(ValueError, match="cannot be combined with shard="):
            tfdist.make_options(preset, gradient_compression="fp16", shard="optimizer")
    with pytest.raises(ValueError, match="Unknown option"):
        tfdist.make_options("parameter_server", gradient_compression="fp16")


def test_step_options_errors():
    assert tfdist.StepOptions().steps_per_execution == 1
    for kwargs, message in [
        ({"mixed_precision": "fp8"}, "mixed_precision must be one of none, mixed_float16"),
        ({"loss_scale": 128.0}, "loss_scale only applies with mixed_precision='mixed_float16'"),
        ({"mixed_precision": "mixed_float16", "loss_scale": 0.0}, "finite number > 0"),
        ({"steps_per_execution": 0}, "steps_per_execution must be an integer >= 1"),
        ({"jit_compile": "yes"}, "jit_compile must be True or False"),
    ]:
        with pytest.raises(ValueError) as info:
            tfdist.StepOptions(**kwargs)
        assert message in str(info.value)


def test_flags():
    from tfdist import flags as tfdist_flags

    values = flags.FlagValues()
    tfdist_flags.define_flags(values)
    tfdist_flags.define_step_flags(values)
    values(["prog", "--strategy=multi_worker_mirrored", "--gradient_compression=powersgd",
            "--powersgd_rank=2", "--bucket_bytes=65536", "--mixed_precision=mixed_bfloat16",
            "--steps_per_execution=4", "--jit_compile"])
    options = tfdist_flags.strategy_options_from_flags(values)
    assert (options.gradient_compression, options.powersgd_rank, options.bucket_bytes) == (
        "powersgd", 2, 65536)
    step = tfdist_flags.step_options_from_flags(values)
    assert (step.mixed_precision, step.steps_per_execution, step.jit_compile) == (
        "mixed_bfloat16", 4, True)
    with pytest.raises(flags.IllegalFlagValueError, match=r"<none\|fp16\|bf16\|powersgd>"):
        values["gradient_compression"].parse("zip")
    values.unparse_flags()
    values(["prog", "--strategy=parameter_server", "--gradient_compression=fp16"])
    with pytest.raises(flags.ValidationError, match="option of mirrored, multi_worker_mirrored"):
        tfdist_flags.strategy_options_from_flags(values)


def test_train_rejects_a_rank_too_large_without_traceback():
    # The rank is checked against the model's variables when Keras builds the optimizer,
    # inside fit: experiments.train still ends in one clear line.
    result = run_python("-m", "experiments.train", "--gradient_compression=powersgd",
                        "--powersgd_rank=300", "--epochs=1", timeout=300)
    assert result.returncode != 0
    assert ("error: powersgd_rank=300 is larger than the smaller dimension of every weight "
            "matrix (the largest, variable 'dense_1/kernel', has shape (256, 128)") \
        in result.stderr
    assert "Use powersgd_rank <= 128" in result.stderr
    assert "Traceback" not in result.stderr


# --- training ------------------------------------------------------------------------


def test_compression_matches_numpy_reference_on_mirrored():
    """fp16, bf16, PowerSGD (warm-up, error feedback) and buckets against NumPy; sparse
    Embedding gradients uncompressed with duplicates summed; replicas bit-identical."""
    result = run_python("tests/comm/run_reference.py", "none", "fp16", "bf16", "powersgd",
                        timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert [r["method"] for r in report["results"]] == ["none", "fp16", "bf16", "powersgd"]
    assert ("powersgd_rank=25 is larger than the smaller dimension of every weight matrix (the "
            "largest, variable 'hidden/kernel', has shape (128, 24)") in report["rank_error"]
    assert "Use powersgd_rank <= 24" in report["rank_error"]
    # PowerSGD's error feedback and Q are saved by tfdist.BackupAndRestore: resuming after
    # epoch 1 equals 2 uninterrupted epochs; zeroing the restored error does not.
    assert report["resume_diff"] <= 1e-5, report
    assert report["zeroed_error_diff"] > 1e-4, report
    # A custom loop (strategy.run + optimizer.apply_gradients) trains, replicas identical.
    assert report["custom_loop"]["last"] < 0.5 * report["custom_loop"]["first"], report
    assert report["one_replica"][-1] < report["one_replica"][0], report


@pytest.mark.parametrize("preset_options,step_options", [
    ({"gradient_compression": "powersgd", "powersgd_rank": 2, "powersgd_warmup_steps": 3,
      "bucket_bytes": 4096}, {"mixed_precision": "mixed_bfloat16", "steps_per_execution": 2}),
    ({"gradient_compression": "fp16"}, {"mixed_precision": "mixed_float16", "loss_scale": 1024}),
    # Buckets summed before the loss scale's finite check (tfdist.compat.loss_scale).
    ({"bucket_bytes": 2048}, {"mixed_precision": "mixed_float16"}),
])
def test_two_workers_stay_bit_identical(tmp_path, preset_options, step_options):
    from tfdist import launch as launch_lib

    log = io.StringIO()
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    result = launch_lib.launch(
        [sys.executable, os.path.join(REPO, "tests", "comm", "run_worker.py"), str(tmp_path),
         json.dumps(preset_options), json.dumps(step_options)],
        num_workers=2, timeout=600, env=env, stdout=log, stderr=log)
    assert result.returncode == 0, log.getvalue()[-3000:]
    first, second = np.load(tmp_path / "0.npz"), np.load(tmp_path / "1.npz")
    for key in first.files:
        assert np.array_equal(first[key], second[key]), key
        assert np.isfinite(first[key]).all(), key
    assert first["loss"][-1] < 0.6 * first["loss"][0]  # it trained


def test_digits_default_run_accuracy_with_every_method():
    result = run_python("tests/comm/run_digits.py", "none", "fp16", "bf16", "powersgd",
                        timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    accuracy = json.loads(result.stdout.strip().splitlines()[-1])
    for method in ("fp16", "bf16", "powersgd"):
        assert abs(accuracy[method] - accuracy["none"]) <= 0.005, accuracy

"""`python -m experiments.train` refuses, up front and in one line, flags that would train
nothing, hang or fail late (each used to: train to 7.8 % on NaNs and exit 0; stay silent
for minutes; die with a raw NotFoundError after the model was built)."""

import pytest

from tests.support import run_python


@pytest.mark.timeout(120)
@pytest.mark.parametrize("flag,message", [
    ("--learning_rate=nan", "--learning_rate must be a finite number > 0. Received: "
                            "--learning_rate=nan"),
    ("--learning_rate=inf", "--learning_rate must be a finite number > 0"),
    ("--logical_devices=100000", "--logical_devices must be at most 64"),
    ("--model_dir=/proc/tfdist_test", "--model_dir must be a directory this process can write "
                                      "to; '/proc/tfdist_test' is not"),
    ("--metrics_out=/proc/tfdist/m.json", "--metrics_out's folder must be a directory this "
                                          "process can write to"),
])
def test_bad_training_flags_are_one_line_errors(flag, message):
    result = run_python("-m", "experiments.train", flag, timeout=100)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1].startswith(f"error: {message}"), result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.timeout(180)
def test_batch_bigger_than_the_training_set_is_refused():
    result = run_python("-m", "experiments.train", "--global_batch_size=100000",
                        "--strategy=default", timeout=150)
    assert result.returncode == 1
    assert "error: global_batch_size must be at most the training set's size" in result.stderr

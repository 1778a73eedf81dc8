"""The README's main command: a real training run, and its bad input."""

import json

import pytest

from tests.support import run_python


@pytest.mark.timeout(300)
def test_default_run_trains_digits_to_95_percent(tmp_path):
    metrics_path = tmp_path / "metrics.json"
    model_dir = tmp_path / "model"
    result = run_python("-m", "experiments.train", f"--metrics_out={metrics_path}",
                        f"--model_dir={model_dir}", timeout=280)
    assert result.returncode == 0, result.stderr[-3000:]
    assert ("tfdist: MirroredStrategy: 2 replica(s) on /job:localhost/replica:0/task:0/device:"
            "CPU:0, /job:localhost/replica:0/task:0/device:CPU:1; global batch 64 = 2 x 32 per "
            "replica") in result.stdout
    metrics = json.loads(metrics_path.read_text())
    assert metrics["preset"] == "mirrored" and metrics["num_replicas"] == 2
    assert metrics["per_replica_batch_size"] == 32 and metrics["dataset"] == "digits"
    assert len(metrics["history"]["loss"]) == metrics["epochs"] == 20
    assert metrics["test_accuracy"] >= 0.95, metrics["test_accuracy"]
    assert metrics["samples_per_sec"] > 0 and metrics["wall_time_s"] > 0
    assert (model_dir / "model.keras").is_file()
    assert any((model_dir / "logs" / "train").iterdir())  # TensorBoard events
    # No TensorFlow start-up or INFO log line (which start-up lines TensorFlow prints depends
    # on the CPU and GPU: tfdist.launch.output knows them all).
    from tfdist.launch.output import INFO_LINES, STARTUP_LINES

    assert not [line for line in result.stderr.splitlines()
                if STARTUP_LINES.match(line) or INFO_LINES.match(line)], result.stderr[-3000:]


@pytest.mark.timeout(200)
@pytest.mark.parametrize("model", ["cnn", "transformer"])
def test_other_models_train(model, tmp_path):
    metrics_path = tmp_path / "metrics.json"
    result = run_python("-m", "experiments.train", f"--model={model}", "--epochs=1",
                        "--steps_per_epoch=3", "--dataset=synthetic", "--logical_devices=4",
                        "--global_batch_size=32", f"--metrics_out={metrics_path}", timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = json.loads(metrics_path.read_text())
    assert metrics["num_replicas"] == 4 and metrics["per_replica_batch_size"] == 8


@pytest.mark.timeout(120)
@pytest.mark.parametrize("argv, fragment", [
    (["--global_batch_size=63"], "Received: global_batch_size=63. Use 62 or 64."),
    (["--strategy=nope"], "flag --strategy=nope: value should be one of <default|one_device|"),
    (["--model=resnet"], "flag --model=resnet: value should be one of <mlp|cnn|transformer>"),
    (["--dataset=imagenet"], "value should be one of <digits|synthetic|mnist>"),
    (["--cross_device_ops=nccl"], "cross_device_ops='nccl' needs every device to be a GPU"),
    (["--num_devices=3"], "num_devices=3 but this process has only 2 logical CPU device(s)"),
    (["--strategy=default", "--num_devices=2"], "--num_devices is an option of mirrored"),
])
def test_bad_input_is_one_clear_line(argv, fragment):
    result = run_python("-m", "experiments.train", "--epochs=1", *argv, timeout=100)
    assert result.returncode != 0
    assert fragment in result.stderr, result.stderr[-2000:]
    assert "Traceback" not in result.stderr, result.stderr[-2000:]

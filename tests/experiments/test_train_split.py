"""experiments/train.py with --split: a real pipelined run, and its bad input."""

import json

import pytest

from tests.support import run_python


@pytest.mark.timeout(200)
def test_train_with_split_auto(tmp_path):
    metrics_path = tmp_path / "metrics.json"
    result = run_python("-m", "experiments.train", "--strategy=default", "--split=auto",
                        "--stages=2", "--micro_batches=4", "--split_balance=flops",
                        "--model=transformer", "--dataset=synthetic", "--epochs=1",
                        "--steps_per_epoch=3", "--global_batch_size=32",
                        f"--metrics_out={metrics_path}", timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "expected bubble (K-1)/(M+K-1) = 0.200" in result.stdout
    metrics = json.loads(metrics_path.read_text())
    assert metrics["split"]["micro_batches"] == 4
    assert [d for d, _ in metrics["split"]["stages"]] == ["/device:CPU:0", "/device:CPU:1"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("argv, fragment", [
    (["--micro_batches=4"], "Pass --split=auto (or a plan file)"),
    (["--split=auto"], "--strategy=mirrored with --split=auto runs replicas x stages"),
    (["--strategy=multi_worker_mirrored", "--split=auto"],
     "a split across workers is not supported. Received: --strategy=multi_worker_mirrored"),
    (["--logical_devices=4", "--split=auto", "--stages=2", "--sync_batch_norm"],
     "A model split runs its replicas with the mirrored preset's defaults"),
])
def test_split_bad_input_is_one_clear_line(argv, fragment):
    result = run_python("-m", "experiments.train", "--epochs=1", *argv, timeout=100)
    assert result.returncode != 0
    assert fragment in result.stderr, result.stderr[-2000:]
    assert "Traceback" not in result.stderr, result.stderr[-2000:]


@pytest.mark.timeout(200)
def test_train_with_sequence_parallel(tmp_path):
    metrics_path = tmp_path / "metrics.json"
    result = run_python("-m", "experiments.train", "--strategy=default", "--logical_devices=2",
                        "--sequence_parallel=2", "--model=transformer", "--dataset=synthetic",
                        "--epochs=1", "--steps_per_epoch=2", "--global_batch_size=16",
                        f"--metrics_out={metrics_path}", timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Sequence parallel: each sequence cut over 2 devices (CPU:0, CPU:1)" in result.stdout
    assert json.loads(metrics_path.read_text())["split"]["sequence_parallel"] == 2


@pytest.mark.timeout(200)
def test_train_with_mirrored_replicas_of_a_split(tmp_path):
    """--strategy=mirrored with --split: the flags' Parallelism, 2 replicas x 2 stages."""
    metrics_path = tmp_path / "metrics.json"
    result = run_python("-m", "experiments.train", "--strategy=mirrored", "--logical_devices=4",
                        "--split=auto", "--stages=2", "--micro_batches=2", "--schedule=gpipe",
                        "--model=mlp", "--dataset=synthetic", "--epochs=1",
                        "--steps_per_epoch=3", "--global_batch_size=32",
                        f"--metrics_out={metrics_path}", timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Placement: 2 stage(s) x 2 replica(s), micro_batches=2" in result.stdout
    assert "replica 1: stages on CPU:2, CPU:3" in result.stdout
    metrics = json.loads(metrics_path.read_text())
    assert metrics["num_replicas"] == 2 and metrics["split"]["micro_batches"] == 2
    assert metrics["split"]["schedule"] == "gpipe"

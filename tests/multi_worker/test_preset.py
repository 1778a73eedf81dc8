"""The multi_worker_mirrored preset's options, input checks, chief-only paths and backup
(in this process; no cluster is formed here)."""

import json
import os
import socket

import pytest

import tfdist
import tfdist.chief
from tfdist import cluster as cluster_lib
from tfdist import multi_worker


def _tf_config(task_type="worker", task_id=0, **cluster):
    cluster = cluster or {"worker": ["127.0.0.1:1", "127.0.0.1:2"]}
    return json.dumps({"cluster": cluster, "task": {"type": task_type, "index": task_id}})


def test_options_defaults_and_errors():
    options = tfdist.make_options("multi_worker_mirrored")
    assert (options.communication, options.bytes_per_pack, options.collective_timeout,
            options.join_timeout) == ("auto", 0, None, 120.0)
    for kwargs, match in [
        ({"communication": "grpc"}, r"communication must be one of auto, ring, nccl\. "
                                    r"Received: communication='grpc'"),
        ({"bytes_per_pack": -1}, r"bytes_per_pack must be an integer >= 0"),
        ({"collective_timeout": 0}, r"collective_timeout must be a number of seconds > 0 or "
                                    r"None"),
        ({"join_timeout": None}, r"join_timeout must be a number of seconds > 0\. Received"),
        ({"num_devices": 2}, r"Unknown option\(s\) for preset 'multi_worker_mirrored'"),
    ]:
        with pytest.raises(ValueError, match=match):
            tfdist.make_options("multi_worker_mirrored", **kwargs)


def test_options_become_flags():
    from absl import flags

    import tfdist.flags

    values = flags.FlagValues()
    tfdist.flags.define_flags(values)
    values(["prog", "--strategy=multi_worker_mirrored", "--communication=ring",
            "--join_timeout=30", "--collective_timeout=60"])
    options = tfdist.flags.strategy_options_from_flags(values)
    assert options == tfdist.MultiWorkerMirroredOptions(
        communication="ring", join_timeout=30.0, collective_timeout=60.0)


def test_nccl_without_gpus_is_rejected_up_front(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    with pytest.raises(ValueError, match=r"communication='nccl' needs GPUs .* Use "
                                         r"communication='ring' or 'auto'"):
        tfdist.make_strategy("multi_worker_mirrored", communication="nccl")


def test_bad_tf_config_is_rejected_before_tensorflow_starts(monkeypatch):
    monkeypatch.setenv("TF_CONFIG", _tf_config(worker=["127.0.0.1:1"], ps=["127.0.0.1:2"]))
    with pytest.raises(cluster_lib.TFConfigError, match=r"has no parameter servers"):
        tfdist.make_strategy("multi_worker_mirrored")
    monkeypatch.setenv("TF_CONFIG", _tf_config(task_id=5))
    with pytest.raises(cluster_lib.TFConfigError, match=r"out of range"):
        tfdist.make_strategy("multi_worker_mirrored")


def test_join_timeout_message_names_tasks_whose_port_is_closed():
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        up = f"127.0.0.1:{listening.getsockname()[1]}"
        down = f"127.0.0.1:{cluster_lib.free_ports(1)[0]}"
        config = cluster_lib.TFConfig(
            cluster=cluster_lib.Cluster(chief=("127.0.0.1:9",), worker=(up, down)),
            task_type="chief", task_id=0)
        missing = multi_worker.missing_tasks(config)
    assert missing == [f"worker:1 ({down})"]
    message = multi_worker.join_timeout_message(config, 0.5, missing)
    assert (f"task chief:0 gave up after waiting 0.5 s for the cluster (chief=1 worker=2): "
            f"these tasks never joined: worker:1 ({down})") in message
    assert "raise --join_timeout" in message


_WATCHDOG_CHILD = """
import sys, time
from tfdist import cluster, multi_worker
config = cluster.parse_tf_config(sys.argv[1])
with multi_worker.join_watchdog(config, float(sys.argv[2])):
    time.sleep(float(sys.argv[3]))   # stands in for the blocking constructor
print("joined", flush=True)
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("timeout,block,killed", [(0.5, 30, True), (10, 0.2, False)])
def test_join_watchdog_kills_only_a_blocked_process(timeout, block, killed):
    from tests.support import run_python

    down = f"127.0.0.1:{cluster_lib.free_ports(1)[0]}"
    config = _tf_config("worker", 0, worker=["127.0.0.1:1", down])
    result = run_python("-c", _WATCHDOG_CHILD, config, str(timeout), str(block), timeout=40)
    if killed:
        assert result.returncode == -9
        assert f"these tasks never joined: worker:1 ({down})" in result.stderr
        assert "joined" not in result.stdout
    else:
        assert result.returncode == 0 and "joined" in result.stdout, result.stderr
        assert result.stderr == ""


def test_is_chief_and_chief_path():
    no_cluster = {}
    assert tfdist.is_chief(no_cluster) and tfdist.chief_path("out/m.keras", no_cluster) == \
        "out/m.keras"
    worker0 = {"TF_CONFIG": _tf_config("worker", 0)}
    worker1 = {"TF_CONFIG": _tf_config("worker", 1)}
    with_chief = {"TF_CONFIG": _tf_config("worker", 0, chief=["127.0.0.1:3"],
                                          worker=["127.0.0.1:1"])}
    assert tfdist.is_chief(worker0) and not tfdist.is_chief(worker1)
    assert not tfdist.is_chief(with_chief)
    assert tfdist.chief_path("out/logs", worker0) == "out/logs"
    private = tfdist.chief_path("out/logs/", worker1)
    assert os.path.basename(private) == "logs" and not private.startswith("out")
    assert os.path.isdir(os.path.dirname(private))
    assert tfdist.chief_path("other/model.keras", worker1).startswith(os.path.dirname(private))
    with pytest.raises(ValueError, match="path must be a non-empty path string"):
        tfdist.chief_path("", worker1)


def test_backup_refuses_a_dataset_that_was_not_advanced(tmp_path):
    import keras
    import numpy as np
    import tensorflow as tf

    from tfdist.checkpoint import BackupAndRestore, repeat_shuffled

    x = np.arange(32, dtype="float32").reshape(16, 2)
    ds = repeat_shuffled(tf.data.Dataset.from_tensor_slices((x, x[:, :1])), buffer_size=16,
                         seed=0).batch(4)
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    backup = BackupAndRestore(str(tmp_path), delete_on_finish=False)
    model.fit(backup.dataset(ds), epochs=1, steps_per_epoch=2, callbacks=[backup], verbose=0,
              shuffle=False)
    state = json.loads((tmp_path / "tfdist_backup.json").read_text())
    assert (state["step"], state["steps_per_epoch"]) == (2, 2)  # one epoch of two steps
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".tmp")]

    again = BackupAndRestore(str(tmp_path), delete_on_finish=False)
    assert (again.initial_epoch, again.initial_step) == (1, 2)
    with pytest.raises(ValueError, match=r"the training data was not advanced"):
        model.fit(ds, epochs=2, steps_per_epoch=2, callbacks=[again], verbose=0)
    with pytest.raises(ValueError, match=r"made with steps_per_epoch=2; this fit uses 3"):
        model.fit(again.dataset(ds), epochs=2, steps_per_epoch=3, callbacks=[again], verbose=0)
    with pytest.raises(ValueError, match=r"buffer_size must be an integer >= 1"):
        repeat_shuffled(ds, buffer_size=0, seed=0)

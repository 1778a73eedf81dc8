"""tfdist.integrations.ray on a real local Ray cluster bound to 127.0.0.1 (2 workers).

The driver (tests/engines/run_ray_driver.py) runs in a subprocess with its own Ray temp
folder, so every Ray process it starts is found afterwards by that folder
and none may survive.
"""

import json
import os
import shutil
import tempfile

import numpy as np
import pytest

from tests.support import run_python

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install tfdist[ray])")


def _ray_processes(marker: str) -> list[int]:
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
            with open(f"/proc/{pid}/environ", "rb") as f:
                environ = f.read()
        except OSError:
            continue
        if marker.encode() in cmdline or marker.encode() in environ:
            found.append(int(pid))
    return found


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_tensorflow_trainer_runs_the_preset_on_127_0_0_1():
    out = tempfile.mkdtemp(prefix="tfdist-ray-out-")
    # Short: Ray's unix socket paths live under it (at most 107 characters).
    temp_dir = tempfile.mkdtemp(prefix="tr", dir="/tmp")
    try:
        result = run_python("tests/engines/run_ray_driver.py", out, temp_dir, timeout=540,
                            env={"TF_CPP_MIN_LOG_LEVEL": "3", "RAY_TRAIN_V2_ENABLED": "1",
                                 "RAY_USAGE_STATS_ENABLED": "0", "TFDIST_TEST_MARKER": temp_dir})
        assert result.returncode == 0, result.stderr[-4000:]
        # A cluster too small for the workers: a clear error instead of Ray waiting.
        with open(os.path.join(out, "small.txt")) as f:
            small = f.read()
        assert "too small for 2 worker(s) (CPU: needs 2, has 1)" in small, small
        reports = []
        for rank in range(2):
            with open(os.path.join(out, f"ray{rank}.json")) as f:
                reports.append(json.load(f))
        for rank, report in enumerate(reports):
            # Ray wrote a workers-only TF_CONFIG and asked for legacy Keras ...
            assert set(report["ray_tf_config"]["cluster"]) == {"worker"}
            assert report["ray_tf_config"]["task"] == {"type": "worker", "index": rank}
            assert report["legacy_keras"] == "1"
            # ... tfdist bound it to loopback, kept Keras 3, and both workers joined.
            assert all(a.startswith("127.0.0.1:") for a in report["tf_config"]["cluster"]["worker"])
            assert [a.rsplit(":", 1)[1] for a in report["tf_config"]["cluster"]["worker"]] == [
                a.rsplit(":", 1)[1] for a in report["ray_tf_config"]["cluster"]["worker"]]
            assert report["legacy_after"] is None
            assert report["replicas"] == 2 and report["iterations"] == 12
        w0, w1, ref = (np.load(os.path.join(out, f"{n}.npy")) for n in ("ray0", "ray1",
                                                                          "reference"))
        np.testing.assert_array_equal(w0, w1)  # every replica's copy identical
        np.testing.assert_allclose(w0, ref, atol=1e-5)  # = one process, same global batch
    finally:
        left = _ray_processes(temp_dir)
        for pid in left:
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
        shutil.rmtree(out, ignore_errors=True)
        shutil.rmtree(temp_dir, ignore_errors=True)
    assert not left, f"Ray processes survived the test: {left}"


def test_make_strategy_refuses_what_ray_cannot_run(monkeypatch):
    from tfdist.integrations import ray as tfdist_ray

    with pytest.raises(ValueError, match=r"never parameter servers \(ray-project/ray#41089\)"):
        tfdist_ray.make_strategy("parameter_server")
    monkeypatch.delenv("TF_CONFIG", raising=False)
    with pytest.raises(ValueError, match="inside a Ray TensorflowTrainer worker"):
        tfdist_ray.make_strategy()


def test_bind_local_needs_every_worker_on_this_node():
    from tfdist import cluster as C
    from tfdist.integrations.ray import _local_config

    config = C.parse_tf_config(json.dumps({"cluster": {"worker": ["10.9.0.1:5", "10.9.0.2:6"]},
                                           "task": {"type": "worker", "index": 1}}))
    with pytest.raises(C.TFConfigError, match="workers on 10.9.0.1, 10.9.0.2"):
        _local_config(config, "10.9.0.1")
    same = C.parse_tf_config(json.dumps({"cluster": {"worker": ["10.9.0.1:5", "10.9.0.1:6"]},
                                         "task": {"type": "worker", "index": 1}}))
    local = _local_config(same, "10.9.0.1")
    assert local.cluster.worker == ("127.0.0.1:5", "127.0.0.1:6") and local.task_id == 1

"""MultiWorkerMirroredStrategy end to end, through tfdist's launcher (2 local processes).

Three launches in all (each ~1.2 GB and 15-40 s on 2 shared cores):
- 2 workers, tf.data (auto-sharded) and numpy input: identical weights on both
  workers, equal to a 1-replica run with the same seed and global batch within 1e-5;
- worker 1 SIGKILLs itself mid-epoch, then (2nd attempt) the chief SIGKILLs itself
  half-way through writing a backup -> the launcher restarts the group twice ->
  training resumes from the chief's last complete backup -> final weights equal
  an uninterrupted run's within 1e-6;
- worker 1 never joins -> worker 0 fails after join_timeout naming worker:1.

The reference runs in this process under a 1-device MirroredStrategy: like
the workers, Keras then builds the model from a first batch (see
docs/multi_worker.md on why plain fit is not the reference for tf.data).
"""

import io
import os
import sys

import numpy as np
import pytest

from tfdist import launch as launch_lib
from tests.multi_worker import run_training as script
from tests.support import REPO, alive

SCRIPT = os.path.join(REPO, "tests", "multi_worker", "run_training.py")


@pytest.fixture(scope="module")
def reference():
    import tfdist

    strategy = tfdist.make_strategy("mirrored", devices=("/cpu:0",))
    return {inputs: script.train(strategy, inputs) for inputs in ("tfdata", "numpy")}



def _no_process_mentions(text: str) -> bool:
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if text.encode() in f.read():
                    return False
        except OSError:
            continue
    return True


def _launch(tmp_path, *args, env_extra=None, **kwargs):
    out, err = io.StringIO(), io.StringIO()
    env = dict(os.environ, PYTHONPATH=REPO, **(env_extra or {}))
    result = launch_lib.launch([sys.executable, SCRIPT, "--out", str(tmp_path), *args],
                               stdout=out, stderr=err, env=env, grace_period=3.0, **kwargs)
    assert all(not alive(t.pid) for t in result.tasks)
    assert _no_process_mentions(str(tmp_path)), "a task outlived the launcher"
    return result, out.getvalue(), err.getvalue()


@pytest.mark.timeout(300)
def test_two_workers_equal_one_replica_for_tfdata_and_numpy(tmp_path, reference):
    result, out, err = _launch(tmp_path, "--inputs", "tfdata,numpy", num_workers=2,
                               timeout=240)
    assert result.returncode == 0, out[-3000:] + err[-3000:]
    assert "[worker:0] joined: 2 replicas" in out and "[worker:1] joined: 2 replicas" in out
    for inputs in ("tfdata", "numpy"):
        w0 = np.load(tmp_path / f"{inputs}_worker0.npy")
        w1 = np.load(tmp_path / f"{inputs}_worker1.npy")
        np.testing.assert_array_equal(w0, w1)
        np.testing.assert_allclose(w0, reference[inputs], rtol=0, atol=1e-5)
        # The run really trained: the weights moved well away from the initial ones.
        assert np.abs(w0 - script.initial_flat()).max() > 1e-2


@pytest.mark.timeout(360)
def test_kills_mid_epoch_and_during_a_save_resume_exactly(tmp_path, reference):
    """Attempt 1: worker 1 is SIGKILLed mid-way through epoch 2. Attempt 2 resumes at
    epoch 1; the chief is SIGKILLed half-way through writing epoch 2's backup. Attempt 3
    resumes at epoch 1 again (the half-written backup is ignored and removed) and finishes
    equal to an uninterrupted run."""
    backup, scratch = tmp_path / "backup", tmp_path / "scratch"
    scratch.mkdir()
    kill_at = script.STEPS + script.STEPS // 2  # mid-way through the 2nd epoch
    result, out, err = _launch(tmp_path, "--inputs", "tfdata", "--backup", str(backup),
                               "--kill_at_step", str(kill_at), "--kill_chief_in_save", "2",
                               num_workers=2, max_restarts=2, timeout=300,
                               env_extra={"TFDIST_SCRATCH_DIR": str(scratch)})
    assert result.returncode == 0, out[-3000:] + err[-3000:]
    assert result.attempts == 3
    assert f"[worker:1] killing myself at step {kill_at}" in out
    assert "worker:1 was killed by SIGKILL; stopped the other tasks" in err
    assert "[worker:0] killing myself while saving backup-step000000000016.npz" in out
    assert "worker:0 was killed by SIGKILL; stopped the other tasks" in err
    assert out.count("[worker:0] resuming at epoch 1") == 2
    assert out.count("[worker:1] resuming at epoch 1") == 2
    deltas = []
    for task in ("worker0", "worker1"):
        weights = np.load(tmp_path / f"tfdata_{task}.npy")
        deltas.append(float(np.abs(weights - reference["tfdata"]).max()))
    print(f"max |w - uninterrupted| = {max(deltas):.2g}")
    assert max(deltas) <= 1e-6, deltas
    assert not backup.exists(), "the backup (and the half-written file) is removed at the end"
    assert os.listdir(scratch) == []


@pytest.mark.timeout(180)
def test_missing_worker_fails_after_join_timeout_naming_it(tmp_path):
    result, out, err = _launch(tmp_path, "--hang_task", "worker:1", "--join_timeout", "5",
                               num_workers=2, timeout=150)
    # The watchdog SIGKILLs the task blocked in TensorFlow's constructor.
    assert result.returncode == 128 + 9, out[-3000:] + err[-3000:]
    assert result.failed_task == "worker:0"
    address = result.cluster.worker[1]
    assert f"these tasks never joined: worker:1 ({address})" in err
    assert "worker:0 gave up after waiting 5 s" in err
    assert "A peer never joined the cluster (join timeout" in err


@pytest.mark.timeout(180)
def test_without_tf_config_it_is_a_one_worker_run(tmp_path, reference):
    from tests.support import run_python

    out = tmp_path / "w.npy"
    result = run_python("-c", f"""
import numpy as np, tfdist
from tests.multi_worker import run_training as script
strategy = tfdist.make_strategy("multi_worker_mirrored")
print("replicas", strategy.num_replicas_in_sync)
np.save({str(out)!r}, script.train(strategy, "tfdata"))
""", env={"TF_CONFIG": ""}, timeout=150)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "replicas 1" in result.stdout
    np.testing.assert_allclose(np.load(out), reference["tfdata"], rtol=0, atol=1e-5)

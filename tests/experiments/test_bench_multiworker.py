"""experiments/bench_multiworker.py's scaling curve: one smoke run of the tiny model at 1 and
2 workers (every variant, one round), and its bad input. No timing is asserted: the rows
exist, their efficiencies are finite and positive, and worker 0 counted its collectives."""

import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest

from experiments import bench_multiworker as bench
from tests.support import REPO, run_in_own_session, running_roles


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_scaling_curve_rows_at_1_and_2_workers(tmp_path):
    out = tmp_path / "rows.json"
    # Its own session: on a timeout every process of the run (workers, the control's
    # processes) goes with it, and none may be left once it ends.
    code, log, left = run_in_own_session(
        "-m", "experiments.bench_multiworker", "--scaling_only", "--models=tiny",
        "--workers=1,2", "--rounds=1", "--quick", f"--out={out}", timeout=360)
    assert code == 0, log[-4000:]
    assert not left, "processes of the run outlived it"
    report = json.loads(out.read_text())
    rows = {r["name"]: r for r in report["rows"]}
    expected = ([f"scaling_tiny_1workers_{v}_efficiency" for v in ("tfdist", "stock")]
                + [f"scaling_tiny_2workers_{v}_efficiency"
                   for v in ("tfdist", "tfdist_unpacked", "stock")])
    assert sorted(rows) == sorted(expected), sorted(rows)
    for name, r in rows.items():
        assert math.isfinite(r["value"]) and r["value"] > 0, (name, r["value"])
        assert r["unit"] == "x"
        # Each row names its baseline's devices, threads and links.
        for words in ("CPU only", "1 intra-op/1 inter-op thread", "loopback (127.0.0.1)",
                      "baseline (control)"):
            assert words in r["note"], (name, words, r["note"])
    # The 1-worker tfdist run is the control at N = 1.
    assert rows["scaling_tiny_1workers_tfdist_efficiency"]["value"] == 1.0
    table = report["scaling"]["tiny"]
    two = table["2"]
    assert sorted(two["step_ms"]) == ["control", "stock", "tfdist", "tfdist_unpacked"]
    assert all(math.isfinite(ms) and ms > 0 for ms in two["step_ms"].values())
    # Worker 0's profile: the gradients and the packed logs (loss, accuracy) are two
    # collectives; without keras_log_reduction each log value is its own (three); the
    # stock loop all-reduces the gradients and its loss (two); the control and one worker
    # none. Counts from the trace are exact, not timings.
    counts = {v: c[0] for v, c in two["collectives"].items()}
    assert counts == {"tfdist": 2.0, "tfdist_unpacked": 3.0, "stock": 2.0, "control": 0.0}
    assert table["1"]["collectives"]["tfdist"][0] == 0.0
    # Every process timed its input pipeline alone; the rows say which input it was.
    assert all(math.isfinite(ms) and ms > 0 for ms in two["input_ms"].values())
    assert two["input"] == "global"
    assert "input pipeline alone" in rows["scaling_tiny_2workers_tfdist_efficiency"]["note"]
    assert "| 2 |" in log and "N=2 tfdist: worker 0, 2.0 collectives/step" in log
    # The control's processes timed each step: their lockstep bound, and each variant
    # against it.
    assert math.isfinite(two["synchronous_bound_ms"]) and two["synchronous_bound_ms"] > 0
    assert sorted(two["efficiency_vs_bound"]) == ["stock", "tfdist", "tfdist_unpacked"]
    assert "control's steps in lockstep" in rows["scaling_tiny_2workers_tfdist_efficiency"]["note"]
    assert table["1"]["synchronous_bound_ms"] is None  # no control at N = 1
    # Every process recorded its CPU per step by thread: the tfdist worker's collective and
    # gRPC threads are among them; the sums are the process's CPU (10 ms ticks, so loosely).
    by_thread = two["cpu_ms_by_thread"]
    assert sorted(by_thread) == ["control", "stock", "tfdist", "tfdist_unpacked"]
    assert all(by_thread.values()), by_thread
    assert sorted(two["preempted_by_thread"]) == sorted(by_thread)
    assert "N=2 tfdist: CPU" in log and "CPU per step" in \
        rows["scaling_tiny_2workers_tfdist_efficiency"]["note"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_stopped_curve_keeps_what_it_measured(tmp_path):
    """SIGTERM while the 2-worker launch runs (a lease or a job's time running out): the
    1-worker point measured before it is on disk, marked partial, the run ends with a
    message instead of a traceback, and no worker is left."""
    out = tmp_path / "rows.json"
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen(
        [sys.executable, "-m", "experiments.bench_multiworker", "--scaling_only",
         "--models=tiny", "--workers=1,2", "--rounds=1", "--quick",
         "--variants=tfdist,control", f"--out={out}"], cwd=REPO, env=env,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        # The 1-worker point is saved once it is measured; the next launch is N = 2's.
        while not out.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        while (not running_roles("experiments.bench_multiworker", "scaling")
               and proc.poll() is None and time.monotonic() < deadline):
            time.sleep(0.2)
        assert proc.poll() is None, "the run ended before its 2-worker launch"
        time.sleep(1.0)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode != 0
    assert "bench_multiworker: the scaling curve stopped" in err, err[-3000:]
    assert f"measured before it are in {out}" in err
    assert "Traceback" not in err, err[-3000:]
    report = json.loads(out.read_text())
    assert report["partial"] is True
    assert [r["name"] for r in report["rows"]] == ["scaling_tiny_1workers_tfdist_efficiency"]
    assert sorted(report["scaling"]["tiny"]) == ["1"]
    time.sleep(1.0)
    assert not running_roles("experiments.bench_multiworker", "scaling")


def test_synchronous_bound_takes_each_steps_slowest_process():
    """Worked by hand: two processes that are slow on alternate steps average 2 s a step
    each, but stepping together every step waits for the slow one (3 s)."""
    a = [[1.0, 3.0, 1.0, 3.0], [1.0, 3.0, 1.0, 3.0], [1.0, 3.0, 1.0, 3.0]]
    b = [[3.0, 1.0, 3.0, 1.0], [3.0, 1.0, 3.0, 1.0], [3.0, 1.0, 3.0, 1.0]]
    assert bench.synchronous_bound([a, b]) == 3.0
    assert bench.synchronous_bound([a]) == 2.0  # one process: its own step
    # The median epoch, as step_seconds takes it: epochs of 8, 12 and 40 s -> 12 s / 4.
    c = [[2.0] * 4, [3.0] * 4, [10.0] * 4]
    assert bench.synchronous_bound([c, c]) == 3.0
    # Unequal lengths: the steps and epochs every process has.
    assert bench.synchronous_bound([[[1.0, 2.0, 9.0]], [[2.0, 1.0]]]) == 2.0
    assert bench.synchronous_bound([a, []]) is None  # a process that timed nothing
    assert bench.synchronous_bound([]) is None


def test_scaling_inputs_give_each_worker_its_batches():
    """--input=global: the same arrays on every worker, TensorFlow's default auto-shard
    (DATA); --input=per_worker: each worker's own examples, auto-shard off. Both batch the
    global batch, which the strategy splits into per-worker batches."""
    import numpy as np
    import tensorflow as tf

    per = bench.SCALING_MODELS["tiny"]["per_worker_batch"]
    off = tf.data.experimental.AutoShardPolicy.OFF
    shards = {}
    for mode in ("global", "per_worker"):
        for task in (0, 1):
            ds = bench.scaling_dataset(tf, "tiny", 2, task, mode)
            x, y = next(iter(ds))
            assert x.shape == (2 * per, 8) and y.shape == (2 * per,)
            policy = ds.options().experimental_distribute.auto_shard_policy
            assert (policy == off) == (mode == "per_worker"), (mode, policy)
            shards[mode, task] = x.numpy()
    np.testing.assert_array_equal(shards["global", 0], shards["global", 1])
    assert not np.array_equal(shards["per_worker", 0], shards["per_worker", 1])
    with pytest.raises(ValueError, match=r"--input must be one of global, per_worker. "
                                         r"Received: 'local'"):
        bench._scaling_part(True, models=("tiny",), workers=["1"], input_mode="local")


def test_bad_worker_counts_and_models_name_what_was_received():
    with pytest.raises(ValueError, match=r"--workers must be integers >= 1, e.g. "
                                         r"--workers=1,2,4,8. Received: '0,2'"):
        bench.check_worker_counts(["0", "2"])
    with pytest.raises(ValueError, match=r"--workers must be integers >= 1.*Received: 'two'"):
        bench.check_worker_counts(["two"])
    assert bench.check_worker_counts(["8", "2", "2"]) == [1, 2, 8]  # 1: the curve's base
    with pytest.raises(ValueError, match=r"--models must name one or more of conv, tiny. "
                                         r"Received: 'resnet'"):
        bench._scaling_part(True, models=("resnet",), workers=["1", "2"])
    with pytest.raises(ValueError, match=r"--variants must name tfdist and any of "
                                         r"tfdist_unpacked, stock, control, control_idle. "
                                         r"Received: "
                                         r"'stock,control'"):
        bench._scaling_part(True, models=("tiny",), workers=["1"], variants=("stock", "control"))
    with pytest.raises(ValueError, match=r"--variants .*Received: 'tfdist,horovod'"):
        bench._scaling_part(True, models=("tiny",), workers=["1"], variants=("tfdist", "horovod"))
    with pytest.raises(ValueError, match=r"control_idle is measured against control; name "
                                         r"both .*Received: 'tfdist,control_idle'"):
        bench._scaling_part(True, models=("tiny",), workers=["1"],
                            variants=("tfdist", "control_idle"))
    with pytest.raises(ValueError, match=r"--control_idle_ms must be at least 1 with "
                                         r"control_idle. Received: 0"):
        bench._scaling_part(True, models=("tiny",), workers=["1"], idle_ms=0,
                            variants=("tfdist", "control", "control_idle"))
    with pytest.raises(ValueError, match=r"--rounds must be at least 1. Received: 0"):
        bench._scaling_part(True, models=("tiny",), workers=["1"], rounds=0)
    result = subprocess.run(
        [sys.executable, "-m", "experiments.bench_multiworker", "--scaling_only",
         "--workers=2,-4"], cwd=REPO, capture_output=True, text=True, timeout=60,
        env=dict(os.environ, PYTHONPATH=REPO))
    assert result.returncode != 0
    assert "--workers must be integers >= 1" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_control_idle_pauses_after_every_step_and_is_no_efficiency(tmp_path):
    """control_idle: the control's processes, each pausing after every step. Its step holds
    the pause (a sleep, so at least that long), it gets a CPU row against the control and no
    efficiency (it is a baseline, not a way to train)."""
    out = tmp_path / "rows.json"
    code, log, left = run_in_own_session(
        "-m", "experiments.bench_multiworker", "--scaling_only", "--models=tiny",
        "--workers=1,2", "--rounds=1", "--quick", "--variants=tfdist,control,control_idle",
        "--control_idle_ms=25", f"--out={out}", timeout=240)
    assert code == 0, log[-4000:]
    assert not left, "processes of the run outlived it"
    report = json.loads(out.read_text())
    two = report["scaling"]["tiny"]["2"]
    assert sorted(two["efficiency"]) == ["tfdist"]  # neither control is a variant to rate
    assert two["idle_ms"] == 25.0
    assert two["step_ms"]["control_idle"] >= two["step_ms"]["control"] + 25.0
    assert two["step_ms"]["control"] < 25.0  # the plain control does not pause
    rows = {r["name"]: r for r in report["rows"]}
    idle_row = rows["scaling_tiny_2workers_control_idle_cpu"]
    assert idle_row["value"] == pytest.approx(
        two["cpu_ms"]["control_idle"] / two["cpu_ms"]["control"])
    assert "25 ms after every step" in idle_row["note"]
    assert "N=2 control_idle (idling 25 ms a step): CPU" in log

"""SIGTERM is a save point: every preset, `tfdist launch`, a direct SIGTERM to one task.

Each case runs tests/checkpoint/run_preemption.py (a small MLP, 8-step epochs,
a deterministic pipeline) and checks against one replica trained in this
process with the same global batch (`reference`), which is the answer for
every worker count (two workers differ from it by ~1e-7):

1. multi_worker_mirrored, 2 workers, `tfdist.BackupAndRestore`: SIGTERM to the
   launcher in the middle of epoch 3 (a cluster preempting the job) -> the
   workers agree on a step at most 10 after the one the chief had reached,
   save there, exit 75 well inside the 30 s grace period; the launcher says
   "preempted at step S, backup saved", exits 75 and does not restart. The
   same command again resumes at step S and ends equal to the reference
   (<= 1e-6), both workers identical. Negative control: with preemption=False
   the same SIGTERM ends the job with 143 and the backup holds the last epoch.
2. multi_worker_mirrored with ZeRO-1, Keras's own BackupAndRestore(save_freq=5):
   worker:1 alone gets SIGTERM (Kubernetes evicting one pod) -> both save at one
   step, exit 75, `--max_restarts=1` restarts the group, which resumes mid-epoch
   at that step and ends equal to the reference.
3. multi_worker_mirrored with PowerSGD (its error feedback and warm start are
   state): worker:1 gets SIGTERM, `--max_restarts=1` resumes at the saved step,
   and the run ends within 1e-6 of two uninterrupted replicas.
4. mirrored (one process, two replicas): SIGTERM -> exit 75 -> resume -> reference.
5. parameter_server (chief, worker, ps under `tfdist launch`): SIGTERM to the
   launcher -> the chief (the coordinator) finishes its scheduled steps, saves
   and exits 75 while the servers keep the variables -> relaunch -> reference.
"""

from __future__ import annotations

import argparse
import functools
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.support import REPO, alive, run_python

PROGRAM = os.path.join(REPO, "tests", "checkpoint", "run_preemption.py")
GRACE = 30.0
TOLERANCE = 1e-6


def _env() -> dict:
    env = dict(os.environ, PYTHONPATH=REPO)
    env.pop("TF_CONFIG", None)
    return env


@functools.lru_cache(maxsize=None)
def _reference(epochs: int, compression: str, replicas: int) -> np.ndarray:
    import tfdist
    from tests.checkpoint import run_preemption as program
    from tfdist.compat import uninstall_after

    options = ({} if compression == "none" else
               program.preset_options(argparse.Namespace(shard="none", compression=compression)))
    with uninstall_after():
        devices = tuple(f"/cpu:{i}" for i in range(replicas))
        strategy = tfdist.make_strategy("mirrored", devices=devices, **options)
        model = program.build(strategy)
        model.fit(program.dataset(), epochs=epochs, steps_per_epoch=program.STEPS, verbose=0)
        return program.flat(model)


def reference(epochs: int = 6, compression: str = "none", replicas: int = 1) -> np.ndarray:
    """One replica, this process, the same global batch: the answer for every worker count.

    replicas=2: two replicas in this process (for PowerSGD, whose rounding
    differs between replica counts: the uninterrupted two-worker run).
    """
    return _reference(epochs, compression, replicas)


def launcher(tmp_path, *program_args, launch_args=(), epochs=6) -> subprocess.Popen:
    """`python -m tfdist.launch ... -- python run_preemption.py ...`, output to a log file."""
    log = open(tmp_path / f"launch-{time.monotonic_ns()}.log", "w+")
    cmd = [sys.executable, "-m", "tfdist.launch", f"--grace_period={GRACE:g}", "--timeout=400",
           *launch_args, "--", sys.executable, PROGRAM, "--out", str(tmp_path),
           "--backup_dir", str(tmp_path / "backup"), "--epochs", str(epochs),
           "--progress", str(tmp_path / "progress"), *program_args]
    proc = subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=log, stderr=subprocess.STDOUT)
    proc.log = log
    return proc


def output(proc) -> str:
    proc.log.seek(0)
    return proc.log.read()


def wait(proc, timeout=400) -> str:
    try:
        proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return output(proc)


def progress(tmp_path) -> int:
    try:
        lines = (tmp_path / "progress").read_text().split("\n")
    except FileNotFoundError:
        return 0
    steps = [int(line.split()[0]) for line in lines if len(line.split()) == 2]
    return max(steps, default=0)


def sigterm_when(proc, tmp_path, step: int, timeout=300) -> tuple[int, float]:
    """SIGTERM to `proc` once the chief trained `step` steps; returns (step then, time)."""
    deadline = time.monotonic() + timeout
    while progress(tmp_path) < step:
        assert proc.poll() is None, output(proc)[-4000:]
        assert time.monotonic() < deadline, output(proc)[-4000:]
        time.sleep(0.01)
    reached = progress(tmp_path)
    proc.send_signal(signal.SIGTERM)
    return reached, time.monotonic()


def weights(tmp_path, *tasks) -> list[np.ndarray]:
    return [np.load(tmp_path / f"{task}.npy") for task in tasks]


def saved_step(tmp_path) -> int | None:
    from tfdist.checkpoint import read_state

    state = read_state(str(tmp_path / "backup"))
    return None if state is None else state["step"]


def no_orphans(tmp_path) -> bool:
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if str(tmp_path).encode() in f.read() and alive(int(pid)):
                    return False
        except OSError:
            continue
    return True


@pytest.mark.timeout(900)
def test_sigterm_to_the_launcher_saves_at_the_next_steps_and_the_relaunch_resumes_exactly(
        tmp_path):
    want = reference()
    args = ("--step_delay", "0.02",)

    # Negative control: the same SIGTERM without the save point.
    control_dir = tmp_path / "control"
    control_dir.mkdir()
    proc = launcher(control_dir, *args, "--no_preemption", launch_args=("--num_workers=2",))
    at_control, _ = sigterm_when(proc, control_dir, 20)
    log = wait(proc)
    assert proc.returncode == 128 + signal.SIGTERM, log[-4000:]
    assert "got SIGTERM: stopped every task" in log
    assert saved_step(control_dir) == 16 < at_control  # only the epoch boundary

    proc = launcher(tmp_path, *args, launch_args=("--num_workers=2",))
    at_sigterm, sent = sigterm_when(proc, tmp_path, 20)
    log = wait(proc)
    seconds = time.monotonic() - sent
    assert proc.returncode == 75, log[-4000:]
    step = saved_step(tmp_path)
    print(f"SIGTERM at step {at_sigterm}, saved step {step}, launcher exited 75 after "
          f"{seconds:.1f} s (grace {GRACE:g} s)")
    assert at_sigterm <= step <= at_sigterm + 10
    assert seconds < GRACE  # 75, not the 143 of a SIGKILL at the end of the grace period
    assert f"got SIGTERM: preempted at step {step}, backup saved" in log, log[-3000:]
    assert "not restarting" in log and "attempt 2" not in log
    for task in ("worker:0", "worker:1"):
        assert f"[{task}] tfdist: preempted at step {step}" in log
    assert no_orphans(tmp_path)

    proc = launcher(tmp_path, *args, launch_args=("--num_workers=2",))
    log = wait(proc)
    assert proc.returncode == 0, log[-4000:]
    assert log.count(f"resuming at step {step}") == 2
    w0, w1 = weights(tmp_path, "worker0", "worker1")
    np.testing.assert_array_equal(w0, w1)
    print(f"max |w - uninterrupted| = {np.abs(w0 - want).max():.2g}")
    np.testing.assert_allclose(w0, want, rtol=0, atol=TOLERANCE)
    assert not (tmp_path / "backup").exists()


@pytest.mark.timeout(600)
def test_sigterm_to_one_worker_with_keras_backup_and_zero_restarts_mid_epoch(tmp_path):
    want = reference()
    proc = launcher(tmp_path, "--shard", "optimizer", "--backup", "keras", "--save_freq", "5",
                    "--sigterm", "1:worker:1:19",
                    launch_args=("--num_workers=2", "--max_restarts=1"))
    log = wait(proc)
    assert proc.returncode == 0, log[-4000:]
    assert "[worker:1] sending myself SIGTERM after step 19" in log
    assert "preempted at step 21, backup saved" in log, log[-4000:]
    assert "attempt 2" in log and log.count("resuming at step 21") == 2
    w0, w1 = weights(tmp_path, "worker0", "worker1")
    np.testing.assert_array_equal(w0, w1)
    np.testing.assert_allclose(w0, want, rtol=0, atol=TOLERANCE)
    assert no_orphans(tmp_path)


@pytest.mark.timeout(600)
def test_sigterm_with_powersgd_error_feedback_resumes_within_1e_6(tmp_path):
    # PowerSGD keeps state across steps (each replica's error feedback, the warm-start Q):
    # the save point saves it, the restarted group restores it. The reference is two
    # replicas in this process (PowerSGD's QR amplifies rounding, so one replica is
    # further off: 1.8e-7 here after 32 steps).
    want = reference(4, "powersgd", replicas=2)
    proc = launcher(tmp_path, "--compression", "powersgd", "--sigterm", "1:worker:1:13",
                    epochs=4, launch_args=("--num_workers=2", "--max_restarts=1"))
    log = wait(proc)
    assert proc.returncode == 0, log[-4000:]
    assert "[worker:1] sending myself SIGTERM after step 13" in log
    [step] = {int(s) for s in re.findall(r"preempted at step (\d+), backup saved", log)}
    assert 13 <= step <= 13 + 10, log[-4000:]
    assert "attempt 2" in log and log.count(f"resuming at step {step}") == 2
    w0, w1 = weights(tmp_path, "worker0", "worker1")
    np.testing.assert_array_equal(w0, w1)
    print(f"SIGTERM after step 13, saved step {step}; "
          f"max |w - uninterrupted| = {np.abs(w0 - want).max():.2g}")
    np.testing.assert_allclose(w0, want, rtol=0, atol=TOLERANCE)
    assert no_orphans(tmp_path)


@pytest.mark.timeout(600)
def test_sigterm_under_mirrored_saves_and_resumes(tmp_path):
    want = reference()
    args = ("--preset", "mirrored", "--out", str(tmp_path), "--backup_dir",
            str(tmp_path / "backup"), "--save_freq", "6")
    first = run_python(PROGRAM, *args, "--sigterm", "1:local:10", timeout=240)
    assert first.returncode == 75, first.stderr[-3000:]
    assert "tfdist: preempted at step 11 (SIGTERM to this process)" in first.stderr
    assert saved_step(tmp_path) == 11
    second = run_python(PROGRAM, *args, timeout=240)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resuming at step 11" in second.stdout
    (w,) = weights(tmp_path, "local")
    np.testing.assert_allclose(w, want, rtol=0, atol=TOLERANCE)


@pytest.mark.timeout(600)
def test_sigterm_under_parameter_server_saves_on_the_coordinator(tmp_path):
    want = reference()
    args = ("--preset", "parameter_server", "--save_freq", "100", "--step_delay", "0.02")
    launch_args = ("--num_workers=1", "--num_ps=1", "--chief")
    proc = launcher(tmp_path, *args, launch_args=launch_args)
    at_sigterm, _ = sigterm_when(proc, tmp_path, 20)
    log = wait(proc)
    assert proc.returncode == 75, log[-4000:]
    step = saved_step(tmp_path)
    assert at_sigterm <= step <= at_sigterm + 10
    assert f"got SIGTERM: preempted at step {step}, backup saved (chief:0 saved" in log
    assert no_orphans(tmp_path)

    proc = launcher(tmp_path, *args, launch_args=launch_args)
    log = wait(proc)
    assert proc.returncode == 0, log[-4000:]
    assert f"[chief:0] resuming at step {step}" in log
    (w,) = weights(tmp_path, "chief0")
    np.testing.assert_allclose(w, want, rtol=0, atol=TOLERANCE)

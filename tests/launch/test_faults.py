"""Real faults under `tfdist launch`, with TensorFlow: kills in the middle of an epoch, of the
chief, twice, of two tasks at once (MultiWorkerMirrored), and of a parameter-server worker.

Every launch is bounded (`timeout`) and the tests check that no task outlived it.
"""

import io
import os
import re
import sys

import numpy as np
import pytest

from tfdist import launch as launch_lib
from tests.multi_worker import run_training as script
from tests.support import REPO, alive

SCRIPT = os.path.join(REPO, "tests", "launch", "run_fault_training.py")
STARTED = re.compile(r"^\[(\w+:\d+)\] \1 pid=(\d+)$")  # run_ps_job.py's first line


@pytest.fixture(scope="module")
def reference():
    """The same training, uninterrupted, as one replica (tests/multi_worker/test_end_to_end.py)."""
    import tfdist

    return script.train(tfdist.make_strategy("mirrored", devices=("/cpu:0",)), "tfdata")


def _launch(args, **kwargs):
    out, err = io.StringIO(), io.StringIO()
    env = dict(os.environ, PYTHONPATH=REPO)
    result = launch_lib.launch([sys.executable, SCRIPT, *args], stdout=out, stderr=err, env=env,
                               grace_period=3.0, **kwargs)
    assert not any(alive(t.pid) for t in result.tasks), "a task outlived the launcher"
    return result, out.getvalue(), err.getvalue()


@pytest.mark.timeout(420)
def test_kills_mid_epoch_of_the_chief_twice_and_together_resume_exactly(tmp_path, reference):
    """Attempt 1: worker:0 dies mid-epoch 2. Attempt 2: the chief and worker:0 die together
    mid-epoch 3. Attempt 3 finishes: both tasks end equal to the uninterrupted run."""
    steps = script.STEPS
    first, second = steps + steps // 2, 2 * steps + steps // 2  # 12 and 20: mid-epoch
    backup = tmp_path / "backup"
    result, out, err = _launch(
        ["--out", str(tmp_path), "--backup", str(backup), "--kill", f"1:worker:0:{first}",
         "--kill", f"2:chief:0:{second}", "--kill", f"2:worker:0:{second}"],
        num_workers=1, chief=True, max_restarts=2, timeout=380)
    assert result.returncode == 0, out[-3000:] + err[-3000:]
    assert result.attempts == 3
    assert f"[worker:0] killing myself at step {first}" in out
    # Attempt 2: both reach step 20 together. The first to kill itself ends the attempt: the
    # launcher then stops the other, which (its Python thread a little behind on a loaded
    # machine) may be stopped, at its SIGTERM save point, before its own kill line.
    together = [task for task in ("chief:0", "worker:0")
                if f"[{task}] killing myself at step {second}" in out]
    assert together, out[-3000:]
    assert "worker:0 was killed by SIGKILL; stopped the other tasks" in err
    # Each attempt resumed from the last epoch that finished before its kill.
    for task in ("chief:0", "worker:0"):
        assert out.count(f"[{task}] resuming at epoch ") == 3
        assert f"[{task}] resuming at epoch 1" in out and f"[{task}] resuming at epoch 2" in out
    for task in ("chief0", "worker0"):
        weights = np.load(tmp_path / f"{task}.npy")
        np.testing.assert_allclose(weights, reference, rtol=0, atol=1e-6)
    np.testing.assert_array_equal(np.load(tmp_path / "chief0.npy"),
                                  np.load(tmp_path / "worker0.npy"))


@pytest.mark.timeout(300)
def test_killed_parameter_server_worker_is_restarted_alone_and_the_job_finishes(tmp_path):
    """SIGKILL of one worker used to end the whole job at exit 137."""
    import json
    import queue
    import signal
    import subprocess
    import threading
    import time

    cmd = [sys.executable, "-m", "tfdist.launch", "--num_workers=2", "--num_ps=1", "--chief",
           "--timeout=260", "--grace_period=2", "--",
           sys.executable, os.path.join(REPO, "tests", "launch", "run_ps_job.py"), str(tmp_path)]
    proc = subprocess.Popen(cmd, cwd=REPO, env=dict(os.environ, PYTHONPATH=REPO),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: queue.Queue = queue.Queue()
    keep: list[str] = []

    def read():
        for line in proc.stdout:
            keep.append(line)
            lines.put(line)
        lines.put(None)

    threading.Thread(target=read, daemon=True).start()
    deadline = time.monotonic() + 260

    def wait_for(predicate):
        while time.monotonic() < deadline:
            try:
                line = lines.get(timeout=1)
            except queue.Empty:
                continue
            assert line is not None, "".join(keep[-60:])
            if predicate(line):
                return line
        raise AssertionError("timed out; output:\n" + "".join(keep[-60:]))

    pids = {}
    try:
        wait_for(lambda line: line.startswith("[chief:0] {") and '"epoch"' in line)
        for line in keep:
            match = STARTED.match(line)
            if match:
                pids[match[1]] = int(match[2])
        os.kill(pids["worker:1"], signal.SIGKILL)
        wait_for(lambda line: "restarting it alone on the same address" in line)
        wait_for(lambda line: (STARTED.match(line) or [None, None])[1] == "worker:1")
        wait_for(lambda line: line.startswith("[worker:1] tfdist-test-step-ran"))
        (tmp_path / "rejoined").write_text("1")
        done = json.loads(wait_for(lambda line: '"done"' in line).split("] ", 1)[1])
        assert proc.wait(timeout=60) == 0, "".join(keep[-60:])
    finally:
        proc.kill()
        proc.wait()
    text = "".join(keep)
    print("chief's count:", done)  # shown with pytest -s
    assert ("worker:1 was killed by SIGKILL; restarting it alone on the same address "
            "(restart 1 of 3); the other tasks keep running") in text
    assert "chief:0 exited 0: the job succeeded" in text
    # Only worker:1 started twice; the chief, ps:0 and worker:0 ran once throughout.
    starts = [match[1] for match in map(STARTED.match, keep) if match]
    assert sorted(starts) == ["chief:0", "ps:0", "worker:0", "worker:1", "worker:1"]
    # Every scheduled step was applied once (the killed worker's steps ran elsewhere), plus
    # the steps the parameter-server accounting reports as re-run after they had written.
    assert done["iterations"] == done["scheduled"] + done["rerun_after_write"], done
    assert not any(alive(p) for p in pids.values())

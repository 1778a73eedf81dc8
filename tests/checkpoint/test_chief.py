"""Where tasks write: chief_path, per-process scratch swept after SIGKILL, atomic chief writes.

No TensorFlow: tfdist.chief and tfdist.compat.keras_files.write_as are plain Python.
"""

import json
import os
import signal
import socket
import subprocess
import sys

import pytest

from tfdist import chief
from tfdist.compat import keras_files
from tests.support import run_python


def _tf_config(task_type, task_id):
    return json.dumps({"cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2"]},
                       "task": {"type": task_type, "index": task_id}})


def _dead_pid():
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def _fake_scratch(root, name, *, host=None, pid=None, start=None, owner=True):
    path = root / name
    path.mkdir()
    (path / "events.out").write_text("left behind")
    if owner:
        (path / ".owner").write_text(json.dumps(
            {"host": host or socket.gethostname(), "pid": pid, "start": start}))
    return path


def test_non_chief_paths_live_in_the_scratch_root(tmp_path):
    environ = {"TF_CONFIG": _tf_config("worker", 1), chief.SCRATCH_ENV: str(tmp_path)}
    path = chief.chief_path("out/logs", environ)
    assert os.path.basename(path) == "logs"
    folder = os.path.dirname(path)
    assert os.path.dirname(folder) == str(tmp_path)
    assert os.path.basename(folder).startswith(f"tfdist_worker1_{os.getpid()}_")
    owner = json.loads(open(os.path.join(folder, ".owner")).read())
    assert owner["pid"] == os.getpid() and owner["host"] == socket.gethostname()
    assert chief.chief_path("out/m.keras", {"TF_CONFIG": _tf_config("worker", 0)}) == \
        "out/m.keras"


def test_sweep_removes_only_scratch_whose_owner_died(tmp_path):
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        dead = _fake_scratch(tmp_path, "tfdist_worker1_1_dead", pid=_dead_pid())
        alive = _fake_scratch(tmp_path, "tfdist_worker1_2_alive", pid=sleeper.pid,
                              start=chief._process_start(sleeper.pid))
        reused = _fake_scratch(tmp_path, "tfdist_worker1_3_reused", pid=sleeper.pid,
                               start="1")  # the pid now belongs to another process
        other_host = _fake_scratch(tmp_path, "tfdist_worker1_4_host", host="elsewhere",
                                   pid=_dead_pid())
        unmarked = _fake_scratch(tmp_path, "tfdist_worker1_5_old", owner=False)
        foreign = _fake_scratch(tmp_path, "not_ours", pid=_dead_pid())
        removed = chief.sweep_stale_scratch(str(tmp_path))
        assert sorted(removed) == sorted([str(dead), str(reused)])
        for kept in (alive, other_host, unmarked, foreign):
            assert kept.exists()
    finally:
        sleeper.kill()
        sleeper.wait()


def test_scratch_of_a_sigkilled_task_is_removed_by_the_next_one(tmp_path):
    """chief_path used to leave a tfdist_worker1_* folder after a SIGKILL."""
    env = {"TF_CONFIG": _tf_config("worker", 1), chief.SCRATCH_ENV: str(tmp_path)}
    killed = run_python("-c", """
import os, signal
from tfdist import chief
path = chief.chief_path("out/logs")
os.makedirs(path)
open(os.path.join(path, "events.out.tfevents"), "w").write("x")
print(path, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
""", env=env, timeout=60)
    assert killed.returncode == -signal.SIGKILL
    left = os.path.dirname(killed.stdout.strip())
    assert os.path.isdir(left)
    nxt = run_python("-c", "from tfdist import chief; print(chief.chief_path('out/logs'))",
                     env=env, timeout=60)
    assert nxt.returncode == 0, nxt.stderr
    assert not os.path.exists(left)
    # The second process removed its own scratch at exit: nothing is left.
    assert os.listdir(tmp_path) == []


def test_a_bad_scratch_root_is_a_clear_error(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match=r"TFDIST_SCRATCH_DIR must name a directory"):
        chief.scratch_root({chief.SCRATCH_ENV: str(tmp_path / "file" / "sub")})


_KILLED_WRITER = r"""
import os, signal, sys
from tfdist.compat import keras_files

def write(path):
    with open(path, "wb") as f:
        f.write(b"NEW-BUT-HALF")
        f.flush()
    os.kill(os.getpid(), signal.SIGKILL)

keras_files.write_as("chief", sys.argv[1], write)
"""


def test_a_chief_killed_during_a_save_leaves_the_previous_file(tmp_path):
    target = tmp_path / "ckpt.weights.h5"
    target.write_bytes(b"PREVIOUS")
    killed = run_python("-c", _KILLED_WRITER, str(target), timeout=60)
    assert killed.returncode == -signal.SIGKILL
    assert target.read_bytes() == b"PREVIOUS"
    partial = [n for n in os.listdir(tmp_path) if n.startswith(".tfdist-partial-")]
    assert len(partial) == 1

    def write(path):
        with open(path, "wb") as f:
            f.write(b"NEXT")

    keras_files.write_as("chief", str(target), write)  # removes the dead writer's partial
    assert target.read_bytes() == b"NEXT"
    assert os.listdir(tmp_path) == ["ckpt.weights.h5"]


def test_a_directory_save_is_swapped_in_and_restored_after_a_kill(tmp_path):
    target = tmp_path / "export"
    target.mkdir()
    (target / "saved_model.pb").write_text("old")

    def write(path):
        os.makedirs(path)
        with open(os.path.join(path, "saved_model.pb"), "w") as f:
            f.write("new")

    keras_files.write_as("chief", str(target), write, directory=True)
    assert (target / "saved_model.pb").read_text() == "new"
    assert os.listdir(tmp_path) == ["export"]

    # A chief killed between moving the old export away and moving the new one in.
    os.rename(target, tmp_path / f".tfdist-old-{_dead_pid()}-export")
    keras_files.sweep_partial_writes(str(target))
    assert (target / "saved_model.pb").read_text() == "new"
    assert os.listdir(tmp_path) == ["export"]


def test_other_workers_write_to_scratch_that_is_removed(tmp_path, monkeypatch):
    monkeypatch.setenv(chief.SCRATCH_ENV, str(tmp_path / "scratch"))
    seen = []

    def write(path):
        seen.append(path)
        with open(path, "w") as f:
            f.write("discarded")

    keras_files.write_as("other", str(tmp_path / "out" / "model.keras"), write)
    assert os.path.basename(seen[0]) == "model.keras"
    assert seen[0].startswith(str(tmp_path / "scratch"))
    assert not os.path.exists(seen[0]) and not (tmp_path / "out").exists()

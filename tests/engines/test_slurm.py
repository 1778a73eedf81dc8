"""tfdist under a real SLURM: fake nodes on this machine (scripts/slurm_local.py).

Skipped where slurmctld/slurmd are not installed; CI installs them first with
`python scripts/slurm_local.py install`. The suite never installs anything.
One SLURM (3 fake nodes, all on 127.0.0.1) serves the module and is stopped
by PID at the end; no daemon, job or task survives.
"""

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile

import numpy as np
import pytest

from scripts.slurm_local import LocalSlurm, missing_binaries
from tests.support import REPO, run_python

pytestmark = [
    pytest.mark.skipif(bool(missing_binaries()),
                       reason=f"SLURM is not installed (missing: {', '.join(missing_binaries())});"
                              f" run `python scripts/slurm_local.py install` as root"),
    pytest.mark.slow,
]
SCRIPT = os.path.join(REPO, "tests", "engines", "run_slurm_training.py")
TIMEOUT = 300


def _free_base(count: int) -> int:
    """A port p with p .. p+count-1 all free on 127.0.0.1."""
    from tfdist import free_ports

    for base in free_ports(40):
        socks = []
        try:
            for port in range(base, base + count):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no run of free ports")


@pytest.fixture(scope="module")
def slurm():
    with LocalSlurm(nodes=3) as cluster:
        yield cluster
    assert not any(os.path.exists(f"/proc/{p}") and _running(p) for p in cluster.pids())


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except FileNotFoundError:
        return False


def _env(slurm):
    env = slurm.env()
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    env["TF_CPP_MIN_LOG_LEVEL"] = "3"
    env.pop("TF_CONFIG", None)
    # `tfdist` and `python` of this venv, as a job script would find them.
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env["PATH"]
    return env


def _srun(slurm, *args, cwd=None):
    return subprocess.run(["srun", *args], env=_env(slurm), capture_output=True, text=True,
                          timeout=TIMEOUT, cwd=cwd or REPO)


def _reports(out, ranks):
    reports = {}
    for rank in ranks:
        with open(os.path.join(out, f"rank{rank}.json")) as f:
            reports[rank] = json.load(f)
        reports[rank]["weights"] = np.load(os.path.join(out, f"rank{rank}.npy"))
    return reports


@pytest.fixture(scope="module")
def uninterrupted(slurm):
    """auto inside `srun -N 2 -n 2`: one task per fake node, with a backup folder."""
    out = tempfile.mkdtemp(prefix="tfdist-slurm-")
    port = _free_base(2)
    proc = _srun(slurm, "-N", "2", "-n", "2", "--kill-on-bad-exit=1", sys.executable, SCRIPT,
                 "--out", out, "--slurm_port", str(port),
                 "--backup", os.path.join(out, "backup"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    reports = _reports(out, ("0", "1"))
    reference = run_python(SCRIPT, "--out", out, "--preset", "multi_worker_mirrored",
                           timeout=TIMEOUT, env={"TF_CPP_MIN_LOG_LEVEL": "3"})
    assert reference.returncode == 0, reference.stderr[-3000:]
    reports["single"] = _reports(out, ("single",))["single"]
    yield reports, port
    shutil.rmtree(out, ignore_errors=True)


def test_auto_trains_one_model_over_two_fake_nodes(uninterrupted):
    reports, port = uninterrupted
    r0, r1 = reports["0"], reports["1"]
    # 'auto' saw the SLURM step: multi-worker, not two unrelated single-worker runs.
    assert r0["strategy"] == r1["strategy"] == "CollectiveAllReduceStrategy"
    assert r0["replicas"] == r1["replicas"] == 2
    # Tasks on two fake nodes that share 127.0.0.1 get distinct ports.
    assert {r0["node"], r1["node"]} == {"tfnode1", "tfnode2"}
    assert r0["tf_config"]["cluster"] == {"worker": [f"127.0.0.1:{port}",
                                                     f"127.0.0.1:{port + 1}"]}
    assert r0["tf_config"]["task"]["index"] == 0 and r1["tf_config"]["task"]["index"] == 1
    np.testing.assert_array_equal(r0["weights"], r1["weights"])
    np.testing.assert_allclose(r0["weights"], reports["single"]["weights"], atol=1e-5)
    assert r0["iterations"] == reports["single"]["iterations"] == 12


def _recipe(name: str) -> str:
    with open(os.path.join(REPO, "docs", "cluster.md")) as f:
        text = f.read()
    match = re.search(rf"<!-- {name} -->\s*```bash\n(.*?)```", text, re.S)
    assert match, f"docs/cluster.md has no '<!-- {name} -->' recipe"
    return match.group(1)


def test_sbatch_runs_the_recipe_in_the_docs(slurm, tmp_path):
    port = _free_base(2)
    script = _recipe("slurm-mwms-recipe")
    assert "python train.py" in script and "--format=json" in script
    script = script.replace("python train.py", f"{sys.executable} {SCRIPT} --out {tmp_path} "
                                               f"--preset multi_worker_mirrored")
    script = script.replace("--format=json", f"--format=json --port={port}")
    path = tmp_path / "job.sh"
    path.write_text(script)
    proc = subprocess.run(["sbatch", "--wait", f"--output={tmp_path}/job-%j.out", str(path)],
                          env=_env(slurm), capture_output=True, text=True, timeout=TIMEOUT,
                          cwd=tmp_path)
    logs = "".join(p.read_text() for p in tmp_path.glob("job-*.out"))
    assert proc.returncode == 0, proc.stderr + logs[-3000:]
    assert "TF_CONFIG OK: task worker:0" in logs and "TF_CONFIG OK: task worker:1" in logs
    reports = _reports(tmp_path, ("0", "1"))
    assert reports["0"]["replicas"] == 2
    np.testing.assert_array_equal(reports["0"]["weights"], reports["1"]["weights"])


def test_parameter_server_roles_come_from_slurm_ranks(slurm, tmp_path):
    port = _free_base(3)
    script = _recipe("slurm-ps-recipe")
    command = f"{sys.executable} {SCRIPT} --out {tmp_path} --preset parameter_server"
    srun_line = next(line for line in script.splitlines() if line.startswith("srun"))
    args = srun_line.split(None, 1)[1].replace("python train.py", command).replace(
        "--format=json", f"--format=json --port={port}")
    proc = subprocess.run(["bash", "-c", f"srun {args}"], env=_env(slurm), capture_output=True,
                          text=True, timeout=TIMEOUT, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (chief,) = _reports(tmp_path, ("0",)).values()
    # Alphabetical roles, as TensorFlow's resolver: rank 0 chief, rank 1 ps, rank 2 worker.
    assert chief["tf_config"] == {
        "cluster": {"chief": [f"127.0.0.1:{port}"], "worker": [f"127.0.0.1:{port + 2}"],
                    "ps": [f"127.0.0.1:{port + 1}"]},
        "task": {"type": "chief", "index": 0}}
    assert chief["strategy"] == "ParameterServerStrategyV2"
    assert chief["iterations"] == 12  # every scheduled step ran, once
    assert not os.path.exists(tmp_path / "rank1.json")  # servers serve, they do not train


def test_killed_task_ends_srun_and_the_restart_resumes_from_the_backup(slurm, uninterrupted):
    reports, _ = uninterrupted
    out = tempfile.mkdtemp(prefix="tfdist-slurm-kill-")
    port = _free_base(2)
    args = ["-N", "2", "-n", "2", "--kill-on-bad-exit=1", sys.executable, SCRIPT, "--out", out,
            "--slurm_port", str(port), "--backup", os.path.join(out, "backup"),
            "--kill_at_step", "6"]  # mid-way through epoch 2 of 3
    try:
        first = _srun(slurm, *args)
        assert first.returncode != 0
        assert re.search(r"task 1: Killed", first.stderr), first.stderr[-2000:]
        assert not os.path.exists(os.path.join(out, "rank0.json"))
        # The documented restart: the same command again.
        second = _srun(slurm, *args)
        assert second.returncode == 0, second.stderr[-3000:]
        resumed = _reports(out, ("0", "1"))
        assert resumed["0"]["initial_epoch"] == resumed["1"]["initial_epoch"] == 1
        np.testing.assert_array_equal(resumed["0"]["weights"], resumed["1"]["weights"])
        # Exactly where the uninterrupted run ended.
        np.testing.assert_allclose(resumed["0"]["weights"], reports["0"]["weights"],
                                   rtol=0, atol=1e-6)
    finally:
        shutil.rmtree(out, ignore_errors=True)


def test_scancel_sigterm_is_a_save_point_and_the_same_srun_resumes(slurm, uninterrupted):
    """What SLURM does when it preempts a job (or its time limit is near, with --signal):
    SIGTERM to every task. They agree on a step, save, exit 75; srun again resumes there."""
    import time

    from tfdist.checkpoint import read_state

    reports, _ = uninterrupted
    out = tempfile.mkdtemp(prefix="tfdist-slurm-term-")
    port = _free_base(2)
    progress = os.path.join(out, "progress")
    args = ["-N", "2", "-n", "2", sys.executable, SCRIPT, "--out", out, "--slurm_port",
            str(port), "--backup", os.path.join(out, "backup"), "--progress", progress,
            "--step_delay", "0.3"]
    try:
        first = subprocess.Popen(["srun", *args], env=_env(slurm), stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True, cwd=REPO)
        deadline = time.monotonic() + TIMEOUT
        lines = []
        while len(lines) < 5 or int(lines[-1].split()[0]) < 5:  # mid-way through epoch 2 of 3
            assert first.poll() is None and time.monotonic() < deadline, first.communicate()
            time.sleep(0.05)
            lines = (open(progress).read().split("\n")[:-1] if os.path.exists(progress)
                     else [])
        at_sigterm, job = int(lines[-1].split()[0]), lines[-1].split()[1]
        subprocess.run(["scancel", "--signal=TERM", job], env=_env(slurm), check=True,
                       timeout=30)
        _, stderr = first.communicate(timeout=TIMEOUT)
        state = read_state(os.path.join(out, "backup"))
        assert state is not None, stderr[-3000:]
        assert at_sigterm <= state["step"] <= at_sigterm + 10, (at_sigterm, state)
        assert f"tfdist: preempted at step {state['step']}" in stderr, stderr[-3000:]
        assert first.returncode == 75, stderr[-3000:]
        second = _srun(slurm, *args[:-4])
        assert second.returncode == 0, second.stderr[-3000:]
        resumed = _reports(out, ("0", "1"))
        np.testing.assert_array_equal(resumed["0"]["weights"], resumed["1"]["weights"])
        np.testing.assert_allclose(resumed["0"]["weights"], reports["0"]["weights"],
                                   rtol=0, atol=1e-6)
    finally:
        shutil.rmtree(out, ignore_errors=True)

"""The launcher on tiny scripts (no TensorFlow): prefixes, exit codes, stopping, restarts,
the job's end policy, bad input, output limits, no orphans."""

import io
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from tfdist import cluster as cluster_lib
from tfdist import launch as launch_lib
from tests.support import REPO, alive

PY = sys.executable


def _script(tmp_path, body: str) -> str:
    path = tmp_path / "child.py"
    path.write_text("import json, os, sys, time, signal\n"
                    "TASK = json.loads(os.environ['TF_CONFIG'])['task']\n"
                    "NAME = f\"{TASK['type']}:{TASK['index']}\"\n" + textwrap.dedent(body))
    return str(path)



def _run(cmd, **kwargs):
    out, err = io.StringIO(), io.StringIO()
    result = launch_lib.launch(cmd, stdout=out, stderr=err, **kwargs)
    for task in result.tasks:
        assert not alive(task.pid), f"{task} left running"
    return result, out.getvalue(), err.getvalue()


@pytest.mark.timeout(60)
def test_prefixes_output_and_sets_tf_config(tmp_path):
    script = _script(tmp_path, """
        print("hello from", NAME, json.loads(os.environ["TF_CONFIG"])["cluster"]["worker"][1])
        print("to stderr", file=sys.stderr)
        job_dir = os.environ["TFDIST_SCRATCH_DIR"]
        open(os.path.join(job_dir, NAME.replace(":", "")), "w").write("scratch")
        print("job dir", job_dir, os.path.isdir(job_dir), oct(os.stat(job_dir).st_mode & 0o777))
        print("attempt", os.environ["TFDIST_LAUNCH_ATTEMPT"])
    """)
    result, out, err = _run([PY, script], num_workers=2)
    assert result.returncode == 0 and result.attempts == 1, err
    port1 = result.cluster.worker[1]
    assert f"[worker:0] hello from worker:0 {port1}" in out
    assert f"[worker:1] hello from worker:1 {port1}" in out
    assert "[worker:1] to stderr" in err
    assert "[worker:0] attempt 1" in out and "[worker:1] attempt 1" in out
    assert all(a.startswith("127.0.0.1:") for a in result.cluster.worker)
    assert "TF_CONFIG" not in os.environ and "TFDIST_SCRATCH_DIR" not in os.environ
    # One scratch directory for the job, private, removed when the job ends.
    job_dirs = {line.split()[3] for line in out.splitlines() if " job dir " in line}
    assert len(job_dirs) == 1 and "True 0o700" in out, out
    assert not os.path.exists(job_dirs.pop())


@pytest.mark.timeout(60)
def test_first_failure_decides_and_stops_the_others(tmp_path):
    script = _script(tmp_path, """
        if NAME == "worker:1":
            sys.exit(3)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # like TensorFlow: needs SIGKILL
        time.sleep(60)
    """)
    start = time.monotonic()
    result, out, err = _run([PY, script], num_workers=3, grace_period=1.0)
    assert result.returncode == 3
    assert result.failed_task == "worker:1"
    assert "worker:1 exited with code 3; stopped the other tasks" in err
    assert time.monotonic() - start < 20
    stopped = {t.task: t.stopped for t in result.tasks}
    assert stopped == {"worker:0": True, "worker:1": False, "worker:2": True}


@pytest.mark.timeout(60)
def test_killed_task_exit_code_is_128_plus_signal(tmp_path):
    script = _script(tmp_path, """
        if NAME == "worker:0":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)
    """)
    result, _, err = _run([PY, script], num_workers=2, grace_period=1.0)
    assert result.returncode == 128 + signal.SIGKILL
    assert "worker:0 was killed by SIGKILL" in err


@pytest.mark.timeout(60)
def test_parameter_server_job_result_is_the_chiefs(tmp_path):
    script = _script(tmp_path, """
        if NAME == "chief:0":
            time.sleep(0.5)
            sys.exit(0)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        time.sleep(60)   # ps and worker servers never exit on their own
    """)
    start = time.monotonic()
    result, _, err = _run([PY, script], num_workers=2, num_ps=1, chief=True, grace_period=1.0)
    assert result.returncode == 0, err
    assert "chief:0 exited 0" in err
    assert time.monotonic() - start < 20
    assert {t.task for t in result.tasks} == {"chief:0", "worker:0", "worker:1", "ps:0"}


@pytest.mark.timeout(60)
def test_restart_uses_fresh_ports_and_can_succeed(tmp_path):
    script = _script(tmp_path, """
        if os.environ["TFDIST_LAUNCH_ATTEMPT"] == "1" and NAME == "worker:1":
            sys.exit(7)
    """)
    result, _, err = _run([PY, script], num_workers=2, max_restarts=2)
    assert result.returncode == 0 and result.attempts == 2, err
    assert "restarting the group with fresh ports (restart 1 of 2)" in err


@pytest.mark.timeout(60)
def test_gives_up_after_max_restarts(tmp_path):
    script = _script(tmp_path, "sys.exit(5 if NAME == 'worker:0' else 0)\n")
    result, _, err = _run([PY, script], num_workers=1, max_restarts=1)
    assert (result.returncode, result.attempts) == (5, 2)
    assert "giving up after 2 attempts" in err


@pytest.mark.timeout(60)
def test_timeout_stops_everything(tmp_path):
    script = _script(tmp_path, "time.sleep(60)\n")
    result, _, err = _run([PY, script], num_workers=2, timeout=1.0, grace_period=1.0)
    assert result.returncode == launch_lib.TIMEOUT_EXIT_CODE
    assert "timed out" in err


def test_bad_input_is_rejected_before_starting(tmp_path):
    def rejects(pattern, cmd=(PY, "-c", "pass"), **kwargs):
        kwargs.setdefault("num_workers", 1)
        with pytest.raises(ValueError, match=pattern):
            launch_lib.launch(list(cmd) if not isinstance(cmd, str) else cmd, **kwargs)

    rejects(r"num_workers must be an integer >= 1. Received: num_workers=0", num_workers=0)
    rejects(r"The script 'missing\.py' does not exist", [PY, "-u", "missing.py"])
    rejects(r"not on PATH", ["no-such-program-xyz"])
    rejects(r"needs a chief", num_ps=1)
    rejects(r"non-empty list", "python x.py")
    rejects(r"NUL character", [PY, "-c", "pass\0"])
    # What used to be PermissionError / Exec format error tracebacks from Popen.
    not_executable = tmp_path / "job.sh"
    not_executable.write_text("#!/bin/sh\necho hi\n")
    rejects(r"is not executable .*\(chmod \+x", [str(not_executable)])
    no_shebang = tmp_path / "job"
    no_shebang.write_text("echo hi\n")
    no_shebang.chmod(0o755)
    rejects(r"neither a binary nor a script with a #! line.*Exec format error", [str(no_shebang)])
    bad_shebang = tmp_path / "job2"
    bad_shebang.write_text("#!/no/such/interpreter\necho hi\n")
    bad_shebang.chmod(0o755)
    rejects(r"'/no/such/interpreter' is not an executable file", [str(bad_shebang)])
    rejects(r"is a directory, not a program", [str(tmp_path)])
    # Times: finite and positive (a NaN timeout or negative grace used to be accepted).
    rejects(r"timeout must be a finite number of seconds > 0", timeout=float("nan"))
    rejects(r"progress_timeout must be a finite number of seconds > 0", progress_timeout=0)
    rejects(r"grace_period must be a finite number of seconds >= 0", grace_period=-1)
    rejects(r"grace_period must be a finite number of seconds >= 0", grace_period=float("nan"))
    rejects(r"network must be one of auto, private, host", network="lan")
    rejects(r"max_worker_restarts restarts one worker of a parameter-server job alone; this "
            r"job has no ps", max_worker_restarts=1)


def test_more_tasks_than_open_files_allow_is_refused_up_front():
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        pytest.skip("no open-file limit here")
    # Used to fail midway with "OSError: [Errno 24] Too many open files".
    with pytest.raises(ValueError, match=rf"may open only {soft} \(ulimit -n\).*expected at "
                                         rf"most \d+ here. Raise the limit"):
        launch_lib.launch([PY, "-c", "pass"], num_workers=soft // 3 + 1)


def test_bare_python_is_the_launchers_own_interpreter(tmp_path):
    """`python` is sys.executable, not the first python on the tasks' PATH."""
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    for name in ("python", "python3"):
        fake = fake_bin / name
        fake.write_text("#!/bin/sh\necho the wrong python\n")
        fake.chmod(0o755)
    env = dict(os.environ, PATH=f"{fake_bin}{os.pathsep}{os.environ['PATH']}")
    code = "import sys; print('interpreter', sys.executable)"
    result, out, err = _run(["python", "-c", code], num_workers=1, env=env)
    assert result.ok, err
    assert f"[worker:0] interpreter {sys.executable}" in out
    assert f"running python = {sys.executable} (the launcher's own interpreter)" in err
    # Negative control: a path is taken as given.
    result, out, _ = _run([str(fake_bin / "python3")], num_workers=1, env=env)
    assert result.ok and "[worker:0] the wrong python" in out


def test_taken_port_is_a_clear_error(tmp_path):
    port = cluster_lib.free_ports(1)[0]
    cluster = cluster_lib.Cluster(worker=(f"127.0.0.1:{port}",))
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))
        sock.listen()
        with pytest.raises(ValueError, match=rf"Port {port} of worker:0 .* already in use"):
            launch_lib.launch([PY, "-c", "pass"], num_workers=1, cluster=cluster,
                              network="host")


def _launcher_process(tmp_path, body, *, network="auto", shell=False, env=None):
    script = _script(tmp_path, body)
    cmd = [PY, script]
    if shell:
        # Grandchildren: the task is a shell that starts two Pythons.
        cmd = ["sh", "-c", f"{PY} {script} & {PY} {script} & wait"]
    return subprocess.Popen(
        [PY, "-m", "tfdist.launch", "--num_workers=2", "--grace_period=1",
         f"--network={network}", "--", *cmd],
        cwd=REPO, env=dict(os.environ, PYTHONPATH=REPO, **(env or {})), stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True)


def _child_pids(proc, n):
    pids = []
    while len(pids) < n:
        line = proc.stdout.readline()
        assert line, proc.stderr.read()
        if "pid=" in line:
            pids.append(int(line.rsplit("pid=", 1)[1]))
    return pids


def _gone(pids, seconds=10):
    deadline = time.monotonic() + seconds
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [p for p in pids if alive(p)]


_SLEEPER = """
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if os.environ.get("ESCAPE") and os.fork() == 0:
        os.setsid()  # leaves the task's process group and session
        os.write(1, f"escaped pid={os.getpid()}{chr(10)}".encode())  # one write: pipes are shared
        time.sleep(60)
        os._exit(0)
    os.write(1, f"{NAME} pid={os.getpid()}{chr(10)}".encode())
    time.sleep(60)
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("network", ["private", "host"])
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL])
def test_signalled_launcher_leaves_no_children_or_grandchildren(tmp_path, sig, network):
    # In the private namespace even processes that left their process group die.
    escape = network == "private"
    proc = _launcher_process(tmp_path, _SLEEPER, network=network, shell=True,
                             env={"ESCAPE": "1"} if escape else None)
    pids = []
    try:
        pids = _child_pids(proc, 8 if escape else 4)
        proc.send_signal(sig)
        rc = proc.wait(timeout=20)
        if sig != signal.SIGKILL:
            assert rc == 128 + sig
        assert not _gone(pids), "orphaned (grand)children"
    finally:
        proc.kill()
        proc.wait()
        for pid in pids:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.timeout(60)
def test_parent_death_signal_alone_leaves_grandchildren(tmp_path):
    """Negative control for the test above: without the job keeper, grandchildren survive."""
    from tfdist.launch import isolation

    script = _script(tmp_path, _SLEEPER)
    # The launcher's way of starting a task (parent-death signal), minus the keeper.
    parent_py = tmp_path / "parent.py"
    parent_py.write_text(textwrap.dedent(f"""
        import os, subprocess, sys, time
        subprocess.Popen([sys.executable, "-I", "-S", {isolation.ENTER_SCRIPT!r}, str(os.getpid()),
                          "-1", "-1", "/bin/sh", "-c", {PY + " " + script + " & wait"!r}])
        time.sleep(60)
    """))
    env = dict(os.environ, TF_CONFIG=json.dumps({"task": {"type": "worker", "index": 0}}))
    parent = subprocess.Popen([PY, str(parent_py)], stdout=subprocess.PIPE, text=True, env=env)
    pids = []
    try:
        pids = _child_pids(parent, 1)
        parent.kill()
        parent.wait()
        assert _gone(pids, seconds=3) == pids, "expected the grandchild to outlive its parents"
    finally:
        parent.kill()
        for pid in pids:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.timeout(60)
def test_closed_stdout_does_not_stop_the_job(tmp_path):
    """`tfdist launch ... | head -1`: the relay keeps draining the tasks, no traceback."""
    proc = _launcher_process(tmp_path, "for i in range(20000): print(NAME, i)\n")
    assert proc.stdout.readline()
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait(timeout=50) == 0, err
    assert "all 2 tasks exited 0" in err and "Traceback" not in err


def test_cli_without_a_command_fails_with_usage():
    result = subprocess.run([PY, "-m", "tfdist.cli", "launch", "--num_workers=2"], cwd=REPO,
                            env=dict(os.environ, PYTHONPATH=REPO), capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 2
    assert "no command to run" in result.stderr


# --- the job's end policy ---------------------------------------------------------------------
_PS_JOB = """
    job = os.environ["TFDIST_SCRATCH_DIR"]
    first = os.path.join(job, "worker1-first-start")
    back = os.path.join(job, "worker1-back")
    os.write(1, f"{NAME} pid={os.getpid()}{chr(10)}".encode())
    if NAME == "chief:0":
        deadline = time.monotonic() + 30
        while not os.path.exists(back) and time.monotonic() < deadline:
            time.sleep(0.05)
        sys.exit(0 if os.path.exists(back) else 9)
    if NAME == "worker:1":
        if not os.path.exists(first):
            open(first, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        open(back, "w").close()
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    time.sleep(60)   # ps and worker servers never exit on their own
"""


@pytest.mark.timeout(60)
def test_parameter_server_worker_is_restarted_alone(tmp_path):
    script = _script(tmp_path, _PS_JOB)
    result, out, err = _run([PY, script], num_workers=2, num_ps=1, chief=True, grace_period=1.0)
    assert result.returncode == 0, err
    assert ("worker:1 was killed by SIGKILL; restarting it alone on the same address "
            "(restart 1 of 3); the other tasks keep running") in err
    restarts = {t.task: t.restarts for t in result.tasks}
    assert restarts == {"chief:0": 0, "worker:0": 0, "worker:1": 1, "ps:0": 0}
    started = [line.split("] ", 1)[1].split()[0] for line in out.splitlines() if "pid=" in line]
    assert sorted(started) == ["chief:0", "ps:0", "worker:0", "worker:1", "worker:1"]
    assert result.attempts == 1


@pytest.mark.timeout(60)
def test_parameter_server_job_fails_when_no_worker_is_left(tmp_path):
    script = _script(tmp_path, """
        if NAME.startswith("worker"):
            sys.exit(3)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        time.sleep(60)
    """)
    result, _, err = _run([PY, script], num_workers=2, num_ps=1, chief=True,
                          max_worker_restarts=1, grace_period=1.0)
    assert result.returncode == 3, err
    assert "and no worker is left to run the training steps" in err
    assert {t.task: t.restarts for t in result.tasks if t.task.startswith("worker")} == {
        "worker:0": 1, "worker:1": 1}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("lost_peer", [True, False])
def test_task_that_left_first_is_named(tmp_path, lost_peer):
    """A peer exiting 0 early makes the survivor crash: the early one is to blame."""
    error = ("tensorflow.python.framework.errors_impl.UnavailableError: Socket closed"
             if lost_peer else "ValueError: a bug of its own")
    script = _script(tmp_path, f"""
        if NAME == "worker:1":
            sys.exit(0)
        time.sleep(1)
        print({error!r}, file=sys.stderr)
        sys.exit(1)
    """)
    result, _, err = _run([PY, script], num_workers=2)
    assert result.returncode == 1
    if lost_peer:
        assert result.failed_task == "worker:1"
        assert ("worker:1 left the job first: it exited 0 while its peers were still training, "
                "and then worker:0 exited with code 1 because its peer was gone") in err
    else:  # negative control: an unrelated failure is the survivor's own
        assert result.failed_task == "worker:0"
        assert "worker:0 exited with code 1; stopped the other tasks." in err


@pytest.mark.timeout(60)
def test_silent_task_ends_the_job_after_progress_timeout(tmp_path):
    script = _script(tmp_path, """
        signal.signal(signal.SIGTERM, signal.SIG_IGN)   # hung in C++: only SIGKILL ends it
        for i in range(600):
            if NAME == "worker:0" or i == 0:
                print(NAME, "step", i, flush=True)
            time.sleep(0.1)
    """)
    result, out, err = _run([PY, script], num_workers=2, progress_timeout=2, grace_period=0.5)
    assert result.returncode == launch_lib.TIMEOUT_EXIT_CODE, err
    assert result.failed_task == "worker:1"
    assert "worker:1 wrote nothing for 2 s (--progress_timeout): it looks hung" in err
    # Servers of a parameter-server job are silent by nature: only the chief is watched.
    script = _script(tmp_path, """
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        for i in range(30 if NAME == "chief:0" else 600):
            if NAME == "chief:0":
                print("step", i, flush=True)
            time.sleep(0.1)
    """)
    result, _, err = _run([PY, script], num_workers=1, num_ps=1, chief=True, progress_timeout=1,
                          grace_period=0.5)
    assert result.returncode == 0, err


# --- output -----------------------------------------------------------------------------------
_TF_STARTUP = [
    "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR",
    "I0000 00:00:1795456104.971374   22509 port.cc:153] oneDNN custom operations are on. You "
    "may see slightly different numerical results due to floating-point round-off errors from "
    "different computation orders. To turn them off, set the environment variable "
    "`TF_ENABLE_ONEDNN_OPTS=0`.",
    "I0000 00:00:1795456104.971674   22509 cudart_stub.cc:31] Could not find cuda drivers on "
    "your machine, GPU will not be used.",
    "I0000 00:00:1795456105.159167   22509 cpu_feature_guard.cc:227] This TensorFlow binary is "
    "optimized to use available CPU instructions in performance-critical operations.",
    "To enable the following instructions: AVX2 AVX512F FMA, in other operations, rebuild "
    "TensorFlow with the appropriate compiler flags.",
    "E0000 00:00:1795456114.737798   22509 cuda_platform.cc:52] failed call to cuInit: "
    "INTERNAL: CUDA error: Failed call to cuInit: UNKNOWN ERROR (303)",
]


@pytest.mark.timeout(60)
def test_tensorflow_startup_lines_are_dropped_unless_asked_for(tmp_path):
    lines = _TF_STARTUP + ["E0000 00:00:1.0   1 some_op.cc:1] a real error stays"]
    script = _script(tmp_path, f"""
        for line in {lines!r}:
            print(line, file=sys.stderr)
    """)
    _, _, err = _run([PY, script], num_workers=1)
    assert "[worker:0] E0000 00:00:1.0   1 some_op.cc:1] a real error stays" in err
    for line in _TF_STARTUP:
        assert line not in err
    _, _, err = _run([PY, script], num_workers=1, tf_logs=True)
    for line in _TF_STARTUP:
        assert f"[worker:0] {line}" in err


@pytest.mark.timeout(60)
def test_output_without_newlines_is_passed_on_in_bounded_pieces(tmp_path):
    from tfdist.launch import output

    script = _script(tmp_path, """
        sys.stdout.write("x" * (3 * 65536 + 10))
        sys.stdout.write("\\nend\\n")
    """)
    result, out, _ = _run([PY, script], num_workers=1)
    assert result.ok
    pieces = out.splitlines()
    assert [len(p) for p in pieces] == [len("[worker:0] ") + output.MAX_LINE + len(
        " [tfdist launch: line longer than 65536 bytes, continued on the next line]")] * 3 + [
        len("[worker:0] ") + 10, len("[worker:0] end")]
    assert "".join(p.split("] ", 1)[1].split(" [tfdist")[0] for p in pieces[:4]) == "x" * (
        3 * 65536 + 10)


@pytest.mark.timeout(120)
def test_launcher_memory_stays_bounded_on_output_without_newlines(tmp_path):
    """Two tasks write 100 MB each without a newline; the launcher stays far below that."""
    script = _script(tmp_path, """
        chunk = "x" * (1 << 20)
        for _ in range(100):
            sys.stdout.write(chunk)
    """)
    # A small parent process measures: a child forked from this (TensorFlow-sized) pytest
    # process would count pytest's pages in its peak until it execs.
    measure = ("import resource, subprocess, sys; "
               "r = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL, timeout=80); "
               "print(r.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")
    result = subprocess.run(
        [PY, "-c", measure, PY, "-m", "tfdist.launch", "--num_workers=2", "--", PY, script],
        cwd=REPO, env=dict(os.environ, PYTHONPATH=REPO), capture_output=True, text=True,
        timeout=110)
    returncode, peak_kib = map(int, result.stdout.split())
    assert returncode == 0, result.stderr
    # The peak of the launcher and every process it started (KiB).
    assert peak_kib < 100 * 1024, f"launcher peaked at {peak_kib // 1024} MiB"


# --- the command line -------------------------------------------------------------------------
@pytest.mark.timeout(120)
def test_every_subcommand_help_names_the_subcommand():
    from tfdist import cli

    for command in cli.COMMANDS:
        result = subprocess.run([PY, "-m", "tfdist.cli", command, "--help"], cwd=REPO,
                                env=dict(os.environ, PYTHONPATH=REPO), capture_output=True,
                                text=True, timeout=60)
        usage = f"USAGE: tfdist {command} [flags]"  # was "USAGE: .../tfdist [flags]"
        assert result.stdout.lstrip().startswith(usage), result.stdout[:300] + result.stderr
        if command != "presets":  # the one command without flags
            assert f"\ntfdist {command}:\n" in result.stdout  # its own flags are listed
    result = subprocess.run([PY, "-m", "tfdist.launch", "--help"], cwd=REPO,
                            env=dict(os.environ, PYTHONPATH=REPO), capture_output=True, text=True,
                            timeout=60)
    assert result.stdout.lstrip().startswith(
        "USAGE: python -m tfdist.launch [flags] -- COMMAND [ARGS...]")
    text = " ".join(result.stdout.split())
    for needle in ("the launcher's own interpreter", "TFDIST_LAUNCH_ATTEMPT (1 for the first "
                   "start", "TFDIST_SCRATCH_DIR", "trusted network", "--progress_timeout",
                   "--network", "--nnodes", "--coordinator"):
        assert needle in text, needle


_UNPRIVILEGED_DRIVER = """
import os, subprocess, sys
keeper_script, enter_script = sys.argv[1:3]
keeper = subprocess.Popen([sys.executable, "-I", "-S", keeper_script, "--private-network"],
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                          start_new_session=True)
print(keeper.stdout.readline().strip())
user = os.open(f"/proc/{keeper.pid}/ns/user", os.O_RDONLY)
net = os.open(f"/proc/{keeper.pid}/ns/net", os.O_RDONLY)
code = ("import os, socket; s = socket.socket(); s.bind(('0.0.0.0', 0)); s.listen(); "
        "print(os.getuid(), os.getgid(), "
        "[l.split(':')[0].strip() for l in open('/proc/net/dev').readlines()[2:]])")
task = subprocess.run([sys.executable, "-I", "-S", enter_script, str(os.getpid()), str(user),
                       str(net), sys.executable, "-c", code], pass_fds=(user, net),
                      capture_output=True, text=True, timeout=30)
print(task.stdout.strip(), task.stderr.strip())
keeper.stdin.close()
keeper.wait(timeout=30)
"""


@pytest.mark.timeout(60)
def test_private_network_for_an_unprivileged_user():
    """Not root: the keeper makes the namespace inside a user namespace mapping our own ids."""
    import shutil

    from tfdist.launch import isolation

    if os.geteuid() != 0:
        pytest.skip("needs root to switch to the unprivileged user 'nobody'")
    nobody = {"user": 65534, "group": 65534, "extra_groups": [], "cwd": "/"}
    probe = f"open({isolation.KEEPER_SCRIPT!r}); open({isolation.ENTER_SCRIPT!r})"

    def usable(python):
        try:
            return subprocess.run([python, "-c", probe], capture_output=True, timeout=30,
                                  **nobody).returncode == 0
        except OSError:  # 'nobody' may not execute it
            return False

    python = next((p for p in (sys.executable, "/usr/bin/python3", shutil.which("python3"))
                   if p and usable(p)), None)
    if python is None:
        pytest.skip("no Python that user 'nobody' may run with tfdist's scripts readable")
    result = subprocess.run([python, "-c", _UNPRIVILEGED_DRIVER, isolation.KEEPER_SCRIPT,
                             isolation.ENTER_SCRIPT], capture_output=True, text=True,
                            timeout=50, **nobody)
    lines = result.stdout.splitlines()
    if lines and lines[0].startswith("unavailable"):
        pytest.skip(f"unprivileged user namespaces are not allowed here: {lines[0]}")
    assert [line.strip() for line in lines[:2]] == ["ready private", "65534 65534 ['lo']"], (
        result.stdout + result.stderr)

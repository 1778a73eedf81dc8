"""`tfdist tf-config`, run as the user runs it (a subprocess; no TensorFlow import)."""

import json
import os
import shlex
import subprocess
import sys

import pytest
import yaml

from tfdist import cluster as C


def run(*args, tf_config=None, extra_env=None):
    env = {k: v for k, v in os.environ.items()
           if k != "TF_CONFIG" and not k.startswith("SLURM")}
    if tf_config is not None:
        env["TF_CONFIG"] = tf_config
    env.update(extra_env or {})
    return subprocess.run([sys.executable, "-m", "tfdist.cli", "tf-config", *args],
                          capture_output=True, text=True, env=env, timeout=60)


def assert_clean(proc):
    assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout


GOOD = json.dumps({"cluster": {"chief": ["c:1"], "worker": ["a:1", "b:1"]},
                   "task": {"type": "worker", "index": 1}})


@pytest.mark.parametrize("tf_config,code,stream,fragments", [
    (GOOD, 0, "stdout", ["TF_CONFIG OK: task worker:1 at b:1; cluster chief=1 worker=2; "
                         "is_chief=False"]),
    (GOOD.replace('"index": 1', '"index": 7'), 1, "stderr",
     ["error: Task worker:7 is out of range", "index must be 0..1"]),
    ('{"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", "index": 0}',
     1, "stderr", ["not valid JSON", "line 1 column"]),
    ('{"cluster": {"worker": ["a:1"], "evaluator": ["e:1"]}, '
     '"task": {"type": "worker", "index": 0}}', 1, "stderr", ["lists an 'evaluator'"]),
    (None, 2, "stderr", ["TF_CONFIG is not set"]),
    # TensorFlow 2's strategies reject 'master': --check says so first.
    ('{"cluster": {"master": ["m:1"]}, "task": {"type": "master", "index": 0}}', 1, "stderr",
     ["error:", 'rename "master" to "chief"']),
    ('{"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", "index": 0}, "x": 1}', 0,
     "stderr", ["warning: TF_CONFIG has keys TensorFlow ignores: 'x'"]),
    # Invalid UTF-8 in the environment: the message still prints, escaped.
    (b'{"cluster": {"worker": ["[fe80::1%\xff]:1"]}, "task": {"type": "worker", "index": 0}}',
     1, "stderr", ["invalid UTF-8", "\\udcff"]),
    ("[" * 3000 + "]" * 3000, 1, "stderr", ["nested too deeply"]),
])
def test_check_exit_codes_and_messages(tf_config, code, stream, fragments):
    proc = run("--check", tf_config=tf_config)
    assert proc.returncode == code, (proc.stdout, proc.stderr)
    assert_clean(proc)
    for fragment in fragments:
        assert fragment in getattr(proc, stream)
    if code == 1:
        assert proc.stdout == ""


def test_check_given_value():
    proc = run("--check", "--tf_config", GOOD)
    assert proc.returncode == 0 and "worker:1" in proc.stdout


def test_local_prints_one_line_per_task():
    proc = run("--local", "--num_workers=2", "--num_ps=1", "--chief", "--evaluator")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 5
    configs = []
    for line in lines:
        (assignment,) = shlex.split(line)  # one shell word: safe for `export`
        name, _, value = assignment.partition("=")
        assert name == "TF_CONFIG"
        configs.append(C.parse_tf_config(value))
    assert [(c.task_type, c.task_id) for c in configs] == [
        ("chief", 0), ("worker", 0), ("worker", 1), ("ps", 0), ("evaluator", 0)]
    assert len({c.cluster for c in configs}) == 1
    assert all(a.startswith("127.0.0.1:") for a in configs[0].cluster.cluster_dict()["worker"])


def test_local_json_one_task():
    proc = run("--local", "--num_workers=2", "--format=json", "--task=worker:1")
    config = C.parse_tf_config(proc.stdout.strip())
    assert (config.task_type, config.task_id) == ("worker", 1)


def test_hosts_and_slurm():
    proc = run("--hosts=a,b,c", "--num_ps=1", "--port=7000", "--format=json")
    configs = [C.parse_tf_config(line) for line in proc.stdout.splitlines()]
    assert configs[0].cluster.cluster_dict() == {"worker": ["a:7000", "b:7000"], "ps": ["c:7000"]}
    slurm = {"SLURM_PROCID": "2", "SLURM_STEP_NODELIST": "n[1-2]",
             "SLURM_STEP_TASKS_PER_NODE": "2,1", "SLURM_STEP_NUM_TASKS": "3"}
    proc = run("--slurm", "--num_ps=1", "--format=json", "--slurm_addresses=name",
               extra_env=slurm)
    config = C.parse_tf_config(proc.stdout)
    assert (config.task_type, config.task_id, config.address) == ("worker", 1, "n2:8888")
    proc = run("--slurm", "--num_workers=1", "--slurm_addresses=name", extra_env=slurm)
    assert proc.returncode == 1 and "step has 3 task(s)" in proc.stderr
    proc = run("--slurm")
    assert proc.returncode == 1 and "not found in the environment" in proc.stderr
    assert_clean(proc)


def test_kubernetes_yaml():
    proc = run("--kubernetes", "--name=mnist", "--image=img:1", "--num_workers=2", "--chief",
               "--", "python", "train.py", "--epochs=3")
    assert proc.returncode == 0, proc.stderr
    manifest = yaml.safe_load(proc.stdout)
    assert manifest == C.kubernetes_tfjob(name="mnist", image="img:1", chief=True,
                                          command=["python", "train.py", "--epochs=3"],
                                          num_workers=2)


@pytest.mark.parametrize("args,code,fragment", [
    ((), 2, "choose exactly one of --check"),
    (("--local", "--check"), 2, "Received: --check, --local"),
    (("--local",), 2, "--local needs --num_workers"),
    (("--local", "--num_workers=0"), 1, "num_workers must be an integer from 1 to 1000"),
    (("--kubernetes", "--name=x"), 2, "--kubernetes needs --image, --num_workers, a command"),
    (("--hosts=a", "--num_workers=1"), 2, "--hosts takes no --num_workers"),
    (("--check", "extra"), 2, "unexpected arguments: extra"),
    (("--hosts=",), 1, "Not enough hosts: 0 host(s)"),
    (("--local", "--num_workers=1", "--task=chief:0"), 2, "not a task of this cluster"),
])
def test_usage_errors(args, code, fragment):
    proc = run(*args)
    assert proc.returncode == code, (proc.stdout, proc.stderr)
    assert fragment in proc.stderr
    assert_clean(proc)


def test_check_roles_for_a_strategy():
    with_ps = json.dumps({"cluster": {"worker": ["a:1"], "ps": ["p:1"]},
                          "task": {"type": "worker", "index": 0}})
    proc = run("--check", "--strategy=multi_worker_mirrored", tf_config=with_ps)
    assert proc.returncode == 1 and "has no parameter servers" in proc.stderr
    assert_clean(proc)
    proc = run("--check", "--strategy=multi_worker_mirrored", tf_config=GOOD)
    assert proc.returncode == 0, proc.stderr


def test_help_lists_the_command_flags():
    proc = run("--help")  # absl exits 1 after --help; what matters is the text
    for flag in ("--[no]check", "--[no]local", "--hosts", "--[no]slurm", "--[no]kubernetes",
                 "--num_workers", "--strategy"):
        assert flag in proc.stdout


def test_every_command_help_lists_its_own_flags():
    from tests.support import run_python

    result = run_python("-m", "tfdist.cli", "tf-config", "--help", timeout=60)
    assert "--[no]check" in result.stdout and "--num_workers" in result.stdout, result.stdout

"""parameter_server preset: options, bad input and cluster errors (no cluster runs)."""

import json
import re

import pytest

import tfdist
from tfdist import config as config_lib


def test_defaults_and_registry():
    opts = tfdist.make_options("parameter_server", local_workers=2, local_ps=1)
    assert opts.is_local and not opts.shards_variables
    assert "parameter_server" in tfdist.available_presets()
    assert tfdist.make_options("parameter_server", shard_count=2).shards_variables
    assert tfdist.make_options("parameter_server", min_shard_bytes=1024,
                               max_shards=2).shards_variables


@pytest.mark.parametrize("kwargs, pattern", [
    (dict(shard_count=0), r"shard_count must be an integer >= 1\. Received: shard_count=0"),
    (dict(shard_count=-2), r"Received: shard_count=-2"),
    (dict(min_shard_bytes=0),
     r"min_shard_bytes must be an integer >= 1\. Received: min_shard_bytes=0"),
    (dict(min_shard_bytes=1024, max_shards=0), r"Received: max_shards=0"),
    (dict(max_shards=2), r"max_shards only bounds min_shard_bytes"),
    (dict(shard_count=2, min_shard_bytes=10), r"either shard_count .* or min_shard_bytes"),
    (dict(local_workers=2), r"local_workers and local_ps together"),
    (dict(local_workers=0, local_ps=1), r"Received: local_workers=0"),
    (dict(local_workers=1, local_ps=0), r"Received: local_ps=0"),
    (dict(connect_timeout=0), r"connect_timeout must be a finite number of seconds > 0"),
    (dict(connect_timeout=float("inf")), r"Received: connect_timeout=inf"),
    (dict(connect_timeout=float("nan")), r"Received: connect_timeout=nan"),
    (dict(skip_completed_reruns="yes"), r"skip_completed_reruns must be True or False"),
    (dict(shard_count=True), r"Received: shard_count=True"),
])
def test_bad_options_are_rejected(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        config_lib.ParameterServerOptions(**kwargs)


def _tf_config(cluster, task_type="chief", index=0):
    return json.dumps({"cluster": cluster, "task": {"type": task_type, "index": index}})


def test_no_cluster_is_a_clear_error(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    with pytest.raises(ValueError, match=r"needs a cluster.*local_workers=2, local_ps=1"):
        tfdist.make_strategy("parameter_server")


def test_tf_config_without_ps_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("TF_CONFIG", _tf_config(
        {"chief": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"]}))
    with pytest.raises(ValueError, match=r"ParameterServerStrategy needs at least one ps"):
        tfdist.make_strategy("parameter_server")


@pytest.mark.parametrize("task_type", ["worker", "ps", "chief"])
def test_cluster_without_chief_is_a_clear_error_not_a_server_forever(monkeypatch, task_type):
    """A worker or ps of a cluster with no coordinator used to serve forever."""
    cluster = {"worker": ["127.0.0.1:1"], "ps": ["127.0.0.1:2"]}
    if task_type == "chief":
        cluster = {"chief": ["127.0.0.1:3"], "ps": ["127.0.0.1:2"]}
    monkeypatch.setenv("TF_CONFIG", _tf_config(cluster, task_type))
    missing = "at least one worker" if task_type == "chief" else "a chief"
    with pytest.raises(ValueError, match=rf"ParameterServerStrategy needs {missing}"):
        tfdist.make_strategy("parameter_server", connect_timeout=1.0)


def test_unreachable_ps_fails_within_the_timeout(monkeypatch):
    ps_port, worker_port, chief_port = tfdist.free_ports(3)
    monkeypatch.setenv("TF_CONFIG", _tf_config({
        "chief": [f"127.0.0.1:{chief_port}"], "worker": [f"127.0.0.1:{worker_port}"],
        "ps": [f"127.0.0.1:{ps_port}"]}))
    import time

    start = time.monotonic()
    with pytest.raises(tfdist.ParameterServerError,
                       match=re.escape(f"ps:0 at 127.0.0.1:{ps_port}")):
        tfdist.make_strategy("parameter_server", connect_timeout=1.0)
    assert time.monotonic() - start < 10


def test_flags_are_generated():
    from absl import flags

    from tfdist import flags as tfdist_flags

    values = flags.FlagValues()
    tfdist_flags.define_flags(values)
    values(["prog", "--strategy=parameter_server", "--local_workers=2", "--local_ps=1",
            "--shard_count=2"])
    opts = tfdist_flags.strategy_options_from_flags(values)
    assert (opts.local_workers, opts.local_ps, opts.shard_count) == (2, 1, 2)


_AFTER_MIRRORED = """
import warnings
import tfdist
tfdist.configure_logical_devices(2)
{before}
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    tfdist.make_strategy("parameter_server", local_workers=1, local_ps=1)
print("WARNINGS", [str(w.message) for w in caught])
"""


@pytest.mark.timeout(180)
@pytest.mark.parametrize("before", ["mirrored", "nothing"])
def test_an_in_process_cluster_warns_that_an_earlier_strategy_stops_working(before):
    # The cluster renames the process's devices: a mirrored strategy made before it then
    # fails at its first step with "unknown device" (in a process of its own).
    import os
    import subprocess
    import sys

    from tests.support import REPO

    script = _AFTER_MIRRORED.format(before='first = tfdist.make_strategy("mirrored", num_devices=2)'
                                    if before == "mirrored" else "")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=150, cwd=REPO,
                          env=dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (line,) = [x for x in proc.stdout.splitlines() if x.startswith("WARNINGS")]
    warned = "so the mirrored strategy made earlier in this process stops working" in line
    assert warned == (before == "mirrored"), line
    if warned:
        assert "Make the parameter_server strategy first, or restart the process" in line

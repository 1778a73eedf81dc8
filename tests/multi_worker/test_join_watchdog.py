"""MultiWorkerMirroredStrategy's join, where TensorFlow would hang or fail without a name.

- A one-task TF_CONFIG whose own address is another host used to block
  `make_strategy` forever (ignoring SIGTERM): the watchdog now runs for every
  cluster and names what is wrong with the address.
- A taken port used to give "UnknownError: Could not start gRPC server"
  without the port.
"""

import json
import socket

import pytest

from tfdist import cluster as cluster_lib
from tfdist import multi_worker
from tests.support import run_python

_MAKE = ("import tfdist; s = tfdist.make_strategy('multi_worker_mirrored', join_timeout=5); "
         "print('made', s.num_replicas_in_sync)")


def _tf_config(address: str) -> str:
    return json.dumps({"cluster": {"worker": [address]}, "task": {"type": "worker", "index": 0}})


@pytest.mark.timeout(180)
def test_one_task_cluster_on_another_host_fails_within_join_timeout():
    result = run_python("-c", _MAKE, env={"TF_CONFIG": _tf_config("no-such-host.invalid:2222")},
                        timeout=150)
    assert result.returncode == -9, result.stderr[-2000:]  # the watchdog's SIGKILL
    assert ("MultiWorkerMirroredStrategy on task worker:0 gave up after waiting 5 s for the "
            "cluster (worker=1): this task's own address no-such-host.invalid:2222 does not "
            "resolve") in result.stderr
    assert "Fix this task's entry in TF_CONFIG" in result.stderr
    assert "made" not in result.stdout


def test_own_address_problems_are_named():
    def config(address):
        return cluster_lib.TFConfig(cluster=cluster_lib.Cluster(worker=(address,)),
                                    task_type="worker", task_id=0)

    assert multi_worker.own_address_problem(config("127.0.0.1:2222")) is None
    assert multi_worker.own_address_problem(config("localhost:2222")) is None
    assert "does not resolve" in multi_worker.own_address_problem(config("x.invalid:2222"))
    # 192.0.2.1 (a documentation address) resolves but is no address of this machine.
    assert multi_worker.own_address_problem(config("192.0.2.1:2222")) == (
        "this task's own address 192.0.2.1:2222 resolves to 192.0.2.1, which is not an address "
        "of this machine: its entry in TF_CONFIG must name this machine")


@pytest.mark.timeout(180)
def test_taken_port_is_named_before_tensorflow_tries_it():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run_python("-c", _MAKE, env={"TF_CONFIG": _tf_config(f"127.0.0.1:{port}")},
                            timeout=150)
    assert result.returncode == 1
    assert (f"ValueError: Port {port} of this task (worker:0, 127.0.0.1:{port}) is already in "
            f"use on this machine") in result.stderr
    assert "Could not start gRPC server" not in result.stderr

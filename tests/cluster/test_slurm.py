"""tfdist.cluster.slurm: SLURM hostlists and the TF_CONFIG of a job step (no SLURM needed).

TensorFlow's SlurmClusterResolver is the independent reference where tfdist
follows its conventions; tests/engines/test_slurm.py runs the same code under a real
SLURM.
"""

import json

import pytest

from tfdist import cluster as C
from tfdist.cluster import TFConfigError
from tfdist.cluster import slurm as slurm_lib

@pytest.mark.parametrize("hostlist,expected", [
    ("n1", ["n1"]),
    ("n[1-3]", ["n1", "n2", "n3"]),
    ("node[01-03,7]", ["node01", "node02", "node03", "node7"]),
    ("n[1-2],m5,o[3-4,6,7-9]", ["n1", "n2", "m5", "o3", "o4", "o6", "o7", "o8", "o9"]),
    ("n[08-10]", ["n08", "n09", "n10"]),
    ("a[1-2]b", ["a1b", "a2b"]),
    ("r[1-2]-n[1-2]", ["r1-n1", "r1-n2", "r2-n1", "r2-n2"]),
])
def test_expand_hostlist(hostlist, expected):
    assert C.expand_hostlist(hostlist) == expected


def test_expand_hostlist_matches_tensorflow():
    from tensorflow.python.distribute.cluster_resolver import slurm_cluster_resolver as tf_slurm
    for hostlist in ("n1", "n[1-3]", "node[01-03,7]", "n[1-2],m5,o[3-4,6,7-9]", "n[08-10]",
                     "gpu-[001-012],cpu[1,3]"):
        assert C.expand_hostlist(hostlist) == tf_slurm.expand_hostlist(hostlist)
    for value in ("1", "3(x2),2,1", "2(x3)"):
        assert C.expand_tasks_per_node(value) == tf_slurm.expand_tasks_per_node(value)


@pytest.mark.parametrize("hostlist,fragment", [
    ("n[1-2", "unbalanced"), ("n1-2]", "']' without '\\['"), ("n[[1]]", "nested '\\['"),
    ("n[a-b]", "bad range 'a-b'"), ("n[3-1]", "bad range '3-1'"), ("n1,,n2", "empty entry"),
    ("", "node list is empty"), ("n[]", "bad range ''"), ("n[1-2]x[", "unbalanced"),
    ("node[1-100000000]", "more than 100000 nodes"), ("n[1-400]m[1-400]", "more than 100000"),
    ("n\u00f6de1", "non-ASCII"), ("n 1", "spaces"), ("n[1-9999999999]", "bad range"),
])
def test_expand_hostlist_errors(hostlist, fragment):
    with pytest.raises(TFConfigError, match=fragment):
        C.expand_hostlist(hostlist)


def _slurm_env(rank, nodelist, per_node, ntasks=None):
    env = {"SLURM_PROCID": str(rank), "SLURM_STEP_NODELIST": nodelist,
           "SLURM_STEP_TASKS_PER_NODE": per_node}
    if ntasks is not None:
        env["SLURM_STEP_NUM_TASKS"] = str(ntasks)
    return env


SLURM_CASES = [
    # nodelist, tasks per node, roles
    ("node[01-02]", "2(x2)", {}),
    ("node[01-02]", "2(x2)", {"num_ps": 1}),
    ("node[01-03]", "2,1(x2)", {"num_ps": 1, "chief": True}),
    ("gpu[1-3]", "1(x3)", {"chief": True}),
    ("a[01-02],b7", "3,1,2", {"num_ps": 2}),
]


@pytest.mark.parametrize("nodelist,per_node,roles", SLURM_CASES)
def test_slurm_matches_tensorflow_resolver(monkeypatch, nodelist, per_node, roles):
    from tensorflow.python.distribute.cluster_resolver import SlurmClusterResolver

    counts = C.expand_tasks_per_node(per_node)
    num_tasks = sum(counts)
    jobs = {"worker": num_tasks - roles.get("num_ps", 0) - int(roles.get("chief", False))}
    if roles.get("num_ps"):
        jobs["ps"] = roles["num_ps"]
    if roles.get("chief"):
        jobs["chief"] = 1
    for rank in range(num_tasks):
        env = _slurm_env(rank, nodelist, per_node, num_tasks)
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        # gpus_per_node/gpus_per_task only so the resolver needs no nvidia-smi.
        resolver = SlurmClusterResolver(jobs=jobs, port_base=8888, gpus_per_node=max(counts),
                                        gpus_per_task=1, auto_set_gpu=False)
        theirs = resolver.cluster_spec().as_dict()
        ours = C.slurm_tf_config(env, addresses="name", **roles)
        assert ours.cluster.cluster_dict() == theirs
        assert (ours.task_type, ours.task_id) == resolver.get_task_info()


def test_slurm_keeps_node_order_where_tensorflow_sorts_strings():
    # SLURM gives rank 0 to node9; TF's resolver sorts 'node10' < 'node9'.
    env = _slurm_env(0, "node[9-10]", "1(x2)")
    config = C.slurm_tf_config(dict(env, SLURMD_NODENAME="node9"), addresses="name")
    assert config.address == "node9:8888"


def test_slurm_job_level_fallback_and_port():
    env = {"SLURM_PROCID": "1", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_TASKS_PER_NODE": "1(x2)",
           "SLURM_NTASKS": "2"}
    config = C.slurm_tf_config(env, port=7000, rpc_layer="grpc", addresses="name")
    assert config.cluster.cluster_dict() == {"worker": ["n1:7000", "n2:7000"]}
    assert (config.task_type, config.task_id, config.rpc_layer) == ("worker", 1, "grpc")


def test_slurm_evaluator_is_outside_the_cluster():
    config = C.slurm_tf_config(_slurm_env(1, "n[1-3]", "1(x3)"), chief=True, evaluator=True,
                               addresses="name")
    # roles in alphabetical order: chief n1, evaluator n2, worker n3
    assert (config.task_type, config.address) == ("evaluator", "n2:8888")
    assert json.loads(config.to_json())["cluster"] == {"chief": ["n1:8888"], "worker": ["n3:8888"]}


@pytest.mark.parametrize("env,kwargs,fragments", [
    ({}, {}, ["SLURM_PROCID, SLURM_STEP_NODELIST, SLURM_STEP_TASKS_PER_NODE not found",
              "srun"]),
    (_slurm_env("x", "n1", "1"), {}, ["SLURM_PROCID must be an integer"]),
    (_slurm_env(0, "n[1-2]", "1"), {}, ["gives tasks for 1 node(s)", "lists 2"]),
    (_slurm_env(0, "n1,n1", "1(x2)"), {}, ["lists a node twice"]),
    (_slurm_env(0, "n[1-2]", "1(x2)", 3), {}, ["SLURM_STEP_NUM_TASKS='3'", "adds up to 2"]),
    (_slurm_env(2, "n[1-2]", "1(x2)"), {}, ["SLURM_PROCID=2 is out of range"]),
    (_slurm_env(0, "n[1-2]", "1(x2)"), {"num_ps": 1, "chief": True},
     ["step has 2 task(s)", "chief=True", "num_ps=1", "need at least 3", "--ntasks=3"]),
    # More tasks than the roles asked for: a clear error, not extra workers.
    (_slurm_env(0, "n[1-2]", "2(x2)", 4), {"num_workers": 2},
     ["step has 4 task(s) (SLURM_STEP_TASKS_PER_NODE=2(x2))", "num_workers=2", "need 2",
      "--ntasks=2", "add up to 4"]),
    (_slurm_env(0, "n[1-2]", "1(x2)"), {"num_workers": 2, "chief": True}, ["need 3"]),
    (_slurm_env(0, "n[1-", "1"), {}, ["Invalid SLURM node list 'n[1-'", "unbalanced"]),
    (_slurm_env(0, "n1", "1"), {"addresses": "dns"}, ["addresses must be 'name', 'nodeaddr'"]),
    (_slurm_env(0, "n1", "x2"), {}, ["Invalid SLURM tasks-per-node value 'x2'"]),
    (dict(_slurm_env(1, "n[1-2]", "1(x2)"), SLURMD_NODENAME="n1"), {},
     ["rank 1 runs on 'n1'", "--distribution=block"]),
    (_slurm_env(0, "n1", "2"), {"port": 65535}, ["exceeds 65535"]),
])
def test_slurm_errors(env, kwargs, fragments):
    with pytest.raises(TFConfigError) as e:
        C.slurm_tf_config(env, **{"addresses": "name", **kwargs})
    for fragment in fragments:
        assert fragment in str(e.value), str(e.value)


def test_slurm_reads_os_environ_by_default(monkeypatch):
    for key, value in _slurm_env(0, "n1", "1").items():
        monkeypatch.setenv(key, value)
    assert C.slurm_tf_config(addresses="name").address == "n1:8888"


def test_tensorflow_resolver_still_sorts_hosts_as_strings(monkeypatch):
    """Why slurm_tf_config keeps SLURM's order: TF 2.21 gives rank 0 (on node9) node10.

    If this fails, TensorFlow changed its ordering: revisit the note in
    slurm_tf_config and docs/cluster.md.
    """
    from tensorflow.python.distribute.cluster_resolver import SlurmClusterResolver

    for key, value in _slurm_env(0, "node[9-10]", "1(x2)", 2).items():
        monkeypatch.setenv(key, value)
    resolver = SlurmClusterResolver(gpus_per_node=1, gpus_per_task=1, auto_set_gpu=False)
    assert resolver.cluster_spec().as_dict() == {"worker": ["node10:8888", "node9:8888"]}
    assert resolver.get_task_info() == ("worker", 0)




def test_nodes_sharing_an_address_get_distinct_ports(monkeypatch):
    """Test clusters run several slurmd on one machine: their tasks must not share a port."""
    asked = []

    def fake_node_addresses(nodes):
        asked.append(list(nodes))
        return {n: "127.0.0.1" for n in nodes}

    monkeypatch.setattr(slurm_lib, "node_addresses", fake_node_addresses)
    configs = [C.slurm_tf_config(_slurm_env(r, "node[1-2]", "2(x2)", 4), addresses="nodeaddr")
               for r in range(4)]
    assert asked == [["node1", "node2"]] * 4
    assert configs[0].cluster.worker == ("127.0.0.1:8888", "127.0.0.1:8889",
                                         "127.0.0.1:8890", "127.0.0.1:8891")
    assert [c.address for c in configs] == list(configs[0].cluster.worker)
    # With node names (distinct hosts) the k-th task on a node uses port + k, as TF's resolver.
    named = C.slurm_tf_config(_slurm_env(3, "node[1-2]", "2(x2)", 4), addresses="name")
    assert named.cluster.worker == ("node1:8888", "node1:8889", "node2:8888", "node2:8889")


def test_auto_addresses_look_up_only_names_that_do_not_resolve(monkeypatch):
    monkeypatch.setattr(slurm_lib, "_resolves", lambda host: host == "localhost")
    monkeypatch.setattr(slurm_lib, "node_addresses",
                        lambda nodes: {n: "10.1.0.%d" % (i + 1) for i, n in enumerate(nodes)})
    config = C.slurm_tf_config(_slurm_env(0, "localhost,n7", "1(x2)", 2))
    assert config.cluster.worker == ("localhost:8888", "10.1.0.1:8888")


def test_node_addresses_without_scontrol_is_a_clean_error(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(TFConfigError, match=r"Could not ask SLURM for the nodes' addresses"):
        slurm_lib.node_addresses(["n1"])


@pytest.mark.parametrize("env,expected", [
    ({}, None),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "4"}, None),  # a batch script: one process
    ({"SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "2"}, 2),
    ({"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "x"}, None),
])
def test_step_num_tasks(env, expected):
    assert C.step_num_tasks(env) == expected


@pytest.mark.parametrize("env,preset", [
    (_slurm_env(1, "n[1-2]", "1(x2)", 2), "multi_worker_mirrored"),
    (_slurm_env(0, "n1", "1", 1), "default"),
    (dict(_slurm_env(1, "n[1-2]", "1(x2)", 2),
          TF_CONFIG=json.dumps({"cluster": {"worker": ["a:1"]},
                                "task": {"type": "worker", "index": 0}})), "default"),
    # The side-car evaluator trains nothing: a local preset, not MWMS (which fails on it).
    ({"TF_CONFIG": json.dumps({"cluster": {"worker": ["a:1", "b:1"]},
                               "task": {"type": "evaluator", "index": 0}})}, "default"),
])
def test_auto_recognises_a_slurm_step(env, preset):
    from tfdist.strategies import choose_preset

    name, reason = choose_preset(environ=env, num_gpus=0)
    assert name == preset, reason
    if preset == "multi_worker_mirrored":
        assert "one of the 2 tasks of a SLURM job step" in reason

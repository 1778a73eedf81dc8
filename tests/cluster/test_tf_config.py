"""tfdist.cluster: TF_CONFIG parsing, validation and generation (pure Python).

The TensorFlow cross-checks use TF's own TFConfigClusterResolver,
SlurmClusterResolver and multi_worker_util as the independent reference.
"""

import dataclasses
import json
import re
import socket
import subprocess
import sys
import warnings

import pytest

from tfdist import cluster as C
from tfdist.cluster import ports as ports_lib
from tfdist.cluster import Cluster, TFConfig, TFConfigError, TFConfigWarning
from tests.support import run_python

W2 = {"worker": ["a:2222", "b:2222"]}


def cfg(cluster=None, task_type="worker", index=0, **extra):
    value = {"cluster": W2 if cluster is None else cluster,
             "task": {"type": task_type, "index": index}}
    value.update(extra)
    return json.dumps(value)


def test_import_does_not_load_tensorflow():
    code = ("import sys, tfdist, tfdist.cluster; tfdist.local_cluster(num_workers=1); "
            "print('tensorflow' in sys.modules)")
    result = run_python("-c", code, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


def test_public_exports():
    import tfdist
    for name in ("Cluster", "TFConfig", "TFConfigError", "parse_tf_config",
                 "tf_config_from_env", "local_cluster", "hosts_cluster", "slurm_tf_config",
                 "kubernetes_tfjob", "tf_config_for"):
        assert getattr(tfdist, name) is getattr(C, name)
    assert issubclass(TFConfigError, ValueError)
    assert C.TASK_TYPES == ("chief", "worker", "ps", "evaluator")


# --------------------------------------------------------------------- parse: valid


def test_parse_minimal_and_round_trip():
    config = C.parse_tf_config(cfg(index=1))
    assert config == TFConfig(cluster=Cluster(worker=("a:2222", "b:2222")),
                              task_type="worker", task_id=1)
    assert config.address == "b:2222"
    assert not config.is_chief
    assert C.parse_tf_config(config.to_json()) == config
    assert json.loads(config.to_json()) == json.loads(cfg(index=1))


def test_parse_accepts_mapping_and_full_cluster():
    value = {"cluster": {"chief": ["c:1"], "worker": ["w0:1", "w1:1"], "ps": ["p:1"]},
             "task": {"type": "ps", "index": 0}, "rpc_layer": "grpc",
             "environment": "cloud"}  # the Kubeflow operator adds "environment"
    config = C.parse_tf_config(value)
    assert config.cluster.num_workers == 2 and config.cluster.num_ps == 1
    assert config.cluster.num_training_tasks == 3
    assert config.rpc_layer == "grpc"
    assert json.loads(config.to_json())["rpc_layer"] == "grpc"
    assert config.summary() == ("task ps:0 at p:1; cluster chief=1 worker=2 ps=1; "
                                "is_chief=False")


@pytest.mark.parametrize("cluster,task_type,index,expected", [
    (W2, "worker", 0, True),          # worker 0 is chief when there is no chief
    (W2, "worker", 1, False),
    ({"chief": ["c:1"], **W2}, "chief", 0, True),
    ({"chief": ["c:1"], **W2}, "worker", 0, False),
    ({"worker": ["a:1"], "ps": ["p:1"]}, "ps", 0, False),
    (W2, "evaluator", 0, False),
])
def test_is_chief(cluster, task_type, index, expected):
    assert C.parse_tf_config(cfg(cluster, task_type, index)).is_chief is expected


def test_evaluator_task_outside_the_cluster():
    config = C.parse_tf_config(cfg(W2, "evaluator", 0))
    assert config.task_type == "evaluator" and config.address is None
    assert "evaluator" not in json.loads(config.to_json())["cluster"]


# --------------------------------------------------------------------- parse: errors


@pytest.mark.parametrize("text,fragments", [
    ('{"cluster": {"worker": ["a:1"]} "task": {}}',
     ["not valid JSON", "Expecting ',' delimiter", "line 1 column 33", "^"]),
    ("{'cluster': {}}", ["not valid JSON", "double quotes", "json.dumps"]),
    ('{"cluster": {\n  "worker": ["a:1",]\n}}', ["line 2 column"]),
    ('{"cluster":\n', ["Expecting value", "line 2 column 1"]),
    ("", ["TF_CONFIG is empty"]),
    ("[1, 2]", ["must be a JSON object", "list"]),
])
def test_malformed_json(text, fragments):
    with pytest.raises(TFConfigError) as e:
        C.parse_tf_config(text)
    for fragment in fragments:
        assert fragment in str(e.value)


def test_json_error_caret_points_at_the_error():
    text = '{"cluster": {"worker": ["a:1"]}, "task": {"type": "worker" "index": 0}}'
    with pytest.raises(TFConfigError) as e:
        C.parse_tf_config(text)
    lines = str(e.value).splitlines()
    snippet, caret = lines[1], lines[2]
    assert snippet.strip() == text
    assert snippet[caret.index("^")] == '"'  # the "index" key after the missing comma
    assert text.index('"index"') == caret.index("^") - 2


ERRORS = [
    # (TF_CONFIG, fragments of the message)
    ({"task": {"type": "worker", "index": 0}}, ['has no "cluster"', '"worker": ["host1:2222"']),
    ({"cluster": W2}, ['has no "task"', '"task": {"type": "worker", "index": 0}']),
    ({"cluster": W2, "task": "worker"}, ['TF_CONFIG["task"] must be an object']),
    ({"cluster": W2, "task": {"index": 0}}, ['has no "type"', "chief, worker, ps, evaluator"]),
    ({"cluster": W2, "task": {"type": "worker"}}, ['has no "index"', '"index": 0']),
    (json.loads(cfg(task_type="workr")), ["Unknown task type 'workr'", "Did you mean 'worker'?"]),
    (json.loads(cfg(task_type="trainer")), ["Unknown task type 'trainer'",
                                            "Valid task types: chief, worker, ps, evaluator"]),
    (json.loads(cfg(index=2)), ["Task worker:2 is out of range", "2 worker task(s)",
                                "index must be 0..1"]),
    (json.loads(cfg(index=-1)), ["index must be >= 0", "Received: index=-1"]),
    (json.loads(cfg(index="1")), ["index must be an integer", "Received: index='1'"]),
    (json.loads(cfg(index=1.0)), ["index must be an integer", "index=1.0"]),
    (json.loads(cfg(index=True)), ["index must be an integer", "index=True"]),
    (json.loads(cfg(task_type="ps")), ["'ps' has no addresses", "lists only: worker"]),
    (json.loads(cfg(task_type="evaluator", index=1)), ["evaluator:1 is out of range",
                                                       "at most one evaluator"]),
    (json.loads(cfg({"worker": ["a:1"], "ps": ["a:1"]})),
     ["Address 'a:1' is used by two tasks: worker:0 and ps:0", "its own host:port"]),
    (json.loads(cfg({"worker": ["localhost:1", "127.0.0.1:1"]})),
     ["used by two tasks: worker:0 and worker:1"]),
    (json.loads(cfg({"worker": ["Node1:1", "node1:1"]})), ["used by two tasks"]),
    (json.loads(cfg({"worker": ["a:1"], "evaluator": ["e:1"]})),
     ["lists an 'evaluator'", 'remove "evaluator"', '"type": "evaluator"']),
    (json.loads(cfg({"chief": ["c:1", "d:1"], "worker": ["a:1"]}, "chief")),
     ["at most one chief", "2 addresses", "under 'worker'"]),
    (json.loads(cfg({"worker": ["a:1"], "workers": ["b:1"]})),
     ["unknown role 'workers'", "Did you mean 'worker'?", "chief, worker, ps"]),
    (json.loads(cfg({})), ["The cluster is empty", "Add at least one worker"]),
    (json.loads(cfg({"ps": ["p:1"]}, "ps")), ["needs workers", "ps=['p:1']"]),
    (json.loads(cfg([])), ["must be an object mapping roles"]),
    (json.loads(cfg({"worker": "a:1"})), ["not a single string", "Wrap it in a list"]),
    (json.loads(cfg({"worker": {"0": "a:1"}})), ["must be a list of 'host:port'"]),
    (json.loads(cfg({"master": ["m:1"], "chief": ["c:1"], "worker": ["a:1"]})),
     ["lists a 'master'", 'rename "master" to "chief"']),
    (json.loads(cfg({"master": ["m:1"], "worker": ["a:1"]}, "master")),
     ["lists a 'master'", "Disallowed task type", "replica type 'Chief'"]),
    (json.loads(cfg(task_type="master")), ["Task type 'master' is not accepted"]),
    # One machine, one port: TensorFlow's server binds the port on every interface.
    (json.loads(cfg({"worker": ["[::1]:1", "[0:0:0:0:0:0:0:1]:1"]})),
     ["used by two tasks: worker:0 and worker:1", "are the same machine and port"]),
    (json.loads(cfg({"worker": ["127.0.0.1:1", "[::ffff:127.0.0.1]:1"]})),
     ["used by two tasks"]),
    (json.loads(cfg({"worker": ["127.0.0.1:1", "127.0.0.2:1"]})), ["used by two tasks"]),
    (json.loads(cfg({"worker": ["10.0.0.1:1", "[::ffff:10.0.0.1]:1"]})),
     ["same address and port"]),
    (json.loads(cfg({"worker": ["[2001:db8::1]:1", "[2001:DB8:0::1]:1"]})),
     ["used by two tasks"]),
    (json.loads(cfg(W2, rpc_layer="GRPC ")), ["rpc_layer must be a protocol name"]),
]


@pytest.mark.parametrize("value,fragments", ERRORS, ids=[f[0] for _, f in ERRORS])
def test_validation_errors(value, fragments):
    for given in (value, json.dumps(value)):
        with pytest.raises(TFConfigError) as e:
            C.parse_tf_config(given)
        for fragment in fragments:
            assert fragment in str(e.value), str(e.value)


@pytest.mark.parametrize("address,fragments", [
    ("a", ["has no port", "'a:2222'"]),
    (":2222", ["has no host"]),
    ("a:0", ["invalid port '0'", "1 to 65535"]),
    ("a:65536", ["invalid port '65536'"]),
    ("a:http", ["invalid port 'http'"]),
    ("a:", ["invalid port ''"]),
    ("grpc://a:1", ["without a scheme", "'a:1'", '"rpc_layer": \'grpc\'']),
    (" a:1", ["contains whitespace", "'a:1'"]),
    ("a b:1", ["contains whitespace"]),
    ("::1:2222", ["IPv6 address without brackets", "[::1]:2222"]),
    ("[::1]", ["not '[IPv6]:port'"]),
    ("[fe80::1%a]b]:2222", ["not '[IPv6]:port'"]),
    ("[fe80::1%a b]:2222", ["contains whitespace"]),
    ("[fe80::1%eth0/1]:2222", ["invalid IPv6 scope 'eth0/1'"]),
    ("[fe80::1%\udcff]:2222", ["invalid UTF-8", "'[fe80::1%\\udcff]:2222'"]),
    ("h\u00e9:1", ["non-ASCII", "'xn--' form"]),
    ("a:1\n", ["control characters"]),
    ("a]:1", ["brackets in the wrong place"]),
    ("0x7f.1:1", ["unusual form", "'127.0.0.1:PORT'"]),
    ("0.0.0.0:1", ["unspecified (bind-all) address"]),
    ("[::]:1", ["unspecified (bind-all) address"]),
    ("224.0.0.1:1", ["multicast or broadcast"]),
    ("a" * 400 + ":1", ["402 characters long", "..."]),
    ("[zz::1]:1", ["invalid IPv6 address 'zz::1'"]),
    ("bad_host!:1", ["invalid host name 'bad_host!'"]),
    ("-a:1", ["invalid host name '-a'"]),
    ("10.0.0.256:1", ["invalid IPv4 address '10.0.0.256'", "from 0 to 255"]),
    ("10.0.0:1", ["invalid IPv4 address '10.0.0'"]),
    ("a:\u0663", ["non-ASCII"]),  # a non-ASCII digit
    ("a:0002222", ["invalid port '0002222'"]),
    (2222, ["must be a string 'host:port'"]),
])
def test_bad_addresses(address, fragments):
    with pytest.raises(TFConfigError) as e:
        Cluster(worker=(address,))
    message = str(e.value)
    assert "worker[0]" in message
    for fragment in fragments:
        assert fragment in message, message


@pytest.mark.parametrize("address", ["a:1", "node-01.example.com:2222", "10.0.0.1:65535",
                                     "[::1]:2222", "[fe80::1]:1", "[fe80::1%eth0]:1",
                                     "localhost:8888", "a.b.:1", "[::ffff:10.0.0.1]:1"])
def test_good_addresses(address):
    assert Cluster(worker=(address,)).worker == (address,)


def test_master_is_rejected_as_tensorflow_2_does():
    value = {"cluster": {"master": ["m:1"], "worker": ["a:1"]},
             "task": {"type": "master", "index": 0}}
    with pytest.raises(TFConfigError, match='rename "master" to "chief"'):
        C.parse_tf_config(value)
    renamed = json.loads(json.dumps(value).replace("master", "chief"))
    assert C.parse_tf_config(renamed).is_chief


@pytest.mark.parametrize("text,fragments", [
    ("[" * 3000 + "]" * 3000, ["nested too deeply", "three levels"]),
    ('{"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", "index": ' + "9" * 5000 + "}}",
     ["cannot read", "Exceeds the limit", "small integers"]),
    ('{"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", "index": 1e400}}',
     ["must be an integer", "inf"]),
    ('{"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", "index": NaN}}',
     ["must be an integer"]),
    ('{"cluster": {"worker": ["a:1"]}, "task": {"type": "\udcff", "index": 0}}',
     ["Unknown task type '\\udcff'"]),
    ('{"cluster": {"worker": [' + ",".join(['"a:1"'] * 5000) + ']}, "task": {}}',
     ["used by two tasks"]),
])
def test_hostile_text_is_a_clean_error(text, fragments):
    with pytest.raises(TFConfigError) as e:
        C.parse_tf_config(text)
    message = str(e.value)
    for fragment in fragments:
        assert fragment in message, message
    assert len(message) < 1000 and message.isascii()


def test_huge_index_from_python_is_quoted_safely():
    huge = 10 ** 5000
    with pytest.raises(TFConfigError, match="an integer of 16610 bits"):
        TFConfig(cluster=Cluster(worker=("a:1",)), task_type="worker", task_id=huge)


def test_unknown_top_level_key_warns():
    with pytest.warns(TFConfigWarning, match="keys TensorFlow ignores: 'clusterr'"):
        C.parse_tf_config(dict(json.loads(cfg()), clusterr={}))


def test_mixing_loopback_and_remote_hosts_warns():
    with pytest.warns(TFConfigWarning, match=r"mixes loopback addresses \(localhost:1\) with "
                                             r"other hosts \(node2:1\)"):
        C.parse_tf_config(cfg({"worker": ["localhost:1", "node2:1"]}))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        C.parse_tf_config(cfg({"worker": ["localhost:1", "127.0.0.1:2", "[::1]:3"]}))


def test_valid_config_emits_no_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        C.parse_tf_config(cfg())


# --------------------------------------------------------------------- the dataclasses


def test_cluster_api():
    c = Cluster(chief=["c:1"], worker=("w0:1", "w1:1"), ps=("p:1",), evaluator=("e:1",))
    assert c.chief == ("c:1",)  # lists become tuples
    assert c.tasks() == [("chief", 0), ("worker", 0), ("worker", 1), ("ps", 0),
                         ("evaluator", 0)]
    assert c.cluster_dict() == {"chief": ["c:1"], "worker": ["w0:1", "w1:1"], "ps": ["p:1"]}
    assert c.address("worker", 1) == "w1:1"
    assert c.sizes() == "chief=1 worker=2 ps=1 evaluator=1"
    with pytest.raises(TFConfigError, match=r"No task worker:2 in this cluster: it has 2"):
        c.address("worker", 2)
    with pytest.raises(TFConfigError, match="'master' is the TF 1.x name of 'chief'"):
        c.address("master", 0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.worker = ()
    with pytest.raises(TFConfigError, match="at most one evaluator"):
        Cluster(worker=("a:1",), evaluator=("e:1", "f:1"))
    with pytest.raises(TypeError):
        Cluster(("a:1",))  # keyword-only


def test_tfconfig_validates_directly():
    c = Cluster(worker=("a:1",))
    with pytest.raises(TFConfigError, match="must be a tfdist.Cluster"):
        TFConfig(cluster={"worker": ["a:1"]}, task_type="worker", task_id=0)
    with pytest.raises(TFConfigError, match="TF 1.x name of 'chief'"):
        TFConfig(cluster=c, task_type="master", task_id=0)
    config = TFConfig(cluster=c, task_type="worker", task_id=0, rpc_layer="grpc+verbs")
    assert config.rpc_layer == "grpc+verbs"


def test_tf_config_from_env():
    assert C.tf_config_from_env({}) is None
    assert C.tf_config_from_env({"TF_CONFIG": ""}) is None
    assert C.tf_config_from_env({"TF_CONFIG": " {} "}) is None
    assert C.tf_config_from_env({"TF_CONFIG": "{ \n}"}) is None
    assert C.tf_config_from_env({"TF_CONFIG": cfg(index=1)}).task_id == 1
    with pytest.raises(TFConfigError, match="out of range"):
        C.tf_config_from_env({"TF_CONFIG": cfg(index=5)})


def test_tf_config_for_and_tf_configs():
    c = Cluster(chief=("c:1",), worker=("a:1",), evaluator=("e:1",))
    assert json.loads(C.tf_config_for(c, "worker", 0)) == {
        "cluster": {"chief": ["c:1"], "worker": ["a:1"]}, "task": {"type": "worker", "index": 0}}
    configs = C.tf_configs(c)
    assert [(x.task_type, x.task_id) for x in configs] == c.tasks()
    assert [x.is_chief for x in configs] == [True, False, False]
    with pytest.raises(TFConfigError, match="out of range"):
        C.tf_config_for(c, "worker", 1)


# --------------------------------------------------------------------- cross-check with TF


@pytest.mark.parametrize("cluster,task", [
    (W2, ("worker", 1)),
    ({"chief": ["c:1"], "worker": ["a:1", "b:1"], "ps": ["p:1", "q:1"]}, ("ps", 1)),
    ({"chief": ["c:1"], "worker": ["a:1"]}, ("chief", 0)),
    ({"chief": ["c:1"], "worker": ["a:1"]}, ("evaluator", 0)),
])
def test_generated_tf_config_reads_back_in_tensorflow(monkeypatch, cluster, task):
    from tensorflow.python.distribute import multi_worker_util
    from tensorflow.python.distribute.cluster_resolver import TFConfigClusterResolver

    ours = TFConfig(cluster=Cluster(**cluster), task_type=task[0], task_id=task[1])
    monkeypatch.setenv("TF_CONFIG", ours.to_json())
    resolver = TFConfigClusterResolver()
    spec = resolver.cluster_spec()
    assert spec.as_dict() == cluster
    assert (resolver.task_type, resolver.task_id) == task
    if task[0] != "evaluator":  # TF calls the evaluator the chief of its own cluster
        assert multi_worker_util.is_chief(spec, *task) == ours.is_chief


# --------------------------------------------------------------------- local ports


def test_local_cluster_ports_are_free_distinct_and_loopback():
    c = C.local_cluster(num_workers=3, num_ps=2, chief=True, evaluator=True)
    assert (len(c.chief), c.num_workers, c.num_ps, len(c.evaluator)) == (1, 3, 2, 1)
    addresses = [c.address(*t) for t in c.tasks()]
    assert all(a.startswith("127.0.0.1:") for a in addresses)
    ports = [int(a.rsplit(":", 1)[1]) for a in addresses]
    assert len(set(ports)) == len(ports)
    for port in ports:  # each is bindable right now
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_ports_never_repeat_within_a_process():
    seen = []
    for _ in range(30):
        seen += C.free_ports(5)
    assert len(set(seen)) == len(seen) == 150


def test_a_bound_port_is_never_handed_out(monkeypatch):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        port = taken.getsockname()[1]
        # Force the picker to try the taken port first.
        choices = iter([port] * 20 + list(range(20000, 20100)))
        monkeypatch.setattr(ports_lib.random.SystemRandom, "randrange",
                            lambda self, a, b: next(choices))
        monkeypatch.setattr(ports_lib, "_HANDED_OUT", set())
        got = C.free_ports(2)
        assert port not in got and len(set(got)) == 2


def test_falls_back_to_kernel_ports_when_the_range_is_busy(monkeypatch):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        port = taken.getsockname()[1]
        monkeypatch.setattr(ports_lib.random.SystemRandom, "randrange", lambda self, a, b: port)
        got = C.free_ports(3)
        assert port not in got and len(set(got)) == 3
        assert all(p >= 1024 for p in got)


def test_check_local_ports():
    c = C.local_cluster(num_workers=2)
    C.check_local_ports(c)
    port = int(c.worker[1].rsplit(":", 1)[1])
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port))
        with pytest.raises(TFConfigError, match=rf"Port {port} of worker:1 \(127.0.0.1:{port}\) "
                                                r"is already in use on this machine"):
            C.check_local_ports(c)
        # Remote addresses are never probed.
        C.check_local_ports(Cluster(worker=(f"node1:{port}",)))
    C.check_local_ports(c)


def test_local_cluster_rejects_bad_input():
    with pytest.raises(TFConfigError, match=r"num_workers must be an integer from 1 to 1000. "
                                            r"Received: num_workers=0"):
        C.local_cluster(num_workers=0)
    with pytest.raises(TFConfigError, match="num_ps must be an integer from 0 to 1000"):
        C.local_cluster(num_workers=1, num_ps=-1)
    with pytest.raises(TFConfigError, match="only uses loopback addresses.*hosts_cluster"):
        C.local_cluster(num_workers=1, host="10.0.0.1")
    assert C.local_cluster(num_workers=1, host="localhost").worker[0].startswith("localhost:")


# --------------------------------------------------------------------- hosts


def test_hosts_cluster_order_ports_and_repeats():
    c = C.hosts_cluster("a,b,c,d,e", num_ps=2, chief=True)
    assert c.cluster_dict() == {"chief": ["a:2222"], "worker": ["b:2222", "c:2222"],
                                "ps": ["d:2222", "e:2222"]}
    c = C.hosts_cluster(["a", "a", "b:9000", "b"], evaluator=True, port=7000)
    assert c.worker == ("a:7000", "a:7001", "b:9000") and c.evaluator == ("b:7000",)
    assert C.hosts_cluster(["[::1]", "[::1]"]).worker == ("[::1]:2222", "[::1]:2223")


def test_hosts_cluster_errors():
    with pytest.raises(TFConfigError, match=r"Not enough hosts: 2 host\(s\) .* leaves 0 "
                                            r"worker\(s\). List at least 3 hosts"):
        C.hosts_cluster("a,b", chief=True, num_ps=1)
    with pytest.raises(TFConfigError, match=r"hosts\[1\] is empty"):
        C.hosts_cluster("a,,b")
    with pytest.raises(TFConfigError, match="used by two tasks"):
        C.hosts_cluster("a,a:2222")
    with pytest.raises(TFConfigError, match="invalid port"):
        C.hosts_cluster("a:x")
    with pytest.raises(TFConfigError, match="port must be an integer from 1 to 65535"):
        C.hosts_cluster("a", port=70000)
    with pytest.raises(TFConfigError, match="listed too often"):
        C.hosts_cluster(["a", "a"], port=65535)


def test_docstring_examples():
    import doctest
    from tfdist.cluster import generate, model, parse
    attempted = 0
    for module in (model, parse, generate):
        result = doctest.testmod(module, optionflags=doctest.ELLIPSIS,
                                 extraglobs=vars(C))
        assert result.failed == 0
        attempted += result.attempted
    assert attempted >= 5


@pytest.mark.parametrize("roles,strategy,fragment", [
    ({"worker": ("a:1",), "ps": ("p:1",)}, "multi_worker_mirrored",
     "has no parameter servers, but the cluster lists ps=['p:1']"),
    ({"worker": ("a:1",), "ps": ("p:1",)}, "parameter_server", "needs a chief (the coordinator"),
    ({"chief": ("c:1",), "ps": ("p:1",)}, "parameter_server", "needs at least one worker"),
    ({"chief": ("c:1",), "worker": ("a:1",)}, "parameter_server", "needs at least one ps"),
    ({"worker": ("a:1",)}, "mirrored", "Unknown strategy 'mirrored'"),
])
def test_check_cluster_for_errors(roles, strategy, fragment):
    with pytest.raises(TFConfigError, match=re.escape(fragment)):
        C.check_cluster_for(Cluster(**roles), strategy)


def test_check_cluster_for_accepts():
    C.check_cluster_for(Cluster(chief=("c:1",), worker=("a:1",)), "multi_worker_mirrored")
    C.check_cluster_for(Cluster(worker=("a:1", "b:1")), "multi_worker_mirrored")
    full = Cluster(chief=("c:1",), worker=("a:1",), ps=("p:1",))
    C.check_cluster_for(full, "parameter_server")
    C.check_cluster_for(TFConfig(cluster=full, task_type="ps", task_id=0), "parameter_server")


_SERVERS_SCRIPT = r'''
import json, os
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
from tfdist import cluster as C
from tfdist._tf import import_tensorflow
cluster = C.local_cluster(num_workers=2, num_ps=1, chief=True)
tf = import_tensorflow()
from tensorflow.python.distribute.cluster_resolver import TFConfigClusterResolver
# In-process servers share one inter-op pool: give them threads (2-core machine).
config = tf.compat.v1.ConfigProto(inter_op_parallelism_threads=8)
servers = []
for task in C.tf_configs(cluster)[1:]:  # this process is the chief
    assert task.task_type != "chief"
    os.environ["TF_CONFIG"] = task.to_json()
    r = TFConfigClusterResolver()
    servers.append(tf.distribute.Server(r.cluster_spec(), job_name=r.task_type,
                                        task_index=r.task_id, config=config, start=True))
del os.environ["TF_CONFIG"]
tf.config.experimental_connect_to_cluster(tf.train.ClusterSpec(cluster.cluster_dict()),
                                          job_name="chief", task_index=0)
out = {}
for task_type, task_id in cluster.tasks():
    with tf.device(f"/job:{task_type}/task:{task_id}/device:CPU:0"):
        x = tf.constant(float(task_id) + 1.0) * 2.0
    out[f"{task_type}:{task_id}"] = [float(x.numpy()), x.device]
print("RESULT", json.dumps(out))
'''


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_tensorflow_servers_run_on_the_generated_cluster():
    """TF gRPC servers bind the local_cluster ports from our TF_CONFIGs and run ops."""
    proc = subprocess.run([sys.executable, "-c", _SERVERS_SCRIPT], capture_output=True,
                          text=True, timeout=150)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    out = json.loads(lines[0][len("RESULT "):])
    assert out == {
        "chief:0": [2.0, "/job:chief/replica:0/task:0/device:CPU:0"],
        "worker:0": [2.0, "/job:worker/replica:0/task:0/device:CPU:0"],
        "worker:1": [4.0, "/job:worker/replica:0/task:1/device:CPU:0"],
        "ps:0": [2.0, "/job:ps/replica:0/task:0/device:CPU:0"],
    }

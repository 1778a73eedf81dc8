"""tfdist.cluster.kubernetes: TFJob and Trainer v2 manifests, checked as the operators would.

Every generated manifest is validated twice: against the operators' generated
API models (tests/cluster/k8s_schema.py: the CRD's types, strictly) and against the
rules their webhooks enforce (tfdist's check_tfjob / check_trainjob /
check_training_runtime, which the generators apply). Negative controls show
each validator catches what the other cannot.
"""

import copy
import json
import re
import subprocess
import sys

import pytest
import yaml

from tests.cluster import k8s_schema
from tests.support import REPO
from tfdist import cluster as C
from tfdist.cluster import TFConfigError

def test_kubernetes_tfjob_manifest():
    m = C.kubernetes_tfjob(name="mnist", image="repo/img:1", command=["python", "train.py"],
                           num_workers=2, num_ps=1, chief=True, evaluator=True,
                           namespace="ml", env={"EPOCHS": 3}, resources={"cpu": 2})
    assert m["apiVersion"] == "kubeflow.org/v1" and m["kind"] == "TFJob"
    assert m["metadata"] == {"name": "mnist", "namespace": "ml"}
    assert m["spec"]["runPolicy"] == {"cleanPodPolicy": "None"}
    specs = m["spec"]["tfReplicaSpecs"]
    assert {k: v["replicas"] for k, v in specs.items()} == {
        "Chief": 1, "Worker": 2, "PS": 1, "Evaluator": 1}
    for spec in specs.values():
        assert spec["restartPolicy"] == "OnFailure"
        (container,) = spec["template"]["spec"]["containers"]
        assert container["name"] == "tensorflow"
        assert container["ports"] == [{"name": "tfjob-port", "containerPort": 2222}]
        assert container["command"] == ["python", "train.py"]
        assert container["env"] == [{"name": "EPOCHS", "value": "3"}]
        assert container["resources"] == {"limits": {"cpu": "2"}}
    minimal = C.kubernetes_tfjob(name="j", image="i", command="python t.py", num_workers=1)
    assert list(minimal["spec"]["tfReplicaSpecs"]) == ["Worker"]
    assert "namespace" not in minimal["metadata"]


def test_kubernetes_yaml_round_trips():
    m = C.kubernetes_tfjob(name="mnist", image="img:1",
                           command=["python", "train.py", "--epochs=3", "--lr", "1e-3"],
                           num_workers=2, num_ps=1, chief=True, restart_policy="Never",
                           env={"A": "yes", "B": "1.0", "C": "a: b", "D": ""})
    text = C.to_yaml(m)
    assert yaml.safe_load(text) == m
    assert "name: tensorflow" in text and "containerPort: 2222" in text
    assert "apiVersion: kubeflow.org/v1\nkind: TFJob\n" in text


@pytest.mark.parametrize("value", [
    "yes", "No", "on", "null", "~", "true", "1", "1.5", "1e3", "0x1f", "-1", ".inf", "",
    "a: b", "#c", "a #b", "-x", "@x", "*x", "&x", "!x", "%x", "x:", "[x]", "{x}", "'x'",
    '"x"', "a\nb", "tab\tx", "üñí", "12:30", "2024-01-01", "None", "/path/to", "a,b",
    "x" * 200,
])
def test_yaml_scalars_round_trip(value):
    doc = {"k": value, "list": [value, 1, 2.5, True, None, {}, []], value or "e": {"n": value}}
    assert yaml.safe_load(C.to_yaml(doc)) == doc


def test_kubernetes_cluster_matches_operator_naming():
    c = C.kubernetes_cluster(name="mnist", namespace="ml", num_workers=2, num_ps=1, chief=True)
    assert c.cluster_dict() == {
        "chief": ["mnist-chief-0.ml.svc:2222"],
        "worker": ["mnist-worker-0.ml.svc:2222", "mnist-worker-1.ml.svc:2222"],
        "ps": ["mnist-ps-0.ml.svc:2222"]}


@pytest.mark.parametrize("kwargs,fragment", [
    ({"name": "My_Job"}, "DNS-1035 label"),
    ({"name": "x" * 64}, "DNS-1035 label"),
    ({"image": ""}, "image must be a container image"),
    ({"command": []}, "command must be a non-empty list"),
    ({"name": "9job"}, "DNS-1035 label"),
    ({"name": "job-"}, "DNS-1035 label"),
    ({"name": "x" * 55, "num_workers": 12}, "too long for 12 Worker replica(s)"),
    ({"image": "my image"}, "image must be a container image"),
    ({"num_workers": 0}, "num_workers must be an integer from 1 to 10000"),
    ({"num_ps": -1}, "num_ps must be an integer from 0 to 10000"),
    ({"port": 0}, "port must be an integer from 1 to 65535"),
    ({"port": 65536}, "port must be an integer from 1 to 65535"),
    ({"restart_policy": "always"}, "restart_policy must be one of Always, OnFailure"),
    ({"clean_pod_policy": "Some"}, "clean_pod_policy must be one of None, Running, All"),
    ({"namespace": "Bad NS"}, "metadata.namespace must be a DNS-1123 label"),
    ({"env": {"TF_CONFIG": "{}"}}, "env must not set TF_CONFIG"),
    ({"env": {"1A": "x"}}, "env names must be C identifiers"),
    ({"resources": {"cpu": "two"}}, "resources['cpu'] must be a Kubernetes quantity"),
    ({"resources": {"bad key!": 1}}, "is not a resource name"),
])
def test_kubernetes_errors(kwargs, fragment):
    args = dict(name="job", image="img", command=["python", "t.py"], num_workers=1)
    args.update(kwargs)
    with pytest.raises(TFConfigError, match=re.escape(fragment)):
        C.kubernetes_tfjob(**args)




TFJOB_SHAPES = [
    dict(num_workers=1),
    dict(num_workers=2, chief=True),
    dict(num_workers=3, num_ps=2, chief=True, evaluator=True, namespace="ml",
         env={"EPOCHS": "3", "A": "yes"}, resources={"cpu": 2, "memory": "4Gi",
                                                     "nvidia.com/gpu": 1}),
    dict(num_workers=2, restart_policy="ExitCode", clean_pod_policy="All", port=9999),
]


@pytest.mark.parametrize("shape", TFJOB_SHAPES)
def test_tfjob_passes_the_operator_schema_and_webhook_rules(shape):
    m = C.kubernetes_tfjob(name="mnist", image="registry.example.com/mnist:1",
                           command=["python", "train.py", "--epochs=3"], **shape)
    k8s_schema.validate_tfjob(m)
    C.check_tfjob(m)
    # What kubectl reads is what was validated.
    k8s_schema.validate_tfjob(yaml.safe_load(C.to_yaml(m)))


def _tfjob():
    return C.kubernetes_tfjob(name="mnist", image="img:1", command=["python", "t.py"],
                              num_workers=2, chief=True)


def _set(manifest, path, value):
    node = manifest
    *parents, last = path
    for key in parents:
        node = node[key]
    if value is _DELETE:
        del node[last]
    else:
        node[last] = value
    return manifest


_DELETE = object()
_W = ("spec", "tfReplicaSpecs", "Worker")
_C0 = _W + ("template", "spec", "containers", 0)

# Values the training operator's webhook (release-1.9, tfjob_webhook.go) or its
# controller rejects although the CRD's OpenAPI schema accepts them.
WEBHOOK_ONLY = [
    (("metadata", "name"), "My_Job", "metadata.name must be a DNS-1035 label"),
    (_C0 + ("name",), "tf", "must have at least one container with name tensorflow"),
    (_C0 + ("image",), "", "containers[0].image is required"),
    (_W + ("template", "spec", "containers"), [], "must be specified"),
    (("spec", "tfReplicaSpecs", "Master"), None, "more than 1 Chief or Master role"),
    (("spec", "tfReplicaSpecs", "Chief", "replicas"), 2, "Chief.replicas must be 0 or 1"),
    (("spec", "tfReplicaSpecs", "Workers"), None, "unknown replica type 'Workers'"),
    (("spec", "runPolicy", "managedBy"), "me", "managedBy must be one of"),
    (_W + ("restartPolicy",), "Sometimes", "restartPolicy must be one of"),
    (("spec", "tfReplicaSpecs"), {}, "spec.tfReplicaSpecs is required"),
]


@pytest.mark.parametrize("path,value,fragment", WEBHOOK_ONLY,
                         ids=[w[2][:40] for w in WEBHOOK_ONLY])
def test_webhook_rules_catch_what_the_schema_accepts(path, value, fragment):
    m = _tfjob()
    if value is None:  # a copy of the Worker spec under another replica type
        value = copy.deepcopy(m["spec"]["tfReplicaSpecs"]["Worker"])
    _set(m, path, value)
    if path[-1] != "tfReplicaSpecs":
        k8s_schema.validate_tfjob(m)  # the CRD's types accept it ...
    with pytest.raises(TFConfigError, match=re.escape(fragment)):
        C.check_tfjob(m)  # ... the operator does not


SCHEMA_ONLY = [
    (_W + ("replica",), 2, "unknown field(s) ['replica']"),
    (_W + ("replicas",), "2", "expected int, got '2'"),
    (_C0 + ("name",), _DELETE, "`name`, must not be `None`"),
    (_C0 + ("command",), "python t.py", "expected a list"),
    (_C0 + ("ports", 0, "containerPort"), "2222", "expected int"),
    (("spec", "runPolicy", "cleanPodPolicy"), 1, "expected str"),
]


@pytest.mark.parametrize("path,value,fragment", SCHEMA_ONLY,
                         ids=[s[2][:30] for s in SCHEMA_ONLY])
def test_schema_validator_catches_typos_and_types(path, value, fragment):
    m = _set(_tfjob(), path, value)
    with pytest.raises(k8s_schema.SchemaError, match=re.escape(fragment)):
        k8s_schema.validate_tfjob(m)


# --------------------------------------------------------------- Trainer v2


def _expand(value, env):
    """Kubernetes' $(VAR) expansion of an env value (kubelet's expansion.Expand rules)."""
    def sub(match):
        if match.group(0) == "$$":
            return "$"
        return env.get(match.group(1), match.group(0))
    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)", sub, value)


def _pod_env(trainjob, index):
    """The env a pod of completion index `index` sees, resolved in order as kubelet does."""
    env = {}
    for var in trainjob["spec"]["trainer"]["env"]:
        if "valueFrom" in var:
            assert var["valueFrom"] == {"fieldRef": {"fieldPath": (
                "metadata.annotations['batch.kubernetes.io/job-completion-index']")}}
            env[var["name"]] = str(index)
        else:
            env[var["name"]] = _expand(var["value"], env)
    return env


@pytest.mark.parametrize("num_workers", [1, 3])
def test_trainjob_and_runtime_pass_the_trainer_schema_and_rules(num_workers):
    runtime = C.kubernetes_training_runtime(namespace="ml")
    job = C.kubernetes_trainjob(name="mnist", image="registry.example.com/mnist:1",
                                command=["python", "train.py"], num_workers=num_workers,
                                namespace="ml", env={"EPOCHS": "3"},
                                resources={"cpu": 4, "memory": "8Gi"})
    for manifest in (runtime, job):
        k8s_schema.validate_trainer(manifest)
        k8s_schema.validate_trainer(yaml.safe_load(C.to_yaml(manifest)))
    C.check_training_runtime(runtime)
    C.check_trainjob(job)
    assert job["spec"]["runtimeRef"] == {"name": runtime["metadata"]["name"],
                                         "kind": "TrainingRuntime",
                                         "apiGroup": "trainer.kubeflow.org"}


def test_each_trainjob_pod_gets_its_own_valid_tf_config():
    job = C.kubernetes_trainjob(name="mnist", image="img:1", command="python train.py",
                                num_workers=3, port=2345)
    expected = C.trainjob_cluster(name="mnist", num_nodes=3, port=2345)
    assert expected.worker[2] == "mnist-node-0-2.mnist:2345"
    for index in range(3):
        env = _pod_env(job, index)
        config = C.parse_tf_config(env["TF_CONFIG"])
        assert config.cluster == expected
        assert (config.task_type, config.task_id) == ("worker", index)
    # Negative control: kubelet expands only variables defined *before* the value.
    names = [v["name"] for v in job["spec"]["trainer"]["env"]]
    assert names.index("TFDIST_TASK_INDEX") < names.index("TF_CONFIG")
    reordered = copy.deepcopy(job)
    reordered["spec"]["trainer"]["env"].reverse()
    with pytest.raises(TFConfigError, match="not valid JSON"):
        C.parse_tf_config(_pod_env(reordered, 1)["TF_CONFIG"])


TRAINER_RULES = [
    (("metadata", "name"), "Mnist", C.check_trainjob, "metadata.name must be a DNS-1035"),
    (("metadata", "name"), "x" * 60, C.check_trainjob, "too long for 2 node(s)"),
    (("spec", "runtimeRef", "kind"), "Runtime", C.check_trainjob, "runtimeRef.kind must be"),
    (("spec", "runtimeRef", "name"), "", C.check_trainjob, "runtimeRef.name must name"),
    (("spec", "managedBy"), "me", C.check_trainjob, "spec.managedBy must be one of"),
    (("spec", "trainer", "image"), "i" * 501, C.check_trainjob, "at most 500 characters"),
    (("spec", "trainer", "command"), ["x"] * 129, C.check_trainjob, "at most 128"),
]


@pytest.mark.parametrize("path,value,check,fragment", TRAINER_RULES,
                         ids=[t[3][:30] for t in TRAINER_RULES])
def test_trainer_rules_catch_what_the_schema_accepts(path, value, check, fragment):
    job = C.kubernetes_trainjob(name="mnist", image="img:1", command="python t.py",
                                num_workers=2)
    _set(job, path, value)
    k8s_schema.validate_trainer(job)
    with pytest.raises(TFConfigError, match=re.escape(fragment)):
        check(job)


@pytest.mark.parametrize("mutate,fragment", [
    (lambda r: r["spec"]["template"]["spec"]["replicatedJobs"][0].update(replicas=2),
     "replicas always must be 1"),
    (lambda r: r["spec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"][
        "template"]["spec"]["containers"][0].update(name="trainer"),
     "container for the ancestor trainer"),
    (lambda r: r["spec"]["mlPolicy"].update(torch={}, jax={}), "only one of the policies"),
])
def test_runtime_webhook_rules(mutate, fragment):
    runtime = C.kubernetes_training_runtime()
    mutate(runtime)
    k8s_schema.validate_trainer(runtime)
    with pytest.raises(TFConfigError, match=re.escape(fragment)):
        C.check_training_runtime(runtime)


def test_trainer_schema_validator_catches_typos_and_types():
    job = C.kubernetes_trainjob(name="mnist", image="img:1", command="python t.py",
                                num_workers=2)
    typo = _set(copy.deepcopy(job), ("spec", "trainer", "numNode"), 2)
    with pytest.raises(k8s_schema.SchemaError, match="numNode: unknown field"):
        k8s_schema.validate_trainer(typo)
    wrong = _set(copy.deepcopy(job), ("spec", "trainer", "numNodes"), "2")
    with pytest.raises(k8s_schema.SchemaError, match="valid integer"):
        k8s_schema.validate_trainer(wrong)


@pytest.mark.parametrize("kwargs,fragment", [
    ({"name": "a_b"}, "name must be a DNS-1035 label"),
    ({"image": "x" * 501}, "at most 500 characters"),
    ({"num_workers": 0}, "num_workers must be an integer from 1"),
    ({"env": {"TFDIST_TASK_INDEX": "1"}}, "env must not set TFDIST_TASK_INDEX"),
    ({"runtime": ""}, "runtimeRef.name must name a runtime"),
])
def test_trainjob_errors(kwargs, fragment):
    args = dict(name="job", image="img", command=["python", "t.py"], num_workers=2)
    args.update(kwargs)
    with pytest.raises(TFConfigError, match=re.escape(fragment)):
        C.kubernetes_trainjob(**args)


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "tfdist.cli", "tf-config", *args],
                          capture_output=True, text=True, timeout=60, cwd=REPO)


def test_cli_offers_both_manifests():
    common = ["--kubernetes", "--name=mnist", "--image=img:1", "--num_workers=2"]
    tfjob = _cli(*common, "--chief", "--", "python", "train.py", "--epochs=3")
    assert tfjob.returncode == 0, tfjob.stderr
    (doc,) = yaml.safe_load_all(tfjob.stdout)
    k8s_schema.validate_tfjob(doc)
    assert doc["spec"]["tfReplicaSpecs"]["Chief"]["template"]["spec"]["containers"][0][
        "command"] == ["python", "train.py", "--epochs=3"]
    both = _cli(*common, "--kind=trainjob", "--namespace=ml", "--", "python", "train.py")
    assert both.returncode == 0, both.stderr
    runtime, job = yaml.safe_load_all(both.stdout)
    assert (runtime["kind"], job["kind"]) == ("TrainingRuntime", "TrainJob")
    for manifest in (runtime, job):
        k8s_schema.validate_trainer(manifest)
    as_json = _cli(*common, "--kind=trainjob", "--format=json", "--", "python", "t.py")
    assert [d["kind"] for d in json.loads(as_json.stdout)["items"]] == ["TrainingRuntime",
                                                                         "TrainJob"]
    # A value the operator would reject: exit 1 and the field's name, no traceback.
    bad = _cli("--kubernetes", "--name=My_Job", "--image=i", "--num_workers=1", "--", "x")
    assert bad.returncode == 1 and "metadata.name must be a DNS-1035 label" in bad.stderr
    assert "Traceback" not in bad.stderr
    ps = _cli(*common, "--kind=trainjob", "--num_ps=1", "--", "python", "t.py")
    assert ps.returncode == 2 and "workers only" in ps.stderr

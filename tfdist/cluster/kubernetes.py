"""Kubernetes manifests: a Kubeflow TFJob, or a Kubeflow Trainer v2 TrainJob with a plain runtime.

Two operators run TensorFlow jobs on Kubernetes:

* the **training operator v1** (`kubeflow.org/v1` TFJob, frozen at release-1.9):
  one pod per replica, and the operator writes each pod's TF_CONFIG itself;
* **Kubeflow Trainer v2** (`trainer.kubeflow.org/v1alpha1` TrainJob) dropped
  TensorFlow (kubeflow/trainer#2699). Its plain runtime (no framework policy)
  still runs N identical pods of an indexed Job: `kubernetes_trainjob` gives
  each pod its TF_CONFIG from the pod's completion index through the
  downward API, so the image needs nothing from tfdist.

Every generated manifest is checked against the rules the operators enforce
beyond their CRD schemas (`check_tfjob`, `check_trainjob`,
`check_training_runtime`), so a value the operator would refuse is a
`TFConfigError` naming the field here, not an admission error later. The
tests also validate the manifests against the operators' generated API
models (the `kubeflow-training` and `kubeflow-trainer-api` packages).
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from tfdist.cluster.errors import TFConfigError, check_count, received
from tfdist.cluster.model import Cluster

# Kubernetes' DNS-1035 label (apimachinery's IsDNS1035Label): what the TFJob
# webhook requires of metadata.name and the TrainJob CRD of its name.
_DNS1035 = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
_DNS1123_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_RESTART_POLICIES = ("Always", "OnFailure", "Never", "ExitCode")
_CLEAN_POD_POLICIES = ("None", "Running", "All")
_TFJOB_REPLICA_TYPES = ("Chief", "Master", "Worker", "PS", "Evaluator")
# training-operator release-1.9, pkg/common/util/webhooks.go: supportedJobControllers.
_TFJOB_MANAGERS = ("kubeflow.org/training-operator", "kueue.x-k8s.io/multikueue")
# trainer release-2.3, pkg/apis/trainer/v1alpha1/trainjob_types.go (ManagedBy).
_TRAINJOB_MANAGERS = ("trainer.kubeflow.org/trainjob-controller", "kueue.x-k8s.io/multikueue")
_TRAINER_API = "trainer.kubeflow.org/v1alpha1"
# trainer release-2.3, pkg/constants/constants.go.
_ANCESTOR_LABEL = "trainer.kubeflow.org/trainjob-ancestor-step"
_NODE = "node"
_INDEX_VAR = "TFDIST_TASK_INDEX"
_INDEX_FIELD = "metadata.annotations['batch.kubernetes.io/job-completion-index']"


def _check_dns1035(what: str, value: Any, *, max_len: int = 63) -> None:
    if not isinstance(value, str) or len(value) > max_len or not _DNS1035.fullmatch(value):
        raise TFConfigError(
            f"{what} must be a DNS-1035 label: lowercase letters, digits and '-', starting "
            f"with a letter, ending with a letter or digit, at most {max_len} characters. "
            f"Received: {what}={received(value)}.")


def _check_image(what: str, value: Any, *, max_len: int | None = None) -> None:
    if not isinstance(value, str) or not value or any(c.isspace() for c in value) or (
            not value.isascii()) or (max_len is not None and len(value) > max_len):
        limit = f", at most {max_len} characters" if max_len else ""
        raise TFConfigError(
            f"{what} must be a container image name (no spaces{limit}), e.g. "
            f"'registry.example.com/train:1'. Received: {what}={received(value)}.")


def _command(command: Any) -> list[str]:
    if isinstance(command, str):
        command = command.split()
    if not isinstance(command, Sequence) or not command or not all(
            isinstance(c, str) and c for c in command):
        raise TFConfigError(
            f"command must be a non-empty list of strings, e.g. ['python', 'train.py']. "
            f"Received: command={received(command)}.")
    return list(command)


def _env_list(env: Mapping[str, Any] | None) -> list[dict[str, str]]:
    out = []
    for key, value in (env or {}).items():
        if not isinstance(key, str) or not re.fullmatch(r"[-._a-zA-Z][-._a-zA-Z0-9]*", key):
            raise TFConfigError(
                f"env names must be C identifiers ('-' and '.' allowed, as Kubernetes "
                f"accepts). Received: env name {received(key)}.")
        if key in ("TF_CONFIG", _INDEX_VAR):
            raise TFConfigError(
                f"env must not set {key}: the operator (TFJob) or tfdist (TrainJob) sets it "
                f"per pod. Received: env={received(dict(env))}.")
        out.append({"name": key, "value": str(value)})
    return out


# The CRDs' pattern for resource quantities (e.g. kubeflow.org_tfjobs.yaml of
# training-operator release-1.9, minResources).
_QUANTITY = re.compile(r"(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|"
                       r"([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?")
_RESOURCE_NAME = re.compile(r"([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*"
                            r"[A-Za-z0-9])?")


def _limits(resources: Mapping[str, Any] | None) -> dict[str, str] | None:
    """Container resource limits as Kubernetes quantities (strings: '2', '500m', '4Gi')."""
    if not resources:
        return None
    limits = {}
    for key, value in resources.items():
        if not isinstance(key, str) or not _RESOURCE_NAME.fullmatch(key):
            raise TFConfigError(
                f"resources: {received(key)} is not a resource name (e.g. 'cpu', 'memory', "
                f"'nvidia.com/gpu').")
        text = str(value) if isinstance(value, (int, float, str)) and not isinstance(
            value, bool) else None
        if text is None or not _QUANTITY.fullmatch(text):
            raise TFConfigError(
                f"resources[{key!r}] must be a Kubernetes quantity such as 2, '500m' or '4Gi'. "
                f"Received: {received(value)}.")
        limits[key] = text
    return limits


def _container(*, name: str, image: str, command: list[str], port: int,
               port_name: str | None, env: list[dict[str, Any]],
               resources: dict[str, str] | None) -> dict[str, Any]:
    container: dict[str, Any] = {"name": name, "image": image, "command": command}
    port_spec: dict[str, Any] = {"containerPort": port}
    if port_name:
        port_spec = {"name": port_name, **port_spec}
    container["ports"] = [port_spec]
    if env:
        container["env"] = env
    if resources:
        container["resources"] = {"limits": resources}
    return container


# --------------------------------------------------------------------------- TFJob


def kubernetes_tfjob(*, name: str, image: str, command: Sequence[str] | str, num_workers: int,
                     num_ps: int = 0, chief: bool = False, evaluator: bool = False,
                     port: int = 2222, namespace: str | None = None,
                     restart_policy: str = "OnFailure",
                     env: Mapping[str, str] | None = None,
                     resources: Mapping[str, Any] | None = None,
                     clean_pod_policy: str = "None") -> dict[str, Any]:
    """A TFJob manifest for Kubeflow's training operator (kubeflow.org/v1).

    The operator creates one pod per replica and sets each pod's TF_CONFIG
    itself (addresses `<name>-<role>-<i>.<namespace>.svc:<port>`, evaluator
    excluded from the cluster), so the command runs unchanged.

    Args:
      name: the TFJob name (a DNS-1035 label: lowercase letters, digits, '-').
      image: the container image holding TensorFlow and the training script.
      command: the container command, e.g. ["python", "train.py"].
      num_workers: Worker replicas (>= 1); the chief is extra.
      num_ps, chief, evaluator: the PS / Chief / Evaluator replica specs.
      port: the container port named `tfjob-port` (the operator's default 2222).
      namespace: metadata.namespace (omitted when None).
      restart_policy: Always, OnFailure, Never or ExitCode.
      env: extra environment variables for every container.
      resources: container resource limits, e.g. {"cpu": 4, "nvidia.com/gpu": 1}.
      clean_pod_policy: spec.runPolicy.cleanPodPolicy: None, Running or All.

    Returns:
      The manifest as a dict; `to_yaml(manifest)` gives `kubectl apply -f` input.

    Raises:
      TFConfigError: naming the first value the operator would reject.
    """
    _check_image("image", image)
    command = _command(command)
    check_count("num_workers", num_workers, 1, 10_000)
    check_count("num_ps", num_ps, 0, 10_000)
    check_count("port", port, 1, 65535)
    if restart_policy not in _RESTART_POLICIES:
        raise TFConfigError(
            f"restart_policy must be one of {', '.join(_RESTART_POLICIES)}. "
            f"Received: restart_policy={received(restart_policy)}.")
    if clean_pod_policy not in _CLEAN_POD_POLICIES:
        raise TFConfigError(
            f"clean_pod_policy must be one of {', '.join(_CLEAN_POD_POLICIES)}. "
            f"Received: clean_pod_policy={received(clean_pod_policy)}.")
    container = _container(name="tensorflow", image=image, command=command, port=port,
                           port_name="tfjob-port", env=_env_list(env), resources=_limits(resources))
    replicas = {"Chief": int(bool(chief)), "Worker": num_workers, "PS": num_ps,
                "Evaluator": int(bool(evaluator))}
    specs = {kind: {"replicas": n, "restartPolicy": restart_policy,
                    "template": {"spec": {"containers": [copy.deepcopy(container)]}}}
             for kind, n in replicas.items() if n}
    metadata: dict[str, Any] = {"name": name}
    if namespace is not None:
        metadata["namespace"] = namespace
    manifest = {"apiVersion": "kubeflow.org/v1", "kind": "TFJob", "metadata": metadata,
                "spec": {"runPolicy": {"cleanPodPolicy": clean_pod_policy},
                         "tfReplicaSpecs": specs}}
    check_tfjob(manifest)
    return manifest


def check_tfjob(manifest: Mapping[str, Any]) -> None:
    """Checks a TFJob against what the training operator enforces beyond its CRD schema.

    The rules of training-operator release-1.9's admission webhook
    (pkg/webhooks/tensorflow/tfjob_webhook.go, pkg/common/util/webhooks.go):
    metadata.name is a DNS-1035 label; tfReplicaSpecs is set; every replica
    has containers, each with an image, one of them named `tensorflow`; at most
    one Chief or Master replica type; runPolicy.managedBy, if set, is one the
    operator supports. And what fails later, when the operator creates the
    pods and services: a replica type it does not know (it ignores it), more
    than one chief replica (TensorFlow allows one), a restart policy other than
    Always/OnFailure/Never/ExitCode, service names `<name>-<type>-<i>` longer
    than 63 characters.

    Raises:
      TFConfigError: naming the field, the value received and the fix.
    """
    if not isinstance(manifest, Mapping):
        raise TFConfigError(f"A TFJob manifest is a mapping. Received: {received(manifest)}.")
    if manifest.get("apiVersion") != "kubeflow.org/v1" or manifest.get("kind") != "TFJob":
        raise TFConfigError(
            f"apiVersion/kind must be kubeflow.org/v1 TFJob. Received: "
            f"{received(manifest.get('apiVersion'))} {received(manifest.get('kind'))}.")
    metadata = manifest.get("metadata") or {}
    name = metadata.get("name")
    _check_dns1035("metadata.name", name)
    if metadata.get("namespace") is not None:
        _check_namespace(metadata["namespace"])
    spec = manifest.get("spec") or {}
    run_policy = spec.get("runPolicy") or {}
    if "managedBy" in run_policy and run_policy["managedBy"] not in _TFJOB_MANAGERS:
        raise TFConfigError(
            f"spec.runPolicy.managedBy must be one of {', '.join(_TFJOB_MANAGERS)}. "
            f"Received: {received(run_policy['managedBy'])}.")
    if "cleanPodPolicy" in run_policy and run_policy["cleanPodPolicy"] not in _CLEAN_POD_POLICIES:
        raise TFConfigError(
            f"spec.runPolicy.cleanPodPolicy must be one of {', '.join(_CLEAN_POD_POLICIES)}. "
            f"Received: {received(run_policy['cleanPodPolicy'])}.")
    specs = spec.get("tfReplicaSpecs")
    if not isinstance(specs, Mapping) or not specs:
        raise TFConfigError(
            f"spec.tfReplicaSpecs is required: a mapping of replica type (Chief, Worker, PS, "
            f"Evaluator) to replica spec. Received: {received(specs)}.")
    chiefs = [t for t in specs if t in ("Chief", "Master")]
    if len(chiefs) > 1:
        raise TFConfigError(
            f"spec.tfReplicaSpecs must not have more than 1 Chief or Master role. Received: "
            f"{', '.join(chiefs)}. Keep 'Chief'.")
    for rtype, rspec in specs.items():
        path = f"spec.tfReplicaSpecs.{rtype}"
        if rtype not in _TFJOB_REPLICA_TYPES:
            raise TFConfigError(
                f"{path}: unknown replica type {received(rtype)}; the operator runs only "
                f"{', '.join(_TFJOB_REPLICA_TYPES)}.")
        if not isinstance(rspec, Mapping):
            raise TFConfigError(f"{path} must be a replica spec. Received: {received(rspec)}.")
        replicas = rspec.get("replicas", 1)
        check_count(f"{path}.replicas", replicas, 0, 2**31 - 1)
        if rtype in ("Chief", "Master") and replicas > 1:
            raise TFConfigError(
                f"{path}.replicas must be 0 or 1: TensorFlow has at most one chief. "
                f"Received: {replicas}. List the other replicas under Worker.")
        if rspec.get("restartPolicy", "Never") not in _RESTART_POLICIES:
            raise TFConfigError(
                f"{path}.restartPolicy must be one of {', '.join(_RESTART_POLICIES)}. "
                f"Received: {received(rspec.get('restartPolicy'))}.")
        containers = (((rspec.get("template") or {}).get("spec") or {}).get("containers"))
        cpath = f"{path}.template.spec.containers"
        if not isinstance(containers, Sequence) or not containers:
            raise TFConfigError(f"{cpath} must be specified (at least one container).")
        for i, container in enumerate(containers):
            if not isinstance(container, Mapping) or not container.get("image"):
                raise TFConfigError(f"{cpath}[{i}].image is required.")
            _check_image(f"{cpath}[{i}].image", container["image"])
        if not any(c.get("name") == "tensorflow" for c in containers):
            raise TFConfigError(
                f"{cpath} must have at least one container with name tensorflow (the "
                f"operator sets TF_CONFIG and the port there). Received names: "
                f"{received([c.get('name') for c in containers])}.")
        if replicas:
            longest = f"{name}-{rtype.lower()}-{replicas - 1}"
            if len(longest) > 63:
                raise TFConfigError(
                    f"metadata.name={name!r} is too long for {replicas} {rtype} replica(s): the "
                    f"operator names their pods and services {longest!r} ({len(longest)} "
                    f"characters; Kubernetes allows 63). Shorten the name to at most "
                    f"{63 - len(longest) + len(name)} characters.")


def _check_namespace(namespace: Any) -> None:
    if not isinstance(namespace, str) or len(namespace) > 63 or not _DNS1123_LABEL.fullmatch(
            namespace):
        raise TFConfigError(
            f"metadata.namespace must be a DNS-1123 label (lowercase letters, digits, '-', "
            f"at most 63 characters). Received: {received(namespace)}.")


def kubernetes_cluster(*, name: str, namespace: str = "default", num_workers: int,
                       num_ps: int = 0, chief: bool = False, port: int = 2222,
                       cluster_domain: str | None = None) -> Cluster:
    """The cluster the training operator writes into each pod's TF_CONFIG."""
    _check_dns1035("name", name)
    _check_namespace(namespace)
    suffix = f".{namespace}.svc" + (f".{cluster_domain}" if cluster_domain else "")
    make = lambda role, n: tuple(f"{name}-{role}-{i}{suffix}:{port}"  # noqa: E731
                                 for i in range(n))
    return Cluster(chief=make("chief", int(bool(chief))), worker=make("worker", num_workers),
                   ps=make("ps", num_ps))


# ------------------------------------------------------------- Trainer v2 TrainJob


def trainjob_cluster(*, name: str, num_nodes: int, port: int = 2222) -> Cluster:
    """The workers of a TrainJob on tfdist's plain runtime: one per node, by pod index.

    JobSet gives pod i of the TrainJob's `node` job the DNS name
    `<name>-node-0-<i>.<name>` (the address Trainer's own XGBoost plugin
    builds for its tracker).
    """
    _check_dns1035("name", name)
    check_count("num_nodes", num_nodes, 1, 100_000)
    check_count("port", port, 1, 65535)
    return Cluster(worker=tuple(f"{name}-{_NODE}-0-{i}.{name}:{port}" for i in range(num_nodes)))


def kubernetes_training_runtime(*, name: str = "tfdist-tensorflow", port: int = 2222,
                                namespace: str | None = None) -> dict[str, Any]:
    """A plain Kubeflow Trainer v2 TrainingRuntime for TensorFlow jobs.

    No framework policy: Trainer's PlainML plugin sets the node count and
    the TrainJob's env on the `node` container; the TF_CONFIG itself comes
    from the TrainJob (see `kubernetes_trainjob`).
    """
    _check_dns1035("runtime name", name)
    check_count("port", port, 1, 65535)
    metadata: dict[str, Any] = {"name": name, "labels": {
        "trainer.kubeflow.org/framework": "tensorflow"}}
    if namespace is not None:
        _check_namespace(namespace)
        metadata["namespace"] = namespace
    runtime = {
        "apiVersion": _TRAINER_API, "kind": "TrainingRuntime", "metadata": metadata,
        "spec": {
            "mlPolicy": {"numNodes": 1},
            "template": {"spec": {"replicatedJobs": [{
                "name": _NODE,
                "replicas": 1,
                "template": {
                    "metadata": {"labels": {_ANCESTOR_LABEL: "trainer"}},
                    "spec": {
                        # TF_CONFIG's task index is the pod's completion index.
                        "completionMode": "Indexed",
                        "template": {"spec": {
                            "restartPolicy": "Never",
                            "containers": [{
                                "name": _NODE,
                                # Replaced by the TrainJob's spec.trainer.image.
                                "image": "tensorflow/tensorflow:2.21.0",
                                "ports": [{"name": "tf-worker", "containerPort": port}],
                            }],
                        }},
                    },
                },
            }]}},
        },
    }
    check_training_runtime(runtime)
    return runtime


def kubernetes_trainjob(*, name: str, image: str, command: Sequence[str] | str,
                        num_workers: int, port: int = 2222, namespace: str | None = None,
                        runtime: str = "tfdist-tensorflow", env: Mapping[str, str] | None = None,
                        resources: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """A Kubeflow Trainer v2 TrainJob running `command` on `num_workers` pods as MWMS workers.

    Each pod gets TF_CONFIG through Kubernetes' own variable expansion:
    `TFDIST_TASK_INDEX` is the pod's completion index (downward API), and
    TF_CONFIG, defined after it, holds `"index": $(TFDIST_TASK_INDEX)`.
    Worker 0 is the chief. The job needs the plain runtime of
    `kubernetes_training_runtime` (apply it first, once per namespace).

    Trainer v2 has no TensorFlow policy (kubeflow/trainer#2699) and runs one
    kind of pod, so this form has workers only: for parameter servers or an
    evaluator use `kubernetes_tfjob` (training operator v1).

    Raises:
      TFConfigError: naming the first value Trainer would reject.
    """
    _check_dns1035("name", name)
    _check_image("image", image, max_len=500)
    command = _command(command)
    check_count("num_workers", num_workers, 1, 100_000)
    check_count("port", port, 1, 65535)
    cluster = trainjob_cluster(name=name, num_nodes=num_workers, port=port)
    tf_config = json.dumps({"cluster": cluster.cluster_dict(),
                            "task": {"type": "worker", "index": 0}}, separators=(",", ":"))
    # Kubernetes expands $(VAR) in an env value from the variables defined before it.
    tf_config = tf_config.replace('"index":0}', f'"index":$({_INDEX_VAR})}}')
    trainer: dict[str, Any] = {
        "image": image, "command": command, "numNodes": num_workers,
        "env": [{"name": _INDEX_VAR, "valueFrom": {"fieldRef": {"fieldPath": _INDEX_FIELD}}},
                {"name": "TF_CONFIG", "value": tf_config}, *_env_list(env)],
    }
    if resources:
        trainer["resourcesPerNode"] = {"limits": _limits(resources)}
    metadata: dict[str, Any] = {"name": name}
    if namespace is not None:
        metadata["namespace"] = namespace
    manifest = {"apiVersion": _TRAINER_API, "kind": "TrainJob", "metadata": metadata,
                "spec": {"runtimeRef": {"name": runtime, "kind": "TrainingRuntime",
                                        "apiGroup": "trainer.kubeflow.org"},
                         "trainer": trainer}}
    check_trainjob(manifest)
    return manifest


def check_trainjob(manifest: Mapping[str, Any]) -> None:
    """Checks a TrainJob against the rules of Kubeflow Trainer release-2.3 beyond types.

    From pkg/apis/trainer/v1alpha1/trainjob_types.go (CEL rules and limits of
    the CRD): metadata.name a DNS-1035 label of at most 63 characters;
    runtimeRef.name 1-253 characters and kind TrainingRuntime or
    ClusterTrainingRuntime; trainer.image at most 500 characters; at most 128
    command, args and env items; managedBy one of the supported controllers.
    And what fails when JobSet creates the pods: their host names
    `<name>-node-0-<i>` must fit in 63 characters.

    Raises:
      TFConfigError: naming the field, the value received and the fix.
    """
    if not isinstance(manifest, Mapping) or manifest.get("apiVersion") != _TRAINER_API or (
            manifest.get("kind") != "TrainJob"):
        raise TFConfigError(
            f"apiVersion/kind must be {_TRAINER_API} TrainJob. Received: "
            f"{received(manifest)}.")
    metadata = manifest.get("metadata") or {}
    name = metadata.get("name")
    _check_dns1035("metadata.name", name)
    if metadata.get("namespace") is not None:
        _check_namespace(metadata["namespace"])
    spec = manifest.get("spec") or {}
    ref = spec.get("runtimeRef") or {}
    if not isinstance(ref.get("name"), str) or not 1 <= len(ref["name"]) <= 253:
        raise TFConfigError(
            f"spec.runtimeRef.name must name a runtime (1-253 characters). Received: "
            f"{received(ref.get('name'))}.")
    if ref.get("kind", "ClusterTrainingRuntime") not in ("TrainingRuntime",
                                                         "ClusterTrainingRuntime"):
        raise TFConfigError(
            f"spec.runtimeRef.kind must be TrainingRuntime or ClusterTrainingRuntime. "
            f"Received: {received(ref.get('kind'))}.")
    if "managedBy" in spec and spec["managedBy"] not in _TRAINJOB_MANAGERS:
        raise TFConfigError(
            f"spec.managedBy must be one of {', '.join(_TRAINJOB_MANAGERS)}. Received: "
            f"{received(spec['managedBy'])}.")
    trainer = spec.get("trainer") or {}
    if "image" in trainer:
        _check_image("spec.trainer.image", trainer["image"], max_len=500)
    for key in ("command", "args", "env"):
        if len(trainer.get(key) or ()) > 128:
            raise TFConfigError(
                f"spec.trainer.{key} has {len(trainer[key])} items; Trainer accepts at most 128.")
    nodes = trainer.get("numNodes", 1)
    check_count("spec.trainer.numNodes", nodes, 1, 2**31 - 1)
    longest = f"{name}-{_NODE}-0-{nodes - 1}"
    if len(longest) > 63:
        raise TFConfigError(
            f"metadata.name={name!r} is too long for {nodes} node(s): JobSet names the last "
            f"pod's host {longest!r} ({len(longest)} characters; Kubernetes allows 63). "
            f"Shorten the name to at most {63 - len(longest) + len(name)} characters.")


def check_training_runtime(manifest: Mapping[str, Any]) -> None:
    """Checks a TrainingRuntime against Trainer release-2.3's runtime webhook.

    pkg/webhooks/trainingruntime_webhook.go: a replicated job labelled as a
    TrainJob ancestor has `replicas: 1` and the container the ancestor needs
    (`node` for the trainer). pkg/apis/trainer/v1alpha1/trainingruntime_types.go:
    at most one framework policy.

    Raises:
      TFConfigError: naming the field and the fix.
    """
    if not isinstance(manifest, Mapping) or manifest.get("kind") not in (
            "TrainingRuntime", "ClusterTrainingRuntime"):
        raise TFConfigError(f"Not a TrainingRuntime: {received(manifest)}.")
    metadata = manifest.get("metadata") or {}
    _check_dns1035("metadata.name", metadata.get("name"))
    spec = manifest.get("spec") or {}
    frameworks = [k for k in ("torch", "mpi", "jax", "xgboost", "flux")
                  if k in (spec.get("mlPolicy") or {})]
    if len(frameworks) > 1:
        raise TFConfigError(
            f"spec.mlPolicy: only one of the policies can be configured. Received: "
            f"{', '.join(frameworks)}.")
    needed = {"trainer": _NODE, "model-initializer": "model-initializer",
              "dataset-initializer": "dataset-initializer"}
    jobs = (((spec.get("template") or {}).get("spec") or {}).get("replicatedJobs") or [])
    for i, job in enumerate(jobs):
        path = f"spec.template.spec.replicatedJobs[{i}]"
        labels = ((job.get("template") or {}).get("metadata") or {}).get("labels") or {}
        ancestor = labels.get(_ANCESTOR_LABEL)
        if ancestor not in needed:
            continue
        if job.get("replicas", 1) != 1:
            raise TFConfigError(f"{path}.replicas always must be 1. Received: "
                                f"{received(job.get('replicas'))}.")
        containers = ((((job.get("template") or {}).get("spec") or {}).get("template") or {})
                      .get("spec") or {}).get("containers") or []
        if not any(c.get("name") == needed[ancestor] for c in containers):
            raise TFConfigError(
                f"{path}.template.spec.template.spec.containers must contain the required "
                f"container for the ancestor {ancestor}: a container named "
                f"{needed[ancestor]!r}.")


# --------------------------------------------------------------------------- YAML


def to_yaml(*documents: Any) -> str:
    """Block-style YAML of one or more manifests (several as one multi-document stream)."""
    import yaml

    class _Dumper(yaml.SafeDumper):
        # Lists indented under their key, as kubectl and the Kubernetes docs write them.
        def increase_indent(self, flow=False, indentless=False):
            return super().increase_indent(flow, False)

        # Write repeated parts in full: kubectl reads anchors, people misread them.
        def ignore_aliases(self, data):
            return True

    return yaml.dump_all(list(documents), Dumper=_Dumper, sort_keys=False,
                         default_flow_style=False, allow_unicode=False, width=100)

"""TF_CONFIG: parse, validate and generate cluster specs for TensorFlow.

A multi-worker TensorFlow job learns its place in the cluster from the
`TF_CONFIG` environment variable, a JSON object such as

    {"cluster": {"chief": ["host0:2222"], "worker": ["host1:2222", "host2:2222"],
                 "ps": ["host3:2222"]},
     "task": {"type": "worker", "index": 1}}

TensorFlow itself checks very little of it: a typo surfaces minutes later as
a hang or a gRPC error. This package validates a TF_CONFIG up front, with
errors that say what to change, and generates correct ones for local runs
(free ports on 127.0.0.1), a list of hosts, a SLURM job step and Kubernetes
(a Kubeflow TFJob, or a Trainer v2 TrainJob). It imports no TensorFlow.

One module per job: `addresses` (the host:port grammar), `model` (Cluster,
TFConfig), `parse` (reading and checking TF_CONFIG), `ports` (free local
ports), `generate` (local and host-list clusters), `slurm`, `kubernetes`.
"""

from tfdist.cluster.addresses import address_key, is_loopback, split_address
from tfdist.cluster.errors import TFConfigError, TFConfigWarning
from tfdist.cluster.generate import hosts_cluster, local_cluster
from tfdist.cluster.kubernetes import (check_tfjob, check_training_runtime, check_trainjob,
                                       kubernetes_cluster, kubernetes_tfjob,
                                       kubernetes_training_runtime, kubernetes_trainjob,
                                       to_yaml, trainjob_cluster)
from tfdist.cluster.model import (CLUSTER_TASK_TYPES, TASK_TYPES, Cluster, TFConfig,
                                  tf_config_for, tf_configs)
from tfdist.cluster.parse import (STRATEGY_KINDS, check_cluster_for, parse_tf_config,
                                  tf_config_from_env)
from tfdist.cluster.ports import check_local_ports, free_ports
from tfdist.cluster.slurm import (expand_hostlist, expand_tasks_per_node, slurm_tf_config,
                                  step_num_tasks)

__all__ = [
    "CLUSTER_TASK_TYPES", "STRATEGY_KINDS", "TASK_TYPES", "Cluster", "TFConfig",
    "TFConfigError", "TFConfigWarning", "address_key", "check_cluster_for",
    "check_local_ports", "check_tfjob", "check_training_runtime", "check_trainjob",
    "expand_hostlist", "expand_tasks_per_node", "free_ports", "hosts_cluster", "is_loopback",
    "kubernetes_cluster", "kubernetes_tfjob", "kubernetes_training_runtime",
    "kubernetes_trainjob", "local_cluster", "parse_tf_config", "slurm_tf_config",
    "split_address", "step_num_tasks", "tf_config_for", "tf_config_from_env", "tf_configs",
    "to_yaml", "trainjob_cluster",
]

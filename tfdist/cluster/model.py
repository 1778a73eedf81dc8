"""The cluster model: which tasks exist (`Cluster`) and which one this process is (`TFConfig`).

Both are frozen and validated at construction, so a `Cluster` or `TFConfig`
that exists is one TensorFlow accepts: every address well formed and used
once, at most one chief and one evaluator, the task inside the cluster.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from tfdist.cluster.addresses import address_key, split_address
from tfdist.cluster.errors import TFConfigError, received

TASK_TYPES: tuple[str, ...] = ("chief", "worker", "ps", "evaluator")
# Roles written into TF_CONFIG["cluster"]; the evaluator runs outside the
# training cluster and only appears in its own TF_CONFIG["task"].
CLUSTER_TASK_TYPES: tuple[str, ...] = ("chief", "worker", "ps")
# 'master' is TF 1.x Estimator's name for the chief. TF 2's strategies reject a
# cluster or task that uses it ("Disallowed task type found in cluster spec"),
# so tfdist rejects it too, with the rename to make.
_MASTER_HINT = (
    "'master' is the TF 1.x name of 'chief', which TensorFlow 2's strategies reject "
    "(\"Disallowed task type found in cluster spec\"): rename \"master\" to \"chief\" "
    "(in a Kubeflow TFJob, name the replica type 'Chief' instead of 'Master').")


def did_you_mean(name: Any, choices: Sequence[str] = TASK_TYPES) -> str:
    """' Did you mean 'x'?' for a near miss among `choices`, else ''."""
    if not isinstance(name, str) or len(name) > 64:
        return ""
    close = difflib.get_close_matches(name.lower(), choices, n=1, cutoff=0.6)
    return f" Did you mean {close[0]!r}?" if close else ""


def check_task_type(task_type: Any) -> None:
    """Raises TFConfigError unless `task_type` is one of TASK_TYPES."""
    if task_type in TASK_TYPES:
        return
    if task_type == "master":
        raise TFConfigError(f"Task type 'master' is not accepted. {_MASTER_HINT}")
    raise TFConfigError(
        f"Unknown task type {received(task_type)}.{did_you_mean(task_type)} Valid task "
        f"types: {', '.join(TASK_TYPES)}.")


def _check_role(name: str, value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        raise TFConfigError(
            f"{name} must be a list of 'host:port' addresses, not a single string. "
            f"Received: {name}={received(value)}. Wrap it in a list: "
            f"{name}=[{received(value)}].")
    if isinstance(value, (Mapping, bytes)) or not isinstance(value, Iterable):
        raise TFConfigError(
            f"{name} must be a list of 'host:port' addresses. Received: "
            f"{name}={received(value)}.")
    addresses = tuple(value)
    for i, address in enumerate(addresses):
        split_address(address, what=f"{name}[{i}]")
    return addresses


@dataclasses.dataclass(frozen=True, kw_only=True)
class Cluster:
    """The addresses ("host:port") of every task, per role.

    `chief`, `worker` and `ps` form TF_CONFIG["cluster"]. The `evaluator`
    (at most one) runs beside the training cluster: by TensorFlow's convention
    it is not written into TF_CONFIG["cluster"], only into its own task.

    Example:
      >>> c = Cluster(worker=("10.0.0.1:2222", "10.0.0.2:2222"))
      >>> c.num_workers, c.tasks()
      (2, [('worker', 0), ('worker', 1)])
    """

    chief: tuple[str, ...] = ()
    worker: tuple[str, ...] = ()
    ps: tuple[str, ...] = ()
    evaluator: tuple[str, ...] = ()

    def __post_init__(self):
        for role in TASK_TYPES:
            object.__setattr__(self, role, _check_role(role, getattr(self, role)))
        if len(self.chief) > 1:
            raise TFConfigError(
                f"A cluster has at most one chief. Received: chief={received(list(self.chief))}"
                f" ({len(self.chief)} addresses). Keep one chief and list the others "
                f"under 'worker'.")
        if len(self.evaluator) > 1:
            raise TFConfigError(
                f"A cluster has at most one evaluator. Received: "
                f"evaluator={received(list(self.evaluator))}. Keep one.")
        if not (self.chief or self.worker or self.ps):
            raise TFConfigError(
                "The cluster is empty: it lists no chief, worker or ps address. Add at "
                "least one worker, e.g. {\"worker\": [\"host1:2222\", \"host2:2222\"]}, "
                "or unset TF_CONFIG to train on one machine.")
        if self.ps and not (self.chief or self.worker):
            raise TFConfigError(
                f"A cluster with parameter servers needs workers to run the training "
                f"steps. Received: ps={received(list(self.ps))} and no chief or worker. Add "
                f"'worker' addresses (and a 'chief' for ParameterServerStrategy).")
        seen: dict[tuple[str, int], tuple[str, str]] = {}
        for task_type, task_id in self.tasks():
            address = self.address(task_type, task_id)
            key = address_key(address)
            if key in seen:
                other, other_address = seen[key]
                same = ("" if other_address == address else
                        f" ({received(other_address)} and {received(address)} are the same "
                        f"{'machine' if key[0] == 'loopback' else 'address'} and port)")
                raise TFConfigError(
                    f"Address {received(address)} is used by two tasks: {other} and "
                    f"{task_type}:{task_id}{same}. Every task needs its own host:port; "
                    f"give one of them another port.")
            seen[key] = (f"{task_type}:{task_id}", address)

    @classmethod
    def from_dict(cls, cluster: Mapping[str, Any], *, what: str = "cluster") -> "Cluster":
        """Builds a Cluster from a TF_CONFIG["cluster"] mapping (role -> addresses).

        Rejects 'evaluator' (it does not belong in the cluster), the TF 1.x name
        'master' and unknown roles.
        """
        if not isinstance(cluster, Mapping):
            raise TFConfigError(
                f"{what} must be an object mapping roles to address lists. Received: "
                f"{what}={received(cluster)}. Example: {{\"worker\": [\"host1:2222\"]}}.")
        for role in cluster:
            if role == "master":
                raise TFConfigError(f"{what} lists a 'master'. {_MASTER_HINT}")
            if role == "evaluator":
                raise TFConfigError(
                    f"{what} lists an 'evaluator'. The evaluator is not part of the "
                    f"training cluster: remove \"evaluator\" from {what} and give the "
                    f"evaluator process its own TF_CONFIG with the same cluster and "
                    f"\"task\": {{\"type\": \"evaluator\", \"index\": 0}}.")
            if role not in CLUSTER_TASK_TYPES:
                raise TFConfigError(
                    f"{what} has an unknown role {received(role)}.{did_you_mean(role)} Valid "
                    f"roles in {what}: {', '.join(CLUSTER_TASK_TYPES)}.")
        return cls(**{role: _check_role(f"{what}[{role!r}]", addresses)
                      for role, addresses in cluster.items()})

    @property
    def num_workers(self) -> int:
        """Number of 'worker' tasks (the chief is not counted)."""
        return len(self.worker)

    @property
    def num_ps(self) -> int:
        return len(self.ps)

    @property
    def num_training_tasks(self) -> int:
        """chief + workers: the processes that run training steps under MWMS."""
        return len(self.chief) + len(self.worker)

    def tasks(self) -> list[tuple[str, int]]:
        """Every task, evaluator included, chief first: [(task_type, task_id), ...]."""
        return [(role, i) for role in TASK_TYPES for i in range(len(getattr(self, role)))]

    def address(self, task_type: str, task_id: int) -> str:
        """The "host:port" of one task."""
        check_task_type(task_type)
        addresses = getattr(self, task_type)
        if isinstance(task_id, bool) or not isinstance(task_id, int) or not (
                0 <= task_id < len(addresses)):
            raise TFConfigError(
                f"No task {task_type}:{received(task_id)} in this cluster: it has "
                f"{len(addresses)} {task_type} task(s).")
        return addresses[task_id]

    def cluster_dict(self) -> dict[str, list[str]]:
        """TF_CONFIG["cluster"]: the non-empty chief/worker/ps lists (no evaluator)."""
        return {role: list(getattr(self, role)) for role in CLUSTER_TASK_TYPES
                if getattr(self, role)}

    def sizes(self) -> str:
        """'chief=1 worker=2 ps=1' (non-empty roles only)."""
        return " ".join(f"{role}={len(getattr(self, role))}" for role in TASK_TYPES
                        if getattr(self, role))


@dataclasses.dataclass(frozen=True, kw_only=True)
class TFConfig:
    """One task's view of the cluster: what TF_CONFIG holds.

    Example:
      >>> cfg = TFConfig(cluster=Cluster(worker=("a:2222", "b:2222")),
      ...                task_type="worker", task_id=1)
      >>> cfg.to_json()
      '{"cluster":{"worker":["a:2222","b:2222"]},"task":{"type":"worker","index":1}}'
    """

    cluster: Cluster
    task_type: str
    task_id: int
    rpc_layer: str | None = None

    def __post_init__(self):
        if not isinstance(self.cluster, Cluster):
            raise TFConfigError(
                f"cluster must be a tfdist.Cluster. Received: cluster={received(self.cluster)}."
                f" Build one with Cluster(worker=[...]) or Cluster.from_dict({{...}}).")
        check_task_type(self.task_type)
        if isinstance(self.task_id, bool) or not isinstance(self.task_id, int):
            raise TFConfigError(
                f"The task index must be an integer. Received: index={received(self.task_id)}."
                f" Write it as a JSON number, e.g. \"index\": 0.")
        if self.task_id < 0:
            raise TFConfigError(
                f"The task index must be >= 0. Received: index={received(self.task_id)}. "
                f"Tasks are numbered from 0.")
        addresses = getattr(self.cluster, self.task_type)
        if self.task_type == "evaluator":
            # The evaluator's own address is optional (it is not in the cluster).
            if self.task_id >= max(1, len(addresses)):
                raise TFConfigError(
                    f"Task evaluator:{received(self.task_id)} is out of range: there is at "
                    f"most one evaluator, so its index must be 0.")
        elif not addresses:
            listed = ", ".join(r for r in CLUSTER_TASK_TYPES if getattr(self.cluster, r))
            raise TFConfigError(
                f"The task type {self.task_type!r} has no addresses in the cluster, which "
                f"lists only: {listed}. Add \"{self.task_type}\": [...] to the cluster or "
                f"change the task type.")
        elif self.task_id >= len(addresses):
            raise TFConfigError(
                f"Task {self.task_type}:{received(self.task_id)} is out of range: the cluster "
                f"has {len(addresses)} {self.task_type} task(s), so the index must be 0.."
                f"{len(addresses) - 1}. Fix \"index\" or add the missing "
                f"{self.task_type} address(es).")
        if self.rpc_layer is not None and (
                not isinstance(self.rpc_layer, str)
                or not re.fullmatch(r"[a-z][a-z0-9+._-]{0,31}", self.rpc_layer)):
            raise TFConfigError(
                f"rpc_layer must be a protocol name such as 'grpc'. Received: "
                f"rpc_layer={received(self.rpc_layer)}. Remove it to use gRPC.")

    @property
    def is_chief(self) -> bool:
        """True for chief:0, or worker:0 when the cluster has no chief."""
        if self.task_type == "chief":
            return True
        return self.task_type == "worker" and self.task_id == 0 and not self.cluster.chief

    @property
    def address(self) -> str | None:
        """This task's "host:port" (None for an evaluator without an address)."""
        addresses = getattr(self.cluster, self.task_type)
        return addresses[self.task_id] if self.task_id < len(addresses) else None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "cluster": self.cluster.cluster_dict(),
            "task": {"type": self.task_type, "index": self.task_id},
        }
        if self.rpc_layer is not None:
            out["rpc_layer"] = self.rpc_layer
        return out

    def to_json(self) -> str:
        """The TF_CONFIG value (compact JSON)."""
        return json.dumps(self.to_dict(), separators=(",", ":"))

    def summary(self) -> str:
        """One line: role, index, address, cluster sizes, whether this task is chief."""
        where = f" at {self.address}" if self.address else ""
        return (f"task {self.task_type}:{self.task_id}{where}; cluster {self.cluster.sizes()}; "
                f"is_chief={self.is_chief}")


def tf_config_for(cluster: Cluster, task_type: str, task_id: int, *,
                  rpc_layer: str | None = None) -> str:
    """The TF_CONFIG JSON for one task of `cluster`."""
    return TFConfig(cluster=cluster, task_type=task_type, task_id=task_id,
                    rpc_layer=rpc_layer).to_json()


def tf_configs(cluster: Cluster, *, rpc_layer: str | None = None) -> list[TFConfig]:
    """One TFConfig per task of `cluster` (evaluator included), chief first."""
    return [TFConfig(cluster=cluster, task_type=t, task_id=i, rpc_layer=rpc_layer)
            for t, i in cluster.tasks()]

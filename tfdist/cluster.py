"""TF_CONFIG: parse, validate and generate cluster specs for TensorFlow.

A multi-worker TensorFlow job learns its place in the cluster from the
`TF_CONFIG` environment variable, a JSON object such as

    {"cluster": {"chief": ["host0:2222"], "worker": ["host1:2222", "host2:2222"],
                 "ps": ["host3:2222"]},
     "task": {"type": "worker", "index": 1}}

TensorFlow itself checks very little of it: a typo surfaces minutes later as
a hang or a gRPC error. This module validates a TF_CONFIG up front, with
errors that say what to change, and generates correct ones for local runs
(free ports on 127.0.0.1), a list of hosts, a SLURM job and a Kubeflow TFJob.

It imports no TensorFlow.
"""

from __future__ import annotations

import dataclasses
import difflib
import ipaddress
import json
import os
import random
import re
import socket
import threading
import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

TASK_TYPES: tuple[str, ...] = ("chief", "worker", "ps", "evaluator")
# Roles written into TF_CONFIG["cluster"]; the evaluator runs outside the
# training cluster and only appears in its own TF_CONFIG["task"].
CLUSTER_TASK_TYPES: tuple[str, ...] = ("chief", "worker", "ps")
# Top-level TF_CONFIG keys TensorFlow (or Estimator / Cloud ML) reads.
_KNOWN_KEYS = ("cluster", "task", "rpc_layer", "environment", "session_master")
_TF_CONFIG = "TF_CONFIG"


class TFConfigError(ValueError):
    """A TF_CONFIG (or a cluster description) is invalid; the message says how to fix it."""


class TFConfigWarning(UserWarning):
    """A TF_CONFIG that works but should be changed (e.g. the old role name 'master')."""


# ---------------------------------------------------------------------------
# Addresses

_HOSTNAME_RE = re.compile(
    r"^(?=.{1,253}$)[A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?"
    r"(\.[A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?)*\.?$"
)
_EXAMPLE = "'host:2222' or '10.0.0.1:2222' or '[::1]:2222'"


def split_address(address: Any, *, what: str = "address") -> tuple[str, int]:
    """Splits a "host:port" address into (host, port), validating both.

    Accepts host names, IPv4 addresses and bracketed IPv6 addresses
    ("[::1]:2222"); the port must be 1..65535.

    Raises:
      TFConfigError: naming the address, what is wrong and the expected form.
    """
    if not isinstance(address, str):
        raise TFConfigError(
            f"{what} must be a string 'host:port'. Received: {what}={address!r}. "
            f"Write it as {_EXAMPLE}."
        )
    if address != address.strip() or any(c.isspace() for c in address):
        raise TFConfigError(
            f"{what} contains whitespace. Received: {what}={address!r}. "
            f"Remove the spaces: {address.strip().replace(' ', '')!r}."
        )
    if "://" in address:
        scheme, rest = address.split("://", 1)
        raise TFConfigError(
            f"{what} must be a bare 'host:port' without a scheme. Received: "
            f"{what}={address!r}. Write {rest!r} and, if you need a protocol other "
            f"than gRPC, set \"rpc_layer\": {scheme!r} in TF_CONFIG instead."
        )
    if address.startswith("["):
        host, sep, port_text = address[1:].partition("]:")
        if not sep:
            raise TFConfigError(
                f"{what} is not 'host:port'. Received: {what}={address!r}. "
                f"Bracketed IPv6 addresses take the port after the bracket: '[::1]:2222'."
            )
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise TFConfigError(
                f"{what} has an invalid IPv6 address {host!r}. Received: {what}={address!r}."
            ) from None
        host = f"[{host}]"
    else:
        if address.count(":") > 1:
            raise TFConfigError(
                f"{what} looks like an IPv6 address without brackets. Received: "
                f"{what}={address!r}. Put the IPv6 address in brackets: '[::1]:2222'."
            )
        host, sep, port_text = address.rpartition(":")
        if not sep:
            raise TFConfigError(
                f"{what} has no port. Received: {what}={address!r}. "
                f"Add the port the task listens on, e.g. '{address}:2222'."
            )
        if not host:
            raise TFConfigError(
                f"{what} has no host. Received: {what}={address!r}. "
                f"Write the host before the port, e.g. 'localhost{address}'."
            )
        looks_ipv4 = re.fullmatch(r"[0-9.]+", host) is not None
        if looks_ipv4:
            try:
                ipaddress.IPv4Address(host)
            except ValueError:
                raise TFConfigError(
                    f"{what} has an invalid IPv4 address {host!r}. Received: "
                    f"{what}={address!r}. Each of the 4 numbers must be 0..255."
                ) from None
        elif not _HOSTNAME_RE.match(host):
            raise TFConfigError(
                f"{what} has an invalid host name {host!r}. Received: {what}={address!r}. "
                f"Use a host name, an IPv4 address or a bracketed IPv6 address: {_EXAMPLE}."
            )
    if not re.fullmatch(r"[0-9]{1,5}", port_text) or not 1 <= int(port_text) <= 65535:
        raise TFConfigError(
            f"{what} has an invalid port {port_text!r}. Received: {what}={address!r}. "
            f"The port must be an integer from 1 to 65535, e.g. '{host}:2222'."
        )
    return host, int(port_text)


def _address_key(address: str) -> tuple[str, int]:
    """Identity of an address for duplicate detection (case, localhost folded)."""
    host, port = split_address(address)
    host = host.lower().rstrip(".")
    if host in ("localhost", "[::1]"):
        host = "127.0.0.1"
    return host, port


# ---------------------------------------------------------------------------
# Cluster


def _check_role(name: str, value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        raise TFConfigError(
            f"{name} must be a list of 'host:port' addresses, not a single string. "
            f"Received: {name}={value!r}. Wrap it in a list: {name}=[{value!r}]."
        )
    if isinstance(value, Mapping) or not isinstance(value, Iterable):
        raise TFConfigError(
            f"{name} must be a list of 'host:port' addresses. Received: {name}={value!r}."
        )
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
                f"A cluster has at most one chief. Received: chief={list(self.chief)} "
                f"({len(self.chief)} addresses). Keep one chief and list the others "
                f"under 'worker'."
            )
        if len(self.evaluator) > 1:
            raise TFConfigError(
                f"A cluster has at most one evaluator. Received: "
                f"evaluator={list(self.evaluator)}. Keep one."
            )
        if not (self.chief or self.worker or self.ps):
            raise TFConfigError(
                "The cluster is empty: it lists no chief, worker or ps address. Add at "
                "least one worker, e.g. {\"worker\": [\"host1:2222\", \"host2:2222\"]}, "
                "or unset TF_CONFIG to train on one machine."
            )
        if self.ps and not (self.chief or self.worker):
            raise TFConfigError(
                f"A cluster with parameter servers needs workers to run the training "
                f"steps. Received: ps={list(self.ps)} and no chief or worker. Add "
                f"'worker' addresses (and a 'chief' for ParameterServerStrategy)."
            )
        seen: dict[tuple[str, int], str] = {}
        for task_type, task_id in self.tasks():
            address = self.address(task_type, task_id)
            key = _address_key(address)
            if key in seen:
                raise TFConfigError(
                    f"Address {address!r} is used by two tasks: {seen[key]} and "
                    f"{task_type}:{task_id}. Every task needs its own host:port; "
                    f"give one of them another port."
                )
            seen[key] = f"{task_type}:{task_id}"

    @classmethod
    def from_dict(cls, cluster: Mapping[str, Any], *, what: str = "cluster") -> "Cluster":
        """Builds a Cluster from a TF_CONFIG["cluster"] mapping (role -> addresses).

        Accepts the old role name 'master' for 'chief' with a TFConfigWarning.
        Rejects 'evaluator' (it does not belong in the cluster) and unknown roles.
        """
        if not isinstance(cluster, Mapping):
            raise TFConfigError(
                f"{what} must be an object mapping roles to address lists. Received: "
                f"{what}={cluster!r}. Example: {{\"worker\": [\"host1:2222\"]}}."
            )
        roles: dict[str, Any] = {}
        for role, addresses in cluster.items():
            if role == "master":
                if "chief" in cluster:
                    raise TFConfigError(
                        f"{what} lists both 'master' and 'chief'. 'master' is the old name "
                        f"of 'chief': keep only 'chief'."
                    )
                warnings.warn(
                    f"{what} uses the old role name 'master'; tfdist treats it as 'chief'. "
                    f"Rename \"master\" to \"chief\" in TF_CONFIG.",
                    TFConfigWarning,
                    stacklevel=3,
                )
                role = "chief"
            elif role == "evaluator":
                raise TFConfigError(
                    f"{what} lists an 'evaluator'. The evaluator is not part of the "
                    f"training cluster: remove \"evaluator\" from {what} and give the "
                    f"evaluator process its own TF_CONFIG with the same cluster and "
                    f"\"task\": {{\"type\": \"evaluator\", \"index\": 0}}."
                )
            elif role not in CLUSTER_TASK_TYPES:
                raise TFConfigError(
                    f"{what} has an unknown role {role!r}.{_did_you_mean(role)} Valid "
                    f"roles in {what}: {', '.join(CLUSTER_TASK_TYPES)}."
                )
            roles[role] = addresses
        for role, addresses in roles.items():
            _check_role(f"{what}[{role!r}]", addresses)
        return cls(**roles)

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
        _check_task_type(task_type)
        addresses = getattr(self, task_type)
        if isinstance(task_id, bool) or not isinstance(task_id, int) or not (
            0 <= task_id < len(addresses)
        ):
            raise TFConfigError(
                f"No task {task_type}:{task_id!r} in this cluster: it has "
                f"{len(addresses)} {task_type} task(s)."
            )
        return addresses[task_id]

    def cluster_dict(self) -> dict[str, list[str]]:
        """TF_CONFIG["cluster"]: the non-empty chief/worker/ps lists (no evaluator)."""
        return {role: list(getattr(self, role)) for role in CLUSTER_TASK_TYPES
                if getattr(self, role)}

    def sizes(self) -> str:
        """'chief=1 worker=2 ps=1' (non-empty roles only)."""
        return " ".join(f"{role}={len(getattr(self, role))}" for role in TASK_TYPES
                        if getattr(self, role))


def _did_you_mean(name: str, choices: Sequence[str] = TASK_TYPES) -> str:
    close = difflib.get_close_matches(str(name).lower(), choices, n=1, cutoff=0.6)
    return f" Did you mean {close[0]!r}?" if close else ""


def _check_task_type(task_type: Any) -> None:
    if task_type not in TASK_TYPES:
        hint = (" 'master' is the old name of 'chief': use 'chief'."
                if task_type == "master" else _did_you_mean(task_type))
        raise TFConfigError(
            f"Unknown task type {task_type!r}.{hint} Valid task types: "
            f"{', '.join(TASK_TYPES)}."
        )


# ---------------------------------------------------------------------------
# TFConfig


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
                f"cluster must be a tfdist.Cluster. Received: cluster={self.cluster!r}. "
                f"Build one with Cluster(worker=[...]) or Cluster.from_dict({{...}})."
            )
        _check_task_type(self.task_type)
        if isinstance(self.task_id, bool) or not isinstance(self.task_id, int):
            raise TFConfigError(
                f"The task index must be an integer. Received: index={self.task_id!r}. "
                f"Write it as a JSON number, e.g. \"index\": 0."
            )
        if self.task_id < 0:
            raise TFConfigError(
                f"The task index must be >= 0. Received: index={self.task_id}. "
                f"Tasks are numbered from 0."
            )
        addresses = getattr(self.cluster, self.task_type)
        if self.task_type == "evaluator":
            # The evaluator's own address is optional (it is not in the cluster).
            limit = max(1, len(addresses))
            if self.task_id >= limit:
                raise TFConfigError(
                    f"Task evaluator:{self.task_id} is out of range: there is at most one "
                    f"evaluator, so its index must be 0."
                )
        elif not addresses:
            listed = ", ".join(r for r in CLUSTER_TASK_TYPES if getattr(self.cluster, r))
            raise TFConfigError(
                f"The task type {self.task_type!r} has no addresses in the cluster, which "
                f"lists only: {listed}. Add \"{self.task_type}\": [...] to the cluster or "
                f"change the task type."
            )
        elif self.task_id >= len(addresses):
            raise TFConfigError(
                f"Task {self.task_type}:{self.task_id} is out of range: the cluster has "
                f"{len(addresses)} {self.task_type} task(s), so the index must be 0.."
                f"{len(addresses) - 1}. Fix \"index\" or add the missing "
                f"{self.task_type} address(es)."
            )
        if self.rpc_layer is not None and (
            not isinstance(self.rpc_layer, str)
            or not re.fullmatch(r"[a-z][a-z0-9+._-]*", self.rpc_layer)
        ):
            raise TFConfigError(
                f"rpc_layer must be a protocol name such as 'grpc'. Received: "
                f"rpc_layer={self.rpc_layer!r}. Remove it to use gRPC."
            )

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


def _json_error(text: str, err: json.JSONDecodeError) -> TFConfigError:
    lines = text.splitlines()
    line = lines[err.lineno - 1] if 0 < err.lineno <= len(lines) else ""
    # Whole line when short; otherwise an 80-character window around the error.
    start = 0 if len(line) <= 100 else max(0, err.colno - 1 - 40)
    snippet = ("..." if start else "") + line[start:start + (100 if not start else 80)]
    caret = " " * (err.colno - 1 - start + (3 if start else 0)) + "^"
    hint = ""
    if "'" in text and "property name enclosed in double quotes" in err.msg:
        hint = (" JSON needs double quotes: it looks like a Python dict; build it "
                "with json.dumps(...).")
    return TFConfigError(
        f"TF_CONFIG is not valid JSON: {err.msg} at line {err.lineno} column "
        f"{err.colno} (char {err.pos}):\n  {snippet}\n  {caret}\nFix the JSON.{hint}"
    )


def parse_tf_config(value: str | Mapping[str, Any]) -> TFConfig:
    """Parses and validates a TF_CONFIG value (a JSON string or a mapping).

    Args:
      value: the TF_CONFIG JSON text, or the already-decoded mapping.

    Returns:
      The validated TFConfig.

    Raises:
      TFConfigError: malformed JSON (with the position), a missing 'cluster' or
        'task', an unknown role, an index out of range or not an integer,
        duplicate or malformed addresses, an evaluator listed in the cluster,
        more than one chief, an empty cluster.

    The old role name 'master' is accepted as 'chief' with a TFConfigWarning.

    Example:
      >>> parse_tf_config('{"cluster": {"worker": ["a:1", "b:1"]},'
      ...                 ' "task": {"type": "worker", "index": 0}}').is_chief
      True
    """
    if isinstance(value, (str, bytes)):
        text = value.decode() if isinstance(value, bytes) else value
        if not text.strip():
            raise TFConfigError("TF_CONFIG is empty. Set it to a JSON object with "
                                "\"cluster\" and \"task\", or unset it.")
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise _json_error(text, err) from None
    else:
        data = value
    if not isinstance(data, Mapping):
        raise TFConfigError(
            f"TF_CONFIG must be a JSON object with \"cluster\" and \"task\". Received a "
            f"{type(data).__name__}: {data!r}."
        )
    unknown = [k for k in data if k not in _KNOWN_KEYS]
    if unknown:
        warnings.warn(
            f"TF_CONFIG has keys TensorFlow ignores: {', '.join(map(repr, unknown))}. "
            f"Known keys: {', '.join(_KNOWN_KEYS)}. Check for a typo.",
            TFConfigWarning,
            stacklevel=2,
        )
    if "cluster" not in data:
        raise TFConfigError(
            "TF_CONFIG has no \"cluster\". Add the addresses of every task, e.g. "
            "\"cluster\": {\"worker\": [\"host1:2222\", \"host2:2222\"]}."
        )
    if "task" not in data:
        raise TFConfigError(
            "TF_CONFIG has no \"task\": this process does not know which task it is. "
            "Add e.g. \"task\": {\"type\": \"worker\", \"index\": 0}."
        )
    cluster = Cluster.from_dict(data["cluster"], what="TF_CONFIG[\"cluster\"]")
    _warn_mixed_loopback(cluster)
    task = data["task"]
    if not isinstance(task, Mapping):
        raise TFConfigError(
            f"TF_CONFIG[\"task\"] must be an object. Received: {task!r}. "
            f"Write e.g. \"task\": {{\"type\": \"worker\", \"index\": 0}}."
        )
    if "type" not in task:
        raise TFConfigError(
            f"TF_CONFIG[\"task\"] has no \"type\". Received: {dict(task)!r}. "
            f"Add one of: {', '.join(TASK_TYPES)}."
        )
    if "index" not in task:
        raise TFConfigError(
            f"TF_CONFIG[\"task\"] has no \"index\". Received: {dict(task)!r}. "
            f"Add the task's position in its role, e.g. \"index\": 0."
        )
    task_type = task["type"]
    if task_type == "master":
        warnings.warn(
            "TF_CONFIG[\"task\"][\"type\"] is the old name 'master'; tfdist treats it as "
            "'chief'. Rename it to \"chief\".",
            TFConfigWarning,
            stacklevel=2,
        )
        task_type = "chief"
    return TFConfig(cluster=cluster, task_type=task_type, task_id=task["index"],
                    rpc_layer=data.get("rpc_layer"))


def _is_loopback(host: str) -> bool:
    host = host.lower().rstrip(".").strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _warn_mixed_loopback(cluster: Cluster) -> None:
    addresses = [cluster.address(*t) for t in cluster.tasks()]
    local = [a for a in addresses if _is_loopback(split_address(a)[0])]
    if local and len(local) < len(addresses):
        remote = [a for a in addresses if a not in local]
        warnings.warn(
            f"The cluster mixes loopback addresses ({', '.join(local)}) with other hosts "
            f"({', '.join(remote)}). A task on another machine cannot reach a loopback "
            f"address: use every task's real host name or IP.",
            TFConfigWarning,
            stacklevel=3,
        )


def tf_config_from_env(environ: Mapping[str, str] | None = None) -> TFConfig | None:
    """The validated TF_CONFIG of this process, or None when it is unset.

    An unset or empty TF_CONFIG, or "{}", means "no cluster" (TensorFlow treats
    "{}" the same way). Anything else must be valid.

    Raises:
      TFConfigError: when TF_CONFIG is set but invalid.
    """
    environ = os.environ if environ is None else environ
    value = environ.get(_TF_CONFIG)
    if value is None or "".join(value.split()) in ("", "{}"):
        return None
    return parse_tf_config(value)


def tf_config_for(cluster: Cluster, task_type: str, task_id: int, *,
                  rpc_layer: str | None = None) -> str:
    """The TF_CONFIG JSON for one task of `cluster`."""
    return TFConfig(cluster=cluster, task_type=task_type, task_id=task_id,
                    rpc_layer=rpc_layer).to_json()


def tf_configs(cluster: Cluster, *, rpc_layer: str | None = None) -> list[TFConfig]:
    """One TFConfig per task of `cluster` (evaluator included), chief first."""
    return [TFConfig(cluster=cluster, task_type=t, task_id=i, rpc_layer=rpc_layer)
            for t, i in cluster.tasks()]


STRATEGY_KINDS: tuple[str, ...] = ("multi_worker_mirrored", "parameter_server")


def check_cluster_for(cluster: Cluster | TFConfig, strategy: str) -> None:
    """Checks that `cluster` has the roles `strategy` needs.

    Args:
      cluster: a Cluster or a TFConfig.
      strategy: 'multi_worker_mirrored' (chief/workers, no ps) or
        'parameter_server' (a chief as coordinator, >= 1 worker, >= 1 ps).

    Raises:
      TFConfigError: naming the missing or extra roles and the fix.
    """
    if isinstance(cluster, TFConfig):
        cluster = cluster.cluster
    if strategy not in STRATEGY_KINDS:
        raise TFConfigError(
            f"Unknown strategy {strategy!r}. Valid: {', '.join(STRATEGY_KINDS)}."
        )
    if strategy == "multi_worker_mirrored":
        if cluster.ps:
            raise TFConfigError(
                f"MultiWorkerMirroredStrategy has no parameter servers, but the cluster "
                f"lists ps={list(cluster.ps)}. Remove \"ps\" from the cluster, or use the "
                f"parameter_server strategy."
            )
        return
    missing = ["a chief (the coordinator that runs the training loop)"] if not cluster.chief else []
    missing += ["at least one worker"] if not cluster.worker else []
    missing += ["at least one ps"] if not cluster.ps else []
    if missing:
        raise TFConfigError(
            f"ParameterServerStrategy needs {', '.join(missing)}. Received a cluster "
            f"with {cluster.sizes()}. Example: local_cluster(num_workers=2, num_ps=1, "
            f"chief=True) or `tfdist tf-config --local --num_workers=2 --num_ps=1 --chief`."
        )


# ---------------------------------------------------------------------------
# Local ports

# Ports handed out by this process: never give the same one twice.
_HANDED_OUT: set[int] = set()
_PORT_LOCK = threading.Lock()
# Like portpicker, prefer ports below Linux's ephemeral range (32768-60999):
# outgoing connections (gRPC clients among them) take their source ports from
# that range and could grab a port between our pick and the server's bind.
_PREFERRED_PORTS = (15000, 25000)
_LOOPBACK_HOSTS = ("127.0.0.1", "localhost")


def _try_bind(host: str, port: int) -> socket.socket | None:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        return None
    return sock


def free_ports(count: int, *, host: str = "127.0.0.1") -> list[int]:
    """`count` distinct TCP ports that are free on `host` (a loopback address).

    Each port is checked by binding it on `host`; all stay bound until the
    whole set is chosen, and no port is returned twice in one process. There is
    an unavoidable race between this check and the server's own bind: start
    the servers right away.
    """
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise TFConfigError(f"count must be an integer >= 0. Received: count={count!r}")
    bind_host = "127.0.0.1" if host == "localhost" else host
    held: list[socket.socket] = []
    ports: list[int] = []
    rng = random.SystemRandom()
    with _PORT_LOCK:
        try:
            attempts = 0
            while len(ports) < count:
                attempts += 1
                if attempts > 100 * (count + 1):
                    raise OSError(f"could not find {count} free ports on {host}")
                # Mostly random picks in the preferred range; fall back to the kernel.
                port = rng.randrange(*_PREFERRED_PORTS) if attempts <= 50 * count else 0
                if port in _HANDED_OUT or port in ports:
                    continue
                sock = _try_bind(bind_host, port)
                if sock is None:
                    continue
                port = sock.getsockname()[1]
                held.append(sock)
                if port in _HANDED_OUT or port in ports:
                    continue
                ports.append(port)
            _HANDED_OUT.update(ports)
        finally:
            for sock in held:
                sock.close()
    return ports


def check_local_ports(cluster: Cluster) -> None:
    """Checks that every loopback address of `cluster` has a free port right now.

    Call it just before starting the local tasks: a port taken since it was
    picked (or a hand-written cluster reusing a busy port) fails here with the
    task's name instead of as "Could not start gRPC server" in a child.
    Non-loopback addresses are not touched.

    Raises:
      TFConfigError: naming the task, its address and the fix.
    """
    for task_type, task_id in cluster.tasks():
        address = cluster.address(task_type, task_id)
        host, port = split_address(address)
        if not _is_loopback(host) or host.startswith("["):
            continue
        sock = _try_bind("127.0.0.1" if host.lower() == "localhost" else host, port)
        if sock is None:
            raise TFConfigError(
                f"Port {port} of {task_type}:{task_id} ({address}) is already in use on "
                f"this machine. Stop the process holding it, or pick free ports with "
                f"local_cluster() / `tfdist tf-config --local`."
            )
        sock.close()


def _check_count(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise TFConfigError(f"{name} must be an integer >= {minimum}. Received: {name}={value!r}")


def local_cluster(*, num_workers: int, num_ps: int = 0, chief: bool = False,
                  evaluator: bool = False, host: str = "127.0.0.1") -> Cluster:
    """A cluster of local tasks on free ports of 127.0.0.1.

    Args:
      num_workers: number of 'worker' tasks (>= 1); the chief is extra.
      num_ps: number of parameter servers.
      chief: add a 'chief' task.
      evaluator: add an 'evaluator' task (it gets a port too, unused by TF).
      host: a loopback host ('127.0.0.1' or 'localhost'); use hosts_cluster()
        for other machines.

    Example:
      >>> cluster = local_cluster(num_workers=2)
      >>> [tf_config_for(cluster, "worker", i) for i in range(2)]  # doctest: +SKIP
    """
    _check_count("num_workers", num_workers, 1)
    _check_count("num_ps", num_ps, 0)
    if host not in _LOOPBACK_HOSTS:
        raise TFConfigError(
            f"local_cluster only uses loopback addresses. Received: host={host!r}. "
            f"Use host='127.0.0.1', or hosts_cluster([...]) for other machines."
        )
    counts = {"chief": int(bool(chief)), "worker": num_workers, "ps": num_ps,
              "evaluator": int(bool(evaluator))}
    ports = iter(free_ports(sum(counts.values()), host=host))
    return Cluster(**{role: tuple(f"{host}:{next(ports)}" for _ in range(n))
                      for role, n in counts.items()})


def hosts_cluster(hosts: str | Iterable[str], *, num_ps: int = 0, chief: bool = False,
                  evaluator: bool = False, port: int = 2222) -> Cluster:
    """A cluster over a list of machines: "host" or "host:port" entries, in order.

    Tasks are assigned in list order: the chief (if `chief`), then the workers,
    then `num_ps` parameter servers, then the evaluator (if `evaluator`).
    A host without a port gets `port`; a host listed several times gets
    `port`, `port + 1`, ... so several tasks can share a machine.

    Example:
      >>> hosts_cluster("a,b,c", num_ps=1).cluster_dict()
      {'worker': ['a:2222', 'b:2222'], 'ps': ['c:2222']}
    """
    if isinstance(hosts, str):
        hosts = [h for h in hosts.split(",")]
    hosts = [h.strip() if isinstance(h, str) else h for h in hosts]
    _check_count("num_ps", num_ps, 0)
    _check_count("port", port, 1)
    if port > 65535:
        raise TFConfigError(f"port must be <= 65535. Received: port={port}")
    for i, h in enumerate(hosts):
        if not isinstance(h, str) or not h:
            raise TFConfigError(
                f"hosts[{i}] is empty or not a string. Received: hosts={hosts!r}. "
                f"List host names separated by commas, e.g. 'node1,node2'."
            )
    extra = int(bool(chief)) + num_ps + int(bool(evaluator))
    num_workers = len(hosts) - extra
    if num_workers < 1:
        raise TFConfigError(
            f"Not enough hosts: {len(hosts)} host(s) for chief={bool(chief)}, "
            f"num_ps={num_ps}, evaluator={bool(evaluator)} leaves {num_workers} "
            f"worker(s). List at least {extra + 1} hosts or ask for fewer roles."
        )
    next_port: dict[str, int] = {}
    addresses = []
    for h in hosts:
        if ":" in h and not h.endswith("]"):
            split_address(h, what="host")
            addresses.append(h)
        else:
            p = next_port.get(h.lower(), port)
            next_port[h.lower()] = p + 1
            address = f"{h}:{p}"
            split_address(address, what="host")
            addresses.append(address)
    it = iter(addresses)
    take = lambda n: tuple(next(it) for _ in range(n))  # noqa: E731
    return Cluster(chief=take(int(bool(chief))), worker=take(num_workers),
                   ps=take(num_ps), evaluator=take(int(bool(evaluator))))


# ---------------------------------------------------------------------------
# SLURM


def expand_hostlist(hostlist: str) -> list[str]:
    """Expands a SLURM hostlist: 'node[01-03,7],gpu[1-2]x' -> ['node01', ..., 'gpu2x'].

    Order is kept and nothing is deduplicated (like TensorFlow's
    `expand_hostlist`). Zero padding follows the width of each range start,
    and several bracket groups in one name expand to every combination.

    Raises:
      TFConfigError: on an unbalanced bracket or a malformed range.
    """
    if not isinstance(hostlist, str) or not hostlist.strip():
        raise TFConfigError(f"The SLURM node list is empty. Received: {hostlist!r}.")
    parts, depth, current = [], 0, ""
    for char in hostlist.strip():
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
        if depth not in (0, 1):
            break
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    if depth != 0:
        raise TFConfigError(
            f"Invalid SLURM node list {hostlist!r}: unbalanced '[' ']'. Expected a list "
            f"like 'node[01-04],gpu7'."
        )
    parts.append(current)
    hosts: list[str] = []
    for part in parts:
        if not part:
            raise TFConfigError(f"Invalid SLURM node list {hostlist!r}: empty entry.")
        names = [""]
        for literal, ranges in re.findall(r"([^\[\]]*)(?:\[([^\]]*)\])?", part):
            values = [literal]
            if ranges:
                values = [literal + v for v in _expand_ranges(ranges, hostlist)]
            names = [n + v for n in names for v in values]
        hosts.extend(names)
    return hosts


def _expand_ranges(ranges: str, hostlist: str) -> list[str]:
    out = []
    for item in ranges.split(","):
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", item)
        if not m or (m.group(2) is not None and int(m.group(2)) < int(m.group(1))):
            raise TFConfigError(
                f"Invalid SLURM node list {hostlist!r}: bad range {item!r}. Ranges look "
                f"like '01-04' or '7'."
            )
        lo, hi = m.group(1), m.group(2) or m.group(1)
        out.extend(str(i).zfill(len(lo)) for i in range(int(lo), int(hi) + 1))
    return out


def expand_tasks_per_node(tasks_per_node: str) -> list[int]:
    """Expands SLURM's tasks-per-node string: '2(x3),1' -> [2, 2, 2, 1]."""
    result = []
    for part in str(tasks_per_node).split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if not m:
            raise TFConfigError(
                f"Invalid SLURM tasks-per-node value {tasks_per_node!r}. Expected a list "
                f"like '2(x3),1' (2 tasks on each of 3 nodes, then 1)."
            )
        result.extend([int(m.group(1))] * int(m.group(2) or 1))
    return result


def _slurm_var(environ: Mapping[str, str], *names: str) -> tuple[str, str] | None:
    for name in names:
        value = environ.get(name)
        if value is not None and value.strip():
            return name, value.strip()
    return None


def slurm_tf_config(environ: Mapping[str, str] | None = None, *, port: int = 8888,
                    num_ps: int = 0, chief: bool = False, evaluator: bool = False,
                    rpc_layer: str | None = None) -> TFConfig:
    """This SLURM task's TF_CONFIG, from the job step's environment.

    Reads what TensorFlow's SlurmClusterResolver reads: SLURM_PROCID (this
    task's rank), SLURM_STEP_NODELIST, SLURM_STEP_TASKS_PER_NODE and
    SLURM_STEP_NUM_TASKS, falling back to the job-level SLURM_JOB_NODELIST /
    SLURM_NODELIST, SLURM_TASKS_PER_NODE and SLURM_NTASKS outside a step.
    Conventions match the resolver: the k-th task on a node listens on
    `port + k`; ranks are given to roles in alphabetical order of the role
    name (chief, evaluator, ps, worker), so with `num_ps=1` rank 0 is the
    parameter server and ranks 1.. are workers.

    One deliberate difference: nodes keep SLURM's order instead of being
    sorted as strings. SLURM hands ranks out in node-list order, so sorting
    'node9,node10' as strings would give rank 0 (on node9) node10's address.
    For the usual zero-padded names ('node[01-10]') both orders agree.

    Raises:
      TFConfigError: when a SLURM variable is missing or inconsistent, or the
        tasks do not fit the requested roles.
    """
    environ = os.environ if environ is None else environ
    _check_count("num_ps", num_ps, 0)
    _check_count("port", port, 1)
    procid = _slurm_var(environ, "SLURM_PROCID")
    nodelist = _slurm_var(environ, "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
    per_node = _slurm_var(environ, "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
    missing = [name for name, found in (("SLURM_PROCID", procid),
                                        ("SLURM_STEP_NODELIST", nodelist),
                                        ("SLURM_STEP_TASKS_PER_NODE", per_node))
               if found is None]
    if missing:
        raise TFConfigError(
            f"{', '.join(missing)} not found in the environment: not running inside a "
            f"SLURM job step? Run the command under srun (one task per TensorFlow "
            f"process), e.g. `srun --ntasks-per-node=1 tfdist tf-config --slurm`."
        )
    if not re.fullmatch(r"[0-9]+", procid[1]):
        raise TFConfigError(f"SLURM_PROCID must be an integer >= 0. Received: {procid[1]!r}.")
    rank = int(procid[1])
    hosts = expand_hostlist(nodelist[1])
    counts = expand_tasks_per_node(per_node[1])
    if len(counts) != len(hosts):
        raise TFConfigError(
            f"{per_node[0]}={per_node[1]!r} gives tasks for {len(counts)} node(s) but "
            f"{nodelist[0]}={nodelist[1]!r} lists {len(hosts)}. They must describe the "
            f"same nodes."
        )
    if len(set(hosts)) != len(hosts):
        raise TFConfigError(f"{nodelist[0]}={nodelist[1]!r} lists a node twice.")
    num_tasks = sum(counts)
    ntasks = _slurm_var(environ, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")
    if ntasks is not None and ntasks[1] != str(num_tasks):
        raise TFConfigError(
            f"{ntasks[0]}={ntasks[1]} but {per_node[0]}={per_node[1]!r} adds up to "
            f"{num_tasks} tasks. They must agree."
        )
    if rank >= num_tasks:
        raise TFConfigError(
            f"SLURM_PROCID={rank} is out of range for a step of {num_tasks} task(s)."
        )
    if port + max(counts) - 1 > 65535:
        raise TFConfigError(f"port={port} + {max(counts)} tasks per node exceeds 65535.")
    addresses = [f"{host}:{port + k}" for host, n in zip(hosts, counts) for k in range(n)]
    roles = {"chief": int(bool(chief)), "evaluator": int(bool(evaluator)), "ps": num_ps}
    roles["worker"] = num_tasks - sum(roles.values())
    if roles["worker"] < 1:
        raise TFConfigError(
            f"The SLURM step has {num_tasks} task(s), too few for chief={bool(chief)}, "
            f"evaluator={bool(evaluator)}, num_ps={num_ps} and at least one worker. "
            f"Ask SLURM for more tasks (--ntasks) or for fewer roles."
        )
    assigned: dict[str, tuple[str, ...]] = {}
    start = 0
    task_type, task_id = "worker", 0
    for role in sorted(roles):
        assigned[role] = tuple(addresses[start:start + roles[role]])
        if start <= rank < start + roles[role]:
            task_type, task_id = role, rank - start
        start += roles[role]
    node = environ.get("SLURMD_NODENAME")
    own_host = split_address(assigned[task_type][task_id])[0]
    if node and node != own_host and node.split(".")[0] != own_host.split(".")[0]:
        raise TFConfigError(
            f"SLURM rank {rank} runs on {node!r} but the node list puts it on "
            f"{own_host!r}: tasks are not distributed in blocks. Run srun with "
            f"--distribution=block."
        )
    return TFConfig(cluster=Cluster(**assigned), task_type=task_type, task_id=task_id,
                    rpc_layer=rpc_layer)


# ---------------------------------------------------------------------------
# Kubernetes (Kubeflow training operator)

_RESTART_POLICIES = ("Always", "OnFailure", "Never", "ExitCode")
_DNS1035 = re.compile(r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$")


def kubernetes_tfjob(*, name: str, image: str, command: Sequence[str], num_workers: int,
                     num_ps: int = 0, chief: bool = False, evaluator: bool = False,
                     port: int = 2222, namespace: str | None = None,
                     restart_policy: str = "OnFailure",
                     env: Mapping[str, str] | None = None,
                     resources: Mapping[str, Any] | None = None,
                     clean_pod_policy: str | None = "None") -> dict[str, Any]:
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
      clean_pod_policy: spec.runPolicy.cleanPodPolicy (None to omit it).

    Returns:
      The manifest as a dict; `to_yaml(manifest)` gives `kubectl apply -f` input.
    """
    if not isinstance(name, str) or not _DNS1035.match(name):
        raise TFConfigError(
            f"name must be a DNS-1035 label (lowercase letters, digits and '-', starting "
            f"with a letter, at most 63 characters). Received: name={name!r}."
        )
    if not isinstance(image, str) or not image or any(c.isspace() for c in image):
        raise TFConfigError(f"image must be a container image name. Received: image={image!r}.")
    if isinstance(command, str):
        command = command.split()
    command = list(command)
    if not command or not all(isinstance(c, str) and c for c in command):
        raise TFConfigError(
            f"command must be a non-empty list of strings, e.g. ['python', 'train.py']. "
            f"Received: command={command!r}."
        )
    _check_count("num_workers", num_workers, 1)
    _check_count("num_ps", num_ps, 0)
    _check_count("port", port, 1)
    if port > 65535:
        raise TFConfigError(f"port must be <= 65535. Received: port={port}")
    if restart_policy not in _RESTART_POLICIES:
        raise TFConfigError(
            f"restart_policy must be one of {', '.join(_RESTART_POLICIES)}. "
            f"Received: restart_policy={restart_policy!r}."
        )
    if namespace is not None and not _DNS1035.match(str(namespace)):
        raise TFConfigError(f"namespace must be a DNS label. Received: namespace={namespace!r}.")
    container: dict[str, Any] = {
        "name": "tensorflow",  # the operator looks for this container name
        "image": image,
        "command": command,
        "ports": [{"name": "tfjob-port", "containerPort": port}],
    }
    if env:
        container["env"] = [{"name": str(k), "value": str(v)} for k, v in env.items()]
    if resources:
        container["resources"] = {"limits": {str(k): v for k, v in resources.items()}}
    replicas = {"Chief": int(bool(chief)), "Worker": num_workers, "PS": num_ps,
                "Evaluator": int(bool(evaluator))}
    specs = {
        kind: {
            "replicas": n,
            "restartPolicy": restart_policy,
            "template": {"spec": {"containers": [container]}},
        }
        for kind, n in replicas.items() if n
    }
    metadata: dict[str, Any] = {"name": name}
    if namespace is not None:
        metadata["namespace"] = namespace
    spec: dict[str, Any] = {}
    if clean_pod_policy is not None:
        spec["runPolicy"] = {"cleanPodPolicy": clean_pod_policy}
    spec["tfReplicaSpecs"] = specs
    return {"apiVersion": "kubeflow.org/v1", "kind": "TFJob", "metadata": metadata,
            "spec": spec}


def kubernetes_cluster(*, name: str, namespace: str = "default", num_workers: int,
                       num_ps: int = 0, chief: bool = False, port: int = 2222,
                       cluster_domain: str | None = None) -> Cluster:
    """The cluster the training operator writes into each pod's TF_CONFIG."""
    suffix = f".{namespace}.svc" + (f".{cluster_domain}" if cluster_domain else "")
    make = lambda role, n: tuple(f"{name}-{role}-{i}{suffix}:{port}"  # noqa: E731
                                 for i in range(n))
    return Cluster(chief=make("chief", int(bool(chief))), worker=make("worker", num_workers),
                   ps=make("ps", num_ps))


# ---------------------------------------------------------------------------
# A small YAML emitter (block style) for manifests: dicts, lists, str, int,
# float, bool, None. Strings that YAML could read as anything else are quoted.

_PLAIN = re.compile(r"^[A-Za-z0-9_./][A-Za-z0-9_./:+=@-]*$")
_YAML_SPECIAL = re.compile(
    r"^(?:~|null|true|false|yes|no|on|off|y|n|[-+]?(?:\.inf|\.nan)"
    r"|[-+]?[0-9][0-9_.:eE+-]*|0x[0-9a-fA-F]+|0o[0-7]+)$",
    re.IGNORECASE,
)


def _yaml_scalar(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return json.dumps(value)
    text = str(value)
    if _PLAIN.match(text) and not _YAML_SPECIAL.match(text) and not text.endswith(":"):
        return text
    return json.dumps(text)  # a JSON string is a valid double-quoted YAML scalar


def _yaml_lines(value: Any, indent: int) -> list[str]:
    pad = " " * indent
    if isinstance(value, Mapping):
        if not value:
            return [pad + "{}"]
        lines = []
        for key, item in value.items():
            head = f"{pad}{_yaml_scalar(str(key))}:"
            if isinstance(item, (Mapping, list, tuple)) and item:
                lines.append(head)
                lines.extend(_yaml_lines(item, indent + 2))
            else:
                lines.append(f"{head} {_yaml_inline(item)}")
        return lines
    if isinstance(value, (list, tuple)):
        if not value:
            return [pad + "[]"]
        lines = []
        for item in value:
            if isinstance(item, (Mapping, list, tuple)) and item:
                sub = _yaml_lines(item, indent + 2)
                lines.append(f"{pad}- {sub[0].lstrip()}")
                lines.extend(sub[1:])
            else:
                lines.append(f"{pad}- {_yaml_inline(item)}")
        return lines
    return [pad + _yaml_scalar(value)]


def _yaml_inline(value: Any) -> str:
    if isinstance(value, Mapping):
        return "{}"
    if isinstance(value, (list, tuple)):
        return "[]"
    return _yaml_scalar(value)


def to_yaml(value: Any) -> str:
    """Block-style YAML for a manifest made of dicts, lists and scalars."""
    return "\n".join(_yaml_lines(value, 0)) + "\n"

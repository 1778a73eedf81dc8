"""Reading TF_CONFIG: parse and validate it, and check it suits a strategy.

`parse_tf_config` turns the JSON text (or a mapping) into a `TFConfig` or
raises `TFConfigError` with what was received and what to change. It never
raises anything else, whatever the text: hostile input (JSON nested thousands
deep, numbers with thousands of digits, invalid UTF-8) is an error message
too, not a traceback.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Mapping
from typing import Any

from tfdist.cluster.addresses import is_loopback, split_address
from tfdist.cluster.errors import TFConfigError, TFConfigWarning, received
from tfdist.cluster.model import TASK_TYPES, Cluster, TFConfig

# Top-level TF_CONFIG keys TensorFlow (or Estimator / Cloud ML) reads.
_KNOWN_KEYS = ("cluster", "task", "rpc_layer", "environment", "session_master")
_TF_CONFIG = "TF_CONFIG"
STRATEGY_KINDS: tuple[str, ...] = ("multi_worker_mirrored", "parameter_server")


def _ascii(text: str) -> str:
    return text.encode("ascii", "backslashreplace").decode("ascii")


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
        f"{err.colno} (char {err.pos}):\n  {_ascii(snippet)}\n  {caret}\nFix the JSON.{hint}")


def _load_json(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise _json_error(text, err) from None
    except RecursionError:
        raise TFConfigError(
            f"TF_CONFIG is nested too deeply to read ({len(text)} characters, mostly "
            f"brackets). A TF_CONFIG is an object of at most three levels: "
            f"{{\"cluster\": {{\"worker\": [\"host:port\"]}}, \"task\": {{...}}}}.") from None
    except ValueError as err:
        # e.g. "Exceeds the limit (4300 digits) for integer string conversion".
        raise TFConfigError(
            f"TF_CONFIG holds a value JSON cannot read here: {_ascii(str(err))}. Task "
            f"indices and ports are small integers: fix the number.") from None


def parse_tf_config(value: str | bytes | Mapping[str, Any]) -> TFConfig:
    """Parses and validates a TF_CONFIG value (a JSON string or a mapping).

    Args:
      value: the TF_CONFIG JSON text, or the already-decoded mapping.

    Returns:
      The validated TFConfig.

    Raises:
      TFConfigError: malformed JSON (with the position), a missing 'cluster' or
        'task', an unknown role (the TF 1.x 'master' included), an index out of
        range or not an integer, duplicate or malformed addresses, an
        evaluator listed in the cluster, more than one chief, an empty cluster.

    Example:
      >>> parse_tf_config('{"cluster": {"worker": ["a:1", "b:1"]},'
      ...                 ' "task": {"type": "worker", "index": 0}}').is_chief
      True
    """
    if isinstance(value, (str, bytes)):
        if isinstance(value, bytes):
            value = value.decode("utf-8", "surrogateescape")
        if not value.strip():
            raise TFConfigError("TF_CONFIG is empty. Set it to a JSON object with "
                                "\"cluster\" and \"task\", or unset it.")
        data = _load_json(value)
    else:
        data = value
    if not isinstance(data, Mapping):
        raise TFConfigError(
            f"TF_CONFIG must be a JSON object with \"cluster\" and \"task\". Received a "
            f"{type(data).__name__}: {received(data)}.")
    unknown = [k for k in data if k not in _KNOWN_KEYS]
    if unknown:
        warnings.warn(
            f"TF_CONFIG has keys TensorFlow ignores: {', '.join(map(received, unknown[:8]))}"
            f"{' ...' if len(unknown) > 8 else ''}. Known keys: {', '.join(_KNOWN_KEYS)}. "
            f"Check for a typo.", TFConfigWarning, stacklevel=2)
    if "cluster" not in data:
        raise TFConfigError(
            "TF_CONFIG has no \"cluster\". Add the addresses of every task, e.g. "
            "\"cluster\": {\"worker\": [\"host1:2222\", \"host2:2222\"]}.")
    if "task" not in data:
        raise TFConfigError(
            "TF_CONFIG has no \"task\": this process does not know which task it is. "
            "Add e.g. \"task\": {\"type\": \"worker\", \"index\": 0}.")
    cluster = Cluster.from_dict(data["cluster"], what="TF_CONFIG[\"cluster\"]")
    _warn_mixed_loopback(cluster)
    task = data["task"]
    if not isinstance(task, Mapping):
        raise TFConfigError(
            f"TF_CONFIG[\"task\"] must be an object. Received: {received(task)}. "
            f"Write e.g. \"task\": {{\"type\": \"worker\", \"index\": 0}}.")
    if "type" not in task:
        raise TFConfigError(
            f"TF_CONFIG[\"task\"] has no \"type\". Received: {received(dict(task))}. "
            f"Add one of: {', '.join(TASK_TYPES)}.")
    if "index" not in task:
        raise TFConfigError(
            f"TF_CONFIG[\"task\"] has no \"index\". Received: {received(dict(task))}. "
            f"Add the task's position in its role, e.g. \"index\": 0.")
    return TFConfig(cluster=cluster, task_type=task["type"], task_id=task["index"],
                    rpc_layer=data.get("rpc_layer"))


def _warn_mixed_loopback(cluster: Cluster) -> None:
    addresses = [cluster.address(*t) for t in cluster.tasks()]
    local = [a for a in addresses if is_loopback(split_address(a)[0])]
    if local and len(local) < len(addresses):
        remote = [a for a in addresses if a not in local]
        warnings.warn(
            f"The cluster mixes loopback addresses ({', '.join(local[:4])}) with other hosts "
            f"({', '.join(remote[:4])}). A task on another machine cannot reach a loopback "
            f"address: use every task's real host name or IP.",
            TFConfigWarning, stacklevel=3)


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


def check_cluster_for(cluster: Cluster | TFConfig, strategy: str) -> None:
    """Checks that `cluster` has the roles `strategy` needs.

    Args:
      cluster: a Cluster, or a TFConfig (then this task's role is checked too).
      strategy: 'multi_worker_mirrored' (chief/workers, no ps; an evaluator
        task takes no part) or 'parameter_server' (a chief as coordinator,
        >= 1 worker, >= 1 ps).

    Raises:
      TFConfigError: naming the missing or extra roles and the fix.
    """
    task = cluster if isinstance(cluster, TFConfig) else None
    if task is not None:
        cluster = task.cluster
    if strategy not in STRATEGY_KINDS:
        raise TFConfigError(
            f"Unknown strategy {received(strategy)}. Valid: {', '.join(STRATEGY_KINDS)}.")
    if strategy == "multi_worker_mirrored":
        if cluster.ps:
            raise TFConfigError(
                f"MultiWorkerMirroredStrategy has no parameter servers, but the cluster "
                f"lists ps={list(cluster.ps)}. Remove \"ps\" from the cluster, or use the "
                f"parameter_server strategy.")
        if task is not None and task.task_type == "evaluator":
            # TensorFlow's MultiWorkerMirroredStrategy looks the evaluator up in the
            # cluster it must not be listed in, and fails with KeyError: 'evaluator'.
            raise TFConfigError(
                "This task is the evaluator (TF_CONFIG task type 'evaluator'), which does "
                "not join MultiWorkerMirroredStrategy's training cluster. Run the evaluator "
                "with a local preset (tfdist.make_strategy('default') or 'mirrored'), "
                "loading the checkpoints the chief writes.")
        return
    missing = ["a chief (the coordinator that runs the training loop)"] if not cluster.chief else []
    missing += ["at least one worker"] if not cluster.worker else []
    missing += ["at least one ps"] if not cluster.ps else []
    if missing:
        raise TFConfigError(
            f"ParameterServerStrategy needs {', '.join(missing)}. Received a cluster "
            f"with {cluster.sizes()}. Example: local_cluster(num_workers=2, num_ps=1, "
            f"chief=True) or `tfdist tf-config --local --num_workers=2 --num_ps=1 --chief`.")

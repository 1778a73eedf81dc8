"""SLURM: this task's TF_CONFIG from a job step's environment.

SLURM starts one process per task (`srun`) and tells each its rank
(SLURM_PROCID) and the step's nodes (SLURM_STEP_NODELIST, a hostlist such as
'node[01-04]') with their task counts (SLURM_STEP_TASKS_PER_NODE, '2(x4)').
From these every task works out the same cluster and its own place in it,
with no coordination.

TensorFlow's own `SlurmClusterResolver` does the same but needs `nvidia-smi`
on CPU-only nodes (tensorflow/tensorflow#56894) and sorts node names as
strings, which gives rank 0 (on node9) the address of node10 in
'node[9-10]'. This module keeps SLURM's order.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
from collections.abc import Mapping, Sequence

from tfdist.cluster.addresses import split_address
from tfdist.cluster.errors import TFConfigError, check_count, received
from tfdist.cluster.model import Cluster, TFConfig

# A hostlist expanding to more names than this is a typo ('node[1-100000000]'),
# not a cluster: refuse it before building the list.
MAX_HOSTS = 100_000


def expand_hostlist(hostlist: str) -> list[str]:
    """Expands a SLURM hostlist: 'node[01-03,7],gpu[1-2]x' -> ['node01', ..., 'gpu2x'].

    Order is kept and nothing is deduplicated (like TensorFlow's
    `expand_hostlist`). Zero padding follows the width of each range start,
    and several bracket groups in one name expand to every combination.

    Raises:
      TFConfigError: on a list it cannot read (unbalanced or nested brackets,
        a malformed range, an empty entry, more than MAX_HOSTS names).
    """
    if not isinstance(hostlist, str) or not hostlist.strip():
        raise TFConfigError(f"The SLURM node list is empty. Received: {received(hostlist)}.")
    text = hostlist.strip()
    expected = "Expected a SLURM hostlist like 'node[01-04,7],gpu1'."
    if not text.isascii() or not text.isprintable() or any(c.isspace() for c in text):
        raise TFConfigError(
            f"Invalid SLURM node list {received(hostlist)}: it holds spaces, control or "
            f"non-ASCII characters. {expected}")
    parts, depth, current = [], 0, ""
    for char in text:
        if char == "[":
            depth += 1
            if depth > 1:
                raise TFConfigError(
                    f"Invalid SLURM node list {received(hostlist)}: nested '['. {expected}")
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise TFConfigError(
                    f"Invalid SLURM node list {received(hostlist)}: ']' without '['. "
                    f"{expected}")
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    if depth != 0:
        raise TFConfigError(
            f"Invalid SLURM node list {received(hostlist)}: unbalanced '[' ']'. {expected}")
    parts.append(current)
    hosts: list[str] = []
    for part in parts:
        if not part:
            raise TFConfigError(
                f"Invalid SLURM node list {received(hostlist)}: empty entry. {expected}")
        pieces = re.findall(r"([^\[\]]+)|\[([^\[\]]*)\]", part)
        names = [""]
        for literal, ranges in pieces:
            values = [literal] if literal else _expand_ranges(ranges, hostlist)
            if len(hosts) + len(names) * len(values) > MAX_HOSTS:
                raise TFConfigError(
                    f"The SLURM node list {received(hostlist)} expands to more than "
                    f"{MAX_HOSTS} nodes: check the ranges.")
            names = [n + v for n in names for v in values]
        hosts.extend(names)
    return hosts


def _expand_ranges(ranges: str, hostlist: str) -> list[str]:
    out: list[str] = []
    for item in ranges.split(","):
        m = re.fullmatch(r"(\d{1,9})(?:-(\d{1,9}))?", item)
        if not m or (m.group(2) is not None and int(m.group(2)) < int(m.group(1))):
            raise TFConfigError(
                f"Invalid SLURM node list {received(hostlist)}: bad range {received(item)}. "
                f"Ranges look like '01-04' or '7'.")
        lo, hi = m.group(1), m.group(2) or m.group(1)
        if int(hi) - int(lo) + len(out) >= MAX_HOSTS:
            raise TFConfigError(
                f"The SLURM node list {received(hostlist)} expands to more than {MAX_HOSTS} "
                f"nodes: check the range {item!r}.")
        out.extend(str(i).zfill(len(lo)) for i in range(int(lo), int(hi) + 1))
    return out


def expand_tasks_per_node(tasks_per_node: str) -> list[int]:
    """Expands SLURM's tasks-per-node string: '2(x3),1' -> [2, 2, 2, 1]."""
    result: list[int] = []
    for part in str(tasks_per_node).split(","):
        m = re.fullmatch(r"\s*(\d{1,6})(?:\(x(\d{1,6})\))?\s*", part)
        if not m or len(result) + int(m.group(2) or 1) > MAX_HOSTS:
            raise TFConfigError(
                f"Invalid SLURM tasks-per-node value {received(tasks_per_node)}. Expected a "
                f"list like '2(x3),1' (2 tasks on each of 3 nodes, then 1).")
        result.extend([int(m.group(1))] * int(m.group(2) or 1))
    return result


def _slurm_var(environ: Mapping[str, str], *names: str) -> tuple[str, str] | None:
    for name in names:
        value = environ.get(name)
        if value is not None and value.strip():
            return name, value.strip()
    return None


def step_num_tasks(environ: Mapping[str, str] | None = None) -> int | None:
    """The number of tasks of the SLURM job step this process runs in, or None.

    Only a job step (`srun`) counts: a batch script has SLURM_PROCID=0 and the
    job's SLURM_NTASKS too, but it is one process.
    """
    environ = os.environ if environ is None else environ
    value = environ.get("SLURM_STEP_NUM_TASKS", "").strip()
    if "SLURM_PROCID" not in environ or not re.fullmatch(r"[0-9]{1,9}", value):
        return None
    return int(value)


def node_addresses(nodes: Sequence[str]) -> dict[str, str]:
    """SLURM's NodeAddr of each node (`scontrol show node`), for nodes whose names do not resolve.

    Raises:
      TFConfigError: scontrol is missing, fails, or does not list a node.
    """
    try:
        result = subprocess.run(["scontrol", "-o", "show", "node", ",".join(nodes)],
                                capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise TFConfigError(
            f"Could not ask SLURM for the nodes' addresses (`scontrol show node`): {err}. "
            f"Run inside a SLURM job, or use the node names (addresses='name').") from None
    found = {}
    for line in result.stdout.splitlines():
        fields = dict(f.split("=", 1) for f in line.split() if "=" in f)
        if "NodeName" in fields and "NodeAddr" in fields:
            found[fields["NodeName"]] = fields["NodeAddr"]
    missing = [n for n in nodes if n not in found]
    if result.returncode != 0 or missing:
        raise TFConfigError(
            f"`scontrol show node` did not give the address of {', '.join(missing) or 'the nodes'}"
            f" (exit {result.returncode}: {received(result.stderr.strip())}). Check that the "
            f"nodes exist, or use the node names (addresses='name').")
    return found


def slurm_tf_config(environ: Mapping[str, str] | None = None, *, port: int = 8888,
                    num_ps: int = 0, chief: bool = False, evaluator: bool = False,
                    num_workers: int | None = None, addresses: str = "auto",
                    rpc_layer: str | None = None) -> TFConfig:
    """This SLURM task's TF_CONFIG, from the job step's environment.

    Reads what TensorFlow's SlurmClusterResolver reads: SLURM_PROCID (this
    task's rank), SLURM_STEP_NODELIST, SLURM_STEP_TASKS_PER_NODE and
    SLURM_STEP_NUM_TASKS, falling back to the job-level SLURM_JOB_NODELIST /
    SLURM_NODELIST, SLURM_TASKS_PER_NODE and SLURM_NTASKS outside a step.

    Conventions match the resolver: ranks are given to roles in alphabetical
    order of the role name (chief, evaluator, ps, worker), so with `num_ps=1`
    rank 0 is the parameter server and ranks 1.. are workers; the k-th task
    on a host listens on `port + k`. Nodes keep SLURM's order (the order in
    which it hands out ranks with block distribution), not the resolver's
    string sort.

    Args:
      environ: the environment to read (default `os.environ`).
      port: the port of the first task on each host.
      num_ps, chief, evaluator: the roles to give the first ranks.
      num_workers: the number of workers the job expects; the step must then
        have exactly that many tasks left after the other roles (None: every
        remaining task is a worker).
      addresses: 'name' (the node names, as DNS knows them), 'nodeaddr'
        (SLURM's NodeAddr of each node, from `scontrol show node`: for nodes
        whose names do not resolve, or whose NodeAddr is the interface to use)
        or 'auto' (the name where it resolves, else the NodeAddr).
        Nodes that share an address (e.g. test nodes on one machine) get
        distinct ports: the k-th task on an *address* listens on `port + k`.
      rpc_layer: an optional TF_CONFIG rpc_layer.

    Raises:
      TFConfigError: when a SLURM variable is missing, unreadable or
        inconsistent, or the step's tasks do not match the requested roles.
    """
    environ = os.environ if environ is None else environ
    check_count("num_ps", num_ps, 0)
    check_count("port", port, 1, 65535)
    if num_workers is not None:
        check_count("num_workers", num_workers, 1)
    if addresses not in ("name", "nodeaddr", "auto"):
        raise TFConfigError(
            f"addresses must be 'name', 'nodeaddr' or 'auto'. Received: "
            f"addresses={received(addresses)}.")
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
            f"process), e.g. `srun --ntasks-per-node=1 tfdist tf-config --slurm`.")
    if not re.fullmatch(r"[0-9]{1,9}", procid[1]):
        raise TFConfigError(
            f"SLURM_PROCID must be an integer >= 0. Received: {received(procid[1])}.")
    rank = int(procid[1])
    hosts = expand_hostlist(nodelist[1])
    counts = expand_tasks_per_node(per_node[1])
    if len(counts) != len(hosts):
        raise TFConfigError(
            f"{per_node[0]}={received(per_node[1])} gives tasks for {len(counts)} node(s) but "
            f"{nodelist[0]}={received(nodelist[1])} lists {len(hosts)}. They must describe "
            f"the same nodes.")
    if len(set(hosts)) != len(hosts):
        raise TFConfigError(f"{nodelist[0]}={received(nodelist[1])} lists a node twice.")
    num_tasks = sum(counts)
    ntasks = _slurm_var(environ, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")
    if ntasks is not None and ntasks[1] != str(num_tasks):
        raise TFConfigError(
            f"{ntasks[0]}={received(ntasks[1])} but {per_node[0]}={received(per_node[1])} "
            f"adds up to {num_tasks} tasks. They must agree.")
    if rank >= num_tasks:
        raise TFConfigError(
            f"SLURM_PROCID={rank} is out of range for a step of {num_tasks} task(s).")
    roles = {"chief": int(bool(chief)), "evaluator": int(bool(evaluator)), "ps": num_ps}
    roles["worker"] = num_tasks - sum(roles.values())
    asked = (f"chief={bool(chief)}, evaluator={bool(evaluator)}, num_ps={num_ps}"
             + (f", num_workers={num_workers}" if num_workers is not None else ""))
    if roles["worker"] < 1 or (num_workers is not None and roles["worker"] != num_workers):
        need = sum(roles.values()) - roles["worker"] + (num_workers or 1)
        more = "at least " if num_workers is None else ""
        raise TFConfigError(
            f"The SLURM step has {num_tasks} task(s) ({per_node[0]}={per_node[1]}) but the "
            f"roles asked for ({asked}) need {more}{need}. Run srun with --ntasks={need}, "
            f"or ask for roles that add up to {num_tasks}.")
    by_node = {h: h for h in hosts}
    if addresses != "name":
        lookup = hosts if addresses == "nodeaddr" else [h for h in hosts if not _resolves(h)]
        if lookup:
            by_node.update(node_addresses(lookup))
    next_port: dict[str, int] = {}
    task_addresses = []
    for host, n in zip(hosts, counts):
        address_host = by_node[host]
        if ":" in address_host and not address_host.startswith("["):
            address_host = f"[{address_host}]"
        for _ in range(n):
            p = next_port.get(address_host, port)
            next_port[address_host] = p + 1
            if p > 65535:
                raise TFConfigError(
                    f"port={port} + {p - port} tasks on {host} ({address_host}) exceeds 65535. "
                    f"Pass a lower --port.")
            task_addresses.append(f"{address_host}:{p}")
    assigned: dict[str, tuple[str, ...]] = {}
    start = 0
    task_type, task_id = "worker", 0
    for role in sorted(roles):
        assigned[role] = tuple(task_addresses[start:start + roles[role]])
        if start <= rank < start + roles[role]:
            task_type, task_id = role, rank - start
        start += roles[role]
    node = environ.get("SLURMD_NODENAME")
    own_node = hosts[_node_index(counts, rank)]
    if node and node != own_node and node.split(".")[0] != own_node.split(".")[0]:
        raise TFConfigError(
            f"SLURM rank {rank} runs on {received(node)} but the node list puts it on "
            f"{own_node!r}: tasks are not distributed in blocks. Run srun with "
            f"--distribution=block.")
    for address in task_addresses:
        split_address(address, what=f"the address of a task on {nodelist[0]}")
    return TFConfig(cluster=Cluster(**assigned), task_type=task_type, task_id=task_id,
                    rpc_layer=rpc_layer)


def _resolves(host: str) -> bool:
    try:
        socket.getaddrinfo(host, None)
    except (OSError, UnicodeError):
        return False
    return True


def _node_index(counts: Sequence[int], rank: int) -> int:
    for i, n in enumerate(counts):
        if rank < n:
            return i
        rank -= n
    raise AssertionError("rank checked against the task count above")

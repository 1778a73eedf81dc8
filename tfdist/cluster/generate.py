"""Clusters for where tasks run: local (free 127.0.0.1 ports) or a list of machines."""

from __future__ import annotations

from collections.abc import Iterable

from tfdist.cluster.addresses import split_address
from tfdist.cluster.errors import TFConfigError, check_count, received
from tfdist.cluster.model import Cluster
from tfdist.cluster.ports import free_ports

_LOOPBACK_HOSTS = ("127.0.0.1", "localhost")


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
    check_count("num_workers", num_workers, 1, 1000)
    check_count("num_ps", num_ps, 0, 1000)
    if host not in _LOOPBACK_HOSTS:
        raise TFConfigError(
            f"local_cluster only uses loopback addresses. Received: host={received(host)}. "
            f"Use host='127.0.0.1', or hosts_cluster([...]) for other machines.")
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
        hosts = hosts.split(",")
    hosts = [h.strip() if isinstance(h, str) else h for h in hosts]
    check_count("num_ps", num_ps, 0)
    check_count("port", port, 1, 65535)
    for i, h in enumerate(hosts):
        if not isinstance(h, str) or not h:
            raise TFConfigError(
                f"hosts[{i}] is empty or not a string. Received: hosts={received(hosts)}. "
                f"List host names separated by commas, e.g. 'node1,node2'.")
    extra = int(bool(chief)) + num_ps + int(bool(evaluator))
    num_workers = len(hosts) - extra
    if num_workers < 1:
        raise TFConfigError(
            f"Not enough hosts: {len(hosts)} host(s) for chief={bool(chief)}, "
            f"num_ps={num_ps}, evaluator={bool(evaluator)} leaves {num_workers} "
            f"worker(s). List at least {extra + 1} hosts or ask for fewer roles.")
    next_port: dict[str, int] = {}
    addresses = []
    for h in hosts:
        if ":" in h and not h.endswith("]"):
            split_address(h, what="host")
            addresses.append(h)
        else:
            p = next_port.get(h.lower(), port)
            if p > 65535:
                raise TFConfigError(
                    f"Host {received(h)} is listed too often: its tasks would need ports "
                    f"above 65535 from port={port}. Pass a lower --port.")
            next_port[h.lower()] = p + 1
            address = f"{h}:{p}"
            split_address(address, what="host")
            addresses.append(address)
    it = iter(addresses)
    take = lambda n: tuple(next(it) for _ in range(n))  # noqa: E731
    return Cluster(chief=take(int(bool(chief))), worker=take(num_workers),
                   ps=take(num_ps), evaluator=take(int(bool(evaluator))))

"""Free TCP ports on this machine for local tasks, and a check just before they start."""

from __future__ import annotations

import random
import socket
import threading

from tfdist.cluster.addresses import is_loopback, split_address
from tfdist.cluster.errors import TFConfigError, received
from tfdist.cluster.model import Cluster

# Ports handed out by this process: never give the same one twice.
_HANDED_OUT: set[int] = set()
_PORT_LOCK = threading.Lock()
# Like portpicker, prefer ports below Linux's ephemeral range (32768-60999):
# outgoing connections (gRPC clients among them) take their source ports from
# that range and could grab a port between our pick and the server's bind.
_PREFERRED_PORTS = (15000, 25000)


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
        raise TFConfigError(f"count must be an integer >= 0. Received: count={received(count)}")
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
        if not is_loopback(host) or host.startswith("["):
            continue
        sock = _try_bind("127.0.0.1" if host.lower().rstrip(".") == "localhost" else host,
                         port)
        if sock is None:
            raise TFConfigError(
                f"Port {port} of {task_type}:{task_id} ({address}) is already in use on "
                f"this machine. Stop the process holding it, or pick free ports with "
                f"local_cluster() / `tfdist tf-config --local`.")
        sock.close()

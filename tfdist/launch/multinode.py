"""The same `tfdist launch` command on each of N machines, like `torchrun --nnodes`.

    # on every machine (node_rank 0 .. N-1), the same command:
    tfdist launch --nnodes=2 --node_rank=$RANK --coordinator=10.0.0.1:29400 \\
        --num_workers=1 -- python train.py --strategy=multi_worker_mirrored

Node 0 also runs the **coordinator**: a small rendezvous server on
`--coordinator` (bound to that address only, not to every interface). Each
node's launcher connects to it, reports the address other machines reach it
at (by default the local address of that connection) and free ports for its
tasks; once all N nodes have joined, the coordinator assembles one cluster
(the chief on node 0, then the workers and ps tasks of node 0, node 1, ...)
and sends it back; each node starts its own tasks with TF_CONFIG for the
whole cluster and reports their exits. The coordinator applies the same
policy as the local launcher (`tfdist.launch.policy`) to the exits of every
node: the first failure stops the tasks of all nodes with a message naming
the task and its node, `--max_restarts` restarts all nodes on fresh ports,
and a parameter-server worker is restarted alone on its node. With
`--min_workers`, a node that does not rejoin within `node_timeout` after a
restart is gone for good: the next attempt runs on the nodes that did, if
they hold at least `min_workers` workers (elastic restart). Node 0 runs the
coordinator, so it must survive.

Every wait is bounded: `join_timeout` for all nodes to join (the message names
the missing node ranks); `node_timeout` without any message from a node or
from the coordinator (they exchange a ping every 2 s) ends the job, so a dead
node, a dead launcher or a network partition is an error on every node that
can still speak, not a hang.

**Security.** TensorFlow's servers listen on every interface and run any op
they are sent, and the coordinator trusts whoever connects: the machines must
sit on a trusted network. Firewall the tasks' ports (reported at start) and
the coordinator's port from everything else.
"""

from __future__ import annotations

import errno
import json
import queue
import signal
import socket
import sys
import threading
import time
from typing import IO, Mapping, Sequence

from tfdist import cluster as cluster_lib
from tfdist import preemption
from tfdist.launch import isolation, jobdir, policy, program, supervisor
from tfdist.launch import output as output_lib
from tfdist.launch.policy import TIMEOUT_EXIT_CODE, LaunchResult

PROTOCOL = 1
MAX_MESSAGE = 1 << 20
PING_SECONDS = 2.0
_ROLES = ("chief", "worker", "ps")


class RendezvousError(RuntimeError):
    """The nodes could not form or keep the job (the message says which and why)."""


# --- messages --------------------------------------------------------------------------------
class Channel:
    """JSON lines over one TCP connection; a reader thread feeds `inbox`.

    `inbox` receives (channel, message) pairs, and (channel, None) at EOF or on
    a malformed message.
    """

    def __init__(self, sock: socket.socket, inbox: queue.Queue, *, name: str = ""):
        self.sock = sock
        self.name = name
        self.last_received = time.monotonic()
        self._inbox = inbox
        self._send_lock = threading.Lock()
        self.closed = False
        self.lost: str | None = None  # why the connection ended, once it did
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        self._thread = threading.Thread(target=self._read, daemon=True,
                                        name=f"tfdist-rdzv-{name}")
        self._thread.start()

    def _read(self) -> None:
        buf = bytearray()
        try:
            while True:
                chunk = self.sock.recv(65536)
                if not chunk:
                    break
                buf += chunk
                while b"\n" in buf:
                    line, _, rest = bytes(buf).partition(b"\n")
                    buf[:] = rest
                    message = json.loads(line)
                    if not isinstance(message, dict) or not isinstance(message.get("op"), str):
                        raise ValueError("not a message")
                    self.last_received = time.monotonic()
                    self._inbox.put((self, message))
                if len(buf) > MAX_MESSAGE:
                    raise ValueError("message too long")
            self.lost = "it closed"
        except OSError as e:
            self.lost = e.strerror or str(e)
        except ValueError as e:
            self.lost = f"malformed message: {e}"
        self._inbox.put((self, None))

    def send(self, **message) -> bool:
        data = (json.dumps(message) + "\n").encode()
        with self._send_lock:
            if self.closed:
                return False
            try:
                self.sock.sendall(data)
                return True
            except OSError:
                return False

    def close(self) -> None:
        with self._send_lock:
            self.closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


def parse_coordinator(coordinator) -> tuple[str, int]:
    """'host:port' of the coordinator, checked."""
    try:
        host, port = cluster_lib.split_address(coordinator, what="coordinator")
    except ValueError as e:
        raise ValueError(f"{e} Example: --coordinator=10.0.0.1:29400 (node 0's address and a "
                         f"free port).") from None
    return host.strip("[]"), port


# --- the coordinator (on node 0) -------------------------------------------------------------
class Coordinator:
    """Assembles the cluster from the nodes' joins and ends the job for all of them.

    Runs in a thread of node 0's launcher.
    """

    def __init__(self, address: tuple[str, int], *, nnodes: int, max_restarts: int,
                 max_worker_restarts: int, join_timeout: float, node_timeout: float,
                 grace_period: float, min_workers: int | None = None):
        self.nnodes = nnodes
        self.min_workers = min_workers
        self.left_out: set[int] = set()  # nodes gone for good (elastic restarts)
        self.max_restarts = max_restarts
        self.max_worker_restarts = max_worker_restarts
        self.join_timeout = join_timeout
        self.node_timeout = node_timeout
        self.grace_period = grace_period
        family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self._server = socket.socket(family, socket.SOCK_STREAM)
        self._server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._server.bind(address)
        except OSError as e:
            self._server.close()
            if e.errno == errno.EADDRINUSE:
                raise ValueError(
                    f"The coordinator's port {address[1]} is in use on this machine. Received: "
                    f"coordinator={address[0]}:{address[1]}. Pick a free port (the same on every "
                    f"node).") from None
            raise ValueError(
                f"Node 0 runs the coordinator, so the coordinator address must be one of node "
                f"0's own addresses; binding {address[0]}:{address[1]} failed ({e.strerror}). "
                f"Received: coordinator={address[0]}:{address[1]}. Use node 0's address as "
                f"the other nodes reach it.") from None
        self._server.listen(max(16, nnodes))
        self._inbox: queue.Queue = queue.Queue()
        # Joins for the next attempt that arrived while this one was still ending.
        self._next_joins: list[tuple[Channel, dict]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="tfdist-coordinator")
        self._acceptor = threading.Thread(target=self._accept, daemon=True,
                                          name="tfdist-coordinator-accept")

    def start(self) -> None:
        self._acceptor.start()
        self._thread.start()

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)

    def close(self) -> None:
        self._stop.set()
        try:
            self._server.close()
        except OSError:
            pass

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, peer = self._server.accept()
            except OSError:
                return
            Channel(conn, self._inbox, name=f"{peer[0]}:{peer[1]}")

    # The coordinator's loop: rounds of join -> run -> end.
    def _run(self) -> None:
        nodes: dict[int, Channel] = {}  # node_rank -> channel, for the current round
        joins: dict[int, dict] = {}
        attempt = 1
        try:
            while not self._stop.is_set():
                outcome = self._round(attempt, nodes, joins)
                if outcome is None:
                    return
                end, restart = outcome
                if not restart:
                    return
                attempt += 1
        finally:
            time.sleep(0.5)  # let the last messages reach the nodes
            for channel in set(nodes.values()):
                channel.close()
            self.close()

    def _broadcast(self, nodes: Mapping[int, Channel], **message) -> None:
        for channel in nodes.values():
            channel.send(**message)

    def _round(self, attempt: int, nodes: dict[int, Channel], joins: dict[int, dict]):
        """One attempt. Returns (End, restart?) or None when nobody is left to tell."""
        deadline = time.monotonic() + self.join_timeout
        # Elastic restarts: after a failure, a node that does not rejoin within node_timeout
        # is gone for good, if the others hold enough workers.
        rejoin_by = (time.monotonic() + self.node_timeout
                     if attempt > 1 and self.min_workers is not None else None)
        joins.clear()
        while len(joins) < self.nnodes - len(self.left_out):
            if rejoin_by is not None and time.monotonic() > rejoin_by:
                missing = sorted(set(range(self.nnodes)) - set(joins) - self.left_out)
                workers = sum(_workers_in(join) for join in joins.values())
                if 0 in joins and workers >= self.min_workers:
                    self.left_out.update(missing)
                    self._broadcast(nodes, op="note", message=(
                        f"node(s) {', '.join(map(str, missing))} did not rejoin within "
                        f"{self.node_timeout:g} s (--node_timeout) after attempt {attempt - 1}: "
                        f"continuing with {workers} worker(s) on node(s) "
                        f"{', '.join(map(str, sorted(joins)))} (--min_workers="
                        f"{self.min_workers}). The script keeps its global batch: each worker "
                        f"takes 1/{workers} of it (a global batch that no longer divides is an "
                        f"error in the script), and training resumes from its last backup."))
                    break
                rejoin_by = None  # too few workers: wait for the rest until join_timeout
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(range(self.nnodes)) - set(joins))
                self._broadcast(nodes, op="end", attempt=attempt, returncode=1, restart=False,
                                failed_task=None, message=(
                                    f"node(s) {', '.join(map(str, missing))} did not join within "
                                    f"{self.join_timeout:g} s (--join_timeout): start `tfdist "
                                    f"launch --node_rank=R ...` on every node, and check that "
                                    f"they reach the coordinator"))
                return None
            try:
                channel, message = (self._next_joins.pop(0) if self._next_joins
                                    else self._inbox.get(timeout=min(left, 1.0)))
            except queue.Empty:
                continue
            if message is None:
                for rank, ch in list(nodes.items()):
                    if ch is channel:
                        del nodes[rank]
                        joins.pop(rank, None)
                continue
            if message.get("op") != "join":
                continue
            if message.get("node_rank") in self.left_out:
                channel.send(op="end", attempt=attempt, returncode=2, restart=False,
                             failed_task=None, message=(
                                 f"the job went on without node {message.get('node_rank')} "
                                 f"(it did not rejoin in time after a failure); it cannot "
                                 f"join this job again"))
                continue
            problem = self._check_join(message, nodes, channel)
            if problem:
                channel.send(op="end", attempt=attempt, returncode=2, restart=False,
                             failed_task=None, message=problem)
                continue
            rank = message["node_rank"]
            nodes[rank] = channel
            channel.name = f"node {rank}"
            joins[rank] = message
        try:
            cluster, owners = self._assemble(joins)
        except ValueError as e:
            self._broadcast(nodes, op="end", attempt=attempt, returncode=2, restart=False,
                            failed_task=None, message=str(e))
            return None
        self._broadcast(nodes, op="cluster", attempt=attempt, cluster=cluster.cluster_dict())
        rules = policy.JobPolicy([f"{t}:{i}" for t, i in cluster.tasks()],
                                 max_worker_restarts=self.max_worker_restarts)
        end = self._watch(attempt, nodes, rules, owners)
        restart = bool(end.returncode and end.restartable and attempt <= self.max_restarts)
        if end.returncode and end.restartable and self.max_restarts and not restart:
            end = policy.End(end.returncode, f"{end.message} Giving up after {attempt} attempts "
                             f"(--max_restarts={self.max_restarts}).", end.failed_task)
        self._broadcast(nodes, op="end", attempt=attempt, returncode=end.returncode,
                        message=end.message, failed_task=end.failed_task, restart=restart)
        # Wait (bounded) until every node stopped its tasks, so a restart finds free ports.
        stopped: set[int] = set()
        wait_until = time.monotonic() + self.grace_period + 15
        while len(stopped) < len(nodes) and time.monotonic() < wait_until:
            try:
                channel, message = self._inbox.get(timeout=0.5)
            except queue.Empty:
                continue
            rank = next((r for r, ch in nodes.items() if ch is channel), None)
            if rank is None:
                continue
            if message is None:
                del nodes[rank]
                self._next_joins = [(ch, m) for ch, m in self._next_joins if ch is not channel]
            elif message.get("op") == "stopped":
                stopped.add(rank)
            elif message.get("op") == "join":
                # A node that stopped first rejoins at once: its join is for the next attempt
                # (dropping it here left that node waiting for a cluster until --join_timeout).
                self._next_joins.append((channel, message))
        return end, restart

    def _check_join(self, message: dict, nodes: Mapping[int, Channel],
                    channel: Channel) -> str | None:
        rank, nnodes = message.get("node_rank"), message.get("nnodes")
        if message.get("version") != PROTOCOL:
            return (f"this node speaks rendezvous protocol {message.get('version')!r}, the "
                    f"coordinator {PROTOCOL}: run the same tfdist version on every node")
        if nnodes != self.nnodes:
            return (f"node {rank} was started with --nnodes={nnodes}, the coordinator with "
                    f"--nnodes={self.nnodes}: give every node the same --nnodes")
        if not isinstance(rank, int) or not 0 <= rank < self.nnodes:
            return f"node_rank must be in 0..{self.nnodes - 1}. Received: node_rank={rank!r}"
        if rank in nodes and nodes[rank] is not channel and not nodes[rank].closed:
            return (f"two launchers joined as node_rank={rank}: give each node its own "
                    f"--node_rank (0..{self.nnodes - 1})")
        host, ports = message.get("host"), message.get("ports")
        if not isinstance(host, str) or not isinstance(ports, dict) or not all(
                isinstance(ports.get(r, []), list) for r in _ROLES):
            return "malformed join message"
        if ports.get("chief") and rank != 0:
            return f"only node 0 may run the chief. Received: a chief on node {rank}"
        return None

    def _assemble(self, joins: Mapping[int, dict]):
        roles: dict[str, list[str]] = {r: [] for r in _ROLES}
        owners: dict[str, int] = {}
        for rank in sorted(joins):
            join = joins[rank]
            for role in _ROLES:
                for port in join["ports"].get(role, []):
                    host = join["host"]
                    host = f"[{host}]" if ":" in host else host
                    owners[f"{role}:{len(roles[role])}"] = rank
                    roles[role].append(f"{host}:{int(port)}")
        cluster = cluster_lib.Cluster(**{r: tuple(a) for r, a in roles.items()})
        if cluster.ps and not cluster.chief:
            raise ValueError(
                f"A parameter-server job needs a chief (the coordinator), on node 0. Received: "
                f"{cluster.sizes()}. Pass --chief to node 0.")
        if not cluster.chief and not cluster.worker:
            raise ValueError("The nodes declared no chief and no worker: give --num_workers.")
        return cluster, owners

    def _watch(self, attempt: int, nodes: dict[int, Channel], rules: policy.JobPolicy,
               owners: Mapping[str, int]) -> policy.End:
        last_ping = 0.0
        # A node is silent from the cluster's broadcast at the earliest: its last message
        # (the join) may be older than node_timeout when the join waited for other nodes.
        started = time.monotonic()
        while True:
            now = time.monotonic()
            if now - last_ping > PING_SECONDS:
                self._broadcast(nodes, op="ping")
                last_ping = now
            for rank, channel in nodes.items():
                if now - max(channel.last_received, started) > self.node_timeout:
                    return policy.End(
                        1, f"node {rank} sent nothing for {self.node_timeout:g} s "
                           f"(--node_timeout): its launcher hung or the network to it failed. "
                           f"Stopped the other nodes' tasks.", f"node {rank}", restartable=True)
            try:
                channel, message = self._inbox.get(timeout=0.5)
            except queue.Empty:
                continue
            rank = next((r for r, ch in nodes.items() if ch is channel), None)
            if rank is None:
                if message is not None and message.get("op") == "join":
                    late = message.get("node_rank") in self.left_out
                    channel.send(op="end", attempt=attempt, returncode=2, restart=False,
                                 failed_task=None, message=(
                                     f"the job went on without node {message.get('node_rank')} "
                                     f"(it did not rejoin in time after a failure)" if late
                                     else "the job is already running"))
                continue
            if message is None:
                del nodes[rank]
                return policy.End(1, f"node {rank}'s launcher went away (it exited or was "
                                     f"killed): stopped the other nodes' tasks.",
                                  f"node {rank}", restartable=True)
            op = message.get("op")
            if message.get("attempt") not in (None, attempt):
                continue
            if op == "exit":
                task, code = message.get("task"), message.get("returncode")
                if task not in owners or not isinstance(code, int):
                    continue
                step = message.get("preempted_step")
                decision = rules.on_exit(task, code, str(message.get("hint", "")),
                                         lost_peer=bool(message.get("lost_peer")),
                                         preempted_step=step if isinstance(step, int) else None)
                if isinstance(decision, policy.End):
                    where = f" (node {owners[task]})"
                    return policy.End(decision.returncode,
                                      decision.message.replace(task, task + where, 1),
                                      decision.failed_task, decision.restartable)
                if isinstance(decision, policy.RestartTask):
                    nodes[owners[task]].send(op="restart_task", attempt=attempt, task=task,
                                             message=decision.message)
                elif isinstance(decision, policy.Note):
                    self._broadcast(nodes, op="note", message=decision.message)
            elif op == "silent":
                task = message.get("task")
                if task in owners and rules.watched(task):
                    return rules.on_silent(task, float(message.get("seconds", 0)))
            elif op == "signal":
                return policy.End(int(message.get("returncode", 1)),
                                  f"node {rank}'s launcher {message.get('reason')}: stopped "
                                  f"every node's tasks.", f"node {rank}")


def _workers_in(join: Mapping) -> int:
    """Training tasks (chief and workers) a node's join declares."""
    ports = join.get("ports", {})
    return len(ports.get("chief", [])) + len(ports.get("worker", []))


# --- one node --------------------------------------------------------------------------------
def _free_ports(count: int, host: str) -> list[int]:
    if not count:
        return []
    bind = "::" if ":" in host else "0.0.0.0"
    return cluster_lib.free_ports(count, host=bind)


def _connect(address: tuple[str, int], deadline: float, say) -> socket.socket:
    """Connects to the coordinator, retrying until `deadline` (node 0 may start later)."""
    told = False
    while True:
        try:
            sock = socket.create_connection(address, timeout=5)
            # The 5 s are for connecting only: a read timeout would end the connection
            # whenever the coordinator is quiet longer (waiting for another node to
            # (re)join), and the node would report the coordinator gone. Liveness is
            # the pings' job (--node_timeout).
            sock.settimeout(None)
            return sock
        except OSError as e:
            if time.monotonic() > deadline:
                raise RendezvousError(
                    f"could not reach the coordinator at {address[0]}:{address[1]} "
                    f"({e.strerror or e}) within --join_timeout: start node 0 (it runs the "
                    "coordinator), check the "
                    f"address and that its port is open between the machines") from None
            if not told:
                say(f"waiting for the coordinator at {address[0]}:{address[1]} ...")
                told = True
            time.sleep(1)


def launch_node(cmd: Sequence[str], *, nnodes: int, node_rank: int, coordinator: str,
                num_workers: int = 1, num_ps: int = 0, chief: bool = False,
                node_address: str | None = None, max_restarts: int = 0,
                min_workers: int | None = None,
                max_worker_restarts: int | None = None, timeout: float | None = None,
                progress_timeout: float | None = None, grace_period: float = 5.0,
                join_timeout: float = 300.0, node_timeout: float = 30.0,
                output: output_lib.Show = "main", tf_logs: bool = False,
                env: Mapping[str, str] | None = None,
                stdout: IO[str] | None = None, stderr: IO[str] | None = None) -> LaunchResult:
    """Runs this node's tasks of an N-node job (call it on every node).

    Args:
      cmd: the command every task runs (`python` is this launcher's interpreter).
      nnodes: number of machines (>= 1), the same on every node.
      node_rank: this machine's rank, 0..nnodes-1; node 0 runs the coordinator.
      coordinator: "host:port" of node 0, as every node reaches it.
      num_workers: worker tasks on this node.
      num_ps: parameter servers on this node.
      chief: the job has a chief; it runs on node 0 (other nodes ignore it).
      node_address: the address other nodes reach this node's tasks at
        (default: this node's address on its connection to the coordinator).
      max_restarts: restart every node's tasks on fresh ports up to this often.
      min_workers: node 0 (the coordinator): elastic restarts. A node that
        does not rejoin within `node_timeout` after a restart is left out if
        the nodes that did hold at least this many chief/worker tasks.
      max_worker_restarts: parameter-server jobs: restarts of one failed worker
        alone (default 3).
      timeout: seconds for the whole job on this node; then 124.
      progress_timeout: seconds a watched task may write nothing (see `launch()`).
      grace_period: seconds between SIGTERM and SIGKILL when stopping tasks.
      join_timeout: seconds to reach the coordinator and for all nodes to join.
      node_timeout: seconds without any message between a node and the
        coordinator before the job ends (they ping every 2 s).
      output: "main" (one progress display: the chief's, else worker 0's, on
        the node that runs it; TensorFlow's logs hidden) or "all" (every
        line of every task); see `tfdist.launch.launch`.
      tf_logs: keep TensorFlow's start-up and INFO log lines.
      env: the tasks' base environment (default: os.environ).
      stdout, stderr: where the prefixed output goes.

    Returns:
      A LaunchResult, the same on every node (the coordinator decides).

    Raises:
      ValueError: bad arguments, a coordinator address that is not node 0's.
      RendezvousError: the coordinator could not be reached.
    """
    supervisor.check_count("nnodes", nnodes, 1)
    supervisor.check_count("node_rank", node_rank, 0)
    if node_rank >= nnodes:
        raise ValueError(f"node_rank must be in 0..nnodes-1 = 0..{nnodes - 1}. Received: "
                         f"node_rank={node_rank}, nnodes={nnodes}")
    supervisor.check_count("num_workers", num_workers, 0)
    supervisor.check_count("num_ps", num_ps, 0)
    supervisor.check_count("max_restarts", max_restarts, 0)
    if min_workers is not None:
        supervisor.check_count("min_workers", min_workers, 1)
        if num_ps:
            raise ValueError(
                f"min_workers shrinks a synchronous (multi_worker_mirrored) job; a "
                f"parameter-server job already goes on without a lost worker. Received: "
                f"min_workers={min_workers} with num_ps={num_ps}. Drop --min_workers.")
    if max_worker_restarts is not None:
        supervisor.check_count("max_worker_restarts", max_worker_restarts, 0)
    for name, value in (("timeout", timeout), ("progress_timeout", progress_timeout)):
        supervisor.check_seconds(name, value)
    for name, value in (("join_timeout", join_timeout), ("node_timeout", node_timeout)):
        supervisor.check_seconds(name, value, allow_none=False)
    supervisor.check_seconds("grace_period", grace_period, allow_zero=True, allow_none=False)
    if node_timeout < 3 * PING_SECONDS:
        raise ValueError(f"node_timeout must be >= {3 * PING_SECONDS:g} s (nodes ping every "
                         f"{PING_SECONDS:g} s). Received: node_timeout={node_timeout!r}")
    here = {"chief": int(bool(chief) and node_rank == 0), "worker": num_workers, "ps": num_ps}
    if node_address is not None:
        try:
            cluster_lib.split_address(f"{node_address}:1", what="node_address")
        except ValueError as e:
            raise ValueError(f"{e} Give a host name or IP address without a port.") from None
    supervisor.check_file_limit(sum(here.values()))
    address = parse_coordinator(coordinator)
    output_lib.check_show(output)
    prog = program.resolve(cmd, env=env)
    console = output_lib.Console(out=stdout or sys.stdout, err=stderr or sys.stderr)
    started = time.monotonic()
    deadline = None if timeout is None else started + timeout

    def say(text: str) -> None:
        console.line("err", f"{supervisor.PREFIX} node {node_rank}: {text}")

    server = None
    if node_rank == 0:
        server = Coordinator(
            address, nnodes=nnodes, max_restarts=max_restarts,
            max_worker_restarts=(policy.DEFAULT_WORKER_RESTARTS if max_worker_restarts is None
                                 else max_worker_restarts),
            join_timeout=join_timeout, node_timeout=node_timeout, grace_period=grace_period,
            min_workers=min_workers)
        server.start()
        say(f"coordinator listening on {address[0]}:{address[1]} for {nnodes} node(s)")
    keeper = isolation.JobKeeper(network="host")
    job_dir = jobdir.JobDir()
    display = output_lib.Display(main_task=output_lib.main_task(chief=bool(chief)),
                                 show=output, tf_logs=tf_logs)
    relay = output_lib.Relay(console=console, display=display)
    inbox: queue.Queue = queue.Queue()
    channel = None
    try:
        if prog.note:
            say(f"running {prog.note}")
        sock = _connect(address, started + join_timeout, say)
        channel = Channel(sock, inbox, name="coordinator")
        host = node_address or sock.getsockname()[0]
        base_env = supervisor.task_env(env, job_dir=job_dir.path,
                                       tf_logs=display.keeps_tf_logs, show=output,
                                       grace_period=grace_period)
        with supervisor.Signals() as signals:
            return _node_loop(
                channel, inbox, prog=prog, host=host, here=here, nnodes=nnodes,
                node_rank=node_rank, base_env=base_env, keeper=keeper, relay=relay,
                signals=signals, deadline=deadline, progress_timeout=progress_timeout,
                grace_period=grace_period, join_timeout=join_timeout,
                node_timeout=node_timeout, say=say)
    finally:
        if channel is not None:
            channel.close()
        if server is not None:
            server.join(timeout=grace_period + 20)
            server.close()
        keeper.close()
        relay.close()
        job_dir.close()


def _node_loop(channel: Channel, inbox: queue.Queue, *, prog, host, here, nnodes, node_rank,
               base_env, keeper, relay, signals, deadline, progress_timeout, grace_period,
               join_timeout, node_timeout, say) -> LaunchResult:
    attempt = 0
    last_cluster = None
    while True:
        attempt += 1
        ports = {role: _free_ports(n, host) for role, n in here.items()}
        channel.send(op="join", version=PROTOCOL, node_rank=node_rank, nnodes=nnodes,
                     attempt=attempt, host=host, ports=ports)
        message = _wait_for(inbox, ("cluster", "end"), time.monotonic() + join_timeout + 5,
                            signals, say=say)
        if message is None or message.get("op") == "end":
            text = (message or {}).get("message") or (
                "the coordinator went away or sent no cluster within --join_timeout")
            if signals.received is not None:
                text = f"got signal {signals.received}: stopped"
            say(text)
            code = (message or {}).get("returncode", 1)
            return LaunchResult(returncode=code if signals.received is None
                                else 128 + signals.received, attempts=attempt,
                                failed_task=(message or {}).get("failed_task"), message=text,
                                tasks=(), cluster=last_cluster)
        cluster = cluster_lib.Cluster.from_dict(message["cluster"])
        last_cluster = cluster
        mine = [(t, i) for t, i in cluster.tasks()
                if cluster_lib.split_address(cluster.address(t, i))[0].strip("[]") == host
                and int(cluster.address(t, i).rsplit(":", 1)[1]) in ports.get(t, [])]
        say(f"attempt {attempt}: cluster {cluster.sizes()} on {nnodes} node(s); starting "
            f"{', '.join(f'{t}:{i}' for t, i in mine) or 'no task'} here on {host}, ports "
            f"{', '.join(cluster.address(t, i).rsplit(':', 1)[1] for t, i in mine) or '-'} "
            f"(listening on all interfaces: keep them behind a firewall)")
        group = supervisor.Group(prog.argv, cluster, tasks=mine, env=base_env, keeper=keeper,
                                 relay=relay, attempt=attempt)
        end = _run_node_attempt(channel, inbox, group, attempt=attempt, signals=signals,
                                deadline=deadline, progress_timeout=progress_timeout,
                                grace_period=grace_period, node_timeout=node_timeout, say=say)
        group.stop(grace_period=grace_period)
        channel.send(op="stopped", attempt=attempt)
        if end.get("signal"):
            # This launcher got the signal: its tasks saved (75) or were stopped.
            end = dict(end, **_signal_end(end["signal"], group))
        elif not end.get("restart") and int(end.get("returncode", 0)) - 128 in (
                signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            # Another node's launcher got the signal; this node's tasks may have saved.
            saved = policy.signal_end(int(end["returncode"]) - 128, group.preempted_steps())
            if saved.returncode == preemption.PREEMPTED_EXIT_CODE:
                end = dict(end, returncode=saved.returncode,
                           message=f"{end.get('message', '')} This node: {saved.message}")
        say(end.get("message", ""))
        result = LaunchResult(returncode=int(end.get("returncode", 1)), attempts=attempt,
                              failed_task=end.get("failed_task"), message=end.get("message", ""),
                              tasks=group.exits(), cluster=cluster)
        if not end.get("restart"):
            return result
        say("restarting this node's tasks on fresh ports")


def _signal_end(signum: int, group: supervisor.Group) -> dict:
    """This node's result when its launcher got `signum` and stopped its tasks."""
    end = policy.signal_end(signum, group.preempted_steps())
    return {"returncode": end.returncode, "restart": False,
            "message": end.message.replace("every task", "this node's tasks")}


def _wait_for(inbox: queue.Queue, ops: Sequence[str], until: float, signals,
              say=None) -> dict | None:
    """The next message with one of `ops`, or None (deadline, signal, connection gone).

    With `say`, the coordinator's notes in between are said (an elastic restart's
    "continuing with N worker(s)" comes while the nodes wait for the cluster).
    """
    while time.monotonic() < until and signals.received is None:
        try:
            _, message = inbox.get(timeout=0.5)
        except queue.Empty:
            continue
        if message is None:
            return None
        if message.get("op") in ops:
            return message
        if say is not None and message.get("op") == "note" and message.get("message"):
            say(str(message["message"]))
    return None


def _run_node_attempt(channel: Channel, inbox: queue.Queue, group: supervisor.Group, *,
                      attempt: int, signals, deadline, progress_timeout, grace_period,
                      node_timeout, say) -> dict:
    """Supervises this node's tasks until the coordinator ends the attempt."""
    last_ping = 0.0
    silent_sent: set[str] = set()
    local_failure: dict | None = None
    while True:
        now = time.monotonic()
        if now - last_ping > PING_SECONDS:
            channel.send(op="ping")
            last_ping = now
        if signals.received is not None:
            name = signal.Signals(signals.received).name
            channel.send(op="signal", attempt=attempt, reason=f"got {name}",
                         returncode=128 + signals.received)
            return {"returncode": 128 + signals.received, "signal": signals.received,
                    "message": f"got {name}: stopped this node's tasks"}
        if deadline is not None and now > deadline:
            channel.send(op="signal", attempt=attempt, reason="timed out (--timeout)",
                         returncode=TIMEOUT_EXIT_CODE)
            return {"returncode": TIMEOUT_EXIT_CODE,
                    "message": "timed out (--timeout): stopped this node's tasks"}
        for task in group.exited():
            code = task.proc.returncode
            tail = group.tail(task) if code else []
            hint = policy.hint(code, tail)
            step = preemption.preempted_step(tail)
            channel.send(op="exit", attempt=attempt, task=task.name, returncode=code, hint=hint,
                         lost_peer=policy.lost_peer(tail), preempted_step=step)
            if code and local_failure is None:
                local_failure = {"returncode": policy.exit_code(code), "failed_task": task.name,
                                 "message": f"{task.name} "
                                            f"{policy.describe_exit(code, step)}.{hint}"}
        if progress_timeout is not None:
            silent = group.silent(progress_timeout, lambda name: name not in silent_sent)
            if silent is not None:
                silent_sent.add(silent.name)
                channel.send(op="silent", attempt=attempt, task=silent.name,
                             seconds=progress_timeout)
        # The coordinator's word, or its silence.
        try:
            _, message = inbox.get(timeout=0.05)
        except queue.Empty:
            message = False
        if message:
            op = message.get("op")
            if op == "end" and message.get("attempt") in (None, attempt):
                return message
            if op == "restart_task":
                task = next((t for t in group.tasks if t.name == message.get("task")), None)
                if task is not None:
                    say(message.get("message", f"restarting {task.name}"))
                    task.restarts += 1
                    group.start(task)
            elif op == "note":
                say(message.get("message", ""))
        if message is None or now - channel.last_received > node_timeout:
            why = (f"lost the connection to the coordinator ({channel.lost})" if message is None
                   else f"no word from the coordinator for {node_timeout:g} s (--node_timeout)")
            why += ": node 0 died or the network to it failed"
            failure = local_failure or {"returncode": 1, "failed_task": None, "message": ""}
            return {**failure, "restart": False,
                    "message": f"{failure['message']} {why}; stopped this node's tasks.".strip()}

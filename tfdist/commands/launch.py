"""Run a script as the tasks of a distributed job, each with its own TF_CONFIG.

  tfdist launch --num_workers=2 -- python train.py --strategy=multi_worker_mirrored
  tfdist launch --num_workers=2 --num_ps=1 --chief -- python train.py --strategy=parameter_server
  # the same command on each of N machines (node 0 runs the coordinator):
  tfdist launch --nnodes=2 --node_rank=R --coordinator=10.0.0.1:29400 --num_workers=1 -- ...

The command: a bare `python`, `python3` or `python3.X` runs with the
launcher's own interpreter (the one tfdist is installed in), not the first
one on PATH; give a full path for another. Each task gets TF_CONFIG,
TFDIST_LAUNCH_ATTEMPT (1 for the first start, 2 after the first group
restart, ...) and TFDIST_SCRATCH_DIR (a private scratch directory removed when
the job ends).

Output: every line is prefixed with its task (`[worker:1] ...`). By default
(--output=main) the job shows one progress display, the chief's (else worker
0's) Keras progress bar: live when this command's stdout is a terminal, one
plain line per epoch without escape codes when it is a pipe or a file. Other
tasks' progress is hidden; their other lines, warnings and errors are shown.
TensorFlow's start-up lines and INFO log lines (C++ and Python) are hidden
unless --verbosity=1. --output=all shows everything every task writes.

Network: one machine (no --nnodes): the tasks run in a private network
namespace with loopback only (--network=private/auto), so their TensorFlow
servers, which listen on every interface and run any op sent to them without
authentication, cannot be reached from outside the job; where the OS does not
allow it, --network=auto says so and runs them on this machine's network. Several
machines (--nnodes): the servers must be reachable, so **the machines must sit
on a trusted network**: firewall the tasks' ports (printed at start) and the
coordinator's port from everything else.

Exit status: 0 when the job succeeded; 75 when it was preempted (the tasks
got SIGTERM, saved a backup and exited 75: run the same command to resume;
docs/preemption.md); else the first failing task's exit status (128+N if
killed by signal N), 124 for --timeout or a task silent past
--progress_timeout, 128+N if the launcher got signal N and the tasks saved
nothing, 2 for bad flags. With --num_ps the job's result is the chief's, and a
failed worker is restarted alone.
"""

from __future__ import annotations

import sys

from absl import flags

from tfdist.launch import isolation

flags.DEFINE_integer("num_workers", 1, "Number of worker tasks (>= 1; per node with --nnodes).")
flags.DEFINE_integer("num_ps", 0, "Number of parameter-server tasks (needs --chief; per node "
                     "with --nnodes).")
flags.DEFINE_bool("chief", False, "Add a chief task (the coordinator for parameter_server; on "
                  "node 0 with --nnodes).")
flags.DEFINE_bool("evaluator", False, "Add an evaluator task (one machine only).")
flags.DEFINE_integer("max_restarts", 0,
                     "Restart the whole group on fresh ports up to this many times after a "
                     "failure (training resumes from tfdist.BackupAndRestore).")
flags.DEFINE_integer("min_workers", None,
                     "Elastic restarts (needs --max_restarts): a worker that failed "
                     "2 attempts in a row (with --nnodes: a node that did not rejoin within "
                     "--node_timeout after a restart) is left out and the group restarts with "
                     "fewer workers, never below this many. The script keeps its global batch "
                     "and resumes from its backup. Default: always --num_workers.")
flags.DEFINE_integer("max_worker_restarts", None,
                     "Parameter-server jobs: restart a failed worker alone, on the same address, "
                     "up to this many times (default 3); then the job goes on without it.")
flags.DEFINE_float("timeout", None, "Seconds for the whole job; then every task is stopped "
                   "and the exit status is 124. Default: no limit.")
flags.DEFINE_float("progress_timeout", None,
                   "Seconds a task may write nothing to stdout/stderr before it counts as hung: "
                   "the group is stopped with a message naming it (exit status 124; restarted "
                   "under --max_restarts). With --num_ps only the chief is watched. Keras's "
                   "progress bar (verbose=1 or 2) counts as output. Default: no limit.")
flags.DEFINE_enum("output", "main", ["main", "all"],
                  "'main': one progress display (the chief's, else worker 0's; live on a "
                  "terminal, plain lines on a pipe), other tasks' progress hidden, TensorFlow's "
                  "start-up and INFO log lines hidden (--verbosity=1 shows them); warnings, "
                  "errors and every other line shown. 'all': everything from every task.")
flags.DEFINE_float("grace_period", 5.0, "Seconds between SIGTERM and SIGKILL when stopping tasks "
                   "(a fit with a backup callback saves and exits within it; the tasks see it "
                   "as TFDIST_GRACE_PERIOD).")
flags.DEFINE_enum("network", "auto", list(isolation.NETWORKS),
                  "One machine: 'private' runs the tasks in a loopback-only network namespace "
                  "(their servers unreachable from outside the job; no internet either: download "
                  "data first), 'host' on this machine's network (servers on all interfaces), "
                  "'auto' private where the OS allows it, else host with a warning.")
flags.DEFINE_integer("nnodes", 1, "Number of machines; run the same command on each, with its "
                     "own --node_rank. Needs --coordinator.")
flags.DEFINE_integer("node_rank", 0, "This machine's rank, 0..nnodes-1 (node 0 runs the "
                     "coordinator).")
flags.DEFINE_string("coordinator", None, "host:port of node 0, as every node reaches it (a free "
                    "port, the same on every node). With --nnodes > 1.")
flags.DEFINE_string("node_address", None, "The address other machines reach this node's tasks "
                    "at. Default: this node's address on its connection to the coordinator.")
flags.DEFINE_float("join_timeout", 300.0, "--nnodes: seconds to reach the coordinator and for "
                   "every node to join.")
flags.DEFINE_float("node_timeout", 30.0, "--nnodes: seconds without any message between a node "
                   "and the coordinator (they ping every 2 s) before the job ends.")
FLAGS = flags.FLAGS

_MULTI_NODE_ONLY = ("node_address", "join_timeout", "node_timeout")


def _error(text: str) -> int:
    print(f"error: {text}", file=sys.stderr)
    return 2


def main(argv: list[str]) -> int:
    from tfdist import launch as launch_lib
    from tfdist.launch import multinode

    cmd = argv[1:]
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        return _error("no command to run. Usage: tfdist launch --num_workers=2 -- python "
                      "train.py [ARGS]")
    multi = FLAGS.nnodes != 1 or FLAGS["coordinator"].present
    common = dict(num_ps=FLAGS.num_ps, chief=FLAGS.chief, max_restarts=FLAGS.max_restarts,
                  min_workers=FLAGS.min_workers,
                  max_worker_restarts=FLAGS.max_worker_restarts, timeout=FLAGS.timeout,
                  progress_timeout=FLAGS.progress_timeout, grace_period=FLAGS.grace_period,
                  output=FLAGS.output, tf_logs=FLAGS.verbosity >= 1)
    try:
        if multi:
            if FLAGS.coordinator is None:
                return _error(f"--nnodes={FLAGS.nnodes} needs --coordinator=HOST:PORT (node 0's "
                              f"address and a free port, the same on every node).")
            if FLAGS.evaluator:
                return _error("--evaluator runs on one machine only; drop it with --nnodes.")
            if FLAGS["network"].present and FLAGS.network != "host":
                return _error(f"--network={FLAGS.network} keeps tasks on one machine; with "
                              f"--nnodes the tasks must reach each other: drop --network.")
            result = multinode.launch_node(
                cmd, nnodes=FLAGS.nnodes, node_rank=FLAGS.node_rank,
                coordinator=FLAGS.coordinator, num_workers=FLAGS.num_workers,
                node_address=FLAGS.node_address, join_timeout=FLAGS.join_timeout,
                node_timeout=FLAGS.node_timeout, **common)
        else:
            given = [f"--{n}" for n in ("node_rank",) + _MULTI_NODE_ONLY if FLAGS[n].present]
            if given:
                return _error(f"{', '.join(given)} only apply with --nnodes > 1.")
            result = launch_lib.launch(cmd, num_workers=FLAGS.num_workers,
                                       evaluator=FLAGS.evaluator, network=FLAGS.network,
                                       **common)
    except ValueError as e:
        return _error(str(e))
    except (launch_lib.LaunchError, launch_lib.IsolationError, multinode.RendezvousError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return result.returncode

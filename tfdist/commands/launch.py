"""`tfdist launch --num_workers=N [...] -- python script.py ARGS`: run a local cluster.

Each task gets its own TF_CONFIG on free 127.0.0.1 ports; output lines are
prefixed with the task (`[worker:1] ...`); the exit code is the first failing
task's (see tfdist/launch.py for the policy with parameter servers).
"""

from __future__ import annotations

import sys

from absl import flags

flags.DEFINE_integer("num_workers", 1, "Number of worker tasks (>= 1).")
flags.DEFINE_integer("num_ps", 0, "Number of parameter-server tasks (needs --chief).")
flags.DEFINE_bool("chief", False, "Add a chief task (the coordinator for parameter_server).")
flags.DEFINE_bool("evaluator", False, "Add an evaluator task.")
flags.DEFINE_integer("max_restarts", 0,
                     "Restart the whole group on fresh ports up to this many times after a "
                     "failure (training resumes from tfdist.checkpoint.BackupAndRestore).")
flags.DEFINE_float("timeout", None, "Seconds for the whole job; then every task is stopped "
                   "and the exit code is 124. Default: no limit.")
flags.DEFINE_float("grace_period", 5.0, "Seconds between SIGTERM and SIGKILL when stopping tasks.")
FLAGS = flags.FLAGS


def main(argv: list[str]) -> int:
    from tfdist import launch as launch_lib

    cmd = argv[1:]
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        print("error: no command to run. Usage: tfdist launch --num_workers=2 -- python "
              "train.py [ARGS]", file=sys.stderr)
        return 2
    try:
        result = launch_lib.launch(
            cmd, num_workers=FLAGS.num_workers, num_ps=FLAGS.num_ps, chief=FLAGS.chief,
            evaluator=FLAGS.evaluator, max_restarts=FLAGS.max_restarts, timeout=FLAGS.timeout,
            grace_period=FLAGS.grace_period)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return result.returncode

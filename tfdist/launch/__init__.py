"""Start and supervise the processes of a distributed job: `tfdist launch`.

    tfdist launch --num_workers=2 -- python train.py --strategy=multi_worker_mirrored
    python -m tfdist.launch --num_workers=2 --max_restarts=1 -- python train.py

    result = tfdist.launch.launch(["python", "train.py"], num_workers=2)
    result.returncode

One module per job:
- `supervisor`: the local supervisor (`launch()`): one process per task,
  their TF_CONFIG, output, the job's end, restarts;
- `multinode`: the same command on each of N machines (`launch_node()`), with
  a small rendezvous at a coordinator address, like `torchrun --nnodes`;
- `notebook`: `notebook_launcher`, a function from a notebook cell on a local cluster;
- `policy`: how task exits end a job (shared by the local and multi-node forms);
- `isolation`: the private network namespace and the job keeper (no orphans);
- `output`: the tasks' output relay; `program`: the command's checks;
- `jobdir`: the per-job scratch directory (`TFDIST_SCRATCH_DIR`).
"""

from tfdist.launch.isolation import IsolationError
from tfdist.launch.multinode import launch_node
from tfdist.launch.policy import TIMEOUT_EXIT_CODE, LaunchResult, TaskExit
from tfdist.launch.supervisor import LaunchError, launch

__all__ = ["IsolationError", "LaunchError", "LaunchResult", "TIMEOUT_EXIT_CODE", "TaskExit",
           "launch", "launch_node"]

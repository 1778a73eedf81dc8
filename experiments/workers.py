"""Runs a benchmark's worker side under `tfdist launch` and reads back chief's result.

The multi-worker benchmarks (bench_allreduce, bench_comm, bench_multiworker)
re-run their own module with --role=... --worker_out=FILE on every task; the
task that measures writes FILE as JSON.
"""

from __future__ import annotations

import io
import json
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def launch_workers(module: str, role: str, *, num_workers: int, timeout: float,
                   extra_args: tuple[str, ...] = (), env: dict | None = None,
                   what: str = "benchmark", tail_lines: int = 20,
                   every_task: bool = False, python: str | None = None) -> dict:
    """`python -m <module> --role=<role> --worker_out=FILE` on `num_workers` tasks -> FILE's JSON.

    With `every_task`, the tasks other than the measuring one may write
    FILE.task<i> too; they come back as a list under "tasks" (task order).
    `python`: the tasks' interpreter (default: this one), e.g. another
    virtual environment's.

    Raises:
      RuntimeError: the launch failed or wrote no result, with the log's last lines.
    """
    from tfdist import launch as launch_lib

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        full_env = dict(os.environ,
                        PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        full_env.update(env or {})
        log = io.StringIO()
        result = launch_lib.launch(
            [python or sys.executable, "-m", module, f"--role={role}", f"--worker_out={out}",
             *extra_args], num_workers=num_workers, timeout=timeout, env=full_env,
            stdout=log, stderr=log)
        if result.returncode != 0 or not os.path.exists(out):
            tail = "\n".join(log.getvalue().splitlines()[-tail_lines:])
            raise RuntimeError(f"{what} workers failed: {result.message}\n{tail}")
        with open(out) as f:
            result = json.load(f)
        if every_task:
            tasks = []
            for i in range(num_workers):
                path = f"{out}.task{i}"
                if os.path.exists(path):
                    with open(path) as f:
                        tasks.append(json.load(f))
            result["tasks"] = tasks
        return result

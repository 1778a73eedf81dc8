"""A parameter-server job for tests/launch/test_faults.py; every task runs it under
`tfdist launch --num_workers=2 --num_ps=1 --chief`.

Worker and ps tasks print their pid and serve inside `make_strategy` (never
return). The chief trains epochs of plain `model.fit`, printing JSON lines:

  {"event": "epoch", "epoch": e, "iterations": n}
  {"event": "done", "iterations": n, "scheduled": s, "rerun_after_write": r}

`rerun_after_write` counts steps that ran twice because a worker died after
their first run had written (the parameter-server work's step accounting,
`tfdist.ps.CoordinatorTrainer`).

After its first epoch it keeps training, one epoch at a time, until the file
DIR/rejoined exists (the test writes it once it has killed worker:1 and seen
the replacement the launcher started run a step) or 120 s pass.
"""

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tests.ps.marked_model import marked_regression  # noqa: E402


def main(workdir: str) -> None:
    import tfdist
    import tfdist.chief

    os.write(1, f"{tfdist.chief.task_name()} pid={os.getpid()}\n".encode())
    strategy = tfdist.make_strategy("parameter_server", connect_timeout=60)
    model, dataset_fn = marked_regression(strategy, hidden=16)

    def emit(**event):
        print(json.dumps(event), flush=True)

    from tfdist.ps import CoordinatorTrainer

    def reruns_after_write() -> int:
        return CoordinatorTrainer.for_model(model).last_report.rerun_after_write

    steps, scheduled, epoch, reruns = 20, 0, 0, 0
    deadline = time.monotonic() + 120
    while epoch == 0 or (not os.path.exists(os.path.join(workdir, "rejoined"))
                         and time.monotonic() < deadline):
        model.fit(dataset_fn, epochs=1, steps_per_epoch=steps, verbose=0)
        scheduled += steps
        reruns += reruns_after_write()
        emit(event="epoch", epoch=epoch, iterations=int(model.optimizer.iterations.numpy()))
        epoch += 1
    model.fit(dataset_fn, epochs=1, steps_per_epoch=steps, verbose=0)  # with worker:1 back
    scheduled += steps
    reruns += reruns_after_write()
    emit(event="done", iterations=int(model.optimizer.iterations.numpy()), scheduled=scheduled,
         rerun_after_write=reruns)


if __name__ == "__main__":
    main(sys.argv[1])

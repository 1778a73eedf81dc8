"""Parameter-server numbers: throughput, dispatch overhead, bytes per step.

    python -m experiments.bench_ps [--quick] [--out results/bench_ps.json]

Each configuration runs in a fresh process (a process can talk to one
cluster) with an in-process cluster: N workers + 1 ps as tf.distribute.Servers
on 127.0.0.1, this process the coordinator, plain Keras 3 `model.fit`.

1. steps/s of `model.fit` for an MLP with 1 and 2 workers (median of repeats).
   On this 2-core machine the workers, the ps and the coordinator share the
   same 2 cores, so 2 workers cannot be ~2x; the number is what it is.
2. Coordinator dispatch overhead per step: `ClusterCoordinator.schedule` of a
   trivial tf.function (returns a constant), M of them then `join()`;
   wall time / M (target <= 2 ms).
3. Bytes moved between a worker and the ps per step, measured on the traced
   train step: every ReadVariableOp of a ps variable is a transfer ps ->
   worker of that variable, every Assign*/ResourceScatter* a transfer worker
   -> ps of its value (variables live only on the ps; compute only on the
   worker). Shown next to K (gradient bytes) and the seeds' formulas for a
   synchronous step of N replicas: 2(N-1)K through a central reducer,
   2(N-1)K/N per rank for a ring.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

from experiments.rows import print_rows, write_rows
from absl import app, flags

flags.DEFINE_bool("quick", False, "Fewer repeats (a smoke run).")
flags.DEFINE_string("out", "results/bench_ps.json", "Where to write the JSON.")
flags.DEFINE_integer("child_workers", None, "Internal: measure with N workers and print JSON.")
FLAGS = flags.FLAGS

DISPATCH_TARGET_MS = 2.0
FEATURES, HIDDEN, BATCH = 64, 256, 64

_READ_OPS = {"ReadVariableOp"}
_WRITE_OPS = {"AssignVariableOp", "AssignAddVariableOp", "AssignSubVariableOp",
              "ResourceScatterAdd", "ResourceScatterSub", "ResourceScatterUpdate"}


def _graph_transfers(concrete) -> tuple[int, int]:
    """(bytes read from variables, bytes written to variables) in one call of `concrete`."""
    import numpy as np

    graph = concrete.graph
    variable_handles = {id(h) for h in graph.internal_captures
                        if h.dtype.name == "resource"}
    read = written = 0

    def nbytes(tensor):
        shape = tensor.shape
        if not shape.is_fully_defined():
            return 0
        return int(np.prod(shape.as_list(), dtype=np.int64)) * tensor.dtype.size

    def walk(g, handles):
        nonlocal read, written
        for op in g.get_operations():
            if op.type in _READ_OPS and (handles is None or id(op.inputs[0]) in handles):
                read += nbytes(op.outputs[0])
            elif op.type in _WRITE_OPS:
                value = op.inputs[2] if op.type.startswith("ResourceScatter") else op.inputs[1]
                written += nbytes(value)
                if op.type.startswith("ResourceScatter"):
                    written += nbytes(op.inputs[1])  # the indices
            for attr in ("f", "then_branch", "else_branch", "body", "cond"):
                try:
                    fn = op.get_attr(attr)
                except (ValueError, TypeError):
                    continue
                lib_fn = g._get_function(fn.name) if hasattr(fn, "name") else None
                if lib_fn is not None and hasattr(lib_fn, "graph"):
                    walk(lib_fn.graph, None)

    walk(graph, variable_handles)
    return read, written


def _measure(num_workers: int, quick: bool) -> dict:
    import numpy as np

    import tfdist
    from tfdist._tf import import_tensorflow

    tf = import_tensorflow()
    import keras

    strategy = tfdist.make_strategy("parameter_server", local_workers=num_workers, local_ps=1)
    from tfdist import ps

    rng = np.random.default_rng(0)
    x = rng.standard_normal((4096, FEATURES)).astype("float32")
    y = rng.standard_normal((4096, 1)).astype("float32")

    def dataset_fn(input_context):
        return tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(BATCH).prefetch(2)

    result = {"num_workers": num_workers}
    for opt_name in ("sgd", "adam"):
        with strategy.scope():
            model = keras.Sequential([keras.Input((FEATURES,)),
                                      keras.layers.Dense(HIDDEN, activation="relu"),
                                      keras.layers.Dense(HIDDEN, activation="relu"),
                                      keras.layers.Dense(1)])
            model.compile(keras.optimizers.get(opt_name), "mse")
        steps = 100 if quick else 300
        model.fit(dataset_fn, epochs=1, steps_per_epoch=20, verbose=0)  # warm-up, trace
        times = []
        for _ in range(3 if quick else 5):
            start = time.perf_counter()
            model.fit(dataset_fn, epochs=1, steps_per_epoch=steps, verbose=0)
            times.append(time.perf_counter() - start)
        result[f"steps_per_sec_{opt_name}"] = steps / statistics.median(times)
        step_fn = ps.CoordinatorTrainer.for_model(model).step_function("train")
        concrete = step_fn._list_all_concrete_functions()[0]
        read, written = _graph_transfers(concrete)
        result[f"read_bytes_{opt_name}"] = read
        result[f"written_bytes_{opt_name}"] = written
        result["grad_bytes"] = sum(int(np.prod(v.shape)) * 4 for v in model.trainable_weights)

    coordinator = ps.coordinator_for(strategy)

    @tf.function
    def trivial():
        return tf.constant(1)

    coordinator.schedule(trivial)
    coordinator.join()
    per_step, schedule_only = [], []
    count = 200 if quick else 1000
    for _ in range(3 if quick else 5):
        start = time.perf_counter()
        for _ in range(count):
            coordinator.schedule(trivial)
        scheduled = time.perf_counter()
        coordinator.join()
        per_step.append((time.perf_counter() - start) / count)
        schedule_only.append((scheduled - start) / count)
    result["dispatch_ms"] = 1000 * statistics.median(per_step)
    result["schedule_call_ms"] = 1000 * statistics.median(schedule_only)
    return result


def _child(num_workers: int, quick: bool) -> dict:
    cmd = [sys.executable, "-m", "experiments.bench_ps", f"--child_workers={num_workers}"]
    if quick:
        cmd.append("--quick")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=root,
                          env={**os.environ, "PYTHONPATH": root})
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"bench child ({num_workers} workers) failed:\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1])


def run(quick: bool) -> list[dict]:
    """Rows: {"name", "value", "unit", "target", "ratio", "note"}."""
    one, two = _child(1, quick), _child(2, quick)
    rows = []

    def row(name, value, unit, note, target=None):
        rows.append({"name": name, "value": float(value), "unit": unit, "target": target,
                     "ratio": (float(value) / target) if target else None, "note": note})

    model = f"MLP {FEATURES}-{HIDDEN}-{HIDDEN}-1, batch {BATCH}, 1 ps, in-process cluster"
    for opt in ("sgd", "adam"):
        row(f"ps_steps_per_sec_1worker_{opt}", one[f"steps_per_sec_{opt}"], "steps/s",
            f"{model}, {opt}, model.fit, median")
        row(f"ps_steps_per_sec_2workers_{opt}", two[f"steps_per_sec_{opt}"], "steps/s",
            f"{model}, {opt}; 2 cores shared by workers, ps and coordinator")
        row(f"ps_speedup_2v1_{opt}",
            two[f"steps_per_sec_{opt}"] / one[f"steps_per_sec_{opt}"], "x",
            "2 workers vs 1, same run; baseline: 1 worker, 1 ps and the coordinator as "
            "in-process servers in one process, TensorFlow's default threads, the same 2 "
            "cores (the 2-worker run adds one in-process worker)")
    row("ps_dispatch_overhead_ms", one["dispatch_ms"], "ms/step",
        "1 worker: schedule M trivial tf.function steps, then join(); wall / M (a full "
        "round trip coordinator -> worker -> coordinator per step)",
        target=DISPATCH_TARGET_MS)
    row("ps_dispatch_overhead_2workers_ms", two["dispatch_ms"], "ms/step",
        "same with 2 workers taking steps in parallel", target=DISPATCH_TARGET_MS)
    row("ps_schedule_call_ms", one["schedule_call_ms"], "ms/step",
        "coordinator time inside schedule() alone (queueing the step), 1 worker",
        target=DISPATCH_TARGET_MS)
    k = one["grad_bytes"]
    n = 2
    for opt in ("sgd", "adam"):
        moved = one[f"read_bytes_{opt}"] + one[f"written_bytes_{opt}"]
        row(f"ps_bytes_per_step_{opt}", moved, "bytes",
            f"measured on the traced step: {one[f'read_bytes_{opt}']} read from + "
            f"{one[f'written_bytes_{opt}']} written to the ps per worker step; "
            f"K={k} gradient bytes, so {moved / k:.2f}K (2K = read weights + push "
            f"one update); N={n} workers move {n}x this through the ps per {n} steps")
    row("central_reducer_bytes_per_sync_step_N2", 2 * (n - 1) * k, "bytes",
        "seeds' 2(N-1)K through a central reducer, N=2 synchronous replicas")
    row("ring_bytes_per_rank_per_sync_step_N2", 2 * (n - 1) * k / n, "bytes",
        "seeds' 2(N-1)K/N per rank for a ring all-reduce, N=2")
    return rows


def main(argv):
    del argv
    if FLAGS.child_workers is not None:
        print(json.dumps(_measure(FLAGS.child_workers, FLAGS.quick)), flush=True)
        sys.stdout.flush()
        os._exit(0)  # skip in-process server teardown
    rows = run(FLAGS.quick)
    print_rows(rows)
    if FLAGS.out:
        write_rows(FLAGS.out, rows, command="python -m experiments.bench_ps")
    return 0


if __name__ == "__main__":
    app.run(main)

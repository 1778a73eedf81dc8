"""Runs corpus programs one after another under one preset, in this process.

    python -m tests.programs.run_preset --preset=mirrored --programs=a,b --out=DIR
    python -m tfdist.launch --num_workers=2 -- \\
        python -m tests.programs.run_preset --preset=multi_worker_mirrored --programs=a,b --out=DIR

TensorFlow starts once, with the preset's strategy made first thing (as a user's script
does). Before each program: `keras.backend.clear_session()` and
`keras.utils.set_random_seed(SEED)`, so every preset builds the same initial weights.

Writes, per program, one JSON line to DIR/<preset>[.worker<i>].jsonl (status, first error
line, logged losses, the program's own checks, optimizer step counts, the largest
difference between replicas' copies of a weight, seconds) and the final weights to
DIR/<preset>/<program>[.worker<i>].npz. The driver (tests/programs/run_corpus.py) compares them.

Exit status: 0 when every program finished; 3 right after the first program that failed
and 4 when one ran past --timeout (the driver starts a fresh process for the programs
left, so one program's failure never reaches the next).
"""

from __future__ import annotations

import argparse
import faulthandler
import importlib
import json
import os
import sys
import threading
import time
import traceback

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tests.programs import corpus  # noqa: E402

PRESETS = ("one_device", "mirrored", "multi_worker_mirrored", "parameter_server",
           "parameter_server_async")
NUM_DEVICES = 2                # mirrored: 2 logical CPUs (the reference runs on the same layout)
# The in-process parameter-server clusters: one worker (steps run one after another, in
# order: the run must equal one device) and two (asynchronous: judged by a property).
PS_WORKERS = {"parameter_server": 1, "parameter_server_async": 2}
EXIT_FAILED, EXIT_TIMEOUT = 3, 4


def worker_index() -> int:
    """This task's index in TF_CONFIG (0 without one)."""
    config = json.loads(os.environ.get("TF_CONFIG") or "{}")
    return int(config.get("task", {}).get("index", 0))


def strategy_factory(preset: str):
    """A function making the preset's strategy; called once here before any TensorFlow op."""
    import tfdist

    if preset in ("one_device", "mirrored"):
        tfdist.configure_logical_devices(NUM_DEVICES)
    if preset == "one_device":
        def make():
            import tensorflow as tf

            return tf.distribute.get_strategy()
        return make
    if preset == "mirrored":
        return lambda: tfdist.make_strategy("mirrored", num_devices=NUM_DEVICES)
    if preset == "multi_worker_mirrored":
        return lambda: tfdist.make_strategy("multi_worker_mirrored")
    if preset in PS_WORKERS:
        return lambda: tfdist.make_strategy("parameter_server", local_workers=PS_WORKERS[preset],
                                            local_ps=1)
    raise ValueError(f"Unknown corpus preset {preset!r}; expected one of {PRESETS}.")


def error_line(exc: BaseException) -> str:
    """The line of an exception that says what went wrong, and the TensorFlow op if one is named.

    TensorFlow's first lines ("Graph execution error:", "Detected at node ...") rarely say it.
    """
    import re

    skip = ("graph execution error", "detected at node", "file \"", "traceback", "stack trace",
            "[[", "node:", "defined at", "function call stack", "==", "in user code", ";")
    text = str(exc)
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    useful = [line for line in lines if not line.lower().startswith(skip)]
    line = (useful or lines or [""])[0]
    op = re.search(r"\[Op:(\w+)\]|\{\{node (\w+)\}\}", text)
    if op and (op.group(1) or op.group(2)) not in line:
        line = f"{line} (op {op.group(1) or op.group(2)})"
    line = f"{type(exc).__name__}: {line}" if line else type(exc).__name__
    return line if len(line) <= 220 else line[:217] + "..."


def replica_spread(models) -> float | None:
    """Largest difference between two replicas' copies of any weight (None: no replicas)."""
    import numpy as np

    worst = None
    for model in models:
        for weight in model.weights:
            copies = getattr(weight.value, "values", None)
            if not copies or len(copies) < 2:
                continue
            first = np.asarray(copies[0])
            spread = max(float(np.max(np.abs(np.asarray(c, "float64") - first), initial=0.0))
                         for c in copies[1:])
            worst = spread if worst is None else max(worst, spread)
    return worst


def step_counts(models) -> list:
    counts = []
    for model in models:
        optimizer = getattr(model, "optimizer", None)
        iterations = getattr(optimizer, "iterations", None)
        counts.append(None if iterations is None else int(iterations.numpy()))
    return counts


def run_program(name: str, preset: str, factory, shared, out: str, suffix: str) -> dict:
    import keras
    import numpy as np

    keras.backend.clear_session()
    keras.utils.set_random_seed(corpus.SEED)
    workdir = os.path.join(out, "work", preset, name)
    os.makedirs(workdir, exist_ok=True)
    run = corpus.Run(preset=preset, workdir=workdir, strategy_factory=factory,
                      shared_strategy=shared)
    module = importlib.import_module(f"tests.programs.{name}")
    outcome = module.main(run)
    weights = {}
    for m, model in enumerate(outcome.models):
        for w, value in enumerate(model.get_weights()):
            weights[f"m{m}_w{w:04d}"] = np.asarray(value)
    os.makedirs(os.path.join(out, preset), exist_ok=True)
    np.savez(os.path.join(out, preset, f"{name}{suffix}.npz"), **weights)
    trend = outcome.losses if outcome.trend is None else outcome.trend
    return {"losses": [float(v) for v in outcome.losses],
            "trend": [float(v) for v in trend],
            "checks": {k: float(v) for k, v in outcome.checks.items()},
            "iterations": step_counts(outcome.models),
            "spread": replica_spread(outcome.models)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", required=True, choices=PRESETS)
    parser.add_argument("--programs", required=True, help="comma-separated program names")
    parser.add_argument("--out", required=True)
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per program")
    args = parser.parse_args(argv)

    index = worker_index() if args.preset == "multi_worker_mirrored" else 0
    suffix = f".worker{index}" if args.preset == "multi_worker_mirrored" else ""
    log_path = os.path.join(args.out, f"{args.preset}{suffix}.jsonl")
    factory = strategy_factory(args.preset)
    shared = factory()

    def record(entry: dict) -> None:
        with open(log_path, "a") as f:
            f.write(json.dumps(entry) + "\n")

    for name in args.programs.split(","):
        start = time.monotonic()

        def on_timeout(name=name, start=start):
            record({"program": name, "status": "timeout", "seconds": time.monotonic() - start,
                    "error": f"no result after {args.timeout:.0f} s"})
            faulthandler.dump_traceback(all_threads=True)
            sys.stderr.flush()
            os._exit(EXIT_TIMEOUT)

        timer = threading.Timer(args.timeout, on_timeout)
        timer.daemon = True
        timer.start()
        print(f"corpus: {args.preset}{suffix} {name} ...", flush=True)
        try:
            result = run_program(name, args.preset, factory, shared, args.out, suffix)
        except BaseException as exc:  # noqa: BLE001 - recorded, then this process ends
            timer.cancel()
            tb = traceback.format_exc()
            print(tb, file=sys.stderr, flush=True)
            record({"program": name, "status": "failed", "error": error_line(exc),
                    "traceback": tb[-6000:], "seconds": time.monotonic() - start})
            return EXIT_FAILED
        timer.cancel()
        seconds = time.monotonic() - start
        print(f"corpus: {args.preset}{suffix} {name} finished in {seconds:.1f} s", flush=True)
        record({"program": name, "status": "finished", "seconds": seconds, **result})
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: TensorFlow's servers and threads can hang it.
    os._exit(code)

"""split_model and the cost model over the KerasHub zoo (tests/zoo.py): the counts.

    python -m tests.split.run_zoo                      # every family, prints a table and counts
    python -m tests.split.run_zoo GPT2 ResNet ViT      # some families
    python -m tests.split.run_zoo --json out.json ...  # also write the rows

Per family, on 2 logical CPUs (one process, fp32):
- accepted: `split_model(model, devices=[cpu:0, cpu:1], micro_batches=M)` returns
  (M = 2; M = 1 where micro-batching changes the maths: BatchNormalization's batch
  statistics, a mixture of experts' load-balancing loss over the batch, and
  MiT's hard-coded dropout, whose masks depend on the micro-batch shapes);
- equal: 3 steps of `fit` (SGD 0.01, MSE, global batch 8, same batches) leave
  every weight within 1e-5 of the unsplit model built with the same seed;
- placed: every variable of every layer sits on its planned stage device
  (tfdist.split.pipeline.check_placement), and both stages hold variables;
- flops: `tfdist.planning.model_stats` forward FLOPs over TensorFlow's profiler on
  the same model's traced forward pass (batch 1), with the profiler's missing
  Einsum FLOPs added (2 x the product of the index sizes); within 0.6-1.4 counts.
"""

from __future__ import annotations

import json
import sys
import time
import traceback

import numpy as np

import tfdist

tfdist.configure_logical_devices(2)
tf = tfdist.import_tensorflow()

import keras  # noqa: E402

from tests import zoo  # noqa: E402
from tests.support import profiler_flops  # noqa: E402
from tfdist import planning  # noqa: E402
from tfdist.split import pipeline  # noqa: E402

DEVICES = ["/cpu:0", "/cpu:1"]
TOL = 1e-5
STEPS = 3
BATCH = 8


def _profiler_flops(model, x) -> float:
    return profiler_flops(model, tf.nest.map_structure(
        lambda a: tf.TensorSpec((1,) + a.shape[1:], tf.as_dtype(a.dtype)), x))


def _input_shapes(x):
    if isinstance(x, dict):
        return {k: tuple(v.shape[1:]) for k, v in x.items()}
    return tuple(x.shape[1:])


def _fit(model, x, y):
    model.compile(keras.optimizers.SGD(0.01), "mse")
    for _ in range(STEPS):
        model.train_on_batch(x, y)


def check(family) -> dict:
    row = {"family": family.name, "accepted": False, "equal": False, "placed": False,
           "flops_ratio": None, "max_diff": None, "error": None}
    x, y = family.batch(BATCH, seed=0)
    start = time.perf_counter()
    try:
        stats = planning.model_stats(family.build(seed=0), input_shapes=_input_shapes(x))
        reference = _profiler_flops(family.build(seed=0), x)
        row["flops_ratio"] = stats.forward_flops_per_example / reference if reference else None
    except Exception as e:  # noqa: BLE001 - the row records any failure
        row["flops_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    micro = 1 if family.tags & {"batchnorm", "moe", "dropout"} else 2
    row["micro_batches"] = micro
    try:
        model = family.build(seed=0)
        split = tfdist.split_model(model, devices=DEVICES, micro_batches=micro)
        row["accepted"] = True
        row["stages"] = [len(s.layer_names) for s in split.stages]
        misplaced = pipeline.check_placement(split)
        on = {d for d in tfdist.split.placement_summary(split)["param_bytes_per_device"]}
        row["placed"] = not misplaced and on == {"CPU:0", "CPU:1"}
        if misplaced:
            row["misplaced"] = misplaced[:3]
        ref = family.build(seed=0)
        _fit(split, x, y)
        _fit(ref, x, y)
        diff = max(float(np.abs(a - b).max()) for a, b in zip(split.get_weights(),
                                                                 ref.get_weights()))
        row["max_diff"] = diff
        row["equal"] = diff <= TOL
    except Exception as e:  # noqa: BLE001
        row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        row["trace"] = traceback.format_exc(limit=-3)
    row["seconds"] = round(time.perf_counter() - start, 1)
    return row


def main(argv: list[str]) -> int:
    out = None
    if "--json" in argv:
        i = argv.index("--json")
        out = argv[i + 1]
        argv = argv[:i] + argv[i + 2:]
    if not zoo.AVAILABLE:
        print(f"skipped: {zoo.SKIP_REASON}")
        return 0
    names = argv or list(zoo.FAMILIES)
    unknown = [n for n in names if n not in zoo.FAMILIES]
    if unknown:
        print(f"unknown families {unknown}; known: {', '.join(zoo.FAMILIES)}", file=sys.stderr)
        return 2
    rows = []
    for name in names:
        row = check(zoo.FAMILIES[name])
        rows.append(row)
        ratio = "-" if row["flops_ratio"] is None else f"{row['flops_ratio']:.3f}"
        diff = "-" if row["max_diff"] is None else f"{row['max_diff']:.1e}"
        print(f"{name:16s} accepted={row['accepted']!s:5} equal={row['equal']!s:5} "
              f"placed={row['placed']!s:5} diff={diff:8} flops={ratio:6} "
              f"{row['seconds']:5.1f}s {row.get('error') or row.get('flops_error') or ''}",
              flush=True)
    n = len(rows)
    accepted = sum(r["accepted"] for r in rows)
    trains = sum(r["equal"] and r["placed"] for r in rows)
    in_range = sum(r["flops_ratio"] is not None and 0.6 <= r["flops_ratio"] <= 1.4 for r in rows)
    print(f"split accepted {accepted}/{n}; trains equal (<= {TOL}) and fully placed "
          f"{trains}/{n}; cost FLOPs within 0.6-1.4x of the profiler {in_range}/{n}")
    if out:
        with open(out, "w") as f:
            json.dump(rows, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

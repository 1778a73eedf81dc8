"""Pipeline benchmark: a compute-heavy MLP split in 2 stages on 2 logical CPUs.

    python -m experiments.bench_split [--quick] [--out results/bench_split.json]

Three worker processes run side by side, measured in interleaved rounds so
all see the same machine load: the unsplit model with one thread
(intra-op 1, inter-op 1), the unsplit model with both cores (intra-op 2,
inter-op 1: the equal-resources baseline, reported against the pipeline too),
and the model split over /cpu:0 and /cpu:1 with
one thread per stage (intra-op 1, inter-op 2) for M = 1, 2, 4, 8
micro-batches. Each timing is the median train_on_batch time (forward,
backward, SGD update) over the repeats of all rounds. Rows: speed-up per M
against the ideal K*M/(M+K-1), and the measured bubble 1 - speedup/K next to
(K-1)/(M+K-1).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from experiments.rows import print_rows, write_rows
from absl import app, flags

WIDTH, LAYERS, BATCH = 512, 8, 4096
MICRO_BATCHES = (1, 2, 4, 8)
K = 2

_FLAGS = flags.FLAGS


def _define_flags():
    if "quick" not in _FLAGS:
        flags.DEFINE_bool("quick", False, "Fewer rounds and repeats (smoke run).")
        flags.DEFINE_string("out", None, "Write the rows as JSON here.")
        flags.DEFINE_enum("worker", None, ["baseline", "equal", "split"],
                          "Internal: run one worker.")
        flags.DEFINE_enum("schedule", "free", ["free", "gpipe"], "Pipeline schedule.")
        flags.DEFINE_bool("onednn", True,
                          "Use TensorFlow's default oneDNN kernels; --noonednn runs both workers "
                          "with TF_ENABLE_ONEDNN_OPTS=0 (Eigen kernels).")


# --------------------------------------------------------------------------------- worker
def _build_model():
    import keras

    keras.utils.set_random_seed(0)
    inputs = keras.Input((WIDTH,))
    x = inputs
    for i in range(LAYERS):
        x = keras.layers.Dense(WIDTH, activation="relu", name=f"dense_{i}")(x)
    return keras.Model(inputs, keras.layers.Dense(16, name="head")(x))


def _worker(kind: str, schedule: str) -> int:
    import tfdist
    from tfdist.split import SplitPlan

    # baseline: one thread; equal: the unsplit model with both cores as a user would give
    # it (intra-op 2); split: one intra-op thread per stage, 2 inter-op threads.
    threads = {"baseline": (1, 1), "equal": (K, 1), "split": (1, K)}[kind]
    tfdist.configure_threads(intra_op=threads[0], inter_op=threads[1])
    tfdist.configure_logical_devices(K)
    import numpy as np
    import keras

    rng = np.random.default_rng(0)
    x = rng.standard_normal((BATCH, WIDTH)).astype("float32")
    y = rng.standard_normal((BATCH, 16)).astype("float32")
    models = {}
    if kind == "baseline":
        m = _build_model()
        m.compile(keras.optimizers.SGD(1e-4), "mse")
        models[1] = m
        # Micro-batching on ONE device and one thread: the extra work M micro-batches cost
        # (smaller matmuls, M partial weight gradients summed), measured in CPU time.
        names = [l.name for l in m.layers if not isinstance(l, keras.layers.InputLayer)]
        one_device = SplitPlan.from_dict({n: "/cpu:0" for n in names})
        for mb in MICRO_BATCHES:
            s = tfdist.split_model(_build_model(), plan=one_device, micro_batches=mb)
            s.compile(keras.optimizers.SGD(1e-4), "mse")
            models[f"cpu_M{mb}"] = s
        models["cpu_unsplit"] = m
    elif kind == "equal":
        m = _build_model()
        m.compile(keras.optimizers.SGD(1e-4), "mse")
        models["unsplit_intra2"] = m
    else:
        # The unsplit model with the split's threads: how much comes from plain inter-op
        # parallelism (a layer's dX and dW matmuls in the backward are independent).
        m = _build_model()
        m.compile(keras.optimizers.SGD(1e-4), "mse")
        models["unsplit2"] = m
        for mb in MICRO_BATCHES:
            s = tfdist.split_model(_build_model(), devices=["/cpu:0", "/cpu:1"],
                                   micro_batches=mb, balance_by="flops", schedule=schedule)
            s.compile(keras.optimizers.SGD(1e-4), "mse")
            models[mb] = s
    for m in models.values():
        m.train_on_batch(x, y)  # trace + warm up
    if kind == "split":
        models["capacity"] = _capacity_probe()
    print("ready", flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if not cmd or cmd[0] == "quit":
            break
        reps = int(cmd[1])
        out = {mb: [] for mb in models}
        for _ in range(reps):  # one step of each in turn: load drifts hit all alike
            for mb, m in models.items():
                if mb == "capacity":
                    out[mb].append(m())
                    continue
                start, cpu = time.perf_counter(), time.process_time()
                m.train_on_batch(x, y)
                wall, cpu = time.perf_counter() - start, time.process_time() - cpu
                out[mb].append(cpu if str(mb).startswith("cpu_") else wall)
        print(json.dumps(out), flush=True)
    return 0


def _capacity_probe():
    """How much parallelism this machine gives right now, same threads as the pipeline.

    Times one chain of matmuls on /cpu:0 and two independent chains on
    /cpu:0 and /cpu:1 in one graph; 2 * t(one) / t(two) is the best speed-up
    any 2-stage schedule could reach at this moment (2.0 on two idle cores).
    """
    import tensorflow as tf

    rng = tf.random.Generator.from_seed(0)
    a = rng.normal((BATCH // 2, WIDTH))
    w = rng.normal((WIDTH, WIDTH)) * 0.03

    def chain(device):
        with tf.device(device):
            h = a
            for _ in range(LAYERS):
                h = tf.nn.relu(h @ w)
            return tf.reduce_sum(h)

    one = tf.function(lambda: chain("/cpu:0"))
    two = tf.function(lambda: chain("/cpu:0") + chain("/cpu:1"))
    one(), two()

    def measure():
        start = time.perf_counter()
        one().numpy()
        t1 = time.perf_counter() - start
        start = time.perf_counter()
        two().numpy()
        return 2 * t1 / (time.perf_counter() - start)

    return measure


# --------------------------------------------------------------------------------- driver
def _start(kind: str, schedule: str, onednn: bool) -> subprocess.Popen:
    # Both workers use the same kernels, so the ratio compares schedules, not kernel libraries.
    env = dict(os.environ, KERAS_BACKEND="tensorflow", TF_ENABLE_ONEDNN_OPTS="1" if onednn else "0")
    return subprocess.Popen(
        [sys.executable, "-m", "experiments.bench_split", f"--worker={kind}",
         f"--schedule={schedule}"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _expect(proc, timeout_s: float) -> str:
    import selectors

    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    if not sel.select(timeout_s):
        raise TimeoutError(f"benchmark worker silent for {timeout_s:.0f}s")
    line = proc.stdout.readline()
    if not line:
        raise RuntimeError(f"benchmark worker exited (code {proc.wait()})")
    return line


def run(quick: bool, schedule: str = "free", onednn: bool = True) -> list[dict]:
    """Runs both workers in interleaved rounds; returns benchmark rows."""
    import numpy as np

    from tfdist.split.plan import bubble_fraction, ideal_speedup

    rounds, reps = (2, 3) if quick else (7, 5)
    procs = {k: _start(k, schedule, onednn) for k in ("baseline", "equal", "split")}
    times: dict[str, dict[int, list[float]]] = {"baseline": {}, "equal": {}, "split": {}}
    try:
        for proc in procs.values():
            _expect(proc, 600)
        for _ in range(rounds):
            for kind, proc in procs.items():
                proc.stdin.write(f"run {reps}\n")
                proc.stdin.flush()
                for mb, ts in json.loads(_expect(proc, 900)).items():
                    times[kind].setdefault(int(mb) if mb.isdigit() else mb, []).extend(ts)
        for proc in procs.values():
            proc.stdin.write("quit\n")
            proc.stdin.flush()
            proc.wait(timeout=60)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    base = float(np.median(times["baseline"][1]))
    kernels = "oneDNN" if onednn else "Eigen (TF_ENABLE_ONEDNN_OPTS=0)"
    note_load = (f"{kernels} kernels; medians of {rounds}x{reps} steps, interleaved; shared "
                 f"2-core machine (load avg {os.getloadavg()[0]:.1f} at the end)")
    rows = [{"name": "split/unsplit_1thread_step", "value": base * 1e3, "unit": "ms",
             "target": None, "ratio": None,
             "note": f"MLP {LAYERS}x Dense({WIDTH}), batch {BATCH}, intra 1 inter 1; {note_load}"}]
    capacity = float(np.median(times["split"]["capacity"]))
    rows.append({"name": "split/machine_parallel_capacity", "value": capacity, "unit": "x",
                 "target": None, "ratio": None,
                 "note": "2 independent matmul chains on /cpu:0,/cpu:1 vs 1 chain, same threads: "
                         "the best 2-stage speed-up this machine allowed during the run "
                         "(2.0 = two idle cores)"})
    unsplit2 = float(np.median(times["split"]["unsplit2"]))
    unsplit_cpu = float(np.median(times["baseline"]["cpu_unsplit"]))
    inflation = {mb: float(np.median(times["baseline"][f"cpu_M{mb}"])) / unsplit_cpu
                 for mb in MICRO_BATCHES}
    for mb in MICRO_BATCHES:
        rows.append({
            "name": f"split/work_M{mb}", "value": inflation[mb], "unit": "x",
            "target": None, "ratio": None,
            "note": (f"CPU time per step with M={mb} micro-batches on one device, one thread, vs "
                     f"the unsplit model: the work micro-batching adds (load-robust); caps the "
                     f"2-stage speed-up at {ideal_speedup(K, mb) / inflation[mb]:.2f}x")})
    rows.append({"name": "split/unsplit_2threads_speedup", "value": base / unsplit2, "unit": "x",
                 "target": None, "ratio": None,
                 "note": "the unsplit model with the split's threads (intra 1, inter 2) vs one "
                         "thread: parallelism inside one step (dX and dW of a layer), no pipeline"})
    equal = float(np.median(times["equal"]["unsplit_intra2"]))
    rows.append({"name": "split/unsplit_intra2_speedup", "value": base / equal, "unit": "x",
                 "target": None, "ratio": None,
                 "note": f"the unsplit model with both cores (intra 2, inter 1; step "
                         f"{equal * 1e3:.1f} ms) vs one thread (intra 1, inter 1): the "
                         "equal-resources baseline for the pipeline rows"})
    for mb in MICRO_BATCHES:
        t = float(np.median(times["split"][mb]))
        rows.append({
            "name": f"split/speedup_M{mb}_vs_equal_resources", "value": equal / t, "unit": "x",
            "target": None, "ratio": None,
            "note": (f"2 stages on /cpu:0,/cpu:1 (intra 1, inter 2: 2 threads), step "
                     f"{t * 1e3:.1f} ms, vs the unsplit model on 1 device with intra 2, inter 1 "
                     "(2 threads): the same cores")})
    for mb in MICRO_BATCHES:
        t = float(np.median(times["split"][mb]))
        speedup = base / t
        ideal = ideal_speedup(K, mb)
        target = 0.9 * ideal if mb == 8 else None
        rows.append({
            "name": f"split/speedup_M{mb}", "value": speedup, "unit": "x",
            "target": target, "ratio": None if target is None else speedup / target,
            "note": (f"2 stages on /cpu:0,/cpu:1, intra 1 inter 2, schedule={schedule}, vs the "
                     f"unsplit model on 1 device, intra 1 inter 1 (ONE thread); step "
                     f"{t * 1e3:.1f} ms; ideal K*M/(M+K-1)={ideal:.2f}x"
                     + ("; M=1 is the naive split (assembly line, one stage idle)"
                        if mb == 1 else "")),
        })
        rows.append({
            "name": f"split/bubble_M{mb}", "value": 1.0 - speedup / K, "unit": "fraction",
            "target": None, "ratio": None,
            "note": (f"measured 1 - speedup/K; GPipe formula "
                     f"(K-1)/(M+K-1)={bubble_fraction(K, mb):.3f}"),
        })
    return rows


def main(argv):
    del argv
    if _FLAGS.worker:
        return _worker(_FLAGS.worker, _FLAGS.schedule)
    rows = run(_FLAGS.quick, _FLAGS.schedule, _FLAGS.onednn)
    print_rows(rows)
    if _FLAGS.out:
        write_rows(_FLAGS.out, rows, command="python -m experiments.bench_split")
    return 0


if __name__ == "__main__":
    _define_flags()
    app.run(main)

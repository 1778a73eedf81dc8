"""Two workers on a rate-limited link, methods side by side: `python -m experiments.bench_shaped`.

    python -m experiments.bench_shaped [--rates_mbit=1000,100] [--rounds=3] [--steps=10]
        [--methods=stock,tfdist,per_value_logs,fp16,powersgd] [--out=results/bench_shaped.json]

Two "nodes" are network namespaces made by this program (experiments/netlab.py:
each node's eth0 is one end of a veth pair whose other end sits on a bridge in
a third namespace; both directions of every link shaped with a `tc` HTB class
at the given rate; the kernel here has no netem, so no delay is added). Each
node runs one worker process (one intra-op and one inter-op thread, worker k
pinned to core k mod the machine's cores) at 192.0.2.(k+1).

Every measurement is a fresh pair of worker processes training the same MLP
(784-512-512-10, Adam 1e-4, 64 examples per worker, synthetic data, the
accuracy metric) for `--steps` timed steps after warm-up; its step time is the
median of the per-step wall times on worker 0. For each rate, the methods run
in interleaved rounds (round 1: every method, round 2: every method, ...) and
each method's figure is the median over rounds, so load drifting on the
machine hits every method alike. Ratios are samples/s of a method over
samples/s of the baseline (`stock`) at the same rate.

Methods:
- `stock`: `tf.distribute.MultiWorkerMirroredStrategy` and a hand-written
  loop (GradientTape, `optimizer.apply_gradients`, the loss reduced with
  `strategy.reduce`, the accuracy in a metric object), what a user writes
  because Keras 3's `fit` fails under the stock strategy (keras-team/keras#20585);
- `tfdist`: `tfdist.make_strategy("multi_worker_mirrored")` and `model.fit`
  (the step's loss and accuracy reduced in one collective);
- `per_value_logs`: the same with `keras_log_reduction` undone (one collective
  per log value, as Keras does);
- `fp16`, `bf16`, `powersgd`: tfdist with `gradient_compression` (PowerSGD
  rank 4, no warm-up steps);
- `zero2`, `zero3`, `zero3_noremat`: tfdist with `shard="gradients"`,
  `shard="parameters"`, and `shard="parameters", shard_remat=False`.

Needs root, `ip`, `tc` and `nsenter`; without them it prints why and exits 1.
The namespaces are removed when the program ends, on error too (their holder
processes die with it).
"""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import time

from absl import app, flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PER_WORKER_BATCH = 64
HIDDEN = (512, 512)
METHODS = {
    "stock": None,
    "tfdist": {},
    "per_value_logs": {},
    "fp16": {"gradient_compression": "fp16"},
    "bf16": {"gradient_compression": "bf16"},
    "powersgd": {"gradient_compression": "powersgd", "powersgd_rank": 4,
                 "powersgd_warmup_steps": 0},
    "zero2": {"shard": "gradients"},
    "zero3": {"shard": "parameters"},
    "zero3_noremat": {"shard": "parameters", "shard_remat": False},
}
RESULT_MARK = "BENCH_SHAPED_RESULT "
WORKER_TIMEOUT = 600


def _define_flags() -> None:
    flags.DEFINE_list("rates_mbit", ["1000", "100"], "Link rates in Mbit/s (each direction).")
    flags.DEFINE_list("methods", ["stock", "tfdist", "per_value_logs", "fp16", "powersgd"],
                      "Methods, the first the baseline of the ratios: " + ", ".join(METHODS))
    flags.DEFINE_integer("rounds", 3, "Interleaved rounds per rate (median over rounds).")
    flags.DEFINE_integer("steps", 10, "Timed steps per measurement.")
    flags.DEFINE_string("out", None, "Write the rows as JSON here.")
    flags.DEFINE_string("role", None, "Internal: run as a worker with this method.")


FLAGS = flags.FLAGS


def check_arguments(rates_mbit, methods, rounds: int, steps: int) -> None:
    """ValueError naming what was received when the arguments cannot run."""
    unknown = [m for m in methods if m not in METHODS]
    if unknown or not methods:
        raise ValueError(f"--methods must name one or more of {', '.join(METHODS)}. "
                         f"Received: {','.join(methods)!r}")
    if not rates_mbit or any(r <= 0 for r in rates_mbit):
        raise ValueError(f"--rates_mbit must be positive rates in Mbit/s. Received: "
                         f"{list(rates_mbit)}")
    if rounds < 1 or steps < 2:
        raise ValueError(f"--rounds must be >= 1 and --steps >= 2. Received: rounds={rounds}, "
                         f"steps={steps}")


# --- worker (inside a node's namespace) ----------------------------------------------------


def _worker(method: str, steps: int) -> None:
    import numpy as np

    import tfdist
    from experiments.bench_comm import _pin, tcp_bytes_by_socket, tcp_bytes_sent_since

    task_id = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    core = _pin(task_id)
    tfdist.configure_threads(intra_op=1, inter_op=1)
    tf = tfdist._tf.import_tensorflow()
    import keras

    if method == "stock":
        strategy = tf.distribute.MultiWorkerMirroredStrategy()
    else:
        strategy = tfdist.make_strategy("multi_worker_mirrored", join_timeout=300,
                                        **METHODS[method])
    if method == "per_value_logs":
        from tfdist.compat import keras_log_reduction

        tfdist.compat.uninstall([keras_log_reduction.NAME])
    workers = strategy.num_replicas_in_sync
    global_batch = PER_WORKER_BATCH * workers
    rng = np.random.default_rng(0)
    x = rng.standard_normal((global_batch * 4, 784)).astype("float32")
    y = rng.integers(0, 10, size=len(x)).astype("int32")
    ds = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(global_batch)
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((784,))] + [
            keras.layers.Dense(w, activation="relu") for w in HIDDEN] + [keras.layers.Dense(10)])
        optimizer = keras.optimizers.Adam(1e-4)
    ends: list[float] = []

    if method == "stock":
        with strategy.scope():
            accuracy = keras.metrics.SparseCategoricalAccuracy()
        loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")
        iterator = iter(strategy.experimental_distribute_dataset(ds))

        def replica_step(xb, yb):
            with tf.GradientTape() as tape:
                logits = model(xb, training=True)
                loss = tf.nn.compute_average_loss(loss_fn(yb, logits),
                                                  global_batch_size=global_batch)
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            accuracy.update_state(yb, logits)
            return loss

        @tf.function
        def train_step(it):
            return strategy.reduce("SUM", strategy.run(replica_step, args=next(it)), axis=None)

        def run(n: int) -> None:
            for _ in range(n):
                float(train_step(iterator))
                ends.append(time.perf_counter())
    else:
        with strategy.scope():
            model.compile(optimizer,
                          keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                          metrics=["accuracy"])

        class Clock(keras.callbacks.Callback):
            def on_train_batch_end(self, batch, logs=None):
                float(logs["loss"])  # the step's result is here
                ends.append(time.perf_counter())

        def run(n: int) -> None:
            model.fit(ds, epochs=1, steps_per_epoch=n, verbose=0, callbacks=[Clock()])

    run(3)  # trace, warm up
    ends.clear()
    before = tcp_bytes_by_socket(None)  # every socket of this node's namespace: worker 0's
    run(steps + 1)
    sent = tcp_bytes_sent_since(before, None)
    step = statistics.median(b - a for a, b in zip(ends, ends[1:]))
    if task_id == 0:
        params = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
        print(RESULT_MARK + json.dumps({
            "method": method, "workers": workers, "step_seconds": step,
            "samples_per_second": global_batch / step, "wire_bytes_per_step": sent / (steps + 1),
            "params": params, "core": core, "global_batch": global_batch}), flush=True)


# --- parent (no TensorFlow) ----------------------------------------------------------------


def _measure(lab, method: str, steps: int, port: int) -> dict:
    """One pair of fresh worker processes on the lab's two nodes; worker 0's result."""
    from experiments.netlab import wait_for_workers

    cluster = {"worker": [f"{lab.address(k)}:{port}" for k in range(2)]}
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               TF_CPP_MIN_LOG_LEVEL="2")
    procs = [lab.popen(k, [sys.executable, "-m", "experiments.bench_shaped", f"--role={method}",
                           f"--steps={steps}"], cwd=ROOT, text=True,
                       env=dict(env, TF_CONFIG=json.dumps(
                           {"cluster": cluster, "task": {"type": "worker", "index": k}})),
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for k in range(2)]
    outputs = wait_for_workers(procs, timeout=WORKER_TIMEOUT,
                               label=f"bench_shaped ({method!r})")
    for line in outputs[0].splitlines():
        if line.startswith(RESULT_MARK):
            return json.loads(line[len(RESULT_MARK):])
    raise RuntimeError(f"bench_shaped: worker 0 of {method!r} printed no result:\n"
                       + outputs[0][-2000:])


def run(rates_mbit, methods, *, rounds: int, steps: int, log=print, on_lab=None) -> list[dict]:
    """Rows: each method's median step per rate, and its samples/s over the first method's.

    A method whose workers fail gets a "failed" row (with their last output) when no
    round of it succeeded; the others are still measured.

    `on_lab(lab)` is called once the namespaces exist (tests read their identities).
    """
    from experiments.netlab import NetLab
    from experiments.rows import row

    check_arguments(rates_mbit, methods, rounds, steps)
    rows = []
    with NetLab(2) as lab:
        if on_lab is not None:
            on_lab(lab)
        port = 47000
        for rate in rates_mbit:
            lab.set_rate(rate * 1e6)
            probe = lab.probe(total_bytes=int(min(32 << 20, rate * 1e6 / 8 / 2)))
            link = (f"{rate:g} Mbit/s each way (tc HTB on a veth pair through a bridge; one TCP "
                    f"stream {probe['bytes_per_second'] * 8 / 1e6:.0f} Mbit/s, 1-byte RTT "
                    f"{probe['rtt_seconds'] * 1e6:.0f} us)")
            log(f"link: {link}")
            results: dict[str, list[dict]] = {m: [] for m in methods}
            failed: dict[str, str] = {}
            for r in range(rounds):
                for method in methods:
                    port += 1  # a fresh port: the last pair's may still be in TIME_WAIT
                    try:
                        result = _measure(lab, method, steps, port)
                    except RuntimeError as e:  # the other methods still measure
                        failed[method] = str(e)
                        log(f"  round {r + 1} {method}: {e}")
                        continue
                    results[method].append(result)
                    log(f"  round {r + 1} {method}: step {result['step_seconds'] * 1e3:.1f} ms")
            rows += [row(f"shaped/{rate:g} Mbit/s/{m}: failed", float("nan"), "-", failed[m])
                     for m in methods if not results[m]]
            measured = [m for m in methods if results[m]]
            if not measured:
                continue
            base = statistics.median(x["step_seconds"] for x in results[measured[0]])
            first = results[measured[0]][0]
            setup = (f"2 workers, each 1 intra-op + 1 inter-op thread pinned to its own core "
                     f"({os.cpu_count()} cores here); MLP 784-{'-'.join(map(str, HIDDEN))}-10 "
                     f"({first['params']:,} params), Adam, global batch {first['global_batch']}; "
                     f"median of {rounds} interleaved rounds x {steps} steps; link {link}")
            for method in measured:
                step = statistics.median(x["step_seconds"] for x in results[method])
                wire = statistics.median(x["wire_bytes_per_step"] for x in results[method])
                rows.append(row(f"shaped/{rate:g} Mbit/s/{method}: step", step * 1e3, "ms",
                                f"{first['global_batch'] / step:,.0f} samples/s; worker 0 sent "
                                + (f"{wire / 1e6:.3f} MB/step" if math.isfinite(wire)
                                   else "unknown bytes (ss failed)") + "; rounds "
                                + ", ".join(f"{x['step_seconds'] * 1e3:.1f}"
                                            for x in results[method]) + f" ms; {setup}"))
                if method != measured[0]:
                    rows.append(row(f"shaped/{rate:g} Mbit/s/{method} vs {measured[0]}: "
                                    "samples/s ratio", base / step, "x",
                                    f"{measured[0]} {base * 1e3:.1f} ms/step vs {method} "
                                    f"{step * 1e3:.1f} ms/step, same run, same link"))
    return rows


def main(argv):
    del argv
    if FLAGS.role:
        return _worker(FLAGS.role, FLAGS.steps)
    from experiments.netlab import NetLab
    from experiments.rows import print_rows, write_rows

    rates = [float(r) for r in FLAGS.rates_mbit]
    check_arguments(rates, FLAGS.methods, FLAGS.rounds, FLAGS.steps)
    problem = NetLab.available()
    if problem:
        print(f"bench_shaped: cannot build the simulated nodes here: {problem}", file=sys.stderr)
        return 1
    rows = run(rates, FLAGS.methods, rounds=FLAGS.rounds, steps=FLAGS.steps)
    print_rows(rows)
    if FLAGS.out:
        write_rows(FLAGS.out, rows, command="python -m experiments.bench_shaped " + " ".join(
            sys.argv[1:]))
    return 0


if __name__ == "__main__":
    _define_flags()
    app.run(main)

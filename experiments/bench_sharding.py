"""Sharding benchmark: step time and memory of each ZeRO stage next to shard="none".

    python -m experiments.bench_sharding [--quick] [--out results/bench_sharding.json]

One worker process per configuration, all alive at once and measured in
interleaved rounds (each round runs every configuration's steps in turn, so
load drifts hit all alike): an MLP trained with Adam under `mirrored` on 2
replicas, logical CPUs /cpu:1 and /cpu:2 (the host /cpu:0 holds offloaded
state), one intra-op thread and two inter-op threads per process:

- shard = none, optimizer, gradients, parameters; parameters with
  shard_remat=False (gathered weights kept until the backward pass: no second
  gather, no recomputed forward); and gradients with offload="optimizer".

Rows: the median step time and its ratio to shard="none"; per replica
device, the bytes of weights, reduced gradients and optimizer state read
from the real variables and traced tensors (tfdist.sharding.memory) next to
tfdist.cost.sharded_state_bytes; and the peak of the memory allocator. On
GPUs that peak is per device; logical CPUs share one allocator, so on CPUs
it is the whole process (both replicas and the host) and says so. The CPU
allocator is TensorFlow's BFC allocator in every worker
(TF_CPU_ALLOCATOR_USE_BFC=1): TensorFlow's default one keeps statistics only
where oneDNN is on (CPUs with AVX-512 VNNI/BF16, AVX-VNNI or AMX).

`run(quick)` returns the rows (for experiments/benchmark.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from absl import app, flags

from experiments.rows import print_rows, write_rows

# (shard, offload, shard_remat)
CONFIGS = (("none", "none", True), ("optimizer", "none", True), ("gradients", "none", True),
           ("parameters", "none", True), ("parameters", "none", False),
           ("gradients", "optimizer", True))
STAGE = {"none": 0, "optimizer": 1, "gradients": 2, "parameters": 3}
REPLICAS = ("/cpu:1", "/cpu:2")

_FLAGS = flags.FLAGS


def _define_flags():
    if "quick" not in _FLAGS:
        flags.DEFINE_bool("quick", False, "A small model, fewer rounds (smoke run).")
        flags.DEFINE_string("out", None, "Write the rows as JSON here.")
        flags.DEFINE_string("worker", None,
                            "Internal: run one configuration, SHARD:OFFLOAD:REMAT (0 or 1).")


def _sizes(quick: bool) -> tuple[int, int, int]:
    """(width, layers, global batch)."""
    return (256, 3, 64) if quick else (1024, 4, 256)


def _name(config) -> str:
    shard, offload, remat = config
    name = shard if offload == "none" else f"{shard}+offload"
    return name if remat else f"{name}_noremat"


# --------------------------------------------------------------------------------- worker
def _worker(config: str, quick: bool) -> int:
    import tfdist

    shard, offload, remat = config.split(":")
    tfdist.configure_logical_devices(3)
    tfdist.configure_threads(intra_op=1, inter_op=2)
    tf = tfdist.import_tensorflow()
    import keras
    import numpy as np

    from tfdist import planning as cost  # the cost model
    from tfdist.sharding import memory

    width, layers, batch = _sizes(quick)
    options = {} if shard == "none" else {"shard": shard, "offload": offload}
    if remat == "0":
        options["shard_remat"] = False
    strategy = tfdist.make_strategy("mirrored", devices=REPLICAS, **options)
    memory.record_gradients(strategy)  # shard="none" too: the same reading for every row
    with strategy.scope():
        keras.utils.set_random_seed(0)
        inputs = keras.Input((width,))
        x = inputs
        for _ in range(layers):
            x = keras.layers.Dense(width, activation="relu")(x)
        model = keras.Model(inputs, keras.layers.Dense(16)(x))
        model.compile(keras.optimizers.Adam(1e-4), "mse")
    rng = np.random.default_rng(0)
    data = tf.data.Dataset.from_tensors(
        (rng.standard_normal((batch, width)).astype("float32"),
         rng.standard_normal((batch, 16)).astype("float32"))).repeat()
    iterator = iter(strategy.experimental_distribute_dataset(data))
    model.fit(data, steps_per_epoch=2, epochs=1, verbose=0)  # trace + warm up

    devices = tf.config.list_logical_devices("GPU") or []
    allocators = [d.name for d in devices] or ["CPU:0"]
    for name in allocators:
        tf.config.experimental.reset_memory_stats(name)
    step = model.make_train_function()
    step(iterator)
    peaks = {name: tf.config.experimental.get_memory_info(name)["peak"] for name in allocators}

    state = memory.state_bytes(model)
    sizes = [int(v.shape.num_elements()) for v in model.trainable_variables]
    predicted = cost.sharded_state_bytes(
        sizes, stage=STAGE[shard], num_shards=len(REPLICAS),
        optimizer=cost.optimizer_state(model.optimizer),
        min_shard_bytes=tfdist.MirroredOptions().shard_min_bytes, offload=offload != "none")
    print("ready " + json.dumps({
        "state": state, "peaks": peaks, "gpu": bool(devices),
        "predicted": {"parameters": predicted.parameters, "gradients": predicted.gradients,
                      "optimizer": predicted.optimizer, "offloaded": predicted.offloaded},
        "params": sum(sizes)}), flush=True)
    for line in sys.stdin:
        command = line.split()
        if not command or command[0] == "quit":
            break
        times = []
        for _ in range(int(command[1])):
            start = time.perf_counter()
            logs = step(iterator)
            float(logs["loss"])  # wait for the step
            times.append(time.perf_counter() - start)
        print(json.dumps(times), flush=True)
    return 0


# --------------------------------------------------------------------------------- driver
def _start(config, quick: bool) -> subprocess.Popen:
    shard, offload, remat = config
    return subprocess.Popen(
        [sys.executable, "-m", "experiments.bench_sharding",
         f"--worker={shard}:{offload}:{int(remat)}"]
        + (["--quick"] if quick else []),
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        # The CPU allocator with statistics on every CPU (the peaks above).
        env=dict(os.environ, KERAS_BACKEND="tensorflow", TF_CPU_ALLOCATOR_USE_BFC="1"),
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _expect(proc, timeout_s: float) -> str:
    import selectors

    selector = selectors.DefaultSelector()
    selector.register(proc.stdout, selectors.EVENT_READ)
    while True:
        if not selector.select(timeout_s):
            raise TimeoutError(f"benchmark worker silent for {timeout_s:.0f}s")
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"benchmark worker exited (code {proc.wait()})")
        if line.startswith("ready ") or line.startswith("["):
            return line


def run(quick: bool) -> list[dict]:
    """Runs every configuration in interleaved rounds; returns benchmark rows."""
    import numpy as np

    rounds, steps = (2, 3) if quick else (7, 10)
    procs = {}
    ready: dict = {}
    times: dict = {config: [] for config in CONFIGS}
    try:
        # Started one after another: tracing six models at once would only thrash two cores.
        for config in CONFIGS:
            procs[config] = _start(config, quick)
            ready[config] = json.loads(_expect(procs[config], 900)[len("ready "):])
        for _ in range(rounds):
            for config, proc in procs.items():
                proc.stdin.write(f"run {steps}\n")
                proc.stdin.flush()
                times[config].extend(json.loads(_expect(proc, 900)))
        for proc in procs.values():
            proc.stdin.write("quit\n")
            proc.stdin.flush()
        for proc in procs.values():
            proc.wait(timeout=600)  # a loaded machine makes TensorFlow's shutdown slow
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()

    width, layers, batch = _sizes(quick)
    base = float(np.median(times[CONFIGS[0]]))
    setup = (f"MLP {layers}x Dense({width}) + Dense(16), Adam, global batch {batch}, "
             f"{ready[CONFIGS[0]]['params']} parameters; mirrored on {', '.join(REPLICAS)} "
             f"(logical CPUs; host /cpu:0), intra-op 1 inter-op 2 threads per process; medians "
             f"of {rounds}x{steps} steps, interleaved; load avg {os.getloadavg()[0]:.1f} at the "
             "end")
    rows = [{"name": "sharding/step_none", "value": base * 1e3, "unit": "ms", "target": None,
             "ratio": None, "note": setup}]
    replica = None
    for config in CONFIGS:
        name, info = _name(config), ready[config]
        step = float(np.median(times[config]))
        if config != CONFIGS[0]:
            rows.append({"name": f"sharding/step_ratio_{name}", "value": step / base,
                         "unit": "x", "target": None, "ratio": None,
                         "note": f"median step {step * 1e3:.1f} ms vs shard=none; same run"
                                 + ("" if config[2] else "; shard_remat=False: each layer "
                                    "keeps its gathered weights until its backward pass")})
        replica = sorted(d for d in info["state"] if any(d.endswith(r[-5:].upper())
                                                         for r in REPLICAS))[0]
        measured = info["state"][replica]
        total = measured["parameters"] + measured["gradients"] + measured["optimizer"]
        predicted = info["predicted"]
        expected = predicted["parameters"] + predicted["gradients"] + predicted["optimizer"]
        rows.append({
            "name": f"sharding/state_bytes_{name}", "value": total, "unit": "bytes",
            "target": expected, "ratio": total / expected,
            "note": (f"on {replica.split('/')[-1]}: weights {measured['parameters']}, reduced "
                     f"gradients {measured['gradients']}, optimizer {measured['optimizer']} (read "
                     f"from the variables and the traced step); target: "
                     f"tfdist.cost.sharded_state_bytes"
                     + (f"; host holds {predicted['offloaded']} per replica"
                        if predicted["offloaded"] else ""))})
        for allocator, peak in info["peaks"].items():
            where = (allocator if info["gpu"] else
                     "process (logical CPUs share one allocator: both replicas and the host)")
            rows.append({"name": f"sharding/peak_mb_{name}" + (f"_{allocator}" if info["gpu"]
                                                               else ""),
                         "value": peak / 2**20, "unit": "MB", "target": None, "ratio": None,
                         "note": f"allocator peak over one training step, {where}"})
    return rows


def main(argv):
    del argv
    if _FLAGS.worker:
        return _worker(_FLAGS.worker, _FLAGS.quick)
    rows = run(_FLAGS.quick)
    print_rows(rows)
    if _FLAGS.out:
        write_rows(_FLAGS.out, rows, command="python -m experiments.bench_sharding"
                   + (" --quick" if _FLAGS.quick else ""))
    return 0


_define_flags()

if __name__ == "__main__":
    app.run(main)

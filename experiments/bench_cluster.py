"""A simulated cluster with rate-limited links: `python -m experiments.bench_cluster`.

    python -m experiments.bench_cluster [--nodes=2,4] [--rates=1,10] [--models=mlp,conv,bert]
        [--methods=none,buckets,fp16,bf16,powersgd] [--steps=8] [--rounds=1]
        [--digits_epochs=0] [--inter_op=1] [--out=results/bench_cluster.json]

Every "node" is a network namespace joined to a switch namespace by a veth
pair whose two directions are shaped with a `tc` HTB class (experiments/netlab.py;
the kernel here has no netem, so no delay is added: the round trip is what
veth, the bridge and HTB give, measured and printed). Node k runs one
`multi_worker_mirrored` worker at 192.0.2.(k+1) with one intra-op and one
inter-op thread (`--inter_op`: more), pinned to core k mod the machine's cores.

Link rates are equivalents scaled to this machine's compute (`RATE_SCALE`):
a node here is one core, a real node is taken to be 16 such cores (the
16-core machine of the scaling measurements), so a real link of R Gbit/s is
shaped to R/16 here and communication takes the same share of a step as it
would there: 1 Gbit/s-equivalent -> 62.5 Mbit/s, 10 -> 625 Mbit/s.

Models: `mlp` (784-1024-1024-512-10, Adam, 64 examples per worker), `conv` (4 x Conv2D(32)
on 32x32x16, SGD, 64 per worker) and `bert`, a KerasHub `BertTextClassifier` built from
config (`BERT`: 2 layers, hidden 256, 4 heads, vocabulary 8192, random weights) on 8
sequences of 64 synthetic token ids per worker, Adam. Its token and segment embeddings
have IndexedSlices gradients: TensorFlow all-gathers their rows (no method compresses
them), so the exchange alone sends them as such and the prediction adds their all-gather
to the cost of the dense gradients (`tfdist.planning.sparse_exchange`, for the variables
`tfdist.model_stats` finds in `sparse_gradients`).

For every nodes x rate x model x method (none; `buckets`: `--bucket_bytes`,
default 1 MiB; `buckets_tf_order`: the same with `bucket_priority=False`; fp16;
bf16; powersgd rank 4, no warm-up), one fresh set of worker
processes measures:
- the training step (`model.fit`, median of the per-step wall times on
  worker 0) and samples/s;
- bytes on the wire per step (worker 0's TCP bytes_sent, `ss -ti`);
- compute: the same step with the exchange removed (a GradientSync keeping
  each worker's own gradients); exchange: the method's gradient exchange
  alone; hidden = (compute + exchange - step) / exchange, the share of the
  exchange the backward pass hid (clipped to [0, 1]);
- the planner's prediction: `tfdist.planning.candidates` with that compute
  time, an alpha-beta link calibrated by the first run of each
  (nodes, rate) in the same lab (all-reduces of 16 KiB .. 4 MiB through
  the same strategy), and the FLOP rate the worker reached on the step
  (`tfdist.model_stats`' training FLOPs per worker batch / the compute-only
  step) and the memory rate it streams at (`a + b` over gradient-sized
  tensors): PowerSGD's own compute is costed at them (a roofline per op), and
  `tfdist.planning.recommend`'s choice, judged against the fastest method
  measured (fastest or within 10%). The cost model assumes no overlap, so
  `buckets` is predicted as `none` with the latency paid once per bucket
  (`tfdist.planning.bucket_collectives`).

With `--digits_epochs=E`, every `mlp` configuration's first round also trains
the MLP's layers on the scikit-learn digits (64 pixels -> 1024-1024-512-10,
the 1,438 training images, global batch 64 per worker, Adam 1e-3 decayed to 0
by a cosine over the E epochs, seed 0) with the same method on the same link,
and reports the held-out accuracy on the other 359 images and the training's
wall time. The target row compares each method's accuracy with `none`'s:
equal within +-0.5 points (E=12 is enough for ~0.98 here).

Needs root, `ip`, `tc` and `nsenter`; without them it prints why and exits 1.
The namespaces and worker processes are removed when the program ends, on
error too.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import sys
import time

from absl import app, flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RATE_SCALE = 1 / 16  # a node here is one core; a real node is 16 such cores
BUCKET_BYTES = 1024 * 1024
POWERSGD_RANK = 4
METHODS = {
    "none": {},
    "buckets": {"bucket_bytes": BUCKET_BYTES},
    # the same buckets, the backward pass in TensorFlow's own order (no bucket_priority)
    "buckets_tf_order": {"bucket_bytes": BUCKET_BYTES, "bucket_priority": False},
    "fp16": {"gradient_compression": "fp16"},
    "bf16": {"gradient_compression": "bf16"},
    "powersgd": {"gradient_compression": "powersgd", "powersgd_rank": POWERSGD_RANK,
                 "powersgd_warmup_steps": 0},
}
MODELS = ("mlp", "conv", "bert")
PER_WORKER_BATCH = 64
# The KerasHub transformer: a BertTextClassifier from config (random weights), its token ids
# synthetic; 2 layers of hidden 256 (6.66 MB of dense gradients) on 8 x 64 tokens per worker.
BERT = dict(vocabulary_size=8192, num_layers=2, num_heads=4, hidden_dim=256,
            intermediate_dim=1024, max_sequence_length=64, dropout=0.0)
BERT_PER_WORKER_BATCH = 8
# Up to 4 MiB. A 16 MiB point (past the MLP's 9.5 MB pack) moved its predicted exchange by
# 3.6% at 10 Gbit/s-eq (docs/performance.md) and costs ~2.5 s per all-reduce at 1 Gbit/s-eq.
CALIBRATION_SIZES = (16 << 10, 256 << 10, 1 << 20, 4 << 20)
WORKER_TIMEOUT = 900
# Targets on the 1 Gbit/s-equivalent link.
POWERSGD_SPEEDUP_TARGET = 2.0
HIDDEN_TARGET = 0.3
PREDICTION_TOLERANCE = 0.3
RECOMMENDATION_TOLERANCE = 0.10
ACCURACY_TOLERANCE = 0.005  # final digits accuracy of a method vs none's, +-0.5 points
DIGITS_LEARNING_RATE = 1e-3


def _define_flags() -> None:
    flags.DEFINE_list("nodes", ["2", "4"], "Node counts (each node one worker).")
    flags.DEFINE_list("rates", ["1"], "Link rates in Gbit/s-equivalent (shaped to rate x "
                      f"{RATE_SCALE:g}).")
    flags.DEFINE_list("models", ["mlp"], "Models: " + ", ".join(MODELS))
    flags.DEFINE_list("methods", list(METHODS), "Methods: " + ", ".join(METHODS))
    flags.DEFINE_integer("steps", 8, "Timed steps per measurement (median kept).")
    flags.DEFINE_integer("rounds", 1, "Interleaved rounds per configuration (the median "
                         "round is kept).")
    flags.DEFINE_integer("bucket_bytes", BUCKET_BYTES, "bucket_bytes of the `buckets` method.")
    flags.DEFINE_integer("digits_epochs", 0, "Also train the MLP's layers on digits for this "
                         "many epochs with each method (mlp only; first round) and report the "
                         "held-out accuracy. 0: not measured.")
    flags.DEFINE_integer("inter_op", 1, "Inter-op threads per worker (TensorFlow's default "
                         "is one per core; a bucket's all-reduce launches on this pool).")
    flags.DEFINE_string("out", "results/bench_cluster.json", "Where to write the rows (JSON).")
    flags.DEFINE_string("role", None, "Internal: run as a worker with this JSON config.")
    flags.DEFINE_string("worker_out", None, "Internal: the worker's result file.")


FLAGS = flags.FLAGS


def check_arguments(nodes, rates, models, methods, steps: int,
                    bucket_bytes: int = BUCKET_BYTES, rounds: int = 1,
                    digits_epochs: int = 0, inter_op: int = 1) -> None:
    """ValueError naming what was received when the arguments cannot run."""
    if not nodes or any(n < 2 for n in nodes):
        raise ValueError(f"--nodes must be node counts >= 2. Received: {list(nodes)}")
    if not rates or any(r <= 0 for r in rates):
        raise ValueError(f"--rates must be positive Gbit/s-equivalents. Received: {list(rates)}")
    for flag, given, known in (("models", models, MODELS), ("methods", methods, METHODS)):
        unknown = [m for m in given if m not in known]
        if unknown or not given:
            raise ValueError(f"--{flag} must name one or more of {', '.join(known)}. "
                             f"Received: {','.join(given)!r}")
    if steps < 2:
        raise ValueError(f"--steps must be >= 2. Received: steps={steps}")
    if bucket_bytes < 1:
        raise ValueError(f"--bucket_bytes must be >= 1. Received: bucket_bytes={bucket_bytes}")
    if rounds < 1:
        raise ValueError(f"--rounds must be >= 1. Received: rounds={rounds}")
    if inter_op < 1:
        raise ValueError(f"--inter_op must be >= 1. Received: inter_op={inter_op}")
    if digits_epochs < 0:
        raise ValueError(f"--digits_epochs must be >= 0 (0: accuracy not measured). "
                         f"Received: digits_epochs={digits_epochs}")
    if digits_epochs and "mlp" not in models:
        raise ValueError(f"--digits_epochs trains the mlp model's layers on digits, so --models "
                         f"must include mlp. Received: --models={','.join(models)} "
                         f"--digits_epochs={digits_epochs}")


# --- worker (inside a node's namespace) ----------------------------------------------------


def _mlp(keras, input_shape, classes: int):
    """The `mlp` model's layers: Dense 1024-1024-512 (relu), then `classes` logits."""
    return keras.Sequential([keras.Input(input_shape)] + [
        keras.layers.Dense(w, activation="relu") for w in (1024, 1024, 512)] + [
        keras.layers.Dense(classes)])


def _model_and_data(name: str, workers: int, keras, np, tf):
    """(model, dataset of global batches, global batch, compile kwargs)."""
    rng = np.random.default_rng(0)
    batch = PER_WORKER_BATCH * workers
    if name == "bert":
        return _bert_and_data(workers, keras, np, tf)
    if name == "mlp":  # 784-1024-1024-512-10: 2.4 M parameters, 9.5 MB of gradients
        shape = (784,)
        model = _mlp(keras, shape, 10)
        optimizer = keras.optimizers.Adam(1e-4)
    else:  # conv: 4 x Conv2D(32) on 32x32x16, 0.13 MB of gradients
        shape = (32, 32, 16)
        model = keras.Sequential([keras.Input(shape)] + [
            keras.layers.Conv2D(32, 3, padding="same", activation="relu") for _ in range(4)] + [
            keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(10)])
        optimizer = keras.optimizers.SGD(0.01)
    x = rng.standard_normal((batch * 4, *shape)).astype("float32")
    y = rng.integers(0, 10, size=len(x)).astype("int32")
    ds = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(batch)
    return model, ds, batch, {
        "optimizer": optimizer,
        "loss": keras.losses.SparseCategoricalCrossentropy(from_logits=True)}


def _bert_and_data(workers: int, keras, np, tf):
    """A KerasHub BertTextClassifier (10 classes) built from `BERT`, on synthetic token ids.

    As the KerasHub guides fine-tune one, with the preprocessing done ahead (token ids,
    segment ids and padding mask as the backbone takes them) and the task's own compile
    defaults except the learning rate.
    """
    import keras_hub

    batch = BERT_PER_WORKER_BATCH * workers
    length = BERT["max_sequence_length"]
    backbone = keras_hub.models.BertBackbone(**BERT)
    model = keras_hub.models.BertTextClassifier(backbone, num_classes=10, preprocessor=None,
                                                dropout=0.0)
    rng = np.random.default_rng(0)
    x = {"token_ids": rng.integers(5, BERT["vocabulary_size"],
                                   size=(batch * 4, length)).astype("int32"),
         "segment_ids": np.zeros((batch * 4, length), "int32"),
         "padding_mask": np.ones((batch * 4, length), "bool")}
    y = rng.integers(0, 10, size=batch * 4).astype("int32")
    ds = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(batch)
    return model, ds, batch, {"optimizer": keras.optimizers.Adam(5e-5)}


def _digits_accuracy(epochs: int, workers: int, keras, np, tf) -> dict:
    """Held-out digits accuracy of the MLP's layers after `epochs` (inside the strategy scope).

    The training images are shuffled with a fixed seed and cut into global batches of
    PER_WORKER_BATCH per worker; the strategy shards them as it does any dataset.
    The wire per step of the fit is this worker's TCP bytes sent over its steps.
    """
    from experiments.bench_comm import tcp_bytes_by_socket, tcp_bytes_sent_since
    from models.datasets import load_dataset

    data = load_dataset("digits")
    flat = [a.reshape(len(a), -1) for a in (data.x_train, data.x_test)]
    batch = PER_WORKER_BATCH * workers
    steps = -(-len(flat[0]) // batch) * epochs  # the decay's length
    keras.utils.set_random_seed(0)
    model = _mlp(keras, flat[0].shape[1:], data.num_classes)
    model.compile(optimizer=keras.optimizers.Adam(
        keras.optimizers.schedules.CosineDecay(DIGITS_LEARNING_RATE, steps)),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"])
    train = tf.data.Dataset.from_tensor_slices((flat[0], data.y_train)).shuffle(
        len(flat[0]), seed=0).batch(batch)
    test = tf.data.Dataset.from_tensor_slices((flat[1], data.y_test)).batch(batch)
    ran, epoch_ends = [], []
    counter = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda i, logs: ran.append(time.perf_counter()),
        on_epoch_end=lambda e, logs: epoch_ends.append(time.perf_counter()))
    sent_before = tcp_bytes_by_socket(None)
    start = time.perf_counter()
    model.fit(train, epochs=epochs, verbose=0, callbacks=[counter])
    seconds = time.perf_counter() - start
    sent = tcp_bytes_sent_since(sent_before, None)
    accuracy = model.evaluate(test, verbose=0, return_dict=True)["accuracy"]
    return {"digits_accuracy": float(accuracy), "digits_seconds": seconds,
            "digits_steps": len(ran), "digits_epochs": epochs, "digits_batch": batch,
            "digits_test_size": len(flat[1]),
            "digits_wire_bytes_per_step": sent / max(1, len(ran)),
            "digits_epoch_seconds": [float(x) for x in np.diff([start] + epoch_ends)],
            "digits_step_seconds": statistics.median(np.diff(ran)) if len(ran) > 1 else 0.0}


def _worker(config: dict, out: str) -> None:
    import numpy as np

    import tfdist
    from tfdist.comm import buckets
    from experiments.bench_comm import (_pin, compute_and_exchange_seconds, step_timer,
                                        tcp_bytes_by_socket, tcp_bytes_sent_since)

    task_id = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    core = _pin(task_id)
    tfdist.configure_threads(intra_op=1, inter_op=config.get("inter_op", 1))
    tf = tfdist._tf.import_tensorflow()
    import keras

    strategy = tfdist.make_strategy("multi_worker_mirrored", join_timeout=300,
                                    **config["options"])
    workers = strategy.num_replicas_in_sync
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model, ds, batch, compile_args = _model_and_data(config["model"], workers, keras, np, tf)
        model.compile(**compile_args)
    # Text inputs leave the sequence length unknown: every BERT input is (sequence,).
    shapes = ([(BERT["max_sequence_length"],)] * len(model.inputs) if config["model"] == "bert"
              else None)
    stats = tfdist.model_stats(model, input_shapes=shapes)
    sparse = {g.index: g for g in stats.sparse_gradients}

    time_steps = step_timer(keras, model, ds)

    steps = config["steps"]
    model.fit(ds, epochs=1, steps_per_epoch=3, verbose=0)  # trace, warm up
    sent_before = tcp_bytes_by_socket(None)  # every socket of this node's namespace
    step = time_steps(steps)
    sent = tcp_bytes_sent_since(sent_before, None) / (steps + 1)
    result = {"workers": workers, "step_seconds": step, "samples_per_second": batch / step,
              "wire_bytes_per_step": sent, "core": core, "global_batch": batch,
              "params": int(model.count_params()),
              "shapes": [list(v.shape) for i, v in enumerate(model.trainable_variables)
                         if i not in sparse],
              "layers": [buckets.layer_of(v) for i, v in enumerate(model.trainable_variables)
                         if i not in sparse],
              "sparse": [dataclasses.asdict(g) for g in sparse.values()],
              "bucket_bytes": config["options"].get("bucket_bytes", 0),
              "inter_op": config.get("inter_op", 1)}
    result["train_flops"] = stats.train_flops_per_example * (batch // workers)
    result["stream_bytes_per_second"] = stream_rate(tf, result["params"])
    result["compute_seconds"], result["comm_seconds"] = compute_and_exchange_seconds(
        tf, strategy, model, ds, time_steps, steps=steps, exchange_repeats=max(3, steps // 2),
        sparse_rows={i: g.rows_per_example * (batch // workers) for i, g in sparse.items()})
    if config.get("calibrate"):
        result["calibration"] = _calibrate(tf, strategy, config["calibrate"])
    if config.get("digits_epochs"):
        with strategy.scope():
            result.update(_digits_accuracy(config["digits_epochs"], workers, keras, np, tf))
    if task_id == 0:
        with open(out, "w") as f:
            json.dump(result, f)


def stream_rate(tf, numbers: int, repeats: int = 9) -> float:
    """Bytes/s of `a + b` over float32 tensors of `numbers` elements: read 2, write 1.

    The median of `repeats` runs of one tf.function on this worker's thread: the
    memory rate PowerSGD's rank-r products and error feedback run at.
    """
    a = tf.random.uniform([numbers])
    b = tf.random.uniform([numbers])
    add = tf.function(lambda x, y: tf.reduce_sum(x + y))
    add(a, b).numpy()
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        add(a, b).numpy()
        seconds.append(time.perf_counter() - start)
    # reduce_sum reads the sum once more: 4 passes of 4 bytes per number
    return 4 * 4 * numbers / statistics.median(seconds)


def _calibrate(tf, strategy, repeats: int) -> list[list[float]]:
    """[[bytes, median seconds]] of one float32 all-reduce of each CALIBRATION_SIZES size."""
    def make(elements: int):
        @tf.function
        def step():
            def replica_fn():
                value = tf.ones([elements], tf.float32)
                return tf.distribute.get_replica_context().all_reduce("SUM", value)[0]

            return strategy.experimental_local_results(strategy.run(replica_fn))[0]

        return step

    barrier = make(1)
    steps = {size: make(size // 4) for size in CALIBRATION_SIZES}
    for step in [barrier, *steps.values()]:
        step().numpy()  # trace, warm the collective's buffers
    seconds = {size: [] for size in steps}
    for _ in range(repeats):  # sizes interleaved: load drift hits all alike
        for size, step in steps.items():
            barrier().numpy()  # every worker starts the timed all-reduce together
            start = time.perf_counter()
            step().numpy()
            seconds[size].append(time.perf_counter() - start)
    return [[size, statistics.median(values)] for size, values in seconds.items()]


# --- parent (no TensorFlow) ----------------------------------------------------------------


def _run_workers(lab, config: dict, port: int) -> dict:
    """One worker per node, fresh processes; worker 0's result. The processes end here."""
    from experiments.netlab import run_workers

    return run_workers(lab, ["-m", "experiments.bench_cluster", f"--role={json.dumps(config)}"],
                       nodes=lab.nodes, port=port, timeout=WORKER_TIMEOUT,
                       label=f"bench_cluster ({lab.nodes} nodes, {config['model']}, "
                             f"{config['method']})")


def flop_rate(result: dict) -> float:
    """FLOP/s the worker reached: training FLOPs per worker batch / compute-only step.

    A result without `train_flops` (written before it was recorded) gets the
    cost model's default, 100 GFLOP/s.
    """
    if not result.get("train_flops") or result["compute_seconds"] <= 0:
        return 100e9
    return result["train_flops"] / result["compute_seconds"]


def _predict(result: dict, method: str, nodes: int, link) -> dict:
    """The planner's costs for the dense gradients, plus the sparse ones' all-gather."""
    from tfdist import planning

    sparse = [planning.SparseGradient(**g) for g in result.get("sparse", [])]
    extra, extra_sent = planning.sparse_exchange(
        sparse, per_replica_batch_size=result["global_batch"] // nodes, num_replicas=nodes,
        link=link) if sparse else (0.0, 0.0)
    kwargs = dict(shapes=[tuple(s) for s in result["shapes"]], num_replicas=nodes, link=link,
                  compute_seconds=result["compute_seconds"] + extra, rank=POWERSGD_RANK,
                  bucket_bytes=result.get("bucket_bytes", 0),
                  flops_per_second=flop_rate(result),
                  bytes_per_second=result.get("stream_bytes_per_second"),
                  layers=result.get("layers"))
    by_method = {c.compression: c for c in planning.candidates(**kwargs)}
    choice, reason = planning.recommend(**kwargs)
    predicted = by_method[METHODS[method].get("gradient_compression", "none")]
    return {"predicted_step": predicted.step_seconds,
            "predicted_wire": planning.ring_allreduce_bytes_per_rank(predicted.wire_bytes, nodes)
            + extra_sent,
            "predicted_comm": predicted.comm_seconds + predicted.compute_seconds + extra,
            "flops_per_second": kwargs["flops_per_second"],
            "bytes_per_second": kwargs["bytes_per_second"], "recommendation": choice,
            "reason": reason}


def hidden_share(r: dict) -> float:
    """(compute + exchange - step) / exchange, clipped to [0, 1]."""
    if r["comm_seconds"] <= 0:
        return 0.0
    return max(0.0, min(1.0, (r["compute_seconds"] + r["comm_seconds"] - r["step_seconds"])
                        / r["comm_seconds"]))


def _method_of(compression: str, measured: dict) -> str | None:
    """The measured method that runs `compression` without buckets, if one was measured."""
    return next((m for m in measured if "bucket_bytes" not in METHODS[m]
                 and METHODS[m].get("gradient_compression", "none") == compression), None)


def config_name(nodes: int, rate: float, model: str, method: str) -> str:
    """A configuration's row prefix (experiments.plots reads the rows back by it)."""
    return f"cluster/{nodes} nodes/{rate:g} Gbit/s-eq/{model}/{method}"


def run(nodes, rates, models, methods, *, steps: int, bucket_bytes: int = BUCKET_BYTES,
        rounds: int = 1, digits_epochs: int = 0, inter_op: int = 1, log=print,
        on_lab=None) -> list[dict]:
    """Rows per configuration and the targets (see the module docstring).

    With rounds > 1, every (model, method) of a lab and rate runs once per round, the
    order rotated from round to round, and each configuration keeps its median-step
    round's result (so its compute, exchange and wire figures are from the same run).
    A configuration whose workers fail gets a "failed" row with their last output; the
    others are still measured.

    With `digits_epochs`, each `mlp` configuration's first round also trains digits and
    its row reports that accuracy (kept whichever round's step is the median).

    `on_lab(lab)` is called once each lab's namespaces exist (tests read their identities).
    """
    from experiments.netlab import NetLab
    from experiments.rows import row
    from tfdist import planning

    check_arguments(nodes, rates, models, methods, steps, bucket_bytes, rounds, digits_epochs,
                    inter_op)
    measured: dict[tuple, list[dict]] = {}
    accuracy: dict[tuple, dict] = {}
    failed: dict[tuple, str] = {}
    links: dict[tuple, dict] = {}
    loads = [os.getloadavg()[0]]
    port = 47100
    configs = [(model, method) for model in models for method in methods]
    for n in nodes:
        with NetLab(n) as lab:
            if on_lab is not None:
                on_lab(lab)
            for rate in rates:
                lab.set_rate(rate * 1e9 * RATE_SCALE)
                probe = lab.probe(pings=50, total_bytes=int(min(16 << 20,
                                                                rate * 1e9 * RATE_SCALE / 16)))
                link = None
                for r, model, method in _interleaved(configs, rounds):
                    key = (n, rate, model, method)
                    if key in failed:
                        continue
                    port += 1  # a fresh port: the last run's may still be in TIME_WAIT
                    config = _config(model, method, r, steps=steps, inter_op=inter_op,
                                     bucket_bytes=bucket_bytes, digits_epochs=digits_epochs,
                                     calibrate=link is None)
                    try:
                        result = _run_workers(lab, config, port)
                    except RuntimeError as e:  # the other configurations still run
                        failed[key] = f"round {r + 1}/{rounds}: {e}" if rounds > 1 else str(e)
                        log(f"  {model} {method}: {e}")
                        continue
                    if link is None:
                        points = result["calibration"]
                        link = planning.fit_alpha_beta(points, n)
                        links[(n, rate)] = {"probe": probe, "points": points, "link": link}
                        log(_link_line(n, rate, probe, link, points))
                    result.update(_predict(result, method, n, link))
                    measured.setdefault(key, []).append(result)
                    if "digits_accuracy" in result:
                        accuracy[key] = {k: v for k, v in result.items()
                                         if k.startswith("digits_")}
                        log(_digits_line(model, method, result))
                    loads.append(os.getloadavg()[0])
                    log(_round_line(r, rounds, model, method, result))
    load = (f"load average {min(loads):.1f}-{max(loads):.1f} on {os.cpu_count()} cores")
    return [row(f"cluster/{n} nodes/{rate:g} Gbit/s-eq/{model}/{method}: failed", float("nan"),
                "-", error) for (n, rate, model, method), error in failed.items()
            ] + _rows(_median_rounds(measured, accuracy), links, load, steps, bucket_bytes, row,
                      rounds)


def _interleaved(configs: list, rounds: int):
    """(round, model, method) for every round of every configuration, the order rotated by
    one configuration from round to round."""
    for r in range(rounds):
        shift = r % len(configs)
        for model, method in configs[shift:] + configs[:shift]:
            yield r, model, method


def _config(model: str, method: str, r: int, *, steps: int, inter_op: int, bucket_bytes: int,
            digits_epochs: int, calibrate: bool) -> dict:
    """What the workers of one configuration's round are told (`_run_workers`)."""
    options = dict(METHODS[method])
    if "bucket_bytes" in options:
        options["bucket_bytes"] = bucket_bytes
    return {"model": model, "method": method, "options": options, "steps": steps,
            "inter_op": inter_op, "calibrate": max(3, steps // 2) if calibrate else 0,
            # digits once per mlp configuration, in its first round
            "digits_epochs": digits_epochs if model == "mlp" and r == 0 else 0}


def _median_rounds(measured: dict, accuracy: dict) -> dict:
    """Each configuration's median-step round, with its digits accuracy and every round's
    step and hidden share."""
    kept = {}
    for key, rounds in measured.items():
        result = sorted(rounds, key=lambda x: x["step_seconds"])[(len(rounds) - 1) // 2]
        result.update(accuracy.get(key, {}))
        result["round_steps"] = [x["step_seconds"] for x in rounds]
        result["round_hidden"] = [(hidden_share(x), x["compute_seconds"], x["comm_seconds"])
                                  for x in rounds]
        kept[key] = result
    return kept


def _link_line(n: int, rate: float, probe: dict, link, points) -> str:
    return (f"{n} nodes, {rate:g} Gbit/s-eq ({rate * RATE_SCALE * 1e3:g} "
            f"Mbit/s): one TCP stream {probe['bytes_per_second'] * 8 / 1e6:.0f}"
            f" Mbit/s, RTT {probe['rtt_seconds'] * 1e6:.0f} us; all-reduce "
            f"alpha {link.latency * 1e3:.2f} ms, "
            f"{link.bandwidth / 1e6:.2f} MB/s (all-reduce "
            + ", ".join(f"{size >> 10} KiB {seconds * 1e3:.2f} ms"
                        for size, seconds in points) + ")")


def _digits_line(model: str, method: str, result: dict) -> str:
    return (f"  {model} {method}: digits accuracy {result['digits_accuracy']:.4f} after "
            f"{result['digits_epochs']} epochs ({result['digits_steps']} steps, "
            f"{result['digits_seconds']:.1f} s: epochs "
            + ", ".join(f"{x:.1f}" for x in result["digits_epoch_seconds"])
            + f" s, median step {result['digits_step_seconds'] * 1e3:.0f} ms; wire "
            f"{result['digits_wire_bytes_per_step'] / 1e6:.3f} MB/step)")


def _round_line(r: int, rounds: int, model: str, method: str, result: dict) -> str:
    return (f"  round {r + 1}/{rounds} {model} {method}: step "
            f"{result['step_seconds'] * 1e3:.1f} ms "
            f"(predicted {result['predicted_step'] * 1e3:.1f}), compute "
            f"{result['compute_seconds'] * 1e3:.1f} ms, exchange "
            f"{result['comm_seconds'] * 1e3:.1f} ms, wire "
            f"{result['wire_bytes_per_step'] / 1e6:.3f} MB, hidden "
            f"{hidden_share(result):.2f}")


def _rows(measured: dict, links: dict, load: str, steps: int, bucket_bytes: int,
          row, rounds: int = 1) -> list[dict]:
    rows = []
    for (n, rate, model, method), r in measured.items():
        lk = links[(n, rate)]
        group = {k[3]: v for k, v in measured.items() if k[:3] == (n, rate, model)}
        fastest = min(group, key=lambda m: group[m]["step_seconds"])
        name = config_name(n, rate, model, method)
        setup = (f"{n} nodes x 1 worker (1 intra + {r.get('inter_op', 1)} inter-op thread"
                 f"{'s' if r.get('inter_op', 1) > 1 else ''}, pinned to core k mod "
                 f"{os.cpu_count()}), {r['params']:,} params, global batch {r['global_batch']}; "
                 f"link {rate * RATE_SCALE * 1e3:g} Mbit/s each way (tc HTB, {rate:g} Gbit/s x "
                 f"{RATE_SCALE:g}; one TCP stream {lk['probe']['bytes_per_second'] * 8 / 1e6:.0f}"
                 f" Mbit/s, RTT {lk['probe']['rtt_seconds'] * 1e6:.0f} us; all-reduce alpha "
                 f"{lk['link'].latency * 1e3:.2f} ms, {lk['link'].bandwidth / 1e6:.2f} MB/s); "
                 f"median of {steps} steps"
                 + (f", the median of {rounds} interleaved rounds (steps "
                    + ", ".join(f"{x * 1e3:.1f}" for x in r["round_steps"]) + " ms)"
                    if rounds > 1 else "") + f"; {load}")
        rows.append(row(f"{name}: step", r["step_seconds"] * 1e3, "ms",
                        f"{r['samples_per_second']:,.0f} samples/s; compute-only "
                        f"{r['compute_seconds'] * 1e3:.1f} ms, exchange alone "
                        f"{r['comm_seconds'] * 1e3:.1f} ms; fastest measured here: {fastest}; "
                        + setup))
        rows.append(row(f"{name}: wire", r["wire_bytes_per_step"] / 1e6, "MB/step",
                        "worker 0's TCP bytes_sent per step (ss -ti, heartbeats included); "
                        "alpha-beta: a ring all-reduce"
                        + (" and the sparse gradients' all-gathers" if r.get("sparse") else "")
                        + f" send {r['predicted_wire'] / 1e6:.3f} MB per rank"))
        rows.append(row(f"{name}: hidden", hidden_share(r), "fraction",
                        "(compute + exchange - step) / exchange"
                        + ("; by round: " + ", ".join(
                            f"{h:.2f} (compute {c * 1e3:.1f}, exchange {e * 1e3:.1f} ms)"
                            for h, c, e in r["round_hidden"]) if rounds > 1 else "")))
        rows.append(row(f"{name}: predicted/measured", r["predicted_step"] / r["step_seconds"],
                        "x", f"planner predicts {r['predicted_step'] * 1e3:.1f} ms (compute "
                        f"{r['compute_seconds'] * 1e3:.1f} + exchange "
                        f"{r['predicted_comm'] * 1e3:.1f} ms, no overlap"
                        + (f", buckets of {bucket_bytes} bytes: the latency once per bucket"
                           if "bucket_bytes" in METHODS[method] else "")
                        + (f"; its own compute at {r['flops_per_second'] / 1e9:.0f} GFLOP/s"
                           + (f", {r['bytes_per_second'] / 1e9:.1f} GB/s"
                              if r.get("bytes_per_second") else "")
                           if method == "powersgd" and "flops_per_second" in r else "")
                        + f"); recommends {r['recommendation']}: {r['reason']}"))
        if "digits_accuracy" in r:
            rows.append(row(f"{name}: digits accuracy", r["digits_accuracy"], "fraction",
                            f"held-out accuracy ({r['digits_test_size']} images) after "
                            f"{r['digits_epochs']} epochs ({r['digits_steps']} steps of global "
                            f"batch {r['digits_batch']}) of 64-1024-1024-512-10 on digits, Adam "
                            f"{DIGITS_LEARNING_RATE:g} cosine-decayed to 0, seed 0, this method "
                            f"and link; the fit took {r['digits_seconds']:.1f} s (epochs "
                            + ", ".join(f"{x:.1f}" for x in r["digits_epoch_seconds"])
                            + f" s; median step {r['digits_step_seconds'] * 1e3:.0f} ms), "
                            f"worker 0 sending {r['digits_wire_bytes_per_step'] / 1e6:.3f} MB "
                            f"per step"))
    rows += _target_rows(measured, row, bucket_bytes)
    return rows


def _target_rows(measured: dict, row, bucket_bytes: int = BUCKET_BYTES) -> list[dict]:
    rows = []
    for (n, rate, model, method), r in measured.items():
        if rate != 1:
            continue
        where = f"{model}, {n} nodes, 1 Gbit/s-eq"
        plain = measured.get((n, rate, model, "none"))
        if method == "powersgd" and plain:
            rows.append(row(f"cluster target: powersgd / none step rate, {where}",
                            plain["step_seconds"] / r["step_seconds"], "x",
                            f"none {plain['step_seconds'] * 1e3:.1f} ms, powersgd "
                            f"{r['step_seconds'] * 1e3:.1f} ms per step, same link",
                            target=POWERSGD_SPEEDUP_TARGET))
        if method == "buckets":
            rows.append(row(f"cluster target: exchange hidden with buckets, {where}",
                            hidden_share(r), "fraction",
                            f"step {r['step_seconds'] * 1e3:.1f}, compute-only "
                            f"{r['compute_seconds'] * 1e3:.1f}, exchange alone "
                            f"{r['comm_seconds'] * 1e3:.1f} ms; bucket_bytes {bucket_bytes}",
                            target=HIDDEN_TARGET))
    for (n, rate, model, method), r in measured.items():
        plain = measured.get((n, rate, model, "none"))
        if method == "none" or "digits_accuracy" not in r or "digits_accuracy" not in (
                plain or {}):
            continue
        points = (r["digits_accuracy"] - plain["digits_accuracy"]) * 100
        met = abs(points) <= ACCURACY_TOLERANCE * 100 + 1e-9
        rows.append(row(f"cluster target: {method} digits accuracy - none's, {model}, {n} nodes, "
                        f"{rate:g} Gbit/s-eq", points, "points",
                        f"none {plain['digits_accuracy']:.4f}, {method} "
                        f"{r['digits_accuracy']:.4f} after {r['digits_epochs']} epochs; equal "
                        f"within +-{ACCURACY_TOLERANCE * 100:g} points: "
                        + ("met" if met else "missed")))
    if measured:
        errors = {k: r["predicted_step"] / r["step_seconds"] - 1 for k, r in measured.items()}
        within = sum(abs(e) <= PREDICTION_TOLERANCE for e in errors.values())
        worst = max(errors, key=lambda k: abs(errors[k]))
        rows.append(row("cluster target: configurations predicted within +-30%",
                        within / len(errors), "fraction",
                        f"{within}/{len(errors)}; worst {'/'.join(map(str, worst))} "
                        f"{errors[worst]:+.0%}", target=1.0))
    for group in sorted({k[:3] for k in measured}):
        same = {k[3]: v for k, v in measured.items() if k[:3] == group}
        best = min(same, key=lambda m: same[m]["step_seconds"])
        rec = next(iter(same.values()))["recommendation"]
        chosen = _method_of(rec, same)
        where = f"{group[2]}, {group[0]} nodes, {group[1]:g} Gbit/s-eq"
        if chosen is None:
            rows.append(row(f"cluster target: recommendation fastest or within 10%, {where}",
                            float("nan"), "-", f"the planner recommends {rec}, not measured"))
            continue
        ratio = same[chosen]["step_seconds"] / same[best]["step_seconds"]
        rows.append(row(f"cluster target: recommendation fastest or within 10%, {where}",
                        ratio, "x of fastest",
                        f"recommends {rec} ({same[chosen]['step_seconds'] * 1e3:.1f} ms), fastest "
                        f"measured {best} ({same[best]['step_seconds'] * 1e3:.1f} ms): "
                        + ("met" if ratio <= 1 + RECOMMENDATION_TOLERANCE else "missed")))
    return rows


def main(argv):
    del argv
    if FLAGS.role:
        return _worker(json.loads(FLAGS.role), FLAGS.worker_out)
    from experiments.netlab import NetLab
    from experiments.rows import print_rows, write_rows

    nodes = [int(n) for n in FLAGS.nodes]
    rates = [float(r) for r in FLAGS.rates]
    check_arguments(nodes, rates, FLAGS.models, FLAGS.methods, FLAGS.steps, FLAGS.bucket_bytes,
                    FLAGS.rounds, FLAGS.digits_epochs, FLAGS.inter_op)
    problem = NetLab.available()
    if problem:
        print(f"bench_cluster: cannot build the simulated nodes here: {problem}", file=sys.stderr)
        return 1
    rows = run(nodes, rates, FLAGS.models, FLAGS.methods, steps=FLAGS.steps,
               bucket_bytes=FLAGS.bucket_bytes, rounds=FLAGS.rounds,
               digits_epochs=FLAGS.digits_epochs, inter_op=FLAGS.inter_op)
    print_rows(rows)
    if FLAGS.out:
        write_rows(FLAGS.out, rows, command="python -m experiments.bench_cluster " + " ".join(
            sys.argv[1:]), rate_scale=RATE_SCALE)
    return 0


if __name__ == "__main__":
    _define_flags()
    app.run(main)

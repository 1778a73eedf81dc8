"""KerasHub tasks under tfdist's synchronous presets against one device, in one fresh process.

    python tests/programs/kerashub/run_tasks.py CASE [CASE ...] --out OUT.json [--reference REF]
    tfdist launch --num_workers=2 -- python tests/programs/kerashub/run_tasks.py \
        --worker multi_worker_mirrored:none --tasks gpt2_lora --out PREFIX

CASE is TASK:SHARD (tasks.TASKS; SHARD none / gradients / parameters) on
`mirrored` with 2 logical CPUs, optionally followed by +generate, +lora
(save_lora_weights, reload into one device and into a fresh sharded model),
+export (model.export served against predict; with the export fixes taken out,
the old refusal). For each case, the same task is fine-tuned on one device
(OneDeviceStrategy, the same seed and initial weights, GLOBAL_BATCH, Adam on
summed duplicate sparse gradients: what every data-parallel replica set sums,
docs/numerics.md) and under the preset; a row then holds

- diff: max |w - w_one_device| over every weight (frozen and trained);
- moved: max |w - w_initial| (it trained);
- replicas_identical: every replicated variable equal on both replicas;
- sharded / weights: weights stored as shards / all weights;
- with LoRA: adapters (trainable weights), adapters_moved, base_frozen_change
  (max |w - w_initial| over the frozen weights; 0.0 expected) and base_sharded.

`--reference REF` also writes the one-device weights of each task to
REF.TASK.npz (what the two-worker runs are compared with). `--worker` is one
task of a `tfdist launch` job: it fine-tunes each task under the multi-worker
preset and writes PREFIX.TASK.workerN.npz. Prints `ROW {json}` per case.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))
sys.path.insert(0, ROOT)

NUM_REPLICAS = 2


def _max_diff(a, b) -> float:
    import numpy as np

    assert len(a) == len(b), (len(a), len(b))
    return max((float(np.max(np.abs(np.asarray(x, "float64") - np.asarray(y, "float64"))))
                for x, y in zip(a, b) if np.size(x)), default=0.0)


def _train(task, strategy, initial=None, *, summed=False, seed=0):
    """The task built and compiled under `strategy.scope()`, fine-tuned as its guide does."""
    import tfdist

    with strategy.scope():
        model = task.build(seed=seed)
        if initial is not None:
            model.set_weights(initial)
        optimizer = None
        if summed:
            import keras

            optimizer = tfdist.sum_duplicate_sparse_gradients(keras.optimizers.Adam(5e-3))
        task.compile(model, optimizer)
    before = [w.copy() for w in model.get_weights()]
    # The data pipeline's random draws (BertMaskedLM's masks) follow the global seed.
    import keras

    keras.utils.set_random_seed(seed + 1)
    task.fit(model)
    return model, before


def _replicas_identical(model) -> bool:
    import numpy as np

    from tfdist.compat.sharding_variables import sharded_storage

    strategy = model.distribute_strategy
    for variable in list(model.weights) + list(model.optimizer.variables):
        if sharded_storage(variable) is not None:
            continue  # one copy of each shard exists
        copies = [np.asarray(c.numpy())
                  for c in strategy.experimental_local_results(variable.value)]
        if any(not np.array_equal(copies[0], c) for c in copies[1:]):
            return False
    return True


def _is_sharded(variable) -> bool:
    from tfdist.compat.sharding_variables import sharded_storage

    return sharded_storage(variable) is not None


def _lora_row(model, before) -> dict:
    weights = model.weights
    ids = {id(v) for v in model.trainable_weights}
    adapters = [i for i, v in enumerate(weights) if id(v) in ids]
    frozen = [i for i, v in enumerate(weights) if id(v) not in ids]
    after = model.get_weights()
    return {
        "adapters": len(adapters),
        "adapter_names": sorted({weights[i].name for i in adapters}),
        "adapters_moved": _max_diff([after[i] for i in adapters], [before[i] for i in adapters]),
        "base_frozen_change": _max_diff([after[i] for i in frozen], [before[i] for i in frozen]),
        "base_sharded": sum(_is_sharded(weights[i]) for i in frozen),
        "frozen": len(frozen),
    }


def _generate(model, task) -> list:
    """Greedy generation to the full length (no stop token), decoded."""
    from tests.programs.kerashub import tasks

    return [str(s) for s in model.generate(list(task.prompts), max_length=tasks.SEQ,
                                           stop_token_ids=None)]


def _lora_reload(model, task) -> dict:
    """save_lora_weights after training; load into a fresh one-device and a fresh sharded model.

    The file holds the adapters (lora_kernel_a/b) only; KerasHub's enable_lora
    also trains the adapted layers' biases, which it does not save.
    """
    import tensorflow as tf

    import tfdist

    path = os.path.join(tempfile.mkdtemp(), "adapters.lora.h5")
    model.backbone.save_lora_weights(path)
    row = {}
    targets = {"one_device": tf.distribute.OneDeviceStrategy("/cpu:0"),
               "sharded": tfdist.make_strategy("mirrored", num_devices=NUM_REPLICAS,
                                               shard="parameters", shard_min_bytes=0)}
    def adapters(m):  # in the backbone's own order (save/load_lora_weights index by it)
        return [v.numpy() for v in m.weights if v.name.startswith("lora_kernel")]

    trained = adapters(model)
    for name, strategy in targets.items():
        with strategy.scope():
            fresh = task.build(seed=0)  # the same base weights; LoRA enabled, adapters fresh
            task.compile(fresh)
            fresh.backbone.load_lora_weights(path)
        loaded = adapters(fresh)
        row[f"reload_{name}_adapters"] = len(loaded)
        row[f"reload_{name}_diff"] = _max_diff(loaded, trained)
        if task.prompts is not None:
            row[f"reload_{name}_generate"] = _generate(fresh, task)
    return row


def _served_inputs(model, inputs):
    """What the exported `serve` takes: the preprocessed inputs (images as they are)."""
    import tensorflow as tf

    if model.preprocessor is None:
        return tf.constant(inputs)
    x = model.preprocessor(inputs)
    if isinstance(x, tuple):  # language models: (x, y, sample_weight)
        x = x[0]
    if not isinstance(x, dict):
        return x
    # The served signature is the backbone's inputs: padding masks as int32 (the
    # preprocessor makes them bool; the model casts them itself).
    return {k: tf.cast(v, "int32") if v.dtype == tf.bool else v for k, v in x.items()}


def _export(model, task) -> dict:
    """model.export after training, served next to model.predict; the old refusal as control."""
    import numpy as np
    import tensorflow as tf

    from tfdist.compat import _patch, sharding_variables

    texts = task.x()[:8]
    x = _served_inputs(model, texts)
    directory = tempfile.mkdtemp()
    model.export(os.path.join(directory, "served"), verbose=False)
    served = tf.saved_model.load(os.path.join(directory, "served"))  # kept alive while used
    outputs = served.serve(x).numpy()
    predicted = model.predict(texts, batch_size=8, verbose=0)
    row = {"export_vs_predict": float(np.max(np.abs(outputs - predicted))),
           "export_shape": list(outputs.shape)}
    # Negative control: without the export fixes a sharded model cannot be exported.
    fixes = [sharding_variables.SAVE_FIX.name, sharding_variables.WRITE_OUT_FIX.name]
    if any(_is_sharded(v) for v in model.weights):
        _patch.uninstall(fixes)
        try:
            model.export(os.path.join(directory, "unfixed"), verbose=False)
            row["export_unfixed"] = "exported"
        except Exception as e:  # noqa: BLE001 - the control records what came out
            row["export_unfixed"] = f"{type(e).__name__}: {e}"
        finally:
            for fix in (sharding_variables.SAVE_FIX, sharding_variables.WRITE_OUT_FIX):
                _patch.install(fix)
    row["plain_export_vs_predict"] = _plain_export(directory)
    return row


def _plain_export(directory: str) -> float:
    """A plain Keras model exported in this process (sharded variables exist): as stock."""
    import keras
    import numpy as np
    import tensorflow as tf

    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    x = np.random.default_rng(0).standard_normal((5, 4)).astype("float32")
    model.export(os.path.join(directory, "plain"), verbose=False)
    served = tf.saved_model.load(os.path.join(directory, "plain"))
    return float(np.max(np.abs(served.serve(x).numpy() - model.predict(x, verbose=0))))


def run_case(spec: str, references: dict, reference_prefix: str | None) -> dict:
    import numpy as np
    import tensorflow as tf

    import tfdist
    from tests.programs.kerashub import tasks

    head, *extras = spec.split("+")
    name, shard = head.split(":")
    task = tasks.TASKS[name]
    if name not in references:
        started = time.perf_counter()
        one, initial = _train(task, tf.distribute.OneDeviceStrategy("/cpu:0"), summed=True)
        references[name] = {"model": one, "initial": initial, "weights": one.get_weights(),
                            "seconds": time.perf_counter() - started}
        if task.prompts is not None:
            references[name]["generate"] = _generate(one, task)
        if reference_prefix:
            np.savez(f"{reference_prefix}.{name}.npz", *references[name]["weights"])
    reference = references[name]
    options = {"sync_batch_norm": True} if name == "resnet_classifier" else {}
    strategy = tfdist.make_strategy("mirrored", num_devices=NUM_REPLICAS, shard=shard,
                                    shard_min_bytes=0, **options)
    started = time.perf_counter()
    model, before = _train(task, strategy, reference["initial"])
    row = {"case": spec, "task": name, "shard": shard,
           "seconds": round(time.perf_counter() - started, 1),
           "one_device_seconds": round(reference["seconds"], 1),
           "diff": _max_diff(model.get_weights(), reference["weights"]),
           "moved": _max_diff(model.get_weights(), before),
           "initial_equal": _max_diff(before, reference["initial"]) == 0.0,
           "replicas_identical": _replicas_identical(model),
           "sharded": sum(_is_sharded(v) for v in model.weights),
           "unsharded": sorted(v.path for v in model.weights if not _is_sharded(v)),
           "weights": len(model.weights)}
    if task.lora:
        row.update(_lora_row(model, before))
    if "generate" in extras:
        row["generate"] = _generate(model, task)
        row["generate_equal"] = row["generate"] == reference["generate"]
    if "lora" in extras:
        row.update(_lora_reload(model, task))
    if "export" in extras:
        row.update(_export(model, task))
    return row


def run_worker(spec: str, task_names: list[str], prefix: str) -> None:
    import numpy as np

    import tfdist
    import tfdist.chief
    from tests.programs.kerashub import tasks

    preset, shard = spec.split(":")
    strategy = tfdist.make_strategy(preset, shard=shard, shard_min_bytes=0)
    worker = tfdist.chief.task_name().replace(":", "")
    for name in task_names:
        task = tasks.TASKS[name]
        model, before = _train(task, strategy)
        # Whole values of sharded weights need every worker's shards: every worker reads.
        weights = model.get_weights()
        row = {"sharded": sum(_is_sharded(v) for v in model.weights)}
        if task.lora:
            row.update(_lora_row(model, before))
        if task.prompts is not None:
            row["generate"] = _generate(model, task)
        np.savez(f"{prefix}.{name}.{worker}.npz", *weights)
        with open(f"{prefix}.{name}.{worker}.json", "w") as f:
            json.dump(row, f)
        if shard == "parameters" and name in EXPORTED_ON_WORKERS:
            _export_on_workers(model, task, f"{prefix}.{name}")
        print(f"{worker} {name} done", flush=True)


EXPORTED_ON_WORKERS = ("gpt2_lora", "bert_classifier")


def _export_on_workers(model, task, prefix: str) -> None:
    """model.export on every worker (gathering the shards is a collective); the chief's file serves.

    tfdist writes the user's path from the chief only (the other workers write
    into their scratch), so the chief compares the SavedModel with predict.
    """
    import numpy as np
    import tensorflow as tf

    import tfdist.chief

    texts = task.x()[:8]
    model.export(f"{prefix}.served", verbose=False)
    predicted = model.predict(texts, batch_size=8, verbose=0)  # a collective too
    if not tfdist.chief.is_chief():
        return
    x = _served_inputs(model, texts)
    served = tf.saved_model.load(f"{prefix}.served")
    outputs = served.serve(x).numpy()
    with open(f"{prefix}.export.json", "w") as f:
        json.dump({"export_vs_predict": float(np.max(np.abs(outputs - predicted)))}, f)


def main(argv) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("cases", nargs="*")
    parser.add_argument("--out", required=True)
    parser.add_argument("--reference")
    parser.add_argument("--worker")
    parser.add_argument("--tasks", default="")
    args = parser.parse_args(argv[1:])
    if args.worker:
        run_worker(args.worker, args.tasks.split(","), args.out)
        return 0
    import tfdist

    tfdist.configure_logical_devices(NUM_REPLICAS)
    references: dict = {}
    rows = []
    for spec in args.cases:
        try:
            row = run_case(spec, references, args.reference)
        except Exception as e:  # noqa: BLE001 - a failing case is a row, the others still run
            row = {"case": spec, "error": f"{type(e).__name__}: {e}",
                   "traceback": traceback.format_exc()[-4000:]}
        print("ROW " + json.dumps({k: v for k, v in row.items() if k != "traceback"}),
              flush=True)
        rows.append(row)
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

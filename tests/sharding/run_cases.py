"""Sharded training cases, run in a fresh process by tests/sharding/test_training.py.

    python tests/sharding/run_cases.py CASE OUT_JSON

CASE is one of:
- mirrored2: 2 logical CPUs. Adam at stages 1-3, SGD+momentum and AdamW at
  stages 2-3, against the single-device run; a BatchNormalization model
  against unsharded mirrored; per-device bytes against tfdist.planning;
  checkpoints both ways; tfdist.BackupAndRestore resume; a custom training
  loop; the bad-input errors.
- mirrored4: 4 logical CPUs: Adam / SGD+momentum / AdamW at stages 1 / 2 / 3;
  host offload with 3 replicas on /cpu:1-3 and the host /cpu:0.
- worker: one task of `tfdist launch --num_workers=2` (stage 3, the three
  optimizers; writes its weights and optimizer state to OUT_JSON.<task>.npz).
- reference: the single-device runs the worker case is compared with.

Every number is written to OUT_JSON; the test asserts on them.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import tempfile

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

VOCAB, SEQ, DIM, CLASSES = 64, 8, 32, 4
GLOBAL_BATCH, STEPS = 24, 20
MIN_BYTES = 4096  # Embedding, Conv1D and the block's Dense kernels are sharded; the rest not
OPTIMIZERS = {
    "adam": lambda keras: keras.optimizers.Adam(1e-2),
    "sgdm": lambda keras: keras.optimizers.SGD(5e-2, momentum=0.9),
    "adamw": lambda keras: keras.optimizers.AdamW(1e-2, weight_decay=0.05),
}


@functools.lru_cache(maxsize=None)
def _layers():
    import keras
    from keras import ops

    class Block(keras.layers.Layer):
        """A custom layer owning only sublayers (nested Dense layers)."""

        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.up = keras.layers.Dense(2 * DIM, activation="relu")
            self.down = keras.layers.Dense(DIM)

        def call(self, x):
            return x + self.down(self.up(x))

    class TiedHead(keras.layers.Layer):
        """Logits from the token embedding's matrix (weights tied, as in LM heads)."""

        def __init__(self, embedding, **kwargs):
            super().__init__(**kwargs)
            self.embedding = embedding

        def call(self, x):
            return ops.matmul(x, ops.transpose(self.embedding.embeddings))

    class Scale(keras.layers.Layer):
        """A custom layer with a weight of its own (not gatherable unless registered)."""

        def build(self, input_shape):
            self.w = self.add_weight(shape=(input_shape[-1], input_shape[-1]),
                                     initializer="identity")

        def call(self, x):
            return ops.matmul(x, self.w)

    return Block, TiedHead, Scale


def build(kind: str = "main"):
    """The test model: embedding (sparse gradients), conv, norm, nested and tied layers."""
    import keras

    Block, TiedHead, Scale = _layers()
    ids = keras.Input((SEQ,), dtype="int32")
    embedding = keras.layers.Embedding(VOCAB, DIM)
    x = embedding(ids)
    x = keras.layers.Conv1D(DIM, 3, padding="same", activation="relu")(x)
    if kind == "batchnorm":  # Keras layers only (saved and loaded as .keras)
        x = keras.layers.BatchNormalization()(x)
        x = keras.layers.Dense(2 * DIM, activation="relu")(x)
        x = keras.layers.GlobalAveragePooling1D()(x)
        return keras.Model(ids, keras.layers.Dense(CLASSES)(x))
    x = keras.layers.LayerNormalization()(x)
    x = Block()(x)
    if kind == "custom":
        x = Scale()(x)
    x = keras.layers.GlobalAveragePooling1D()(x)
    x = TiedHead(embedding)(x)
    return keras.Model(ids, keras.layers.Dense(CLASSES)(x))


def data():
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.integers(0, VOCAB, size=(GLOBAL_BATCH * STEPS, SEQ)).astype("int32")
    y = rng.integers(0, CLASSES, size=(GLOBAL_BATCH * STEPS,)).astype("int32")
    return x, y


def initial_weights(kind: str = "main"):
    import keras

    keras.utils.set_random_seed(7)
    return build(kind).get_weights()


def make_model(strategy, optimizer: str, kind: str = "main"):
    import keras

    scope = strategy.scope() if strategy is not None else _null()
    with scope:
        model = build(kind)
        model.set_weights(initial_weights(kind))
        model.compile(OPTIMIZERS[optimizer](keras),
                      keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def fit(model, steps: int = STEPS, **kwargs):
    x, y = data()
    model.fit(x[:GLOBAL_BATCH * steps], y[:GLOBAL_BATCH * steps], batch_size=GLOBAL_BATCH,
              epochs=1, shuffle=False, verbose=0, **kwargs)
    return model


def state(model):
    """Weights then optimizer variables, whole, as numpy arrays."""
    import numpy as np

    return ([np.asarray(v.numpy()) for v in model.weights]
            + [np.asarray(v.numpy()) for v in model.optimizer.variables])


def max_diff(a, b) -> float:
    import numpy as np

    assert len(a) == len(b), (len(a), len(b))
    return max(float(np.max(np.abs(x - y))) if x.size else 0.0 for x, y in zip(a, b))


def replicas_identical(model) -> bool:
    """Every replicated variable (model and optimizer) has the same value on every replica."""
    import numpy as np

    from tfdist.compat.sharding_variables import sharded_storage

    strategy = model.distribute_strategy
    for variable in list(model.weights) + list(model.optimizer.variables):
        if sharded_storage(variable) is not None:
            continue
        copies = [np.asarray(c.numpy()) for c in
                  strategy.experimental_local_results(variable.value)]
        if any(not np.array_equal(copies[0], c) for c in copies[1:]):
            return False
    return True


def sharded(num_devices=None, devices=None, **options):
    import tfdist

    placement = {"devices": devices} if devices else {"num_devices": num_devices}
    return tfdist.make_strategy("mirrored", shard_min_bytes=MIN_BYTES, **placement, **options)


def memory_check(model, stage: int, offload: bool = False) -> dict:
    """Measured per-device bytes next to tfdist.planning's prediction for this stage."""
    import tfdist
    from tfdist import planning
    from tfdist.sharding import memory, plan_of

    strategy = model.distribute_strategy
    plan = plan_of(strategy)
    sizes = [int(v.shape.num_elements()) for v in model.trainable_variables]
    predicted = planning.sharded_state_bytes(
        sizes, stage=stage, num_shards=strategy.num_replicas_in_sync,
        optimizer=planning.optimizer_state(model.optimizer), min_shard_bytes=MIN_BYTES,
        offload=offload)
    measured = memory.state_bytes(model)
    return {"predicted": {"parameters": predicted.parameters, "gradients": predicted.gradients,
                          "optimizer": predicted.optimizer, "offloaded": predicted.offloaded},
            "measured": {device: row for device, row in measured.items()},
            "replicas": list(tfdist.replica_devices(strategy)),
            "host": plan.host_device if plan is not None else None}


def gathers_per_step(model) -> int:
    """All-gathers (CollectiveGatherV2 ops) in one replica's traced forward + backward pass."""
    import keras

    import tfdist

    tf = tfdist.import_tensorflow()
    strategy = model.distribute_strategy
    x, y = data()
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def step(features, labels):
        with tf.GradientTape() as tape:
            loss = loss_fn(labels, model(features, training=True))
        return tape.gradient(loss, model.trainable_variables)

    graph = tf.function(lambda: strategy.run(
        step, args=(x[:GLOBAL_BATCH // 2], y[:GLOBAL_BATCH // 2]))).get_concrete_function().graph
    gathers = [op for op in graph.get_operations() if op.type == "CollectiveGatherV2"]
    return len(gathers) // strategy.num_replicas_in_sync


def error_text(fn) -> str:
    try:
        fn()
    except ValueError as e:
        return f"ValueError: {e}"
    except Exception as e:  # noqa: BLE001 - the test wants to see what else came out
        return f"{type(e).__name__}: {e}"
    return "no error"


# ------------------------------------------------------------------------------ cases


def case_mirrored2(out: dict) -> None:
    import keras
    import numpy as np

    import tfdist
    from tfdist.compat import sharding_variables

    tfdist.configure_logical_devices(2)
    tf = tfdist.import_tensorflow()

    single = {name: state(fit(make_model(None, name))) for name in OPTIMIZERS}
    out["equal"] = {}
    runs = [("adam", "optimizer"), ("adam", "gradients"), ("adam", "parameters"),
            ("sgdm", "gradients"), ("sgdm", "parameters"),
            ("adamw", "gradients"), ("adamw", "parameters")]
    stage_of = {"optimizer": 1, "gradients": 2, "parameters": 3}
    out["memory"] = {}
    models = {}
    for optimizer, shard in runs:
        model = fit(make_model(sharded(2, shard=shard), optimizer))
        models[(optimizer, shard)] = model
        out["equal"][f"{optimizer}/{shard}"] = {
            "diff": max_diff(state(model), single[optimizer]),
            "moved": max_diff(state(model)[:len(model.weights)], initial_weights()),
            "replicas_identical": replicas_identical(model),
        }
        if optimizer == "adam":
            out["memory"][shard] = memory_check(model, stage_of[shard])

    # shard_remat=False: each layer keeps the weights it gathered until its backward pass
    # instead of gathering them again (and recomputing its forward) there; as exact.
    kept = fit(make_model(sharded(2, shard="parameters", shard_remat=False), "adam"))
    out["equal"]["adam/parameters/kept"] = {
        "diff": max_diff(state(kept), single["adam"]),
        "moved": max_diff(state(kept)[:len(kept.weights)], initial_weights()),
        "replicas_identical": replicas_identical(kept),
    }
    out["gathers_per_step"] = {"remat": gathers_per_step(models[("adam", "parameters")]),
                               "kept": gathers_per_step(kept)}
    out["sharded_weights"] = sum(
        sharding_variables.sharded_storage(v) is not None for v in kept.trainable_variables)

    # BatchNormalization: per-replica batch statistics, so the reference is unsharded mirrored.
    bn_none = fit(make_model(tfdist.make_strategy("mirrored", num_devices=2), "adam",
                             "batchnorm"))
    bn_sharded = fit(make_model(sharded(2, shard="parameters"), "adam", "batchnorm"))
    out["batchnorm_diff"] = max_diff(state(bn_sharded), state(bn_none))

    # Checkpoints: sharded -> unsharded and back, tf.train.Checkpoint and .keras.
    tmp = tempfile.mkdtemp()
    trained = models[("adam", "parameters")]

    # SavedModels of the stage-3 model: model.export and tf.saved_model.save (which holds the
    # optimizer's sharded slots too) serve what predict computes, with whole variables.
    x, _ = data()
    predicted = trained.predict(x[:16], verbose=0)
    trained.export(os.path.join(tmp, "export"), verbose=False)
    exported = tf.saved_model.load(os.path.join(tmp, "export"))
    out["export_diff"] = float(np.max(np.abs(exported.serve(x[:16]).numpy() - predicted)))
    tf.saved_model.save(trained, os.path.join(tmp, "saved_model"))
    saved = tf.saved_model.load(os.path.join(tmp, "saved_model"))
    [served] = saved.signatures["serving_default"](tf.constant(x[:16])).values()
    out["saved_model_diff"] = float(np.max(np.abs(served.numpy() - predicted)))
    stored = tf.train.list_variables(os.path.join(tmp, "saved_model", "variables",
                                                  "variables"))
    out["saved_model_shapes"] = sorted({tuple(shape) for _, shape in stored})
    out["export_left_sharded"] = all(
        type(v.value).__name__ == "ShardedStorage" for v in trained.trainable_weights
        if v.shape.num_elements() * 4 >= MIN_BYTES)
    path = tf.train.Checkpoint(model=trained, optimizer=trained.optimizer).write(
        os.path.join(tmp, "sharded"))
    plain_strategy = tfdist.make_strategy("mirrored", num_devices=2)
    from tfdist.sharding import memory

    memory.record_gradients(plain_strategy)
    plain = make_model(plain_strategy, "adam")
    with plain_strategy.scope():
        plain.optimizer.build(plain.trainable_variables)
    tf.train.Checkpoint(model=plain, optimizer=plain.optimizer).read(path).assert_consumed()
    out["ckpt_sharded_to_plain"] = max_diff(state(plain), state(trained))
    back_strategy = sharded(2, shard="parameters")
    bn_sharded.save(os.path.join(tmp, "sharded.keras"))
    with plain_strategy.scope():
        loaded = keras.models.load_model(os.path.join(tmp, "sharded.keras"))
    out["keras_sharded_to_plain"] = max_diff(state(loaded), state(bn_sharded))
    bn_none.save(os.path.join(tmp, "plain.keras"))
    with back_strategy.scope():
        loaded = keras.models.load_model(os.path.join(tmp, "plain.keras"))
    out["keras_plain_to_sharded"] = max_diff(state(loaded), state(bn_none))
    out["keras_really_sharded"] = type(loaded.layers[1].embeddings.value).__name__
    fit(plain, steps=3)
    # Negative control for the byte counts: the unsharded model holds everything whole.
    out["memory"]["none"] = memory_check(plain, 0)
    path = tf.train.Checkpoint(model=plain, optimizer=plain.optimizer).write(
        os.path.join(tmp, "plain"))
    back = make_model(back_strategy, "adam")
    with back_strategy.scope():
        back.optimizer.build(back.trainable_variables)
    tf.train.Checkpoint(model=back, optimizer=back.optimizer).read(path).assert_consumed()
    out["ckpt_plain_to_sharded"] = max_diff(state(back), state(plain))
    out["ckpt_really_sharded"] = type(back.layers[1].embeddings.value).__name__
    fit(plain, steps=3)
    fit(back, steps=3)
    out["ckpt_then_train"] = max_diff(state(back), state(plain))

    # tfdist.BackupAndRestore: 2 epochs straight vs 1 epoch, a new model, then resume.
    backup_dir = os.path.join(tmp, "backup")
    x, y = data()

    class Interrupt(keras.callbacks.Callback):  # training stops after epoch 1 of 2
        def on_epoch_end(self, epoch, logs=None):
            self.model.stop_training = True

    def epochs(model, n, backup=None, interrupt=False):
        callbacks = [backup] if backup is not None else []
        callbacks += [Interrupt()] if interrupt else []
        ds = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(GLOBAL_BATCH)
        if backup is not None:
            ds = backup.dataset(ds)
        model.fit(ds, epochs=n, steps_per_epoch=STEPS // 2, verbose=0, callbacks=callbacks)
        return model

    straight = epochs(make_model(sharded(2, shard="gradients"), "adam"), 2)
    interrupted = epochs(make_model(sharded(2, shard="gradients"), "adam"), 2,
                         tfdist.BackupAndRestore(backup_dir), interrupt=True)
    out["backup_interrupted_diff"] = max_diff(state(interrupted), state(straight))
    resumed_backup = tfdist.BackupAndRestore(backup_dir)
    out["backup_initial_epoch"] = resumed_backup.initial_epoch
    resumed = epochs(make_model(sharded(2, shard="gradients"), "adam"), 2, resumed_backup)
    out["backup_resume_diff"] = max_diff(state(resumed), state(straight))

    # A custom training loop (the tf.distribute tutorial's idiom) at stage 3. The optimizer
    # is built first: Keras 3 cannot build it inside strategy.run (not even unsharded).
    strategy = sharded(2, shard="parameters")
    model = make_model(strategy, "adam")
    with strategy.scope():
        model.optimizer.build(model.trainable_variables)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")

    @tf.function
    def train_step(batch):
        def step(features, labels):
            with tf.GradientTape() as tape:
                loss = tf.nn.compute_average_loss(loss_fn(labels, model(features, training=True)),
                                                  global_batch_size=GLOBAL_BATCH)
            grads = tape.gradient(loss, model.trainable_variables)
            model.optimizer.apply_gradients(zip(grads, model.trainable_variables))
        strategy.run(step, args=batch)

    dataset = strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH))
    for batch in dataset:
        train_step(batch)
    out["custom_loop_diff"] = max_diff(
        [np.asarray(v.numpy()) for v in model.weights],
        single["adam"][:len(model.weights)])

    # Bad input: an optimizer that is not element-wise.
    lamb_strategy = sharded(2, shard="optimizer")

    def lamb():
        with lamb_strategy.scope():
            model = build()
            model.compile(keras.optimizers.Lamb(1e-3),
                          keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        fit(model, steps=1)

    out["error_optimizer"] = error_text(lamb)
    def eager():
        model = make_model(sharded(2, shard="gradients"), "adam")
        model.compile(model.optimizer, model.loss, run_eagerly=True)
        fit(model, steps=1)

    out["error_eager"] = error_text(eager)
    # A custom layer owning a sharded weight: not known to be pure, it runs without remat
    # (gathers its weight when it reads it and keeps it until its backward pass, and says so
    # once); registered, under keras.remat.
    import logging

    _, _, Scale = _layers()
    from tfdist import sharding

    notes = []

    class Notes(logging.Handler):
        def emit(self, record):
            notes.append(record.getMessage())

    handler = Notes(logging.INFO)
    logger = logging.getLogger("tfdist")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        unregistered = fit(make_model(sharded(2, shard="parameters"), "adam", "custom"))
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    out["unregistered_notes"] = [n for n in notes if "without rematerialisation" in n]
    reference = fit(make_model(None, "adam", "custom"))
    out["unregistered_layer_diff"] = max_diff(state(unregistered), state(reference))
    sharding.register_gatherable_layer(Scale)
    registered = fit(make_model(sharded(2, shard="parameters"), "adam", "custom"))
    out["registered_layer_diff"] = max_diff(state(registered), state(reference))
    out["registered_listed"] = sharding.gatherable_layers()[-1]


def case_mirrored4(out: dict) -> None:
    import tfdist

    tfdist.configure_logical_devices(4)
    out["equal"] = {}
    # The first run lists the devices backwards: replica i is not collective rank i there
    # (TensorFlow orders a group by device name), which decides who owns which shard.
    reverse = ("/cpu:3", "/cpu:2", "/cpu:1", "/cpu:0")
    for optimizer, shard, devices in [("adam", "optimizer", reverse),
                                      ("sgdm", "gradients", None),
                                      ("adamw", "parameters", None)]:
        single = state(fit(make_model(None, optimizer)))
        model = fit(make_model(sharded(4, devices=devices, shard=shard), optimizer))
        if devices is not None:
            from tfdist.sharding import plan_of

            out["reversed_ranks"] = list(plan_of(model.distribute_strategy).ranks)
        out["equal"][f"{optimizer}/{shard}"] = {
            "diff": max_diff(state(model), single),
            "replicas_identical": replicas_identical(model)}

    # Host offload: replicas on /cpu:1-3, optimizer state and update on the host /cpu:0.
    from tfdist.compat import optimizer_update
    from tfdist.sharding import sync as sync_lib

    single = state(fit(make_model(None, "adam")))
    out["offload"] = {}
    for shard in ("gradients", "parameters"):
        strategy = sharded(devices=("/cpu:1", "/cpu:2", "/cpu:3"), shard=shard,
                           offload="optimizer")
        model = fit(make_model(strategy, "adam"))
        sync = optimizer_update.gradient_sync(strategy)
        slots = sorted({c.device for v in model.optimizer.variables
                        if hasattr(v.value, "components") for c in v.value.components})
        out["offload"][shard] = {
            "diff": max_diff(state(model), single),
            "update_op_devices": sync.traced_update_devices,
            "slot_devices": slots,
            "scalar_reads": sync_lib.SCALAR_READS,
            "memory": memory_check(model, 2 if shard == "gradients" else 3, offload=True),
        }
    out["error_offload"] = error_text(lambda: tfdist.make_strategy(
        "mirrored", num_devices=2, shard="optimizer", offload="optimizer"))


def case_worker(out_path: str) -> None:
    import numpy as np

    import tfdist
    import tfdist.chief

    strategy = tfdist.make_strategy("multi_worker_mirrored", shard="parameters",
                                    shard_min_bytes=MIN_BYTES)
    results = {}
    for optimizer in OPTIMIZERS:
        model = fit(make_model(strategy, optimizer))
        # Whole values need every worker's shards: each worker reads them (a collective).
        results[optimizer] = np.concatenate([s.ravel() for s in state(model)])
        results[f"{optimizer}_sharded"] = np.array(
            [type(v.value).__name__ == "ShardedStorage" for v in model.trainable_variables])
    task = tfdist.chief.task_name().replace(":", "")
    np.savez(f"{out_path}.{task}.npz", **results)
    print(f"{task} done", flush=True)


def case_reference(out_path: str) -> None:
    import numpy as np

    results = {name: np.concatenate([s.ravel() for s in state(fit(make_model(None, name)))])
               for name in OPTIMIZERS}
    np.savez(f"{out_path}.npz", **results)


def main(argv) -> int:
    case, out_path = argv[1], argv[2]
    if case == "worker":
        case_worker(out_path)
        return 0
    if case == "reference":
        case_reference(out_path)
        return 0
    out: dict = {}
    {"mirrored2": case_mirrored2, "mirrored4": case_mirrored4}[case](out)
    with open(out_path, "w") as f:
        json.dump(out, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    sys.exit(main(sys.argv))

"""mixed_float16 under tfdist's mirrored strategies: a LossScaleOptimizer's gradients are
summed over replicas before its finite check (tfdist.compat.loss_scale's `tf_apply` fix), so
each bucket's collective can start during the backward pass (bucket_priority orders it
there), the check needs no collective of its own, and the model trains as when the sums are
taken inside the update that the check may skip.

Negative controls: with the fix taken out, Keras applies the gradients inside its `cond`
and nothing can be ordered; with it and the `check_finite` fix both taken out, an overflow
on one replica reaches the weights."""

import contextlib

import numpy as np
import pytest

import tfdist
from tests.support import conv_model, count_priority_edits
from tfdist import step_options
from tfdist.comm.sync import CommSync
from tfdist.compat import _patch, loss_scale
from tfdist.numerics import replica_spread

BUCKETS = {"bucket_bytes": 2048}


def _mixed_float16():
    """Models built inside use the mixed_float16 policy (the previous one comes back)."""
    return step_options.dtype_policy(tfdist.StepOptions(mixed_precision="mixed_float16"))


@contextlib.contextmanager
def _taken_out(*fixes):
    """Runs the block with `fixes` uninstalled, then installs loss_scale's fixes again."""
    assert {fix.name for fix in fixes} <= set(_patch.installed())
    _patch.uninstall([fix.name for fix in fixes])
    try:
        yield
    finally:
        loss_scale.install()


def _data():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((32, 8, 8, 4)).astype("float32")
    return x, (x.mean(axis=(1, 2)) > 0).argmax(axis=1)  # a learnable class per example


def _fit(strategy, optimizer_options: dict, x=None, epochs: int = 2) -> dict:
    """Trains the conv model under mixed_float16; returns its weights, losses, final loss
    scale and the largest difference between replicas' copies."""
    import keras

    data_x, y = _data()
    x = data_x if x is None else x
    with _mixed_float16():
        with strategy.scope():
            model = conv_model(seed=5)
            optimizer_options = dict(optimizer_options)
            name = optimizer_options.pop("name", "sgd")
            steps_per_execution = optimizer_options.pop("steps_per_execution", 1)
            inner = (keras.optimizers.Adam(0.01, **optimizer_options) if name == "adam"
                     else keras.optimizers.SGD(0.05, momentum=0.5, **optimizer_options))
            model.compile(inner, keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                          steps_per_execution=steps_per_execution)
        assert type(model.optimizer).__name__ == "LossScaleOptimizer"
        history = model.fit(x, y, batch_size=16, epochs=epochs, shuffle=False, verbose=0)
    return {"weights": [w.numpy() for w in model.weights], "loss": history.history["loss"],
            "scale": float(model.optimizer.dynamic_scale.numpy()),
            "spread": replica_spread(model.weights)}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("optimizer_options", [
    {}, {"name": "adam", "global_clipnorm": 0.5}, {"gradient_accumulation_steps": 2},
    {"steps_per_execution": 2}],
    ids=["sgd", "adam_global_clipnorm", "accumulation", "steps_per_execution"])
def test_buckets_start_in_the_backward_pass_and_train_the_same(monkeypatch, optimizer_options):
    added = count_priority_edits(monkeypatch)
    fixed = _fit(tfdist.make_strategy("mirrored", num_devices=2, **BUCKETS), optimizer_options)
    assert added and all(n > 0 for n in added), added  # each replica's backward pass ordered
    added.clear()
    strategy = tfdist.make_strategy("mirrored", num_devices=2, **BUCKETS)
    with _taken_out(loss_scale.APPLY_FIX):
        unfixed = _fit(strategy, optimizer_options)
    assert sum(added) == 0  # negative control: inside Keras's cond nothing can be ordered
    # Summing, then dividing by the loss scale (a power of 2) is the old order's arithmetic.
    for a, b in zip(fixed["weights"], unfixed["weights"]):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    assert fixed["scale"] == unfixed["scale"]
    assert fixed["spread"] == 0.0
    assert fixed["loss"][-1] < fixed["loss"][0]


def _custom_loop(strategy) -> dict:
    """keras.io's custom training loop under mixed precision: `strategy.run` of a step that
    scales the loss with the LossScaleOptimizer and applies the gradients itself."""
    import keras

    tf = tfdist.import_tensorflow()
    x, y = _data()
    with _mixed_float16():
        with strategy.scope():
            model = conv_model(seed=5)
            optimizer = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.05))
            optimizer.build(model.trainable_variables)
        loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")
        batches = strategy.experimental_distribute_dataset(
            tf.data.Dataset.from_tensor_slices((x, y)).batch(16))

        def step(xb, yb):
            with tf.GradientTape() as tape:
                loss = tf.nn.compute_average_loss(loss_fn(yb, model(xb, training=True)),
                                                  global_batch_size=16)
                scaled = optimizer.scale_loss(loss)
            grads = tape.gradient(scaled, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return loss

        @tf.function
        def train(batch):
            return strategy.reduce("SUM", strategy.run(step, args=batch), axis=None)

        losses = [float(train(batch)) for _ in range(2) for batch in batches]
    return {"weights": [w.numpy() for w in model.weights], "loss": losses,
            "spread": replica_spread(model.weights)}


@pytest.mark.timeout(300)
def test_a_custom_loop_with_loss_scaling(monkeypatch):
    added = count_priority_edits(monkeypatch)
    fixed = _custom_loop(tfdist.make_strategy("mirrored", num_devices=2, **BUCKETS))
    assert added and all(n > 0 for n in added), added
    added.clear()
    strategy = tfdist.make_strategy("mirrored", num_devices=2, **BUCKETS)
    with _taken_out(loss_scale.APPLY_FIX):
        unfixed = _custom_loop(strategy)
    assert sum(added) == 0  # negative control
    for a, b in zip(fixed["weights"], unfixed["weights"]):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    assert fixed["spread"] == 0.0
    assert fixed["loss"][-1] < fixed["loss"][0]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("options", [
    BUCKETS, {}, {"cross_device_ops": "reduction_to_one_device"}],
    ids=["buckets", "default", "reduction_to_one_device"])
def test_an_overflow_on_one_replica_skips_the_step_on_every_replica(options):
    # With reduction_to_one_device (no collectives) check_finite's fix cannot apply: the
    # sums are what fixes the overflow there.
    x, _ = _data()
    overflowing = x.copy()
    overflowing[8:16] = 1e30  # the second replica's half of the first batch: Inf in float16
    before = _fit(tfdist.make_strategy("mirrored", num_devices=2, **options), {}, epochs=1)
    strategy = tfdist.make_strategy("mirrored", num_devices=2, **options)
    # The sums alone decide: check_finite's own collective is not needed (taken out here).
    with _taken_out(loss_scale.FIX):
        skipped = _fit(strategy, {}, x=overflowing, epochs=1)
    assert all(np.isfinite(w).all() for w in skipped["weights"])
    assert skipped["scale"] == before["scale"] / 2  # one step skipped: halved once
    assert skipped["spread"] == 0.0
    # Negative control: neither fix, Keras takes replica 0's finite flag and applies the step.
    strategy = tfdist.make_strategy("mirrored", num_devices=2, **options)
    with _taken_out(loss_scale.FIX, loss_scale.APPLY_FIX):
        applied = _fit(strategy, {}, x=overflowing, epochs=1)
    assert not all(np.isfinite(w).all() for w in applied["weights"])


@pytest.mark.timeout(300)
def test_the_default_sync_runs_one_collective_fewer_and_trains_the_same(monkeypatch):
    # Without buckets nothing overlaps, but the finite check of the sums needs no collective
    # of its own (check_finite's fix all-reduces an overflow count: one per replica's trace).
    from tfdist.compat import comm_collectives

    calls: list = []
    original = comm_collectives.all_reduce_sum

    def counting(strategy, tensors, **kwargs):
        calls.append(len(tensors))
        return original(strategy, tensors, **kwargs)

    monkeypatch.setattr(comm_collectives, "all_reduce_sum", counting)
    fixed = _fit(tfdist.make_strategy("mirrored", num_devices=2), {})
    assert calls == []  # the default sync sums with Keras's all-reduce; nothing else runs
    strategy = tfdist.make_strategy("mirrored", num_devices=2)
    with _taken_out(loss_scale.APPLY_FIX):
        unfixed = _fit(strategy, {})
    assert calls == [1, 1]  # negative control: the overflow count, once per replica
    for a, b in zip(fixed["weights"], unfixed["weights"]):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    assert fixed["spread"] == 0.0


@pytest.mark.timeout(300)
def test_fp16_compression_sums_the_scaled_gradients(monkeypatch):
    # Sent in float16 as Horovod and Apex send them, scaled: the loss scale keeps the sums in
    # float16's range, lowering itself where they overflow.
    added = count_priority_edits(monkeypatch)
    run = _fit(tfdist.make_strategy("mirrored", num_devices=2, gradient_compression="fp16",
                                    **BUCKETS), {}, epochs=3)
    assert added and all(n > 0 for n in added), added
    assert all(np.isfinite(w).all() for w in run["weights"])
    assert run["loss"][-1] < run["loss"][0]
    assert run["spread"] == 0.0


def test_which_syncs_sum_before_the_finite_check():
    from tfdist.sharding.sync import ShardedSync

    strategy = tfdist.make_strategy("mirrored", num_devices=2)

    def sync(**options):
        return CommSync(strategy=strategy, **options).reduces_before_loss_scale

    assert sync() and sync(bucket_bytes=4096)
    assert sync(bucket_bytes=4096, compression="bf16")
    assert sync(bucket_bytes=4096, compression="fp16")
    assert tfdist.sync.DEFAULT_SYNC.reduces_before_loss_scale
    # PowerSGD's error feedback would take in the gradients of a step the loss scale skips;
    # ZeRO hands each replica a shard; a user's own sync may keep gradients local.
    assert not sync(bucket_bytes=4096, compression="powersgd")
    assert not ShardedSync.reduces_before_loss_scale
    assert not tfdist.sync.GradientSync().reduces_before_loss_scale

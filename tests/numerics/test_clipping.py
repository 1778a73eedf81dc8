"""Gradient clipping under tfdist's data-parallel presets clips what one device would clip.

Keras 3 clips (`clipnorm`, `global_clipnorm`, `clipvalue`) in each replica
before the all-reduce; tfdist clips the summed gradients instead
(tfdist/compat/optimizer_update.py, the clip_gradients fix). Reference: the
same model, seed, initial weights and global batch on one device. The model
has the shapes real ones have: an Embedding (sparse gradients; ids unique
within each global batch, so one device's clipping of its IndexedSlices and
the replicas' summed slices see the same rows), LayerNormalization, a custom
layer with a nested Dense, and a Dense head. The clip thresholds are set so
that clipping is active on every step (checked: without any clip the
weights differ from the clipped run by far more than the tolerance).

ZeRO-1/2 clip the same way: stage 2 sums the squares of its shards over the
replicas for the norms (tfdist/sharding/sync.py, `ShardedSync.clip`).

Negative control: with the fix taken out, the same tfdist strategy runs
Keras's own clipping and differs from one device by orders of magnitude more
than the tolerance: that is also the canary for Keras changing this upstream.
Strategies tfdist did not make pass through (tests/compat/test_untouched.py).
"""

import numpy as np
import pytest

import tfdist
from tests.support import (embedding_gated_model, max_abs_difference as _max_diff,
                          one_device as _one_device, tutorial_custom_loop)

TOLERANCE = 1e-5  # float32 summation order across 2-4 replicas over 8 steps
STEPS, GLOBAL_BATCH, VOCAB, LENGTH = 8, 16, 16 * 8 * 2, 1
CLIPS = [dict(clipnorm=0.05), dict(global_clipnorm=0.05), dict(clipvalue=0.002)]


def _data():
    rng = np.random.default_rng(0)
    # Every id once per epoch: unique within each global batch.
    ids = rng.permutation(VOCAB)[:STEPS * GLOBAL_BATCH].reshape(-1, LENGTH).astype("int32")
    features = rng.normal(size=(STEPS * GLOBAL_BATCH, 6)).astype("float32")
    targets = rng.normal(size=(STEPS * GLOBAL_BATCH, 3)).astype("float32") * 4
    return (ids, features), targets


def _build(optimizer):
    model = embedding_gated_model(VOCAB, LENGTH)
    model.compile(optimizer, "mse")
    return model


def _fit(strategy, optimizer_kwargs, optimizer="sgd"):
    import keras

    make = {"sgd": lambda: keras.optimizers.SGD(0.1, **optimizer_kwargs),
            "adam": lambda: keras.optimizers.Adam(0.01, **optimizer_kwargs)}[optimizer]
    (ids, features), targets = _data()
    with strategy.scope():
        model = _build(make())
    model.fit([ids, features], targets, batch_size=GLOBAL_BATCH, epochs=1, shuffle=False,
              verbose=0)
    return model.get_weights()


@pytest.mark.parametrize("clip", CLIPS, ids=lambda c: next(iter(c)))
@pytest.mark.parametrize("num_devices", [2, 4])
def test_mirrored_clips_like_one_device(clip, num_devices):
    reference = _fit(_one_device(), clip)
    unclipped = _fit(_one_device(), {})
    assert _max_diff(reference, unclipped) > 100 * TOLERANCE  # the clip is active
    strategy = tfdist.make_strategy("mirrored", num_devices=num_devices)
    weights = _fit(strategy, clip)
    assert _max_diff(weights, reference) < TOLERANCE


def test_adam_and_the_comm_sync_clip_like_one_device():
    # Adam divides by the gradient's scale, so the test uses global_clipnorm (which changes
    # the direction across variables); bucketed all-reduce goes through tfdist.comm's sync.
    clip = dict(global_clipnorm=0.01)
    reference = _fit(_one_device(), clip, optimizer="adam")
    strategy = tfdist.make_strategy("mirrored", num_devices=2, bucket_bytes=256)
    assert _max_diff(_fit(strategy, clip, optimizer="adam"), reference) < TOLERANCE


def test_custom_training_loop_clips_like_one_device():
    # The custom-training tutorial's loop: strategy.run, a loss scaled by the global batch,
    # optimizer.apply_gradients in each replica.
    import keras

    def train(strategy):
        (ids, features), targets = _data()
        with strategy.scope():
            model = _build(keras.optimizers.SGD(0.1, clipnorm=0.05))
        tutorial_custom_loop(strategy, model, model.optimizer, (ids, features), targets,
                             GLOBAL_BATCH)
        return model.get_weights()

    reference = train(_one_device())
    assert _max_diff(train(tfdist.make_strategy("mirrored", num_devices=2)), reference) < TOLERANCE


def test_without_the_fix_keras_clips_per_replica():
    # Negative control and canary: with the clip fix taken out, a tfdist strategy runs Keras's
    # own clipping (each replica's share, before the all-reduce) and leaves one device far
    # behind. (A user's own MirroredStrategy runs the same Keras code; it is not used here
    # because two stock strategies in one process collide on TensorFlow's collective keys.)
    from tfdist.compat import _patch, optimizer_update

    clip = dict(clipnorm=0.05)
    reference = _fit(_one_device(), clip)
    strategy = tfdist.make_strategy("mirrored", num_devices=2)
    assert optimizer_update.CLIP_FIX.name in _patch.installed()
    _patch.uninstall([optimizer_update.CLIP_FIX.name])
    try:
        unfixed = _fit(strategy, clip)
    finally:
        optimizer_update.install()
    assert optimizer_update.CLIP_FIX.name in _patch.installed()
    assert _max_diff(unfixed, reference) > 100 * TOLERANCE
    assert _max_diff(_fit(strategy, clip), reference) < TOLERANCE


SHARD_MIN_BYTES = 500  # the embedding and two kernels sharded, the other 7 variables replicated


def _sharded(shard):
    return tfdist.make_strategy("mirrored", num_devices=2, shard=shard,
                                shard_min_bytes=SHARD_MIN_BYTES)


@pytest.mark.parametrize("clip", CLIPS, ids=lambda c: next(iter(c)))
@pytest.mark.parametrize("shard", ["optimizer", "gradients"])
def test_sharded_sync_clips_like_one_device(clip, shard):
    # ZeRO-1 holds every summed gradient whole. ZeRO-2 holds only the sum of its shard of a
    # sharded variable's gradient (the embedding's sparse one included): the norms add the
    # squares of the shards over the replicas, and replicated variables' whole gradients join
    # global_clipnorm's norm. The model has both kinds.
    from tfdist.compat import optimizer_update

    assert optimizer_update.clips_after_reduce(_optimizer_under(_sharded(shard)))
    reference = _fit(_one_device(), clip)
    assert _max_diff(_fit(_sharded(shard), clip), reference) < TOLERANCE


def test_sharded_adam_with_global_clipnorm_clips_like_one_device():
    # AdamW-style fine-tuning's recipe (Adam and global_clipnorm) under ZeRO-2.
    clip = dict(global_clipnorm=0.01)
    reference = _fit(_one_device(), clip, optimizer="adam")
    assert _max_diff(_fit(_sharded("gradients"), clip, optimizer="adam"), reference) < TOLERANCE


@pytest.mark.parametrize("clip", CLIPS[:2], ids=lambda c: next(iter(c)))
def test_without_the_sharded_clip_keras_clips_per_replica(monkeypatch, clip):
    # Negative control: ZeRO-2 leaving clipping to Keras (each replica's share, before the
    # reduce-scatter, as before the sharded clip) is far from one device.
    from tfdist.sharding.sync import ShardedSync

    monkeypatch.setattr(ShardedSync, "clips_reduced_gradients", False)
    reference = _fit(_one_device(), clip)
    assert _max_diff(_fit(_sharded("gradients"), clip), reference) > 100 * TOLERANCE


def _optimizer_under(strategy):
    import keras

    with strategy.scope():
        return keras.optimizers.SGD(0.1, clipnorm=1.0)

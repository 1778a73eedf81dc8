"""The exchange lays buckets out at layer boundaries, as the planner counts them (in-process,
mirrored over 2 logical CPUs)."""

import warnings

import numpy as np
import pytest

import tfdist
from tests.support import conv_model
from tfdist import planning
from tfdist.comm import buckets
from tfdist.compat import comm_collectives, optimizer_update


def _exchange(monkeypatch, bucket_bytes: int, forget_layers: bool = False):
    """Trains one step; returns (the bytes of each bucket's collective in replica 0's
    trace, the model)."""
    import keras

    calls = []
    original = comm_collectives.all_reduce_sum

    def counting(strategy, tensors, **kwargs):
        calls.append([t.shape.num_elements() * t.dtype.size for t in tensors])
        return original(strategy, tensors, **kwargs)

    monkeypatch.setattr(comm_collectives, "all_reduce_sum", counting)
    strategy = tfdist.make_strategy("mirrored", num_devices=2, bucket_bytes=bucket_bytes)
    with strategy.scope():
        keras.utils.set_random_seed(3)
        # bench_comm's conv model on smaller images
        model = conv_model((8, 8, 16), filters=32, layers=4, outputs=10)
        model.compile(keras.optimizers.SGD(0.1), "sparse_categorical_crossentropy")
    if forget_layers:
        model.optimizer.build(model.trainable_variables)
        optimizer_update.gradient_sync(strategy, model.optimizer)._layers_of.clear()
    rng = np.random.default_rng(0)
    x = rng.standard_normal((8, 8, 8, 16)).astype("float32")
    y = rng.integers(0, 10, 8)
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert len(calls) % 2 == 0  # each replica traces the same exchange
    return calls[:len(calls) // 2], model


@pytest.mark.timeout(300)
def test_buckets_follow_layers_and_the_planner_counts_them(monkeypatch):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        calls, model = _exchange(monkeypatch, 40000)
    # 4 buckets: not many (the negative control of the warning below)
    assert not [w for w in caught if "buckets" in str(w.message)]
    # dense (1320 bytes) and conv2d_3 (36,992) share the first bucket; every other layer
    # is a bucket of its own: the bias of the layer below waits for its own layer. The
    # first bucket also carries the replica's example count (4 bytes, float32:
    # tfdist.sync.sum_over_replicas), so weighting by examples adds no collective.
    assert [sum(c) for c in calls] == [38312 + 4, 36992, 36992, 18560]
    variables = model.trainable_variables
    layers = [buckets.layer_of(v) for v in variables]
    assert len(set(layers)) == 5 and None not in layers
    assert len(calls) == planning.bucket_collectives(
        [tuple(v.shape) for v in variables], bucket_bytes=40000, layers=layers)


@pytest.mark.timeout(300)
def test_without_the_layers_the_first_bucket_takes_the_bias_below(monkeypatch):
    # Negative control: with the layers forgotten, each gradient is its own layer, as
    # tfdist laid buckets out before, and the first bucket takes conv2d_2's bias too.
    calls, _ = _exchange(monkeypatch, 40000, forget_layers=True)
    assert sum(calls[0]) == 38312 + 128 + 4


@pytest.mark.timeout(300)
def test_many_small_buckets_are_warned_about_once(monkeypatch):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        calls, _ = _exchange(monkeypatch, 1024)
    messages = [str(w.message) for w in caught if "buckets (" in str(w.message)]
    # once, though both replicas trace the exchange
    assert len(messages) == 1, messages
    assert len(calls) > 64
    total = sum(sum(c) for c in calls)
    assert (f"bucket_bytes=1024 cuts {planning.format_bytes(total)} of gradients into "
            f"{len(calls)} buckets") in messages[0]
    assert "pass a larger bucket_bytes" in messages[0]


def test_many_buckets_of_a_mebibyte_or_more_are_not_warned_about():
    import tensorflow as tf

    from tfdist.comm import sync

    comm = object.__new__(sync.CommSync)
    comm.bucket_bytes, comm._warned = 1 << 20, set()
    grads = [tf.zeros([1 << 18]) for _ in range(100)]  # 100 gradients of 1 MiB
    whole = [[buckets.Segment(i)] for i in range(100)]
    halves = [[buckets.Segment(i, 0, 1 << 17)] for i in range(100)] + \
        [[buckets.Segment(i, 1 << 17, None)] for i in range(100)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        comm.warn_if_many(whole, grads)  # 100 buckets of 1 MiB: large enough
        small = [tf.zeros([256]) for _ in range(64)]
        comm.warn_if_many(whole[:64], small)  # 64 buckets of 1 KiB: not many
        assert not caught
        comm.warn_if_many(halves, grads)  # 200 buckets of 512 KiB
        comm.warn_if_many(halves, grads)  # the same layout: warned once
    assert len(caught) == 1
    assert "into 200 buckets (512.00 KiB each on average)" in str(caught[0].message)

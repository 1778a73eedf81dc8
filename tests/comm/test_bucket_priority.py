"""bucket_priority end to end: `fit` under the mirrored preset (2 logical CPUs) with buckets
orders the backward pass for them (tfdist.compat.backward_priority) and trains to the same
weights as TensorFlow's own order."""

import numpy as np
import pytest

import tfdist
from tfdist.compat import backward_priority


def _fit(monkeypatch, **options):
    """Two epochs of the conv model; returns (its weights, edges added per traced call)."""
    import keras

    added: list = []
    original = backward_priority.prioritise

    def counting(buckets):
        added.append(original(buckets))
        return added[-1]

    monkeypatch.setattr(backward_priority, "prioritise", counting)
    strategy = tfdist.make_strategy("mirrored", num_devices=2, **options)
    with strategy.scope():
        keras.utils.set_random_seed(5)
        inputs = keras.Input((8, 8, 4))
        x = inputs
        for _ in range(3):
            x = keras.layers.Conv2D(8, 3, padding="same", activation="relu")(x)
        x = keras.layers.GlobalAveragePooling2D()(x)
        model = keras.Model(inputs, keras.layers.Dense(4)(x))
        model.compile(keras.optimizers.SGD(0.05), "sparse_categorical_crossentropy")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((32, 8, 8, 4)).astype("float32")
    y = rng.integers(0, 4, 32)
    model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    return [w.numpy() for w in model.weights], added


@pytest.mark.timeout(300)
@pytest.mark.parametrize("compression", ["none", "powersgd"])
def test_priority_orders_the_backward_pass_and_trains_the_same(monkeypatch, compression):
    extra = ({"gradient_compression": "powersgd", "powersgd_warmup_steps": 0}
             if compression == "powersgd" else {})
    ordered, added = _fit(monkeypatch, bucket_bytes=4096, **extra)
    # one call per replica's traced step, each adding control dependencies
    assert len(added) >= 2 and all(n > 0 for n in added), added
    # Negative control: bucket_priority=False leaves the order to TensorFlow.
    plain, none_added = _fit(monkeypatch, bucket_bytes=4096, bucket_priority=False, **extra)
    assert none_added == []
    for a, b in zip(ordered, plain):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.timeout(300)
def test_one_bucket_is_not_ordered(monkeypatch):
    # Everything in one bucket: nothing can start earlier, so nothing is edited.
    _, added = _fit(monkeypatch, bucket_bytes=1 << 20)
    assert added == []

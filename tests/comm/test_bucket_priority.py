"""bucket_priority end to end: `fit` under the mirrored preset (2 logical CPUs) with buckets
orders the backward pass for them (tfdist.compat.backward_priority) and trains to the same
weights as TensorFlow's own order."""

import numpy as np
import pytest

import tfdist
from tests.support import conv_model, count_priority_edits


def _fit(monkeypatch, **options):
    """Two epochs of the conv model; returns (its weights, edges added per traced call)."""
    import keras

    added = count_priority_edits(monkeypatch)
    strategy = tfdist.make_strategy("mirrored", num_devices=2, **options)
    with strategy.scope():
        model = conv_model(seed=5)
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


def _same_with_and_without(monkeypatch, build_and_fit):
    """Runs `build_and_fit(strategy)` (returns the trained models) with bucket_priority on
    and off; asserts control inputs were added and the weights agree."""
    import keras

    added = count_priority_edits(monkeypatch)
    runs = []
    for priority in (True, False):
        keras.utils.set_random_seed(11)
        strategy = tfdist.make_strategy("mirrored", num_devices=2, bucket_bytes=2048,
                                        bucket_priority=priority)
        runs.append([w.numpy() for m in build_and_fit(strategy) for w in m.weights])
    assert added and sum(added) > 0, added
    for a, b in zip(*runs):
        np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-5)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("policy", ["float32", "mixed_float16"])
def test_kerashub_classifier_on_strings(monkeypatch, policy):
    # keras.io's KerasHub getting-started pattern: task + preprocessor on raw strings, also
    # under the guide's mixed_float16 policy, where Keras's LossScaleOptimizer applies the
    # gradients inside a tf.cond on whether they are all finite: tfdist sums them before
    # that check (tfdist.compat.loss_scale; tests/comm/test_loss_scale_buckets.py), so the
    # buckets are ordered there too.
    import keras
    import keras_hub

    tf = tfdist.import_tensorflow()
    vocabulary = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "good", "bad", "movie", "a"]
    texts = tf.constant(["a good movie", "a bad movie", "good", "bad bad movie"] * 4)
    labels = np.array([1, 0, 1, 0] * 4)

    def build_and_fit(strategy):
        keras.mixed_precision.set_global_policy(policy)
        try:
            with strategy.scope():
                tokenizer = keras_hub.models.BertTokenizer(vocabulary=vocabulary)
                preprocessor = keras_hub.models.BertPreprocessor(tokenizer, sequence_length=8)
                backbone = keras_hub.models.BertBackbone(
                    vocabulary_size=len(vocabulary), num_layers=2, num_heads=2, hidden_dim=16,
                    intermediate_dim=32, max_sequence_length=8, dropout=0.0)
                model = keras_hub.models.BertClassifier(
                    backbone=backbone, num_classes=2, preprocessor=preprocessor, dropout=0.0)
            model.fit(texts, labels, batch_size=8, epochs=2, shuffle=False, verbose=0)
        finally:
            keras.mixed_precision.set_global_policy("float32")
        return [model]

    _same_with_and_without(monkeypatch, build_and_fit)


@pytest.mark.timeout(300)
def test_two_optimizers_and_clipping_in_a_custom_train_step(monkeypatch):
    # keras.io's GAN pattern (two tapes, two optimizers in one train_step), each update
    # clipped by its global norm as custom loops do.
    import keras

    tf = tfdist.import_tensorflow()

    class TwoPart(keras.Model):
        def __init__(self):
            super().__init__()
            self.encoder = keras.Sequential([keras.layers.Dense(32, activation="relu"),
                                             keras.layers.Dense(16, activation="relu")])
            self.head = keras.Sequential([keras.layers.Dense(32, activation="relu"),
                                          keras.layers.Dense(1)])

        def call(self, x):
            return self.head(self.encoder(x))

        def compile(self, first, second):
            super().compile()
            self.first, self.second = first, second

        def train_step(self, data):
            x, y = data
            for optimizer, part in ((self.first, self.head), (self.second, self.encoder)):
                with tf.GradientTape() as tape:
                    loss = tf.reduce_mean(tf.square(self(x) - y))
                grads = tape.gradient(loss, part.trainable_weights)
                grads, _ = tf.clip_by_global_norm(grads, 1.0)
                optimizer.apply_gradients(zip(grads, part.trainable_weights))
            return {"loss": loss}

    rng = np.random.default_rng(2)
    x = rng.standard_normal((32, 24)).astype("float32")
    y = rng.standard_normal((32, 1)).astype("float32")

    def build_and_fit(strategy):
        with strategy.scope():
            model = TwoPart()
            model.build((None, 24))
            model.compile(keras.optimizers.Adam(1e-3), keras.optimizers.Adam(1e-3))
        model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
        return [model]

    _same_with_and_without(monkeypatch, build_and_fit)

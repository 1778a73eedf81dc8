"""Sequence parallelism on 4 logical CPUs.

References: the same model unsplit on one device, same seed and batches, fp32.
"""

import numpy as np
import pytest

import keras
import tensorflow as tf

from models import build_transformer
from tfdist.split.sequence_parallel import nearest_valid_lengths, sequence_parallel

from tests.support import assert_fit_matches

TOL = 1e-5
RNG = np.random.default_rng(0)
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def transformer(seed=0):
    keras.utils.set_random_seed(seed)
    return build_transformer((8, 8, 1), 10)  # 8 tokens of 8 features, 2 blocks


def causal_lm(seed=0):
    keras.utils.set_random_seed(seed)
    ids = keras.Input((8,), dtype="int32", name="ids")
    x = keras.layers.Embedding(50, 16, name="tok")(ids)
    h = keras.layers.LayerNormalization(name="ln")(x)
    x = x + keras.layers.MultiHeadAttention(2, 8, name="mha")(h, h, use_causal_mask=True)
    x = x + keras.layers.Dense(16, name="ff2")(keras.layers.Dense(32, activation="gelu",
                                                                  name="ff1")(x))
    return keras.Model(ids, keras.layers.Dense(50, name="lm_head")(x))


def _data(name, n=16):
    if name == "transformer":
        return RNG.standard_normal((n, 8, 8, 1)).astype("float32"), RNG.integers(0, 10, n)
    return RNG.integers(0, 50, (n, 8)).astype("int32"), RNG.integers(0, 50, (n, 8))


BUILDERS = {"transformer": transformer, "causal_lm": causal_lm}
DEVICES = ["/cpu:0", "/cpu:1", "/cpu:2", "/cpu:3"]


def _grads(model, x, y, *, graph):
    if graph:
        fn = tf.function(lambda a, b: tf.gradients(LOSS(b, model(a, training=True)),
                                                   [v.value for v in model.trainable_variables]))
        grads = fn(x, y)
    else:
        with tf.GradientTape() as tape:
            loss = LOSS(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
    return [np.asarray(tf.convert_to_tensor(g)) for g in grads]


@pytest.mark.parametrize("name", sorted(BUILDERS))
@pytest.mark.parametrize("n", [2, 4])
def test_forward_and_gradients_equal_unsplit(name, n):
    x, y = _data(name)
    ref = BUILDERS[name]()
    sp = sequence_parallel(BUILDERS[name](), devices=DEVICES[:n])
    assert np.abs(np.asarray(sp(x)) - np.asarray(ref(x))).max() <= TOL
    for a, b in zip(_grads(sp, x, y, graph=True), _grads(ref, x, y, graph=False)):
        assert np.abs(a - b).max() <= TOL


def test_fit_equals_unsplit_and_activations_are_split():
    x, y = _data("transformer")
    ref, sp = transformer(), sequence_parallel(transformer(), devices=DEVICES[:2])
    for m in (ref, sp):
        m.compile(keras.optimizers.SGD(0.05), LOSS)
    assert_fit_matches(sp, ref, x, y, tol=TOL)
    # Activation bytes per device, read from the traced forward pass (op outputs and
    # their devices) for the position-wise layers of the blocks: 1/N of the unsplit ones.
    spec = tf.TensorSpec((8, 8, 8, 1))

    def bytes_by_device(model, prefixes):
        graph = tf.function(lambda a: model(a, training=True)).get_concrete_function(spec).graph
        out = {}
        for op in graph.get_operations():
            if not any(part.startswith(prefixes) for part in op.name.split("/")[:2]):
                continue
            if op.type in ("ReadVariableOp", "Const"):  # weights, not activations
                continue
            for t in op.outputs:
                if t.shape.is_fully_defined() and t.dtype.is_floating:
                    device = op.device.split("device:")[-1] or "CPU:0"
                    out[device] = out.get(device, 0) + t.shape.num_elements() * t.dtype.size
        return out

    prefixes = tuple(f"block{b}_{part}" for b in range(2) for part in ("ln1", "ln2", "ff1", "ff2"))
    split = bytes_by_device(sp, prefixes)
    whole = sum(bytes_by_device(ref, prefixes).values())
    assert sorted(split) == ["CPU:0", "CPU:1"]
    for device, nbytes in split.items():
        assert nbytes == pytest.approx(whole / 2, rel=0.05), (device, nbytes, whole)


def test_composes_with_mirrored_replicas():
    x, y = _data("causal_lm")
    ref = causal_lm()
    sp = sequence_parallel(causal_lm(), devices=DEVICES, replicas=2)  # 2 replicas x 2 slices
    assert sp.replica_devices == [["/device:CPU:0", "/device:CPU:1"],
                                  ["/device:CPU:2", "/device:CPU:3"]]
    for m in (ref, sp):
        m.compile(keras.optimizers.SGD(0.1), LOSS)
    assert_fit_matches(sp, ref, x, y, tol=TOL)


def test_length_not_divisible_is_a_clear_error():
    assert nearest_valid_lengths(10, 4) == (8, 12)
    keras.utils.set_random_seed(0)
    inp = keras.Input((10, 8))
    h = keras.layers.LayerNormalization()(inp)
    model = keras.Model(inp, keras.layers.MultiHeadAttention(2, 4)(h, h))
    with pytest.raises(ValueError, match=r"Sequence length 10 does not divide over 4 devices"
                                         r".*the nearest are 8 and 12"):
        sequence_parallel(model, devices=DEVICES)
    with pytest.raises(ValueError, match="devices must be a list of device names"):
        sequence_parallel(model, devices="/cpu:0")

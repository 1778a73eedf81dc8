"""The cost model against independent measurements.

- Memory: TensorFlow's allocator statistics (`get_memory_info`) while a model's
  variables, Adam slots and gradients are created, in a fresh process
  (`experiments/state_memory.py`, TensorFlow's BFC allocator on every CPU), against
  `planning.replica_memory`'s parameter / optimizer / gradient bytes, with oneDNN off
  (the path of CPUs without AVX-512, where the default allocator keeps no
  statistics).
- FLOPs: TensorFlow's profiler on the model's own traced forward pass (plus the
  Einsum FLOPs it does not register: 2 x the product of the index sizes),
  against `planning.model_stats`, on a ViT, a GPT-2-style decoder with a tied head
  and ResNet50 (plain Keras and keras.applications; the KerasHub versions run in
  tests/split/test_zoo.py).
"""

import json

import numpy as np
import pytest

import keras
import tensorflow as tf

from tests.support import run_python
from tests.support import TiedEmbedding, profiler_flops
from tfdist import planning
from tfdist.planning import flops


@pytest.mark.timeout(120)
def test_memory_matches_the_allocator():
    # TF_ENABLE_ONEDNN_OPTS=0 takes the path of CPUs without AVX-512 VNNI/BF16 or AMX (an
    # AMD EPYC without AVX-512), where TensorFlow's default CPU allocator keeps no
    # statistics, on any CPU. The script's BFC allocator is the same on both paths;
    # notebook 05 runs it on this machine's default path.
    result = run_python("-m", "experiments.state_memory", timeout=100,
                        env={"TF_ENABLE_ONEDNN_OPTS": "0"})
    assert result.returncode == 0, result.stderr[-2000:]
    measured = json.loads(result.stdout.strip().splitlines()[-1])
    assert measured.pop("allocator").startswith("TensorFlow's BFC allocator")
    for part, (allocated, predicted) in measured.items():
        # The BFC allocator rounds every allocation up to 256 bytes and also counts the
        # small ones (biases, Adam's step counter): at most 0.2% above the exact sums
        # here (1%: a bound). A wrong slot count or dtype would be off by 2x.
        assert 1.0 <= allocated / predicted <= 1.01, (part, allocated, predicted)


class Patches(keras.layers.Layer):
    """Image -> patch embeddings plus a class token and positions (a ViT stem)."""

    def __init__(self, patch, dim, **kwargs):
        super().__init__(**kwargs)
        self.conv = keras.layers.Conv2D(dim, patch, strides=patch)
        self.dim = dim

    def build(self, shape):
        self.conv.build(shape)
        n = (shape[1] // self.conv.kernel_size[0]) * (shape[2] // self.conv.kernel_size[1])
        self.cls = self.add_weight(shape=(1, 1, self.dim), name="cls")
        self.pos = self.add_weight(shape=(1, n + 1, self.dim), name="pos")

    def call(self, x):
        h = self.conv(x)
        h = keras.ops.reshape(h, (keras.ops.shape(h)[0], -1, self.dim))
        cls = keras.ops.broadcast_to(self.cls, (keras.ops.shape(h)[0], 1, self.dim))
        return keras.ops.concatenate([cls, h], axis=1) + self.pos


def vit():
    inputs = keras.Input((32, 32, 3))
    x = Patches(8, 32)(inputs)
    for _ in range(2):
        h = keras.layers.LayerNormalization()(x)
        x = x + keras.layers.MultiHeadAttention(4, 8)(h, h)
        h = keras.layers.LayerNormalization()(x)
        x = x + keras.layers.Dense(32)(keras.layers.Dense(64, activation="gelu")(h))
    return keras.Model(inputs, keras.layers.Dense(10)(x[:, 0]))


def gpt():
    ids = keras.Input((None,), dtype="int32", name="token_ids")
    embed = TiedEmbedding(100, 32)
    x = embed(ids)
    for _ in range(2):
        h = keras.layers.LayerNormalization()(x)
        x = x + keras.layers.MultiHeadAttention(4, 8)(h, h, use_causal_mask=True)
        h = keras.layers.LayerNormalization()(x)
        x = x + keras.layers.Dense(32)(keras.layers.Dense(128, activation="gelu")(h))
    return keras.Model(ids, embed(x, reverse=True))


@pytest.mark.parametrize("name, build, shape, spec", [
    ("vit", vit, None, tf.TensorSpec((1, 32, 32, 3))),
    ("gpt", gpt, {"token_ids": (16,)}, tf.TensorSpec((1, 16), tf.int32)),
    ("resnet50", lambda: keras.applications.ResNet50(weights=None, input_shape=(32, 32, 3)),
     None, tf.TensorSpec((1, 32, 32, 3))),
])
def test_forward_flops_match_the_profiler(name, build, shape, spec):
    keras.utils.set_random_seed(0)
    model = build()
    stats = planning.model_stats(model, input_shapes=shape)
    ratio = stats.forward_flops_per_example / profiler_flops(model, spec)
    assert 0.95 <= ratio <= 1.05, (name, ratio)  # the target was 0.6-1.4
    # Per-layer FLOPs add up to the total, and the transformer blocks are seen.
    assert sum(layer.forward_flops for layer in stats.layers) == pytest.approx(
        stats.forward_flops_per_example)
    if name != "resnet50":
        attention = [l for l in stats.layers if l.class_name == "MultiHeadAttention"]
        assert attention and all(l.forward_flops > 0 for l in attention)


def test_einsum_flops_by_hand():
    assert flops.einsum_flops("abc,cd->abd", [(2, 3, 4), (4, 5)]) == 2 * 2 * 3 * 4 * 5
    assert flops.einsum_flops("...c,cd->...d", [(2, 3, 4), (4, 5)]) == 2 * 6 * 4 * 5


def test_text_model_needs_and_takes_input_shapes():
    keras.utils.set_random_seed(0)
    model = gpt()
    with pytest.raises(ValueError, match=r"Input 'token_ids' has shape \(None, None\).*"
                                         r"input_shapes=\{'token_ids': \(128,\)\}"):
        planning.model_stats(model)
    short = planning.model_stats(model, input_shapes={"token_ids": (8,)})
    long = planning.model_stats(model, input_shapes=[(16,)])
    # Position-wise layers double with the length; attention scores grow faster.
    assert 2.0 < long.forward_flops_per_example / short.forward_flops_per_example < 2.2
    assert long.activation_bytes_per_example > 1.9 * short.activation_bytes_per_example
    with pytest.raises(ValueError, match=r"input_shapes\['token_ids'\] must be 1 positive"):
        planning.model_stats(model, input_shapes={"token_ids": (0,)})
    with pytest.raises(ValueError, match=r"names inputs the model does not have: \['ids'\]"):
        planning.model_stats(model, input_shapes={"ids": (8,)})
    assert np.isfinite(long.forward_flops_per_example)

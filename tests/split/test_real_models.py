"""split_model on the patterns real models use, in plain Keras.

Each pattern is split over 2 logical CPUs and compared with the unsplit model
built with the same seed (same weights, same batches), in fp32: forward
outputs and weights after `fit` within 1e-5; every variable is read back from
its device. The KerasHub versions run in tests/split/test_zoo.py.
"""

import numpy as np
import pytest

import keras

import tfdist
from tfdist.split import SplitPlan
from tfdist.split.pipeline import check_placement

from tests.support import TiedEmbedding, assert_fit_matches

TOL = 1e-5
RNG = np.random.default_rng(0)
DEVICES = ["/cpu:0", "/cpu:1"]


def _dev(variable) -> str:
    value = getattr(variable, "value", variable)
    return value.device.split("device:")[-1]


def _train_both(build, x, y, *, plan=None, micro_batches=2,
                optimizer=lambda: keras.optimizers.SGD(0.05),
                loss="mse", epochs=2, **split_kwargs):
    """(split, reference) after the same fit; the split is checked fully placed."""
    reference = build()
    model = build()
    split = tfdist.split_model(model, plan=plan, devices=None if plan else DEVICES,
                               micro_batches=micro_batches, **split_kwargs)
    assert check_placement(split) == []
    assert np.allclose(np.asarray(split(x)), np.asarray(reference(x)), atol=TOL)
    for m in (split, reference):
        m.compile(optimizer(), loss)
    assert_fit_matches(split, reference, x, y, tol=TOL, epochs=epochs)
    return split, reference


# --- nested models ------------------------------------------------------------------------------
def nested_task_model(seed=0):
    """A backbone Functional nested in a task model, like KerasHub's XCausalLM(backbone)."""
    keras.utils.set_random_seed(seed)
    inp = keras.Input((12,), name="features")
    h = keras.layers.Dense(16, activation="relu", name="b0")(inp)
    h = keras.layers.Dense(16, activation="relu", name="b1")(h)
    h = keras.layers.Dense(16, activation="relu", name="b2")(h)
    backbone = keras.Model(inp, h, name="backbone")
    outer_in = keras.Input((12,), name="x")
    inner_seq = keras.Sequential([keras.Input((16,)), keras.layers.Dense(8, name="s0"),
                                  keras.layers.Dense(8, name="s1")], name="neck")
    out = keras.layers.Dense(1, name="head")(inner_seq(backbone(outer_in)))
    return keras.Model(outer_in, out, name="task")


def test_nested_functional_and_sequential_are_flattened_and_split_inside():
    x = RNG.standard_normal((16, 12)).astype("float32")
    y = RNG.standard_normal((16, 1)).astype("float32")
    split, _ = _train_both(nested_task_model, x, y)
    names = list(split.placed_layers())
    assert names == ["backbone/b0", "backbone/b1", "backbone/b2", "neck/s0", "neck/s1", "head"]
    # The backbone's own layers land on both devices: the cut runs through it.
    stage_of = {n: s for s, (_, ns) in enumerate(split.plan.stages) for n in ns}
    assert stage_of["backbone/b0"] == 0 and stage_of["head"] == 1
    assert {stage_of[n] for n in names if n.startswith(("backbone", "neck"))} == {0, 1}


def test_nested_call_with_training_argument_behaves_as_in_keras():
    """`base(x, training=False)`: Keras's Functional lets the outer call's `training`
    override it (fit runs the nested dropout), and inference keeps it off; the split
    does the same, so it trains equal (M=1: the same dropout masks)."""
    def build():
        keras.utils.set_random_seed(1)
        inp = keras.Input((6,))
        base = keras.Model(inp, keras.layers.Dropout(0.5, name="drop")(
            keras.layers.Dense(6, name="feat")(inp)), name="base")
        x = keras.Input((6,))
        return keras.Model(x, keras.layers.Dense(1, name="head")(base(x, training=False)))

    x = RNG.standard_normal((16, 6)).astype("float32")
    y = RNG.standard_normal((16, 1)).astype("float32")
    split, reference = _train_both(build, x, y, micro_batches=1)
    assert np.allclose(split.predict(x, verbose=0), reference.predict(x, verbose=0), atol=TOL)


# --- shared and tied layers ---------------------------------------------------------------------
def tied_lm(seed=0):
    keras.utils.set_random_seed(seed)
    ids = keras.Input((6,), dtype="int32", name="token_ids")
    embed = TiedEmbedding(20, 8, name="token_embedding")
    h = embed(ids)
    for i in range(3):
        h = keras.layers.Dense(8, activation="tanh", name=f"block_{i}")(h)
    logits = embed(h, reverse=True)  # second call: the LM head, tied to the embedding
    return keras.Model(ids, logits, name="tied_lm")


def test_tied_embedding_head_reads_the_embedding_across_devices_and_trains_equal():
    x = RNG.integers(0, 20, (16, 6)).astype("int32")
    y = RNG.integers(0, 20, (16, 6)).astype("int32")
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    split, _ = _train_both(tied_lm, x, y, loss=loss, optimizer=lambda: keras.optimizers.Adam(0.01))
    embed = split.placed_layers()["token_embedding"]
    assert [_dev(w) for w in embed.weights] == ["CPU:0"]  # one copy, on its first call's stage
    head = [n for s in split.stages for n in s.nodes if n.layer == "token_embedding"]
    assert len(head) == 2 and not head[1].first_call
    last = split.stages[-1]
    assert head[1] in last.nodes  # the head runs on the last stage, reading CPU:0's table
    # Its gradient flows back: the embedding changed, and Adam's slots sit on CPU:0.
    slots = [v for v in split.optimizer.variables if "token_embedding" in v.path]
    assert slots and {_dev(v) for v in slots} == {"CPU:0"}


def test_one_layer_called_twice_in_two_stages():
    def build():
        keras.utils.set_random_seed(3)
        inp = keras.Input((8,))
        shared = keras.layers.Dense(8, activation="tanh", name="shared")
        h = shared(inp)
        h = keras.layers.Dense(8, name="middle")(h)
        h = shared(h)
        return keras.Model(inp, keras.layers.Dense(1, name="out")(h))

    x = RNG.standard_normal((16, 8)).astype("float32")
    y = RNG.standard_normal((16, 1)).astype("float32")
    plan = SplitPlan.from_dict({"shared": "/cpu:0", "middle": "/cpu:1", "out": "/cpu:1"})
    split, _ = _train_both(build, x, y, plan=plan)
    second = [n for n in split.stages[1].nodes if n.layer == "shared"]
    assert len(second) == 1  # its second call runs on stage 1


# --- variables outside build(), layers whose configs do not round-trip ------------------------
class InitWeights(keras.layers.Layer):
    """Creates its weights in __init__ (as KerasHub layers do when the config has shapes),
    and has a get_config() that fails (as some real layers' do)."""

    def __init__(self, units, in_dim, **kwargs):
        super().__init__(**kwargs)
        self.w = self.add_weight(shape=(in_dim, units), initializer="glorot_uniform", name="w")
        self.scale = 3.0  # lost on a config round-trip: not in get_config

    def call(self, x):
        return keras.ops.tanh(keras.ops.matmul(x, self.w)) * self.scale

    def get_config(self):
        raise NotImplementedError("this layer cannot be serialized")


def test_init_weights_and_non_round_tripping_config_are_placed_and_equal():
    def build():
        keras.utils.set_random_seed(4)
        inp = keras.Input((8,))
        h = keras.layers.Dense(8, name="first")(inp)
        h = InitWeights(8, 8, name="custom_a")(h)
        h = InitWeights(4, 8, name="custom_b")(h)
        return keras.Model(inp, keras.layers.Dense(1, name="out")(h))

    x = RNG.standard_normal((16, 8)).astype("float32")
    y = RNG.standard_normal((16, 1)).astype("float32")
    plan = SplitPlan.from_dict({"first": "/cpu:0", "custom_a": "/cpu:0", "custom_b": "/cpu:1",
                                "out": "/cpu:1"})
    split, _ = _train_both(build, x, y, plan=plan)
    assert [_dev(w) for w in split.placed_layers()["custom_b"].weights] == ["CPU:1"]


# --- keras.applications, sequence lengths ---------------------------------------------------------
def test_keras_applications_mobilenet_v3_small_splits_and_trains_equal():
    def build():
        keras.utils.set_random_seed(5)
        return keras.applications.MobileNetV3Small(input_shape=(32, 32, 3), weights=None,
                                                   classes=4, include_preprocessing=False,
                                                   minimalistic=True)

    x = RNG.standard_normal((8, 32, 32, 3)).astype("float32")
    y = RNG.standard_normal((8, 4)).astype("float32")
    split, _ = _train_both(build, x, y, micro_batches=1, epochs=1)
    assert {d for d in tfdist.split.placement_summary(split)["param_bytes_per_device"]} == \
        {"CPU:0", "CPU:1"}


def test_report_with_unknown_sequence_length():
    keras.utils.set_random_seed(6)
    inp = keras.Input((None, 8))
    h = keras.layers.Dense(16, name="a")(inp)
    model = keras.Model(inp, keras.layers.Dense(2, name="b")(h))
    split = tfdist.split_model(model, devices=DEVICES)
    text = tfdist.placement_report(split, batch_size=4)
    assert "a (None, 16): 64*L B/sample" in text
    summary = tfdist.split.placement_summary(split, batch_size=4, sequence_length=10)
    assert summary["cuts"][0]["bytes_per_sample"] == 10 * 16 * 4
    assert summary["cuts"][0]["bytes_per_micro_batch"] == 4 * 10 * 16 * 4
    x = RNG.standard_normal((4, 7, 8)).astype("float32")
    assert np.allclose(split(x).numpy(), model(x).numpy(), atol=TOL)


# --- bad input -------------------------------------------------------------------------
def _model():
    keras.utils.set_random_seed(7)
    inp = keras.Input((4,))
    return keras.Model(inp, keras.layers.Dense(1, name="o")(keras.layers.Dense(4, name="i")(inp)))


@pytest.mark.parametrize("call, message", [
    (lambda m: tfdist.split_model("model", devices=DEVICES),
     r"needs a keras.Model .*Received: str"),
    (lambda m: tfdist.split_model(m, devices="/cpu:0"),
     r"devices must be a list of device names.*Received the string devices='/cpu:0'"),
    (lambda m: tfdist.split_model(m, devices=["/cpu:0", "/device:CPU:0"]),
     r"Each device may appear once.*repeated: \['/device:CPU:0'\]"),
    (lambda m: tfdist.split_model(m, devices=[0, 1]),
     r"device must be a TensorFlow device name.*Received: device=0"),
    (lambda m: tfdist.split_model(m, plan={"i": "/cpu:0", "o": "/cpu:1"}),
     r"plan must be a tfdist.split.SplitPlan.*Received: dict"),
    (lambda m: tfdist.split_model(m, plan=SplitPlan.from_dict({"i": "/cpu:0", "o": "/cpu:1"}),
                                  num_stages=2, balance_by="flops"),
     r"num_stages, balance_by shape the automatic plan; with plan= given they would be ignored"),
    (lambda m: tfdist.split_model(m, plan=SplitPlan.from_dict({"i": "/cpu:0", "o": "/cpu:1"}),
                                  device_weights=[1, 2]),
     r"device_weights shape the automatic plan"),
    (lambda m: tfdist.split_model(m, plan=SplitPlan.from_dict({"i": "/cpu:0", "o": "/cpu:1"}),
                                  devices=["/cpu:2", "/cpu:3"]),
     r"The plan uses devices .*CPU:0.* that devices= does not list"),
    (lambda m: tfdist.split_model(m, devices=DEVICES, balance_by="bytes"),
     r"balance_by must be one of params, flops, time. Received: balance_by='bytes'"),
    (lambda m: tfdist.split_model(m, devices=DEVICES, device_weights=[1, float("nan")]),
     r"device_weights must be 2 positive numbers"),
    (lambda m: tfdist.split_model(m, devices=DEVICES, schedule="pipedream"),
     r"schedule must be one of free, gpipe, 1f1b. Received: schedule='pipedream'"),
    (lambda m: tfdist.split_model(m, devices=DEVICES, schedule="1f1b", micro_batches=1),
     r"schedule='1f1b' needs at least as many micro-batches as stages.*micro_batches=1 for 2"),
    (lambda m: tfdist.split_model(keras.Sequential([keras.layers.Dense(2)]), devices=DEVICES),
     r"is not built"),
])
def test_bad_input_is_a_clear_error(call, message):
    with pytest.raises(ValueError, match=message):
        call(_model())


def test_dense_settings_that_cannot_be_sharded_are_refused_and_the_rest_carried():
    keras.utils.set_random_seed(8)
    inp = keras.Input((4,))
    dense = keras.layers.Dense(6, name="d", kernel_regularizer=keras.regularizers.L2(0.1),
                               kernel_constraint=keras.constraints.NonNeg(),
                               bias_initializer="ones")
    model = keras.Model(inp, keras.layers.Dense(1, name="o")(dense(inp)))
    split = tfdist.split_model(model, devices=DEVICES,
                               tensor_parallel={"d": ("column", ["/cpu:2", "/cpu:3"])})
    sharded = split.placed_layers()["d"]
    assert isinstance(sharded.kernel_regularizer, keras.regularizers.L2)
    assert isinstance(sharded.kernel_constraint, keras.constraints.NonNeg)
    x = RNG.standard_normal((8, 4)).astype("float32")
    # The penalty over the shards equals the unsplit layer's (0.1 * sum of squares).
    assert np.isclose(float(sum(split.losses)), float(sum(model.get_layer("d").losses)),
                      rtol=1e-6)
    assert np.allclose(split(x).numpy(), model(x).numpy(), atol=TOL)
    keras.utils.set_random_seed(8)
    ortho = keras.Model(inp, keras.layers.Dense(
        6, name="q", kernel_regularizer=keras.regularizers.OrthogonalRegularizer())(inp))
    with pytest.raises(ValueError, match=r"'q' cannot be split row-wise.*OrthogonalRegularizer"):
        tfdist.split_model(ortho, devices=["/cpu:0"],
                           tensor_parallel={"q": ("row", ["/cpu:2", "/cpu:3"])})

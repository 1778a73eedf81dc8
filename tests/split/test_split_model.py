"""split_model on 4 logical CPUs: real placement, GPipe equality, tensor and data parallel.

Devices are read from the actual variables and graph ops. Numbers are
compared with the unsplit model (same seed, same batches) in fp32.
"""

import numpy as np
import pytest

import keras
import tensorflow as tf

import tfdist
from tfdist.split import SplitPlan, plan_balanced, plan_from_rules

from tests.support import assert_fit_matches

TOL = 1e-5
RNG = np.random.default_rng(0)
X = RNG.standard_normal((64, 16)).astype("float32")
Y = RNG.standard_normal((64, 1)).astype("float32")


def _dev(variable) -> str:
    value = getattr(variable, "value", variable)
    return value.device.split("device:")[-1]


def residual_model(seed=1):
    keras.utils.set_random_seed(seed)
    inp = keras.Input((16,), name="x")
    a = keras.layers.Dense(32, activation="relu", name="d0")(inp)
    b = keras.layers.Dense(32, activation="tanh", name="d1")(a)
    c = keras.layers.Add(name="add")([a, b])  # `a` skips stage 1's first layer
    d = keras.layers.Dense(32, activation="relu", name="d2")(c)
    return keras.Model(inp, keras.layers.Dense(1, name="out")(d))


def sequential_model(seed=1):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((16,)),
                             keras.layers.Dense(32, activation="relu", name="s0"),
                             keras.layers.Dense(32, activation="relu", name="s1"),
                             keras.layers.Dense(1, name="s2")])


def _max_diff(a, b):
    return max(float(np.abs(x - y).max()) for x, y in zip(a, b))


def _fit(model, optimizer, epochs=1, batch_size=16):
    model.compile(optimizer, "mse")
    return model.fit(X, Y, batch_size=batch_size, epochs=epochs, shuffle=False,
                     verbose=0).history["loss"]


# --- placement ------------------------------------------------------------------------------
def test_variables_forward_backward_and_slots_on_planned_devices():
    plan = SplitPlan.from_dict({"d0": "/cpu:2", "d1": "/cpu:3", "add": "/cpu:3", "d2": "/cpu:3",
                                "out": "/cpu:3"})
    split = tfdist.split_model(residual_model(), plan=plan, micro_batches=2)
    want = {"d0": "CPU:2", "d1": "CPU:3", "d2": "CPU:3", "out": "CPU:3"}
    for name, layer in split.placed_layers().items():
        for w in layer.weights:
            assert _dev(w) == want[name], (w.path, _dev(w))
    split.compile(keras.optimizers.Adam(0.01), "mse")
    step = tf.function(lambda x, y: split.train_step((x, y)))
    ops = step.get_concrete_function(tf.TensorSpec((8, 16)), tf.TensorSpec((8, 1))).graph
    seen = {"forward": set(), "backward": set()}
    for op in ops.get_operations():
        if op.type not in ("MatMul", "BiasAddGrad", "ReluGrad", "TanhGrad"):
            continue
        layer = next((n for n in want if f"/{n}_" in op.name or f"/{n}/" in op.name), None)
        if layer is None:
            continue
        kind = "backward" if op.name.startswith("gradients") else "forward"
        assert op.device.endswith(want[layer]), (op.name, op.device)
        seen[kind].add(layer)
    assert seen["forward"] == set(want) and seen["backward"] == set(want)
    # Optimizer slots (Adam m and v) are created on their variable's device.
    split.optimizer.build(split.trainable_variables)
    slots = [v for v in split.optimizer.variables if "momentum" in v.path or "velocity" in v.path]
    assert len(slots) == 2 * len(split.trainable_variables)
    for v in slots:
        layer = v.path.split("/")[-1].rsplit("_", 2)[0]
        assert _dev(v) == want[layer], (v.path, _dev(v))


def test_get_weights_are_the_original_model_weights_in_order():
    model = residual_model()
    before = model.get_weights()
    split = tfdist.split_model(model, devices=["/cpu:0", "/cpu:1"])
    assert [w.shape for w in split.get_weights()] == [w.shape for w in model.get_weights()]
    assert _max_diff(split.get_weights(), before) == 0.0
    new = [w + 1.0 for w in model.get_weights()]
    split.set_weights(new)
    assert _max_diff(split.get_weights(), new) == 0.0
    # The split runs the model's own layers: the model sees the new weights, and its
    # variables now live on the planned devices.
    assert _max_diff(model.get_weights(), new) == 0.0
    assert [_dev(w) for w in model.get_layer("d0").weights] == ["CPU:0", "CPU:0"]
    assert {_dev(w) for w in model.get_layer("out").weights} == {"CPU:1"}


# --- pipeline ------------------------------------------------------------------------------
def test_pipeline_loss_and_gradients_equal_unsplit():
    model = residual_model()
    split = tfdist.split_model(model, devices=["/cpu:0", "/cpu:1"], micro_batches=4)
    split.compile(keras.optimizers.SGD(0.1), "mse")
    model.compile(keras.optimizers.SGD(0.1), "mse")

    @tf.function
    def split_grads(x, y):
        loss = split.compute_loss(x=x, y=y, y_pred=split(x, training=True))
        return loss, tf.gradients(loss, [v.value for v in split.trainable_variables])

    loss_s, grads_s = split_grads(X[:32], Y[:32])
    with tf.GradientTape() as tape:
        loss_u = model.compute_loss(x=X[:32], y=Y[:32], y_pred=model(X[:32], training=True))
    grads_u = tape.gradient(loss_u, model.trainable_variables)
    assert abs(float(loss_s) - float(loss_u)) <= TOL
    assert _max_diff([g.numpy() for g in grads_s], [g.numpy() for g in grads_u]) <= TOL


@pytest.mark.parametrize("micro_batches", [1, 4])
def test_fit_equals_unsplit(micro_batches):
    split = tfdist.split_model(residual_model(), devices=["/cpu:0", "/cpu:1"],
                               micro_batches=micro_batches)
    ref = residual_model()
    loss_s = _fit(split, keras.optimizers.Adam(0.01), epochs=2)
    loss_u = _fit(ref, keras.optimizers.Adam(0.01), epochs=2)
    assert np.allclose(loss_s, loss_u, atol=TOL)
    assert _max_diff(split.get_weights(), ref.get_weights()) <= TOL


def test_run_eagerly_falls_back_to_a_tape_with_equal_numbers():
    split = tfdist.split_model(sequential_model(), devices=["/cpu:0", "/cpu:1"], micro_batches=2)
    split.compile(keras.optimizers.SGD(0.05), "mse", run_eagerly=True)
    loss_s = split.fit(X, Y, batch_size=16, shuffle=False, verbose=0).history["loss"]
    loss_u = _fit(sequential_model(), keras.optimizers.SGD(0.05))
    assert np.allclose(loss_s, loss_u, atol=TOL)


def test_sequential_three_stages_and_report():
    split = tfdist.split_model(sequential_model(), devices=["/cpu:0", "/cpu:1", "/cpu:2"],
                               micro_batches=2)
    assert [s.device for s in split.stages] == ["/device:CPU:0", "/device:CPU:1",
                                                "/device:CPU:2"]
    loss_s = _fit(split, keras.optimizers.SGD(0.05))
    loss_u = _fit(sequential_model(), keras.optimizers.SGD(0.05))
    assert np.allclose(loss_s, loss_u, atol=TOL)
    text = tfdist.placement_report(split, batch_size=16)
    assert "expected bubble (K-1)/(M+K-1) = 0.500" in text
    assert "cut after stage 0: s0 (32,): 128 B/sample, 1.0 KiB per micro-batch of 8" in text
    summary = tfdist.split.placement_summary(split, batch_size=16)
    # params: s0 16*32+32 floats; optimizer: SGD without momentum has only counters on CPU:0
    assert summary["param_bytes_per_device"]["CPU:0"] == (16 * 32 + 32) * 4
    assert summary["param_bytes_per_device"]["CPU:2"] == (32 + 1) * 4


def test_skip_connection_crossing_a_cut_is_carried():
    plan = SplitPlan.from_dict({"d0": "/cpu:0", "d1": "/cpu:1", "add": "/cpu:2", "d2": "/cpu:2",
                                "out": "/cpu:2"})
    split = tfdist.split_model(residual_model(), plan=plan, micro_batches=2)
    crossing = [[t[0] for t in cut.tensors] for cut in split.cuts]
    assert crossing == [["d0"], ["d0", "d1"]]  # d0's output skips stage 1
    assert np.allclose(split(X).numpy(), residual_model()(X).numpy(), atol=TOL)


def test_adam_slot_bytes_in_report():
    split = tfdist.split_model(sequential_model(), devices=["/cpu:0", "/cpu:1"])
    _fit(split, keras.optimizers.Adam(0.01))
    summary = tfdist.split.placement_summary(split)
    params, opt = summary["param_bytes_per_device"], summary["optimizer_bytes_per_device"]
    # Adam keeps 2 slots per variable; iterations (int64) and learning_rate (fp32) add 12 B.
    assert opt["CPU:1"] == 2 * params["CPU:1"]
    assert opt["CPU:0"] == 2 * params["CPU:0"] + 12


# --- plans against a model ------------------------------------------------------------------
def test_plan_balanced_by_params_flops_time_and_weights():
    model = sequential_model()
    by_params = plan_balanced(model, 2, by="params", devices=["/cpu:0", "/cpu:1"])
    assert by_params.stages == (("/device:CPU:0", ("s0",)), ("/device:CPU:1", ("s1", "s2")))
    assert plan_balanced(model, 2, by="flops").num_stages == 2
    assert plan_balanced(model, 3, by="time").num_stages == 3
    heavy_first = plan_balanced(model, 2, by="params", device_weights=[1.0, 100.0])
    assert heavy_first.stages[0][1] == ("s0",)
    with pytest.raises(ValueError, match="has 3 layer.*num_stages=4"):
        plan_balanced(model, 4)
    with pytest.raises(ValueError, match="device_weights must be 2 positive"):
        plan_balanced(model, 2, device_weights=[1.0, 0.0])


def test_plan_from_rules_on_a_model():
    plan = plan_from_rules(residual_model(), {"^d[01]$": "/cpu:0", "add|d2|out": "/cpu:1"})
    assert plan.num_stages == 2
    with pytest.raises(ValueError, match="Ambiguous"):
        plan_from_rules(residual_model(), {"d": "/cpu:0", "add|out|d2": "/cpu:1"})


# --- tensor parallel ------------------------------------------------------------------------
def test_tensor_parallel_column_and_row_equal_unsplit():
    model = residual_model()
    tp = {"d0": ("column", ["/cpu:0", "/cpu:2"]), "d1": ("row", ["/cpu:1", "/cpu:3"])}
    plan = SplitPlan.from_dict({"d0": "/cpu:0", "d1": "/cpu:1", "add": "/cpu:1", "d2": "/cpu:1",
                                "out": "/cpu:1"})
    split = tfdist.split_model(model, plan=plan, micro_batches=2, tensor_parallel=tp)
    layers = split.placed_layers()
    assert [_dev(w) for w in layers["d0"].weights] == ["CPU:0", "CPU:0", "CPU:2", "CPU:2"]
    assert sorted(_dev(w) for w in layers["d1"].weights) == ["CPU:1", "CPU:1", "CPU:3"]
    assert [w.shape for w in split.get_weights()] == [w.shape for w in model.get_weights()]
    assert np.abs(split(X).numpy() - model(X).numpy()).max() <= TOL
    split.compile(keras.optimizers.SGD(0.05), "mse")
    step = tf.function(lambda x, y: split.train_step((x, y)))
    graph = step.get_concrete_function(tf.TensorSpec((8, 16)), tf.TensorSpec((8, 1))).graph
    matmul_devices = {"d0": set(), "d1": set()}
    for op in graph.get_operations():
        for name in matmul_devices:
            if op.type == "MatMul" and f"/{name}_" in op.name:
                matmul_devices[name].add(op.device.split("device:")[-1])
    # forward and gradient matmuls of each shard run on the shard's device
    assert matmul_devices == {"d0": {"CPU:0", "CPU:2"}, "d1": {"CPU:1", "CPU:3"}}
    loss_s = _fit(split, keras.optimizers.SGD(0.05))
    loss_u = _fit(residual_model(), keras.optimizers.SGD(0.05))
    assert np.allclose(loss_s, loss_u, atol=TOL)
    text = tfdist.placement_report(split)
    assert "column-split: CPU:0, CPU:2" in text and "row-split: CPU:1, CPU:3" in text


def test_tensor_parallel_rejects_non_dense():
    with pytest.raises(ValueError,
                       match="supports keras.layers.Dense and MultiHeadAttention.*'add'"):
        tfdist.split_model(residual_model(), devices=["/cpu:0", "/cpu:1"],
                           tensor_parallel={"add": ("column", ["/cpu:0", "/cpu:1"])})


def attention_model(seed=4):
    keras.utils.set_random_seed(seed)
    inp = keras.Input((6, 8), name="tokens")
    h = keras.layers.MultiHeadAttention(num_heads=4, key_dim=4, name="mha")(inp, inp)
    h = keras.layers.Add(name="res")([inp, h])
    out = keras.layers.Dense(1, name="head")(keras.layers.GlobalAveragePooling1D(name="pool")(h))
    return keras.Model(inp, out)


def test_tensor_parallel_attention_heads_equal_unsplit():
    model = attention_model()
    reference = attention_model()  # the split changes `model`'s attention in place
    tokens = RNG.standard_normal((16, 6, 8)).astype("float32")
    target = RNG.standard_normal((16, 1)).astype("float32")
    plan = SplitPlan.from_dict({"mha": "/cpu:0", "res": "/cpu:0", "pool": "/cpu:1",
                                "head": "/cpu:1"})
    split = tfdist.split_model(model, plan=plan, micro_batches=2,
                               tensor_parallel={"mha": ("column", ["/cpu:2", "/cpu:3"])})
    mha = split.placed_layers()["mha"]
    devices = sorted({_dev(w) for w in mha.weights})
    assert devices == ["CPU:0", "CPU:2", "CPU:3"]  # head shards; output bias on the stage device
    assert [w.shape for w in split.get_weights()] == [w.shape for w in reference.get_weights()]
    assert _max_diff(split.get_weights(), reference.get_weights()) == 0.0
    assert np.abs(split(tokens).numpy() - reference(tokens).numpy()).max() <= TOL
    split.compile(keras.optimizers.SGD(0.05), "mse")
    reference.compile(keras.optimizers.SGD(0.05), "mse")
    assert_fit_matches(split, reference, tokens, target, tol=TOL, epochs=1)
    assert "heads-split: CPU:0, CPU:2, CPU:3" in tfdist.placement_report(split)


# --- data parallel x pipeline ----------------------------------------------------------------
def test_two_replicas_by_two_stages_equal_single_device():
    split = tfdist.split_model(residual_model(), devices=["/cpu:0", "/cpu:1", "/cpu:2", "/cpu:3"],
                               micro_batches=2, replicas=2)
    assert split.replica_devices == [["/device:CPU:0", "/device:CPU:1"],
                                     ["/device:CPU:2", "/device:CPU:3"]]
    loss_s = _fit(split, keras.optimizers.SGD(0.05), epochs=2)
    ref = residual_model()
    loss_u = _fit(ref, keras.optimizers.SGD(0.05), epochs=2)
    assert np.allclose(loss_s, loss_u, atol=TOL)
    assert _max_diff(split.get_weights(), ref.get_weights()) <= TOL
    assert "replica 1: stages on CPU:2, CPU:3" in tfdist.placement_report(split)


# --- subclassed models -------------------------------------------------------------------------
class Chain(keras.Model):
    def __init__(self):
        super().__init__()
        self.a = keras.layers.Dense(8, activation="relu")
        self.b = keras.layers.Dense(1)

    def call(self, x):
        return self.b(self.a(x))


class Skip(Chain):
    def call(self, x):
        h = self.a(x)
        return self.b(h + h)


def test_subclassed_chain_is_traced_and_skip_is_rejected():
    keras.utils.set_random_seed(2)
    chain = Chain()
    chain(X[:2])
    split = tfdist.split_model(chain, devices=["/cpu:0", "/cpu:1"], input_shape=(16,))
    assert np.allclose(split(X).numpy(), chain(X).numpy(), atol=TOL)
    skip = Skip()
    skip(X[:2])
    with pytest.raises(ValueError, match="does not compute what its call"):
        tfdist.split_model(skip, devices=["/cpu:0", "/cpu:1"], input_shape=(16,))


# --- bad input ---------------------------------------------------------------------------------
def test_bad_input_errors():
    model = residual_model()
    with pytest.raises(ValueError, match="'/device:CPU:9' does not exist"):
        tfdist.split_model(model, devices=["/cpu:0", "/cpu:9"])
    with pytest.raises(ValueError, match="has 3 layer"):
        tfdist.split_model(sequential_model(), devices=["/cpu:0", "/cpu:1", "/cpu:2", "/cpu:3"])
    with pytest.raises(ValueError, match="micro_batches must be an integer >= 1"):
        tfdist.split_model(model, devices=["/cpu:0"], micro_batches=0)
    with pytest.raises(ValueError, match="replicas=3"):
        tfdist.split_model(model, devices=["/cpu:0", "/cpu:1"], replicas=3)
    plan = SplitPlan.from_dict({"d0": "/cpu:1", "d1": "/cpu:0", "add": "/cpu:0", "d2": "/cpu:0",
                                "out": "/cpu:0"})
    split = tfdist.split_model(model, plan=plan, micro_batches=4)
    with pytest.raises(ValueError, match="batch of 6 samples cannot be split into micro_batches=4"):
        split(X[:6], training=True)
    # Inference takes any batch (near-equal micro-batches, even empty ones).
    for n in (6, 3):
        assert np.allclose(split(X[:n]).numpy(), model(X[:n]).numpy(), atol=TOL)
    split.compile("sgd", "mse")
    with pytest.raises(ValueError, match="multiple of 4"):
        split.fit(X, Y, batch_size=10, verbose=0)
    with pytest.raises(ValueError, match="Layers without a device"):
        tfdist.split_model(model, plan=SplitPlan.from_dict({"d0": "/cpu:0"}))


def test_batch_normalization_rejected_with_micro_batches():
    keras.utils.set_random_seed(3)
    inp = keras.Input((16,))
    h = keras.layers.BatchNormalization(name="bn")(keras.layers.Dense(8, name="dd")(inp))
    model = keras.Model(inp, keras.layers.Dense(1, name="o")(h))
    with pytest.raises(ValueError, match=r"\['bn'\] keep batch statistics"):
        tfdist.split_model(model, devices=["/cpu:0", "/cpu:1"], micro_batches=2)
    split = tfdist.split_model(model, devices=["/cpu:0", "/cpu:1"], micro_batches=1)
    assert np.allclose(split(X).numpy(), model(X).numpy(), atol=TOL)


def test_split_from_options_auto_and_file(tmp_path):
    from tfdist import config
    from tfdist.split import split_from_options

    model = sequential_model()
    assert split_from_options(model, config.SplitOptions()) is model
    auto = split_from_options(model, config.SplitOptions(split="auto", stages=2,
                                                         micro_batches=2, split_balance="flops"))
    assert len(auto.stages) == 2 and auto.micro_batches == 2
    path = tmp_path / "plan.json"
    auto.plan.save(path)
    loaded = split_from_options(model, config.SplitOptions(split=str(path)))
    assert loaded.plan == auto.plan


def test_gpipe_schedule_equals_unsplit():
    split = tfdist.split_model(residual_model(), devices=["/cpu:0", "/cpu:1"], micro_batches=4,
                               schedule="gpipe")
    loss_s = _fit(split, keras.optimizers.SGD(0.05))
    loss_u = _fit(residual_model(), keras.optimizers.SGD(0.05))
    assert np.allclose(loss_s, loss_u, atol=TOL)

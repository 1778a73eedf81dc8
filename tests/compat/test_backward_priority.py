"""tfdist.compat.backward_priority: its canary (the private touch points), the control
dependencies it adds to a traced backward pass, values unchanged, and no cycle."""

import numpy as np
import pytest

import tfdist
from tests.support import conv_model
from tfdist.compat import backward_priority


def _gradients(model, prioritise: bool, seen: dict):
    """A tf.function returning the model's gradients; at trace time, with `prioritise`,
    gives each layer's gradients a bucket (last layer first) and records the edits."""
    tf = tfdist.import_tensorflow()
    variables = model.trainable_variables

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.square(model(x)))
        grads = tape.gradient(loss, variables)
        if prioritise:
            by_layer: dict = {}
            for g, v in zip(grads, variables):
                by_layer.setdefault(v.path.rsplit("/", 1)[0], []).append(g)
            seen["added"] = backward_priority.prioritise(list(reversed(by_layer.values())))
        seen["gated"] = sorted(
            (op.type, sorted(c.type for c in op.control_inputs))
            for op in tf.compat.v1.get_default_graph().get_operations()
            if op.type == "Conv2DBackpropInput")
        return grads

    return step


def test_canary_tensorflow_has_what_the_edits_need():
    # If this fails, TensorFlow changed a private touch point of
    # tfdist.compat.backward_priority (see its docstring).
    tf = tfdist.import_tensorflow()
    assert backward_priority.supported()
    model = conv_model((6, 6, 4), outputs=3, seed=1)
    names: list = []

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(model(x))
        grads = tape.gradient(loss, model.trainable_variables)
        names.extend(op.name for op in backward_priority.producers(grads))
        return grads

    step(tf.zeros((2, 6, 6, 4)))
    # every variable's gradient comes from an op under gradient_tape/
    assert len(names) == len(model.trainable_variables)
    assert all(backward_priority.TAPE_SCOPE in n for n in names)


def test_input_gradients_wait_for_the_weight_gradients_and_values_do_not_change():
    tf = tfdist.import_tensorflow()
    model = conv_model((6, 6, 4), outputs=3, seed=1)
    x = tf.constant(np.random.default_rng(0).standard_normal((4, 6, 6, 4)), tf.float32)
    plain_seen: dict = {}
    plain = [g.numpy() for g in _gradients(model, False, plain_seen)(x)]
    seen: dict = {}
    ordered = [g.numpy() for g in _gradients(model, True, seen)(x)]
    # Negative control: TensorFlow's own graph has no such order.
    assert plain_seen["gated"] == [("Conv2DBackpropInput", [])] * 3
    # Each conv layer computes its input's gradient only after its kernel's and its bias's
    # (a Sum over the same output gradient, then a Reshape).
    assert seen["gated"] == [("Conv2DBackpropInput", ["Conv2DBackpropFilter", "Reshape"])] * 3
    assert seen["added"] >= 4
    # The same values to float32 rounding (grappler may fuse the bias's sum differently
    # once the sum waits for the kernel gradient).
    for a, b in zip(plain, ordered):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def _exp_weighted_step(seen: dict):
    """A tf.function whose weight gradient is dy * exp(dy), exp(dy) also used by the input
    gradient (so it is not the weight gradient's own op): Exp reads dy, as the weight
    gradient's Mul does, and feeds it. Delaying Exp until Mul ran would be a cycle."""
    tf = tfdist.import_tensorflow()
    w = tf.Variable([0.5, 1.0, 2.0])

    @tf.custom_gradient
    def scaled(x, weight):
        def grad(dy):
            # named as TensorFlow names the ops of registered gradients
            with tf.name_scope(backward_priority.TAPE_SCOPE + "scaled"):
                e = tf.exp(dy)
                return dy * weight * e, dy * e
        return x * weight, grad

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(scaled(scaled(x, w), w))
        grads = tape.gradient(loss, [w])
        seen["added"] = backward_priority.prioritise([grads])
        return grads

    return step


def test_a_sibling_that_feeds_the_weight_gradient_is_never_made_to_wait_for_it():
    # The ancestor check leaves Exp alone, and the function runs.
    tf = tfdist.import_tensorflow()
    seen: dict = {}
    assert np.isfinite(_exp_weighted_step(seen)(tf.ones((3,)))[0].numpy()).all()
    assert seen["added"] >= 1  # the other reader of dy (the input gradient) does wait


def test_without_the_ancestor_check_the_last_check_takes_the_edits_back(monkeypatch, caplog):
    # Negative control for the test above: without the ancestor check Exp would wait for
    # Mul, a cycle; the topological sort at the end finds it, and the call's edits go.
    tf = tfdist.import_tensorflow()
    monkeypatch.setattr(backward_priority._Ancestry, "among", lambda self, op, above: False)
    monkeypatch.setattr(backward_priority, "_WARNED", False)
    seen: dict = {}
    assert np.isfinite(_exp_weighted_step(seen)(tf.ones((3,)))[0].numpy()).all()
    assert seen["added"] == 0
    assert "would close a cycle" in caplog.text


def test_without_either_check_the_graph_has_a_cycle(monkeypatch):
    # Negative control for both checks: the cycle is real.
    tf = tfdist.import_tensorflow()
    monkeypatch.setattr(backward_priority._Ancestry, "among", lambda self, op, above: False)
    monkeypatch.setattr(backward_priority, "_acyclic", lambda graph: True)
    with pytest.raises(Exception, match="(?i)cycle"):
        _exp_weighted_step({})(tf.ones((3,)))


def test_eager_gradients_are_left_alone():
    tf = tfdist.import_tensorflow()
    w = tf.Variable([1.0, 2.0])
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(w * w)
    assert backward_priority.prioritise([[tape.gradient(loss, w)]]) == 0


def test_a_gradient_clipped_by_the_global_norm_names_only_its_own_ops():
    # A custom train_step clipping by the global norm scales each gradient by a factor
    # computed from every gradient: walking back from one clipped gradient reaches them all
    # a few ops further up. Only the nearest backward op is the gradient's own.
    tf = tfdist.import_tensorflow()
    model = conv_model((6, 6, 4), outputs=3, seed=1)
    seen: dict = {}

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.square(model(x)))
        grads = tape.gradient(loss, model.trainable_variables)
        norm = tf.sqrt(tf.add_n([tf.reduce_sum(g * g) for g in grads]))
        clipped = [g * tf.minimum(1.0, 0.1 / norm) for g in grads]
        seen["own"] = [sorted(op.type for op in backward_priority.producers([g]))
                       for g in clipped]
        seen["all"] = len(backward_priority.producers(clipped))
        return clipped

    step(tf.zeros((2, 6, 6, 4)))
    kinds = {("Conv2DBackpropFilter",), ("Reshape",), ("MatMul",), ("BiasAddGrad",)}
    assert all(len(own) == 1 and tuple(own) in kinds for own in seen["own"]), seen["own"]
    assert seen["all"] == len(model.trainable_variables)

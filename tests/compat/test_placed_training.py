"""The upstream behaviour tfdist.compat.placed_training works around, still present?

If one of these fails, Keras/TensorFlow now places backward ops or slots
by itself and the workaround can be retired (or needs updating).
"""

import keras
import pytest
import tensorflow as tf

import tfdist
from tfdist.compat import _patch, placed_training


class _OnDevice(keras.layers.Layer):
    """Pins build (variables) and call (forward ops) of one Dense to a device."""

    def __init__(self, device, **kwargs):
        super().__init__(**kwargs)
        self.device_name = device
        self.inner = keras.layers.Dense(4, activation="relu")

    def build(self, input_shape):
        with tf.device(self.device_name):
            self.inner.build(input_shape)

    def call(self, x):
        with tf.device(self.device_name):
            return self.inner(x)


def _placed_model():
    inp = keras.Input((3,))
    return keras.Model(inp, _OnDevice("/cpu:3")(inp))


def _slot_devices_after_fit(optimizer):
    model = _placed_model()
    model.compile(optimizer, "mse")
    model.fit(tf.ones((4, 3)), tf.ones((4, 4)), batch_size=4, epochs=1, verbose=0)
    slots = [v for v in optimizer.variables if "momentum" in v.path or "velocity" in v.path]
    assert len(slots) == 4
    return {v.value.device.split("device:")[-1] for v in slots}


def test_upstream_slots_ignore_variable_device_and_fix_places_them():
    assert "CPU:3" not in _slot_devices_after_fit(keras.optimizers.Adam())  # upstream gap
    # (Split models compiled by earlier tests in this process may have installed it.)
    was_installed = placed_training.OPTIMIZER_SLOTS in tfdist.compat.installed()
    with tfdist.compat.uninstall_after():
        fixed = keras.optimizers.Adam()
        placed_training.colocate_optimizer_slots(fixed)
        assert placed_training.OPTIMIZER_SLOTS in tfdist.compat.installed()
        assert _slot_devices_after_fit(fixed) == {"CPU:3"}
        # Other optimizers pass straight through to Keras while the fix is installed.
        assert "CPU:3" not in _slot_devices_after_fit(keras.optimizers.Adam())
    assert (placed_training.OPTIMIZER_SLOTS in tfdist.compat.installed()) == was_installed


def test_changed_shapes_are_refused():
    with pytest.raises(_patch.CompatError, match=r"written for \(reference_variable, name, "
                                                 r"initializer\)"):
        placed_training.OPTIMIZER_SLOTS_FIX.check(lambda self, reference_variable: None)

    class OtherLoss(keras.Model):  # as if Keras changed the private loss helper
        def _compute_loss(self, x, y):
            return 0.0

    with pytest.raises(_patch.CompatError, match=r"keras.Model._compute_loss takes \(x, y\)"):
        placed_training._check_train_step(OtherLoss())


def test_upstream_tape_gradients_ignore_forward_device_and_fix_colocates():
    model = _placed_model()
    model.compile(keras.optimizers.SGD(), "mse")
    spec = (tf.TensorSpec((2, 3)), tf.TensorSpec((2, 4)))

    def grad_devices(step):
        graph = tf.function(step).get_concrete_function(*spec).graph
        return {op.device for op in graph.get_operations()
                if op.type == "ReluGrad" or (op.type == "MatMul" and "grad" in op.name.lower())}

    tape_devices = grad_devices(lambda x, y: model.train_step((x, y)))
    assert tape_devices and not any(d.endswith("CPU:3") for d in tape_devices)  # upstream gap
    fixed = grad_devices(lambda x, y: placed_training.placed_train_step(model, (x, y)))
    assert fixed and all(d.endswith("CPU:3") for d in fixed)


def test_keras_graph_reads_nodes_in_order_and_moves_variables():
    """The private Keras structure tfdist.compat.keras_graph reads, still there and working."""
    from tfdist.compat import keras_graph

    inp = keras.Input((3,), name="x")
    d1 = keras.layers.Dense(4, name="d1")
    out = keras.layers.Dense(2, name="d2")(d1(inp, training=False))
    model = keras.Model(inp, out)
    nodes = keras_graph.graph_nodes(model)
    assert [n.operation.name for n in nodes] == ["d1", "d2"]
    assert nodes[0].kwargs == {"training": False} and nodes[0].inputs == (inp,)
    variable = d1.kernel
    before = variable.numpy()
    keras_graph.move_variable(variable, "/cpu:3")
    assert d1.kernel is variable  # the same Keras variable, new storage
    assert variable.value.device.endswith("CPU:3")
    assert (variable.numpy() == before).all()
    assert model(tf.ones((1, 3))).shape == (1, 2)

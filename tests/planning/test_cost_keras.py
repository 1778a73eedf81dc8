"""Memory accounting against the real variables, gradients and optimizer slots of Keras models."""

import math

import numpy as np
import pytest

from tfdist import planning
from tfdist._tf import import_tensorflow

tf = import_tensorflow()
import keras  # noqa: E402


def _nbytes(tensors):
    return sum(math.prod(t.shape) * np.dtype(t.dtype.name if hasattr(t.dtype, "name")
                                             else t.dtype).itemsize for t in tensors)


def _mlp():
    return keras.Sequential([
        keras.Input((20,)), keras.layers.Dense(64, activation="relu"),
        keras.layers.BatchNormalization(), keras.layers.Dropout(0.1), keras.layers.Dense(10),
    ], name="mlp")


def _cnn():
    inputs = keras.Input((16, 16, 3))
    x = keras.layers.Conv2D(8, 3, padding="same", activation="relu")(inputs)
    x = keras.layers.MaxPooling2D()(x)
    x = keras.layers.Conv2D(16, 3)(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    return keras.Model(inputs, keras.layers.Dense(5)(x), name="cnn")


def _transformer():
    inputs = keras.Input((12,), dtype="int32")
    x = keras.layers.Embedding(50, 16)(inputs)
    attention = keras.layers.MultiHeadAttention(num_heads=2, key_dim=8)(x, x)
    x = keras.layers.LayerNormalization()(x + attention)
    x = keras.layers.Dense(32, activation="relu")(x)
    x = keras.layers.GlobalAveragePooling1D()(x)
    return keras.Model(inputs, keras.layers.Dense(3)(x), name="transformer")


def _nested():
    inner = keras.Sequential([keras.Input((6,)), keras.layers.Dense(4)], name="inner")
    inputs = keras.Input((6,))
    return keras.Model(inputs, keras.layers.Dense(2)(inner(inputs)), name="outer")


MODELS = {"mlp": _mlp, "cnn": _cnn, "transformer": _transformer, "nested": _nested}
OPTIMIZERS = {
    "sgd": lambda: keras.optimizers.SGD(),
    "momentum": lambda: keras.optimizers.SGD(momentum=0.9),
    "adam": lambda: keras.optimizers.Adam(),
    "adamw": lambda: keras.optimizers.AdamW(),
    "adam_amsgrad": lambda: keras.optimizers.Adam(amsgrad=True),
    "rmsprop_centered": lambda: keras.optimizers.RMSprop(momentum=0.5, centered=True),
    "adagrad": lambda: keras.optimizers.Adagrad(),
    "nadam": lambda: keras.optimizers.Nadam(),
    "lion": lambda: keras.optimizers.Lion(),
    "adam_schedule": lambda: keras.optimizers.Adam(
        keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.9)),
    "adam_ema": lambda: keras.optimizers.Adam(use_ema=True),
    "adam_accumulate": lambda: keras.optimizers.Adam(gradient_accumulation_steps=2),
    "loss_scale": lambda: keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam()),
}


def _inputs(model, batch):
    spec = model.inputs[0]
    shape = (batch,) + tuple(spec.shape[1:])
    if "int" in str(spec.dtype):
        return np.random.default_rng(0).integers(0, 50, size=shape).astype("int32")
    return np.random.default_rng(0).normal(size=shape).astype("float32")


@pytest.mark.parametrize("model_name", sorted(MODELS))
def test_params_and_grads_equal_the_real_variables_and_gradients(model_name):
    model = MODELS[model_name]()
    stats = planning.model_stats(model)
    memory = planning.replica_memory(stats, per_replica_batch_size=4, optimizer="sgd")
    assert memory.parameters == _nbytes(model.trainable_variables)
    assert stats.num_params == model.count_params() - sum(
        math.prod(w.shape) for w in model.non_trainable_weights)
    assert memory.non_trainable == _nbytes(model.non_trainable_variables)
    with tf.GradientTape() as tape:
        out = model(_inputs(model, 4), training=True)
        loss = tf.reduce_mean(out ** 2)
    grads = tape.gradient(loss, model.trainable_variables)
    assert memory.gradients == _nbytes(grads)


@pytest.mark.parametrize("optimizer_name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("model_name", ["mlp", "transformer"])
def test_optimizer_state_equals_the_built_optimizer_variables(model_name, optimizer_name):
    model = MODELS[model_name]()
    optimizer = OPTIMIZERS[optimizer_name]()
    optimizer.build(model.trainable_variables)
    memory = planning.replica_memory(planning.model_stats(model), per_replica_batch_size=1,
                                     optimizer=planning.optimizer_state(optimizer))
    assert memory.optimizer == _nbytes(optimizer.variables)


def test_compiled_optimizer_is_read_by_the_planner():
    import tfdist

    model = _mlp()
    model.compile(optimizer=keras.optimizers.SGD(momentum=0.9), loss="mse")
    plan = tfdist.plan(model, global_batch_size=8, machine=planning.Machine(
        device=planning.Device(kind="CPU", memory=2**30), link=planning.Link(bandwidth=1e9)))
    assert plan.optimizer.slots_per_variable == 1
    assert plan.recommended == "default"


@pytest.mark.parametrize("model_name", ["mlp", "cnn"])
def test_activations_are_the_layer_outputs(model_name):
    model = MODELS[model_name]()
    stats = planning.model_stats(model)
    # Independent count: run a model returning every layer's output.
    probe = keras.Model(model.inputs[0], [layer.output for layer in model.layers
                                       if not isinstance(layer, keras.layers.InputLayer)])
    batch = 3
    values = probe(_inputs(model, batch))
    assert stats.activation_bytes_per_example * batch == _nbytes(values)
    memory = planning.replica_memory(stats, per_replica_batch_size=batch)
    assert memory.activations == _nbytes(values)


def test_nested_models_are_expanded_into_their_layers():
    stats = planning.model_stats(_nested())
    assert [layer.name.split("/")[0] for layer in stats.layers] == ["inner", stats.layers[1].name]
    assert [layer.output_shape for layer in stats.layers] == [(4,), (2,)]
    assert stats.activation_bytes_per_example == (4 + 2) * 4
    # each Dense: 2 x inputs x units (matmul) + units (bias add)
    assert stats.forward_flops_per_example == 2 * (6 * 4 + 4 * 2) + 4 + 2


def test_flops_by_hand():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((20,))
    h = keras.layers.Dense(64, activation="relu")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(10)(h))
    # matmul 2*in*out, bias add 1 per output, relu 1 per output
    assert planning.model_stats(model).forward_flops_per_example == \
        2 * 20 * 64 + 64 + 64 + 2 * 64 * 10 + 10
    cnn = planning.model_stats(_cnn())
    # conv1: 3x3x3 per output of 16x16x8, + bias + relu; pool 2x2 windows over 8x8x8;
    # conv2: 3x3x8 per output of 6x6x16 + bias; global average: its 6x6x16 inputs;
    # dense 16x5 + bias.
    assert cnn.forward_flops_per_example == (
        2 * 27 * 2048 + 2048 + 2048 + 4 * 512 + 2 * 72 * 576 + 576 + 576 + 2 * 16 * 5 + 5)
    assert [layer.class_name for layer in cnn.layers][:2] == ["Conv2D", "MaxPooling2D"]


def test_unbuilt_model_is_rejected():
    model = keras.Sequential([keras.layers.Dense(3)], name="lazy")
    with pytest.raises(ValueError, match=r"Model 'lazy' is not built \(it has no variables yet\)"):
        planning.model_stats(model)


def test_subclassed_model_without_symbolic_outputs_is_rejected():
    class Sub(keras.Model):
        def __init__(self):
            super().__init__(name="sub")
            self.dense = keras.layers.Dense(3)

        def call(self, x):
            return self.dense(x)

    model = Sub()
    model(np.zeros((1, 4), "float32"))
    with pytest.raises(ValueError, match=r"Cannot analyse subclassed model 'sub' \(Sub\): its "
                                         r"layers have no symbolic graph.*from_param_count"):
        planning.model_stats(model)


def test_unknown_dimensions_are_rejected():
    inputs = keras.Input((None, 4))
    model = keras.Model(inputs, keras.layers.Dense(2)(inputs), name="ragged")
    with pytest.raises(ValueError, match=r"Input '.*' has shape \(None, None, 4\): dimensions "
                                         r"besides the batch are unknown.*input_shapes="):
        planning.model_stats(model)
    # Given the length, it traces: 2 x 4 x 2 per position + bias, over 7 positions.
    stats = planning.model_stats(model, input_shapes=(7, 4))
    assert stats.forward_flops_per_example == 7 * (2 * 4 * 2 + 2)
    assert stats.activation_bytes_per_example == 7 * 2 * 4

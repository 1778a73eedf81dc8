"""Tensor parallelism: one Dense layer's matmul split across devices (Megatron-style).

Column-parallel: the kernel's output columns are split; device i computes
`x @ W[:, cols_i] + b[cols_i]` and the slices are concatenated. Every output
element is the same dot product as the unsplit layer, so results are
bit-identical. Row-parallel: the kernel's input rows are split; device i
computes `x[..., rows_i] @ W[rows_i, :]` and the partial products are summed
(then bias and activation), which equals the unsplit layer up to fp32
summation order. A column-parallel layer followed by a row-parallel one needs
no gather in between in Megatron; here each layer is self-contained (inputs
arrive whole, outputs leave whole) so any Dense can be split on its own.
"""

from __future__ import annotations

import types

import numpy as np

from tfdist._tf import import_tensorflow
from tfdist.compat import keras_attention

import_tensorflow()  # quietly, before keras imports TensorFlow itself

import keras  # noqa: E402


def _shard_sizes(total: int, parts: int) -> list[int]:
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


@keras.saving.register_keras_serializable(package="tfdist")
class ShardedDense(keras.layers.Layer):
    """A Dense layer whose kernel (and bias) live in shards on several devices.

    Args:
      units, activation, use_bias: as keras.layers.Dense.
      mode: "column" or "row".
      devices: one device per shard.
      output_device: where the shards' results are combined.

    `get_weights()` / `set_weights()` use the unsplit Dense layout
    ([kernel, bias]), so weights move between this and a Dense unchanged.
    """

    def __init__(self, units, *, activation=None, use_bias=True, mode="column",
                 devices=(), output_device=None, kernel_initializer="glorot_uniform",
                 bias_initializer="zeros", kernel_regularizer=None, bias_regularizer=None,
                 kernel_constraint=None, bias_constraint=None, **kwargs):
        super().__init__(**kwargs)
        if mode not in ("column", "row"):
            raise ValueError(f"mode must be 'column' or 'row'. Received: mode={mode!r}")
        self.units = int(units)
        self.activation = keras.activations.get(activation)
        self.use_bias = bool(use_bias)
        self.mode = mode
        self.shard_devices = tuple(devices)
        self.output_device = output_device or self.shard_devices[0]
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        self.bias_initializer = keras.initializers.get(bias_initializer)
        self.kernel_regularizer = keras.regularizers.get(kernel_regularizer)
        self.bias_regularizer = keras.regularizers.get(bias_regularizer)
        self.kernel_constraint = keras.constraints.get(kernel_constraint)
        self.bias_constraint = keras.constraints.get(bias_constraint)

    @classmethod
    def from_dense(cls, layer, *, mode, devices, output_device=None):
        """A ShardedDense carrying a Dense layer's whole configuration.

        Raises:
          ValueError: not a Dense, or a setting that would change meaning when
            the kernel is cut into shards (naming it): a regularizer that does
            not add up over shards (only L1/L2/L1L2 do), a norm constraint
            across the split axis, LoRA or quantization.
        """
        if not isinstance(layer, keras.layers.Dense):
            raise ValueError(
                f"Tensor parallelism supports keras.layers.Dense and MultiHeadAttention "
                f"layers. Received: "
                f"{layer.name!r} of type {type(layer).__name__}. Remove it from "
                "tensor_parallel or place it whole on one device."
            )
        config = layer.get_config()
        problems = []
        if config.get("lora_rank"):
            problems.append(f"lora_rank={config['lora_rank']} (LoRA adapters are not sharded)")
        if config.get("quantization_config") or getattr(layer, "quantization_mode", None):
            problems.append("quantization (quantized kernels are not sharded)")
        for which in ("kernel", "bias"):
            reg = getattr(layer, f"{which}_regularizer", None)
            if reg is not None and type(reg) not in _ADDITIVE_REGULARIZERS:
                problems.append(
                    f"{which}_regularizer={type(reg).__name__} (a sum over shards equals it "
                    "only for L1, L2 and L1L2)")
            constraint = getattr(layer, f"{which}_constraint", None)
            if constraint is not None and not _constraint_shardable(constraint, which, mode):
                problems.append(
                    f"{which}_constraint={type(constraint).__name__} (it normalises across the "
                    f"axis a {mode} split cuts)")
        if problems:
            raise ValueError(
                f"Dense layer {layer.name!r} cannot be split {mode}-wise without changing what "
                f"it computes: {'; '.join(problems)}. Remove it from tensor_parallel, or drop "
                "these settings.")
        return cls(layer.units, activation=config["activation"], use_bias=layer.use_bias,
                   mode=mode, devices=devices, output_device=output_device,
                   kernel_initializer=config["kernel_initializer"],
                   bias_initializer=config["bias_initializer"],
                   kernel_regularizer=config["kernel_regularizer"],
                   bias_regularizer=config["bias_regularizer"],
                   kernel_constraint=config["kernel_constraint"],
                   bias_constraint=config["bias_constraint"],
                   activity_regularizer=layer.activity_regularizer,
                   trainable=layer.trainable, name=layer.name, dtype=layer.dtype_policy)

    def build(self, input_shape):
        tf = import_tensorflow()
        in_dim = int(input_shape[-1])
        n = len(self.shard_devices)
        split_dim = self.units if self.mode == "column" else in_dim
        if split_dim < n:
            raise ValueError(
                f"Layer {self.name!r} cannot be split {self.mode}-wise over {n} devices: it has "
                f"only {split_dim} {'output units' if self.mode == 'column' else 'input features'}."
            )
        self.sizes = _shard_sizes(split_dim, n)
        self.kernels, self.biases = [], []
        for i, (device, size) in enumerate(zip(self.shard_devices, self.sizes)):
            shape = (in_dim, size) if self.mode == "column" else (size, self.units)
            with tf.device(device):
                self.kernels.append(self.add_weight(
                    name=f"kernel_shard{i}", shape=shape, initializer=self.kernel_initializer,
                    regularizer=self.kernel_regularizer, constraint=self.kernel_constraint))
                if self.use_bias and self.mode == "column":
                    self.biases.append(self.add_weight(
                        name=f"bias_shard{i}", shape=(size,), initializer=self.bias_initializer,
                        regularizer=self.bias_regularizer, constraint=self.bias_constraint))
        if self.use_bias and self.mode == "row":
            with tf.device(self.output_device):
                self.biases.append(self.add_weight(
                    name="bias", shape=(self.units,), initializer=self.bias_initializer,
                    regularizer=self.bias_regularizer, constraint=self.bias_constraint))

    def _devices(self):
        mapping = getattr(self, "device_map", None)
        shards = [mapping(d) for d in self.shard_devices] if mapping else list(self.shard_devices)
        out = mapping(self.output_device) if mapping else self.output_device
        return shards, out

    def call(self, inputs):
        tf = import_tensorflow()
        from keras import ops

        shard_devices, output_device = self._devices()

        if self.mode == "column":
            parts = []
            for i, device in enumerate(shard_devices):
                with tf.device(device):
                    y = ops.matmul(inputs, self.kernels[i])
                    if self.use_bias:
                        y = y + self.biases[i]
                    parts.append(y)
            with tf.device(output_device):
                y = ops.concatenate(parts, axis=-1)
                return self.activation(y) if self.activation is not None else y
        offsets = np.cumsum([0] + self.sizes)
        parts = []
        for i, device in enumerate(shard_devices):
            with tf.device(device):
                parts.append(ops.matmul(inputs[..., offsets[i]:offsets[i + 1]], self.kernels[i]))
        with tf.device(output_device):
            y = tf.add_n(parts)
            if self.use_bias:
                y = y + self.biases[0]
            return self.activation(y) if self.activation is not None else y

    def compute_output_shape(self, input_shape):
        return tuple(input_shape[:-1]) + (self.units,)

    # --- the unsplit Dense layout -------------------------------------------------------
    def get_weights(self):
        axis = 1 if self.mode == "column" else 0
        kernel = np.concatenate([k.numpy() for k in self.kernels], axis=axis)
        if not self.use_bias:
            return [kernel]
        if self.mode == "column":
            return [kernel, np.concatenate([b.numpy() for b in self.biases])]
        return [kernel, self.biases[0].numpy()]

    def set_weights(self, weights):
        weights = list(weights)
        expected = 2 if self.use_bias else 1
        if len(weights) != expected:
            raise ValueError(f"{self.name}: expected {expected} arrays ([kernel, bias] of the "
                             f"unsplit Dense). Received: {len(weights)}")
        offsets = np.cumsum([0] + self.sizes)
        for i, k in enumerate(self.kernels):
            sl = slice(offsets[i], offsets[i + 1])
            k.assign(weights[0][:, sl] if self.mode == "column" else weights[0][sl, :])
        if self.use_bias:
            if self.mode == "column":
                for i, b in enumerate(self.biases):
                    b.assign(weights[1][offsets[i]:offsets[i + 1]])
            else:
                self.biases[0].assign(weights[1])

    def get_config(self):
        config = super().get_config()
        ser = keras.saving.serialize_keras_object
        config.update(units=self.units, activation=keras.activations.serialize(self.activation),
                      use_bias=self.use_bias, mode=self.mode, devices=list(self.shard_devices),
                      output_device=self.output_device,
                      kernel_initializer=ser(self.kernel_initializer),
                      bias_initializer=ser(self.bias_initializer),
                      kernel_regularizer=ser(self.kernel_regularizer),
                      bias_regularizer=ser(self.bias_regularizer),
                      kernel_constraint=ser(self.kernel_constraint),
                      bias_constraint=ser(self.bias_constraint))
        return config


# Penalties that add up over disjoint shards of a tensor (sums of |w| or w^2).
_ADDITIVE_REGULARIZERS = (keras.regularizers.L1, keras.regularizers.L2, keras.regularizers.L1L2)


def _constraint_shardable(constraint, which: str, mode: str) -> bool:
    """Element-wise constraints always shard; per-column norms (axis 0 of the
    kernel) survive a column split, which keeps whole columns together."""
    if isinstance(constraint, keras.constraints.NonNeg):
        return True
    norm_types = (keras.constraints.MaxNorm, keras.constraints.MinMaxNorm,
                  keras.constraints.UnitNorm)
    if isinstance(constraint, norm_types):
        axis = getattr(constraint, "axis", 0)
        return which == "kernel" and mode == "column" and axis in (0, -2)
    return False


def _einsum_split_letter(equation: str, mode: str) -> tuple[str, str, str, str]:
    inputs, out_spec = equation.split("->")
    in_spec, k_spec = inputs.split(",")
    if mode == "column":  # a kernel axis that survives into the output: heads / features out
        letters = [c for c in k_spec if c in out_spec and c not in in_spec]
    else:  # a contracted axis: heads / features in
        letters = [c for c in k_spec if c in in_spec and c not in out_spec]
    if not letters:
        raise ValueError(f"EinsumDense '{equation}' has no axis to split {mode}-wise.")
    return letters[0], in_spec, k_spec, out_spec


@keras.saving.register_keras_serializable(package="tfdist")
class ShardedEinsumDense(keras.layers.Layer):
    """An EinsumDense split over devices along one kernel axis (the heads of attention).

    Column mode splits an output axis of the kernel (query/key/value
    projections: the heads); row mode splits a contracted axis (the output
    projection: the heads again), summing the partial results.
    """

    def __init__(self, equation, kernel_shape, *, bias_axes=None, bias_shape=None,
                 activation=None, mode="column", devices=(), output_device=None, **kwargs):
        super().__init__(**kwargs)
        self.equation = equation
        self.kernel_shape = tuple(int(d) for d in kernel_shape)
        self.bias_axes = bias_axes
        self.bias_shape = None if bias_shape is None else tuple(int(d) for d in bias_shape)
        self.activation = keras.activations.get(activation)
        self.mode = mode
        self.shard_devices = tuple(devices)
        self.output_device = output_device or self.shard_devices[0]
        self.letter, self.in_spec, self.k_spec, self.out_spec = _einsum_split_letter(
            equation, mode)
        self.k_axis = self.k_spec.index(self.letter)
        total = self.kernel_shape[self.k_axis]
        if total < len(self.shard_devices):
            raise ValueError(f"{self.name}: axis of size {total} cannot be split over "
                             f"{len(self.shard_devices)} devices.")
        self.sizes = _shard_sizes(total, len(self.shard_devices))
        self.b_axis = (bias_axes.index(self.letter)
                       if bias_axes and mode == "column" and self.letter in bias_axes else None)

    @classmethod
    def from_einsum_dense(cls, layer, *, mode, devices, output_device=None):
        bias = getattr(layer, "bias", None)
        return cls(layer.equation, layer.kernel.shape, bias_axes=layer.bias_axes,
                   bias_shape=None if bias is None else bias.shape,
                   activation=keras.activations.serialize(layer.activation)
                   if layer.activation is not None else None,
                   mode=mode, devices=devices, output_device=output_device,
                   name=layer.name, dtype=layer.dtype_policy)

    def build(self, input_shape):
        tf = import_tensorflow()
        self.kernels, self.biases = [], []
        for i, (device, size) in enumerate(zip(self.shard_devices, self.sizes)):
            shape = list(self.kernel_shape)
            shape[self.k_axis] = size
            with tf.device(device):
                self.kernels.append(self.add_weight(name=f"kernel_shard{i}", shape=shape,
                                                    initializer="glorot_uniform"))
                if self.bias_shape is not None and self.b_axis is not None:
                    b_shape = list(self.bias_shape)
                    b_shape[self.b_axis] = size
                    self.biases.append(self.add_weight(name=f"bias_shard{i}", shape=b_shape,
                                                       initializer="zeros"))
        if self.bias_shape is not None and self.b_axis is None:
            with tf.device(self.output_device):
                self.biases.append(self.add_weight(name="bias", shape=self.bias_shape,
                                                   initializer="zeros"))

    def _devices(self):
        mapping = getattr(self, "device_map", None)
        shards = [mapping(d) for d in self.shard_devices] if mapping else list(self.shard_devices)
        return shards, (mapping(self.output_device) if mapping else self.output_device)

    def call(self, inputs):
        tf = import_tensorflow()
        from keras import ops

        shard_devices, output_device = self._devices()
        parts = []
        if self.mode == "row":
            in_axis = self.in_spec.index(self.letter) - len(self.in_spec)
            pieces = tf.split(inputs, self.sizes, axis=in_axis)
        for i, device in enumerate(shard_devices):
            with tf.device(device):
                x = inputs if self.mode == "column" else pieces[i]
                y = ops.einsum(self.equation, x, self.kernels[i])
                if self.mode == "column" and self.b_axis is not None:
                    y = y + self.biases[i]
                parts.append(y)
        with tf.device(output_device):
            if self.mode == "column":
                y = ops.concatenate(parts, axis=self.out_spec.index(self.letter))
                if self.bias_shape is not None and self.b_axis is None:
                    y = y + self.biases[0]
            else:
                y = tf.add_n(parts)
                if self.bias_shape is not None:
                    y = y + self.biases[0]
            return self.activation(y) if self.activation is not None else y

    def get_weights(self):
        kernel = np.concatenate([k.numpy() for k in self.kernels], axis=self.k_axis)
        if self.bias_shape is None:
            return [kernel]
        if self.b_axis is not None:
            return [kernel, np.concatenate([b.numpy() for b in self.biases], axis=self.b_axis)]
        return [kernel, self.biases[0].numpy()]

    def set_weights(self, weights):
        offsets = np.cumsum([0] + self.sizes)
        for i, k in enumerate(self.kernels):
            k.assign(np.take(weights[0], range(offsets[i], offsets[i + 1]), axis=self.k_axis))
        if self.bias_shape is not None:
            if self.b_axis is not None:
                for i, b in enumerate(self.biases):
                    b.assign(np.take(weights[1], range(offsets[i], offsets[i + 1]),
                                     axis=self.b_axis))
            else:
                self.biases[0].assign(weights[1])


def shard_attention(layer, *, devices, output_device) -> None:
    """Splits a built MultiHeadAttention's projections by heads over `devices`, in place.

    Query, key and value projections are column-parallel (each device
    computes its heads), the output projection row-parallel (each device
    contributes its heads' part of the sum). The attention itself (softmax
    over all heads) runs on `output_device`. The layer keeps its
    get_weights()/set_weights() layout (tfdist.compat.keras_attention swaps
    the private projection sub-layers).
    """
    if not isinstance(layer, keras.layers.MultiHeadAttention):
        raise ValueError(f"shard_attention needs a MultiHeadAttention. Received: {layer!r}")
    for attr, mode, old in keras_attention.projections(layer):
        if not isinstance(old, keras.layers.EinsumDense):
            raise RuntimeError(
                f"MultiHeadAttention's {attr} is a {type(old).__name__}, not an EinsumDense, "
                f"in Keras {keras.__version__}; shard_attention cannot split it.")
        weights = old.get_weights()
        new = ShardedEinsumDense.from_einsum_dense(old, mode=mode, devices=devices,
                                                   output_device=output_device)
        new.build(None)
        new.set_weights(weights)
        keras_attention.replace_projection(layer, attr, new)
    # Keep the unsplit layout: [q kernel, q bias, k ..., v ..., output kernel, output bias].
    object.__setattr__(layer, "get_weights", types.MethodType(_mha_get_weights, layer))
    object.__setattr__(layer, "set_weights", types.MethodType(_mha_set_weights, layer))


def sharded_sublayers(layer) -> list:
    """The layer itself and its attention projections that run on shard devices."""
    subs = [layer]
    if isinstance(layer, keras.layers.MultiHeadAttention):
        subs += [sub for _, _, sub in keras_attention.projections(layer)]
    return [s for s in subs if hasattr(s, "shard_devices")]


def _mha_get_weights(self):
    return [w for _, _, sub in keras_attention.projections(self) for w in sub.get_weights()]


def _mha_set_weights(self, weights):
    weights = list(weights)
    for _, _, sub in keras_attention.projections(self):
        n = len(sub.get_weights())
        sub.set_weights(weights[:n])
        weights = weights[n:]
    if weights:
        raise ValueError(f"{self.name}: {len(weights)} arrays too many for set_weights.")

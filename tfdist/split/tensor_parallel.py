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

import numpy as np

from tfdist._tf import import_tensorflow

import keras


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
                 devices=(), output_device=None, **kwargs):
        super().__init__(**kwargs)
        if mode not in ("column", "row"):
            raise ValueError(f"mode must be 'column' or 'row'. Received: mode={mode!r}")
        self.units = int(units)
        self.activation = keras.activations.get(activation)
        self.use_bias = bool(use_bias)
        self.mode = mode
        self.shard_devices = tuple(devices)
        self.output_device = output_device or self.shard_devices[0]

    @classmethod
    def from_dense(cls, layer, *, mode, devices, output_device=None):
        if not isinstance(layer, keras.layers.Dense):
            raise ValueError(
                f"Tensor parallelism supports keras.layers.Dense layers. Received: "
                f"{layer.name!r} of type {type(layer).__name__}. Remove it from "
                "tensor_parallel or place it whole on one device."
            )
        return cls(layer.units, activation=layer.get_config()["activation"],
                   use_bias=layer.use_bias, mode=mode, devices=devices,
                   output_device=output_device, name=layer.name, dtype=layer.dtype_policy)

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
                self.kernels.append(self.add_weight(name=f"kernel_shard{i}", shape=shape,
                                                    initializer="glorot_uniform"))
                if self.use_bias and self.mode == "column":
                    self.biases.append(self.add_weight(name=f"bias_shard{i}", shape=(size,),
                                                       initializer="zeros"))
        if self.use_bias and self.mode == "row":
            with tf.device(self.output_device):
                self.biases.append(self.add_weight(name="bias", shape=(self.units,),
                                                   initializer="zeros"))

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
        config.update(units=self.units, activation=keras.activations.serialize(self.activation),
                      use_bias=self.use_bias, mode=self.mode, devices=list(self.shard_devices),
                      output_device=self.output_device)
        return config

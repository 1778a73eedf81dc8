"""Pieces several tests build on: a tied-embedding layer and a FLOP count from TF's profiler."""

from __future__ import annotations

import keras


class TiedEmbedding(keras.layers.Embedding):
    """An embedding whose transpose is the output head (KerasHub's ReversibleEmbedding idea)."""

    def call(self, inputs, reverse=False):
        if reverse:
            return keras.ops.matmul(inputs, keras.ops.transpose(self.embeddings))
        return super().call(inputs)

    def compute_output_spec(self, inputs, reverse=False):
        if reverse:
            return keras.KerasTensor(tuple(inputs.shape[:-1]) + (self.input_dim,), inputs.dtype)
        return super().compute_output_spec(inputs)


def profiler_flops(model, spec) -> float:
    """TensorFlow's profiler on the model's own traced forward pass, plus its Einsums.

    The profiler has no FLOP count for Einsum (attention), so those come from
    tfdist.flops. `spec`: the input TensorSpec(s), batch 1.
    """
    import tensorflow as tf

    from tfdist import flops

    fn = tf.function(lambda inputs: model(inputs, training=False))
    graph = fn.get_concrete_function(spec).graph
    options = tf.compat.v1.profiler.ProfileOptionBuilder.float_operation()
    options["output"] = "none"
    total = tf.compat.v1.profiler.profile(graph=graph, options=options).total_float_ops
    for op in graph.get_operations():
        if op.type == "Einsum":
            total += flops.einsum_flops(op.get_attr("equation").decode(),
                                        [t.shape.as_list() for t in op.inputs])
    return float(total)


def assert_fit_matches(model, reference, x, y, *, tol: float, batch_size: int = 8,
                       epochs: int = 2) -> None:
    """Fits both on the same batches in the same order: every epoch's loss and every weight agree.

    The independent computation the split, pipelined and sequence-parallel
    tests compare against (`reference`: the same model, unsplit, same seed).
    """
    import numpy as np

    fit = dict(batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0)
    h_model = model.fit(x, y, **fit).history["loss"]
    h_reference = reference.fit(x, y, **fit).history["loss"]
    assert np.allclose(h_model, h_reference, atol=tol), (h_model, h_reference)
    diff = max(float(np.abs(a - b).max()) for a, b in zip(model.get_weights(),
                                                          reference.get_weights()))
    assert diff <= tol, f"weights differ by {diff} > {tol}"

"""What the cost model knows about a model: its parameters, activations and FLOPs per layer.

`model_stats(model)` reads a built Keras model (exact variable bytes; FLOPs
and activations traced by `tfdist.planning.flops`); `ModelStats.from_param_count`
describes a model known only by its size. TensorFlow is imported only by
`model_stats`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Iterable

from tfdist.planning.units import DTYPE_BYTES, check_positive


@dataclasses.dataclass(frozen=True, kw_only=True)
class LayerStats:
    """One layer: its output shape (without batch), parameters and cost per example."""

    name: str
    class_name: str
    output_shape: tuple[int | None, ...]
    num_params: int
    activation_elements: int
    forward_flops: float


@dataclasses.dataclass(frozen=True, kw_only=True)
class SparseGradient:
    """A trainable variable whose gradient is a `tf.IndexedSlices` (an `Embedding`'s lookup).

    Attributes:
      variable: the variable's path.
      index: its position in the model's `trainable_variables`.
      rows_per_example: rows of the gradient per example (one per looked-up id,
        repeats included: the exchange sends them before duplicates are summed).
      row_bytes: bytes of one row of values.
      index_bytes: bytes of one index (4 for int32 ids, 8 for int64).
      variable_bytes: bytes of the whole variable.
    """

    variable: str
    index: int
    rows_per_example: int
    row_bytes: int
    index_bytes: int
    variable_bytes: int

    def __post_init__(self):
        for name in ("index", "rows_per_example", "row_bytes", "index_bytes",
                     "variable_bytes"):
            check_positive(name, getattr(self, name), integer=True, allow_zero=name == "index")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelStats:
    """What the cost model needs to know about a model.

    Attributes:
      num_params: trainable parameters (Psi).
      trainable_bytes: bytes of the trainable variables (= gradient bytes K).
      non_trainable_bytes: other model state (batch-norm statistics, seeds).
      activation_bytes_per_example: layer outputs kept for the backward pass,
        per example.
      forward_flops_per_example: FLOPs of one forward pass per example (a
        training step is about 3x that).
      layers: per-layer detail (empty when built from a parameter count).
      sparse_gradients: the variables whose gradients are IndexedSlices (empty
        when built from a parameter count).
    """

    num_params: int
    trainable_bytes: int
    non_trainable_bytes: int = 0
    activation_bytes_per_example: int = 0
    forward_flops_per_example: float = 0.0
    layers: tuple[LayerStats, ...] = ()
    sparse_gradients: tuple[SparseGradient, ...] = ()

    def __post_init__(self):
        check_positive("num_params", self.num_params, integer=True)
        check_positive("trainable_bytes", self.trainable_bytes, integer=True)
        for name in ("non_trainable_bytes", "activation_bytes_per_example"):
            check_positive(name, getattr(self, name), integer=True, allow_zero=True)
        check_positive("forward_flops_per_example", self.forward_flops_per_example,
                        allow_zero=True)

    @classmethod
    def from_param_count(cls, num_params: int, *, bytes_per_param: int = 4,
                         activation_bytes_per_example: int = 0,
                         forward_flops_per_example: float | None = None) -> "ModelStats":
        """Stats for a model known only by its size.

        FLOPs per example depend on the architecture (a dense layer does 2 per
        parameter per example, a transformer 2 per parameter per *token*), so
        they stay unknown (0) unless given; the planner then makes no
        compute-time estimate.
        """
        check_positive("num_params", num_params, integer=True)
        check_positive("bytes_per_param", bytes_per_param, integer=True)
        return cls(num_params=num_params, trainable_bytes=num_params * bytes_per_param,
                   activation_bytes_per_example=activation_bytes_per_example,
                   forward_flops_per_example=forward_flops_per_example or 0.0)

    @property
    def gradient_bytes(self) -> int:
        """K: bytes all-reduced per step (one gradient per trainable variable)."""
        return self.trainable_bytes

    @property
    def dense_gradient_bytes(self) -> int:
        """Bytes of the gradients that are dense tensors (K less the sparse variables')."""
        return self.trainable_bytes - sum(g.variable_bytes for g in self.sparse_gradients)

    @property
    def train_flops_per_example(self) -> float:
        """Forward + backward (about 2x forward): 3x the forward FLOPs."""
        return 3.0 * self.forward_flops_per_example


def _variable_bytes(variables: Iterable[Any]) -> tuple[int, int]:
    count = total = 0
    for variable in variables:
        dtype = str(getattr(variable.dtype, "name", variable.dtype))
        if dtype not in DTYPE_BYTES:
            raise ValueError(f"Variable {variable.name!r} has dtype {dtype!r}, which the cost "
                             f"model does not know. Known: {', '.join(DTYPE_BYTES)}.")
        size = math.prod(int(d) for d in variable.shape)
        count += size
        total += size * DTYPE_BYTES[dtype]
    return count, total


def model_stats(model: Any, *, input_shapes: Any = None) -> ModelStats:
    """Reads a built Keras model: exact variable bytes, traced activations and FLOPs.

    Parameter, gradient and non-trainable bytes are exact (summed over the
    model's real variables). FLOPs and activations come from tracing the
    forward pass at the given input shapes, one layer call at a time
    (`tfdist.planning.flops`): FLOPs count every op the pass runs (matmuls, einsums,
    convolutions, element-wise arithmetic), inside custom layers too;
    activations are the outputs of every layer call (the tensors the backward
    pass keeps), at the variables' dtype. Nested models are expanded into
    their layers.

    Args:
      model: a built Functional or Sequential keras.Model (KerasHub models
        included).
      input_shapes: shapes of one example's inputs without the batch
        dimension, where the model leaves dimensions unknown (text models: the
        sequence length): a tuple for one input, a list in input order, or
        {input name: shape}, e.g. {"token_ids": (128,), "padding_mask": (128,)}.

    Raises:
      ValueError: the model is not built, is subclassed (no graph to read), or
        has unknown input dimensions and no `input_shapes` (naming the input).

    Example:
      >>> stats = tfdist.model_stats(gpt2, input_shapes={"token_ids": (128,),
      ...                                                "padding_mask": (128,)})
    """
    if not hasattr(model, "trainable_variables") or not hasattr(model, "layers"):
        raise ValueError(
            f"model must be a keras.Model. Received: {type(model).__name__}. For a model known "
            "only by its size use ModelStats.from_param_count(num_params)."
        )
    if not model.built or not model.variables:
        raise ValueError(
            f"Model {model.name!r} is not built (it has no variables yet). Build it first: "
            "give it a keras.Input(shape=...) or call model.build(input_shape)."
        )
    num_params, trainable_bytes = _variable_bytes(model.trainable_variables)
    if num_params == 0:
        raise ValueError(f"Model {model.name!r} has no trainable variables: nothing to train.")
    _, non_trainable_bytes = _variable_bytes(model.non_trainable_variables)
    from tfdist.planning import flops
    from tfdist.compat import keras_graph
    from tfdist.split import graph as graph_lib

    if keras_graph.functional_of(model) is None:
        raise ValueError(
            f"Cannot analyse subclassed model {model.name!r} ({type(model).__name__}): its "
            "layers have no symbolic graph, so their outputs and FLOPs are unknown. Build the "
            "model functionally or as a Sequential with keras.Input(shape=...), or pass a "
            "parameter count (ModelStats.from_param_count / tfdist plan --params=...).")
    graph = graph_lib.flatten(model)
    costs = flops.trace_costs(graph, input_shapes)
    dtype_bytes = trainable_bytes // num_params
    per_layer: dict[str, list] = {name: [0, 0.0, None] for name in graph.layers}
    current = next(iter(graph.layers), None)
    for node, node_cost in zip(graph.nodes, costs):
        if node.layer is not None and node.first_call:
            current = node.layer
            per_layer[current][2] = node_cost.output_shapes[0] if node_cost.output_shapes \
                else ()
        if current is None:
            continue
        # a keras op (x + y) or a shared layer's later call counts for the layer before it
        per_layer[current][0] += node_cost.output_elements
        per_layer[current][1] += node_cost.flops
    seen: set[int] = set()
    layers = []
    for name, layer in graph.layers.items():
        own = [w for w in layer.trainable_weights if id(w) not in seen]
        seen.update(id(w) for w in layer.weights)
        elements, layer_flops, shape = per_layer[name]
        layers.append(LayerStats(
            name=name, class_name=type(layer).__name__, output_shape=tuple(shape or ()),
            num_params=_variable_bytes(own)[0], activation_elements=int(elements),
            forward_flops=float(layer_flops)))
    return ModelStats(
        num_params=num_params,
        trainable_bytes=trainable_bytes,
        non_trainable_bytes=non_trainable_bytes,
        activation_bytes_per_example=sum(l.activation_elements for l in layers) * dtype_bytes,
        forward_flops_per_example=sum(c.flops for c in costs),
        layers=tuple(layers),
        sparse_gradients=_sparse_gradients(model, graph, input_shapes),
    )


def sparse_gradients(model: Any, *, input_shapes: Any = None) -> tuple[SparseGradient, ...]:
    """The trainable variables of a built Keras model whose gradients are IndexedSlices.

    Traces (runs nothing) the gradient of the sum of the model's outputs at a
    batch of one example: an `Embedding`'s table gets the looked-up rows and
    their ids, whatever the loss. A table that is also used densely (tied
    input and output embeddings) gets a dense gradient and is not listed.

    Args:
      model: a built Functional or Sequential keras.Model.
      input_shapes: see `model_stats`.
    """
    from tfdist.split import graph as graph_lib

    return _sparse_gradients(model, graph_lib.flatten(model), input_shapes)


def _sparse_gradients(model: Any, graph: Any, input_shapes: Any) -> tuple[SparseGradient, ...]:
    from tfdist._tf import import_tensorflow
    from tfdist.planning import flops

    tf = import_tensorflow()
    variables = list(model.trainable_variables)
    found: list[SparseGradient] = []

    def fn(*flat):
        values = dict(zip(graph.input_keys, flat))
        with tf.GradientTape() as tape:
            for node in graph.nodes:
                node.call(values, False)
            total = tf.add_n([tf.reduce_sum(tf.cast(values[k], tf.float32))
                              for k in graph.output_keys])
        for index, (g, v) in enumerate(zip(tape.gradient(total, variables), variables)):
            if isinstance(g, tf.IndexedSlices) and g.values.shape[0] is not None:
                found.append(SparseGradient(
                    variable=v.path, index=index, rows_per_example=int(g.values.shape[0]),
                    row_bytes=int(g.values.shape[1:].num_elements()) * g.values.dtype.size,
                    index_bytes=g.indices.dtype.size,
                    variable_bytes=_variable_bytes([v])[1]))
        return total

    tf.function(fn, autograph=False).get_concrete_function(*flops.input_specs(graph, input_shapes))
    return tuple(found)

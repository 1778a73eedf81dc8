"""What a model's forward pass really runs: FLOPs and activation sizes from a traced graph.

`trace_costs(model, input_shapes=...)` traces the model's forward pass
(training=False) with `tf.function` at concrete input shapes, one call of
the flattened layer graph at a time (tfdist.split.graph), and counts every
TensorFlow op each layer call creates:

- MatMul / BatchMatMul: 2 x output elements x the contracted size;
- Einsum (EinsumDense, attention): 2 x the product of all index sizes
  (TensorFlow's profiler registers nothing for Einsum);
- convolutions: 2 x output elements x filter height x width x input depth
  per group (depthwise: x filter height x width); transposed: 2 x the
  incoming gradient's elements x filter height x width x output depth;
- element-wise arithmetic and activations: one per output element; Softmax
  five; reductions and pooling: their input / window elements.

Shape-only ops (Reshape, Transpose, Concat, Gather, Cast, ...) count 0. The
per-layer numbers let the cost model and `plan_balanced(by="flops")` see
inside custom layers (a transformer block, an MBConv), where counting a
layer's own `kernel` sees nothing. Imports TensorFlow; `tfdist.planning` uses it
only from `model_stats`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Sequence

from tfdist._tf import import_tensorflow

_MATMUL = {"MatMul": ("transpose_a", -1, -2), "BatchMatMul": ("adj_x", -1, -2),
           "BatchMatMulV2": ("adj_x", -1, -2), "BatchMatMulV3": ("adj_x", -1, -2)}
_ELEMENTWISE = frozenset("""
Add AddV2 Sub Mul RealDiv Div DivNoNan FloorDiv FloorMod Maximum Minimum Pow Sqrt Rsqrt Square
SquaredDifference Neg Exp Expm1 Log Log1p Tanh Sigmoid Relu Relu6 Elu Selu Softplus Softsign Erf
Erfc LeakyRelu Abs Reciprocal Inv Sin Cos Floor Ceil Round Sign Greater GreaterEqual Less
LessEqual Equal NotEqual Select SelectV2 BiasAdd LogicalAnd LogicalOr LogicalNot IsFinite
ClipByValue Atan2 Atan Acos Asin Tan Cosh Sinh Xlogy Xdivy AddN
""".split())
_REDUCTIONS = frozenset("Mean Sum Max Min Prod ArgMax ArgMin All Any EuclideanNorm".split())
_SOFTMAX = {"Softmax": 5, "LogSoftmax": 5}
_POOLS = frozenset("AvgPool MaxPool AvgPool3D MaxPool3D MaxPoolV2".split())


def _prod(shape) -> int | None:
    dims = list(shape)
    if any(d is None for d in dims):
        return None
    return int(math.prod(int(d) for d in dims))


def _shape(tensor) -> list | None:
    shape = tensor.shape
    if shape.rank is None:
        return None
    return shape.as_list()


def einsum_flops(equation: str, shapes: Sequence[Sequence[int]]) -> int:
    """2 x the product of every distinct index size of an einsum."""
    inputs = equation.replace(" ", "").split("->")[0].split(",")
    sizes: dict[str, int] = {}
    ellipsis = 1
    for spec, shape in zip(inputs, shapes):
        shape = list(shape)
        if "..." in spec:
            head, tail = spec.split("...")
            n = len(shape) - len(head) - len(tail)
            ellipsis = max(ellipsis, int(math.prod(shape[len(head):len(head) + n])))
            letters = head + tail
            dims = shape[:len(head)] + shape[len(head) + n:]
        else:
            letters, dims = spec, shape
        for letter, dim in zip(letters, dims):
            sizes[letter] = max(sizes.get(letter, 1), int(dim))
    return 2 * ellipsis * int(math.prod(sizes.values()))


def op_flops(op) -> int:
    """FLOPs of one TensorFlow graph op with static shapes (0 when not arithmetic)."""
    kind = op.type
    outs = [_shape(t) for t in op.outputs]
    out = outs[0] if outs else None
    out_count = _prod(out) if out is not None else None
    if kind in _MATMUL:
        attr, last, second = _MATMUL[kind]
        a = _shape(op.inputs[0])
        if a is None or out_count is None:
            return 0
        try:
            transposed = bool(op.get_attr(attr))
        except ValueError:
            transposed = False
        k = a[second] if transposed else a[last]
        return 2 * out_count * int(k or 0)
    if kind == "Einsum":
        shapes = [_shape(t) for t in op.inputs]
        if any(s is None or any(d is None for d in s) for s in shapes):
            return 0
        return einsum_flops(op.get_attr("equation").decode(), shapes)
    if kind in ("Conv2D", "Conv3D"):
        filt = _shape(op.inputs[1])
        if filt is None or out_count is None:
            return 0
        return 2 * out_count * int(math.prod(filt[:-1]))
    if kind == "DepthwiseConv2dNative":
        filt = _shape(op.inputs[1])
        if filt is None or out_count is None:
            return 0
        return 2 * out_count * int(filt[0]) * int(filt[1])
    if kind in ("Conv2DBackpropInput", "Conv3DBackpropInputV2"):
        filt, grad = _shape(op.inputs[1]), _shape(op.inputs[2])
        if filt is None or grad is None or _prod(grad) is None:
            return 0
        return 2 * _prod(grad) * int(math.prod(filt[:-2])) * int(filt[-2])
    if out_count is None:
        return 0
    if kind in _ELEMENTWISE:
        return out_count
    if kind in _SOFTMAX:
        return _SOFTMAX[kind] * out_count
    if kind in ("FusedBatchNorm", "FusedBatchNormV2", "FusedBatchNormV3"):
        return 2 * out_count  # inference: one multiply-add per element
    if kind in _REDUCTIONS:
        return _prod(_shape(op.inputs[0]) or [None]) or 0
    if kind in _POOLS:
        try:
            ksize = op.get_attr("ksize")
        except ValueError:
            return out_count
        return out_count * int(math.prod(ksize))
    return 0


@dataclasses.dataclass(frozen=True)
class NodeCost:
    """One layer call's forward cost per example.

    Attributes:
      node: index in the flattened graph.
      layer: the plan name of its layer (None for a keras op such as x + y).
      flops: forward FLOPs per example.
      output_elements: elements of its outputs per example (the activations
        the backward pass keeps).
      output_shapes: its outputs' shapes without the batch dimension.
    """

    node: int
    layer: str | None
    class_name: str
    flops: float
    output_elements: int
    output_shapes: tuple


def input_specs(graph, input_shapes=None, *, batch_size: int = 1) -> list:
    """Concrete `tf.TensorSpec`s for a model's inputs.

    Args:
      graph: a tfdist.split.graph.LayerGraph.
      input_shapes: shapes without the batch dimension: one tuple for a
        single-input model, a list in input order, or {input name: shape}.
        Needed where the model's inputs have unknown dimensions (text: the
        sequence length); known dimensions must agree.

    Raises:
      ValueError: a missing or mismatching shape, naming the input.
    """
    tf = import_tensorflow()
    names = [name for name, _, _ in graph.input_specs]
    given: dict[str, tuple] = {}
    if input_shapes is not None:
        if isinstance(input_shapes, Mapping):
            unknown = sorted(set(input_shapes) - set(names))
            if unknown:
                raise ValueError(f"input_shapes names inputs the model does not have: {unknown}. "
                                 f"Model inputs: {names}.")
            given = {k: tuple(v) for k, v in input_shapes.items()}
        else:
            shapes = list(input_shapes)
            if shapes and all(isinstance(d, (int, type(None))) for d in shapes):
                shapes = [tuple(shapes)]
            if len(shapes) != len(names):
                raise ValueError(
                    f"input_shapes gives {len(shapes)} shape(s) but the model has "
                    f"{len(names)} input(s) {names}. Give one shape per input (without the "
                    "batch dimension), or a dict {input name: shape}.")
            given = {n: tuple(s) for n, s in zip(names, shapes)}
    specs = []
    for name, shape, dtype in graph.input_specs:
        want = list(shape[1:])
        if name in given:
            got = list(given[name])
            bad = (len(got) != len(want)
                   or any(not isinstance(g, int) or isinstance(g, bool) or g < 1 for g in got)
                   or any(w is not None and w != g for w, g in zip(want, got)))
            if bad:
                raise ValueError(
                    f"input_shapes[{name!r}] must be {len(want)} positive integer(s) matching "
                    f"the model's input shape {tuple(want)} (None: any). Received: "
                    f"{tuple(got)}.")
            want = got
        if any(d is None for d in want):
            raise ValueError(
                f"Input {name!r} has shape {tuple(shape)}: dimensions besides the batch are "
                "unknown (e.g. a text model's sequence length), so its costs depend on them. "
                "Pass input_shapes="
                f"{{{name!r}: {tuple(d if d is not None else 128 for d in want)}}}"
                " (CLI: --input_shape=...), with the lengths you train on.")
        specs.append(tf.TensorSpec([batch_size] + want, dtype, name=None))
    return specs


def trace_costs(graph, input_shapes=None) -> list[NodeCost]:
    """Per-call forward FLOPs and output sizes, from the traced graph at batch 1.

    Args:
      graph: a LayerGraph (`tfdist.split.graph.flatten(model)`).
      input_shapes: see `input_specs`.
    """
    tf = import_tensorflow()
    specs = input_specs(graph, input_shapes)
    ranges: list[tuple[Any, int, int]] = []

    def fn(*flat):
        g = tf.compat.v1.get_default_graph()
        values = dict(zip(graph.input_keys, flat))
        for node in graph.nodes:
            start = len(g.get_operations())
            node.call(values, False)
            ranges.append((node, start, len(g.get_operations()), [
                values[k] for k in node.output_keys]))
        return [values[k] for k in graph.output_keys]

    concrete = tf.function(fn, autograph=False).get_concrete_function(*specs)
    ops = concrete.graph.get_operations()
    out = []
    for node, start, end, outputs in ranges:
        flops = sum(op_flops(op) for op in ops[start:end])
        shapes, elements = [], 0
        for t in outputs:
            shape = _shape(t) if tf.is_tensor(t) else None
            if shape is None or _prod(shape) is None:
                shapes.append(None)
                continue
            shapes.append(tuple(shape[1:]))
            elements += _prod(shape[1:]) if len(shape) > 1 else 1
        out.append(NodeCost(node=node.index, layer=node.layer,
                            class_name=type(node.operation).__name__, flops=float(flops),
                            output_elements=int(elements), output_shapes=tuple(shapes)))
    return out

